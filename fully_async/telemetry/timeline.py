"""Per-actor phase timeline, exported as Chrome / Perfetto trace events (layer 1).

Each actor keeps a `Timeline`; `span("generate")` records a complete event ("ph": "X").  A span
that starts right where the previous span of the same name ended is merged into it, so the
rollouter's thousands of engine steps show as one "generate" bar per uninterrupted stretch.
When disabled every call is a cheap no-op.  The driver gathers the events of all actors and
writes one `timeline.json` (load it in chrome://tracing or ui.perfetto.dev).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

from fully_async.core import safe_write

MERGE_GAP_US = 2000.0


class Timeline:
    def __init__(self, actor: str, enabled: bool = False):
        self.actor = actor
        self.enabled = enabled
        self.events: list[dict] = []
        self._last: dict[str, dict] = {}

    @contextlib.contextmanager
    def span(self, name: str, **args) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.time() * 1e6
        try:
            yield
        finally:
            self.add(name, start, time.time() * 1e6 - start, **args)

    def add(self, name: str, start_us: float, dur_us: float, **args) -> None:
        if not self.enabled:
            return
        last = self._last.get(name)
        if last is not None and not args and start_us - (last["ts"] + last["dur"]) < MERGE_GAP_US \
                and self.events and self.events[-1] is last:
            last["dur"] = start_us + dur_us - last["ts"]
            return
        event = {"name": name, "ph": "X", "ts": start_us, "dur": dur_us, "pid": self.actor, "tid": self.actor,
                 "args": args}
        self.events.append(event)
        self._last[name] = event

    def drain(self) -> list[dict]:
        out, self.events, self._last = self.events, [], {}
        return out


def write_trace(path: str, events: list[dict]) -> None:
    """Chrome trace JSON with one named process row per actor."""
    actors = sorted({e["pid"] for e in events})
    ids = {a: i + 1 for i, a in enumerate(actors)}
    trace = [{"name": "process_name", "ph": "M", "pid": ids[a], "tid": ids[a], "args": {"name": a}} for a in actors]
    trace += [dict(e, pid=ids[e["pid"]], tid=ids[e["tid"]]) for e in sorted(events, key=lambda e: e["ts"])]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    safe_write.write_json(path, {"traceEvents": trace, "displayTimeUnit": "ms"})


def write_pool_trace(path: str, spans: list) -> None:
    """The device pool's trace (several jobs): one process per job, one track per device of the pool and one
    for the job's waits.  `spans`: PoolEvent-like records (job, track, name, start, end in seconds, args)."""
    jobs = sorted({s.job for s in spans})
    tracks = sorted({s.track for s in spans}, key=lambda t: (t == "wait", t))
    pid = {j: i + 1 for i, j in enumerate(jobs)}
    tid = {t: i + 1 for i, t in enumerate(tracks)}
    trace: list[dict] = []
    for j in jobs:
        trace.append({"name": "process_name", "ph": "M", "pid": pid[j], "tid": 0, "args": {"name": f"job {j}"}})
        for t in tracks:
            trace.append({"name": "thread_name", "ph": "M", "pid": pid[j], "tid": tid[t], "args": {"name": t}})
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": pid[j], "tid": tid[t],
                          "args": {"sort_index": tid[t]}})
    for s in sorted(spans, key=lambda s: (s.start, -(s.end - s.start))):  # an enclosing lease before its contents
        trace.append({"name": s.name, "ph": "X", "ts": s.start * 1e6, "dur": max(0.0, s.end - s.start) * 1e6,
                      "pid": pid[s.job], "tid": tid[s.track], "args": s.args})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    safe_write.write_json(path, {"traceEvents": trace, "displayTimeUnit": "ms"})
