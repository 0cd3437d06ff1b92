"""Signs of life from every actor of a run, from its first line on (layer 2).

Why: the driver's watchdog asks the actors it holds for their progress, but an actor can stall where no call reaches
it -- in its constructor (start-up: a trainer stopped before its first step), or created by another actor (an engine
replica inside the rollouter, the trainer's ranks 1..).  Each actor process therefore beats: a daemon thread puts a
counter, its role and where its threads are in our code (innermost `fully_async` frame of each) into Ray's internal
key-value store every PERIOD_S, under the run's Ray job id.  A stopped (SIGSTOP) or wedged process, or one whose
Python holds the GIL, stops beating; the driver (`Heartbeats`) sees which one, and what it was doing.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

NAMESPACE = "fully_async_heartbeat"
PERIOD_S = 1.0
_state: dict = {"role": None, "thread": None}


def _job_id() -> Optional[str]:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - not in a Ray process
        pass
    return None


def where(frames: Optional[dict] = None, skip: Optional[int] = None) -> list[str]:
    """'file.py:line in function' of the innermost frame in our package of each thread (this module's own thread
    and threads outside our code left out): what the process is doing."""
    frames = sys._current_frames() if frames is None else frames
    out = []
    for ident, frame in frames.items():
        if ident == skip:
            continue
        f = frame
        while f is not None and f"{os.sep}fully_async{os.sep}" not in f.f_code.co_filename:
            f = f.f_back
        if f is None or f.f_code.co_filename == __file__:
            continue
        rel = f.f_code.co_filename.split(f"{os.sep}fully_async{os.sep}", 1)[1]
        out.append(f"{rel}:{f.f_lineno} in {f.f_code.co_name}")
    return sorted(out)[:4]


def start(role: str, period_s: float = PERIOD_S) -> bool:
    """Beat as `role` from this process (once per process; a later call only renames it).  No-op outside Ray."""
    _state["role"] = role
    job = _job_id()
    if job is None or _state["thread"] is not None:
        return _state["thread"] is not None
    from ray.experimental.internal_kv import _internal_kv_put

    pid, host = os.getpid(), socket.gethostname()

    def beat() -> None:
        n = 0
        me = threading.get_ident()
        while True:
            n += 1
            value = {"role": _state["role"], "beat": n, "pid": pid, "host": host,
                     "where": where(skip=me)}
            try:
                _internal_kv_put(f"{job}/{pid}", json.dumps(value), namespace=NAMESPACE)
            except Exception:  # noqa: BLE001 - the cluster is going away: the driver sees no beats
                return
            time.sleep(period_s)

    _state["thread"] = threading.Thread(target=beat, name="fully_async-heartbeat", daemon=True)
    _state["thread"].start()
    return True


class RayKV:
    """The driver's view of the beats of its own Ray job."""

    def __init__(self) -> None:
        self.prefix = f"{_job_id()}/"

    def read(self) -> dict[str, dict]:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        out = {}
        for key in _internal_kv_list(self.prefix, namespace=NAMESPACE):
            raw = _internal_kv_get(key, namespace=NAMESPACE)
            if raw:
                out[key.decode() if isinstance(key, bytes) else key] = json.loads(raw)
        return out

    def clear(self) -> None:
        """Forget the beats of earlier runs of this driver (a Ray session shared by several runs)."""
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(self.prefix, del_by_prefix=True, namespace=NAMESPACE)


class Heartbeats:
    """Which actors stopped beating.  `kv.read()` gives {key: beat dict}; the driver's own clock (`clock`) times
    how long each beat counter stood still, so no two hosts' clocks are compared."""

    def __init__(self, kv: Any = None, clock: Callable[[], float] = time.monotonic):
        self.kv = kv if kv is not None else RayKV()
        self.clock = clock
        self.seen: dict[str, tuple[int, float, dict]] = {}   # key -> (beat, when it last changed, value)

    def poll(self) -> None:
        now = self.clock()
        try:
            beats = self.kv.read()
        except Exception:  # noqa: BLE001 - the cluster is going away; the next poll tries again
            return
        for key, value in beats.items():
            old = self.seen.get(key)
            if old is None or old[0] != value.get("beat"):
                self.seen[key] = (value.get("beat"), now, value)

    def roles(self) -> set[str]:
        return {v.get("role") for _, _, v in self.seen.values()}

    def stalled(self, timeout_s: float) -> list[str]:
        """'<role> (pid P on H): no heartbeat for Ns; it was at <where>' of each process whose beat stood still
        longer than `timeout_s`."""
        now = self.clock()
        out = []
        for beat, since, value in self.seen.values():
            if now - since > timeout_s:
                out.append(describe(value, now - since))
        return sorted(out)


def describe(value: dict, silent_s: float) -> str:
    what = "; ".join(value.get("where") or []) or "no frame of ours (outside our code)"
    return (f"{value.get('role')} (pid {value.get('pid')} on {value.get('host')}): no heartbeat for "
            f"{silent_s:.0f}s, it was at: {what}")
