"""The queue between rollouter and trainer (layer 6; wrapped as a Ray actor by main).

Back-pressure does not live here: the rollouter's staleness bound limits how many groups can be
admitted per param version, so the queue never needs to drop or refuse a group.  The queue is a
plain FIFO of sample groups: the rollouter's metrics go to the trainer (per step) and its validation
results to the driver, on their own paths.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Optional

from fully_async.core.checkpoint import QUEUE_STATE, ROLLOUT_STATE, read_state, write_state
from fully_async.core.types import SampleGroup


class GroupQueue:
    def __init__(self, resume_path: Optional[str] = None) -> None:
        self._groups: deque[SampleGroup] = deque(load_queue_part(resume_path) if resume_path else [])
        self._cond = threading.Condition()
        self._closed = False
        self._put = self._taken = 0

    def put_many(self, groups: list[SampleGroup]) -> int:
        with self._cond:
            if self._closed and groups:
                raise RuntimeError("put into a closed queue: the rollouter already declared the data exhausted")
            self._groups.extend(groups)
            self._put += len(groups)
            self._cond.notify_all()
            return len(self._groups)

    def close(self) -> None:
        """No more groups will come (the rollouter finished its prompts)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get_batch(self, n: int, timeout_s: Optional[float] = None) -> dict:
        """Wait for `n` groups (or the close); on timeout return no groups and remove nothing.

        Returns {"groups", "closed"}; after the close the remainder (< n) is returned.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while len(self._groups) < n and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            ready = len(self._groups) >= n or self._closed
            take = min(n, len(self._groups)) if ready else 0
            groups = [self._groups.popleft() for _ in range(take)]
            self._taken += take
            return {"groups": groups, "closed": self._closed and not self._groups}

    def snapshot(self) -> list[SampleGroup]:
        """The queued groups, not removed."""
        with self._cond:
            return list(self._groups)

    def save_part(self, folder: str) -> None:
        """This queue's part of a checkpoint: the groups generated and not yet trained (the driver calls it while
        the rollouter holds, so no group is between the two)."""
        write_state(os.path.join(folder, QUEUE_STATE), self.snapshot())

    def progress(self) -> dict:
        """What the driver's watchdog shows of the queue (a stopped queue answers nothing, and is named)."""
        with self._cond:
            return {"queued": len(self._groups), "put": self._put, "taken": self._taken, "closed": self._closed}

    def size(self) -> int:
        with self._cond:
            return len(self._groups)


def load_queue_part(path: str) -> list[SampleGroup]:
    """The queued groups of checkpoint `path` (older checkpoints kept them inside the rollouter's part)."""
    own = os.path.join(path, QUEUE_STATE)
    if os.path.isfile(own) or os.path.isfile(own[:-len(".json")] + ".pkl"):  # (.pkl: an older version's)
        return read_state(own)
    return read_state(os.path.join(path, ROLLOUT_STATE)).get("queue", [])
