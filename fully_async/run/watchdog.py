"""The run's watchdog (layer 7): fails a run whose actors all stood still for trainer.progress_timeout_s.

Why apart from the launcher: it is the one piece of supervision that must never wait on an actor.  It asks each
actor for its progress through `Calls` (one outstanding call per actor, never waited on past a moment), so an actor
that stops answering -- stopped with SIGSTOP, wedged, or holding the GIL in a reward function -- counts as standing
still and is named, with the last state it reported, when the run is failed.
"""
from __future__ import annotations

import time
from typing import Any


class Watchdog:
    """Fails the run when the progress counters of every actor stood still for `timeout_s`.  It never waits on an
    actor: each poll asks every actor for its progress (one outstanding call each, `Calls`) and an actor that does
    not answer counts as standing still -- "not responding", with the last state it reported -- so a stopped
    (SIGSTOP) or wedged actor, or one whose Python holds the GIL, ends the run named."""

    def __init__(self, actors: dict, timeout_s: float, poll_s: float = 5.0, calls: Any = None):
        from fully_async.cluster.ray_utils import Calls

        self.actors = actors
        self.timeout_s = timeout_s
        self.poll_s = min(poll_s, timeout_s / 4)
        self.last_change = time.monotonic()
        self.last_poll = 0.0
        self.signature: Any = None
        self.calls = calls if calls is not None else Calls()
        self.last_state: dict = {}

    def state(self, wait_s: float = 2.0) -> dict:
        from fully_async.cluster.ray_utils import UNRESPONSIVE

        out = {}
        for name, handle in self.actors.items():
            key = f"{name}.progress"
            try:
                done, value = self.calls.poll(key, handle.progress.remote, wait_s)
            except Exception as exc:  # noqa: BLE001 - a dead actor is part of the report (its run() says why)
                out[name] = f"failed ({type(exc).__name__})"
                continue
            if done:
                out[name] = self.last_state[name] = value
            else:
                out[name] = f"{UNRESPONSIVE}: no answer for {self.calls.silent().get(key, 0.0):.0f}s"
        return out

    def check(self) -> None:
        from fully_async.cluster.ray_utils import UNRESPONSIVE, RunFailed

        now = time.monotonic()
        if now - self.last_poll < self.poll_s:
            return
        self.last_poll = now
        state = self.state()
        signature = {n: {k: v for k, v in s.items() if k in ("step", "engine_steps", "validations", "lease_polls")}
                     if isinstance(s, dict) else s.split(":")[0] for n, s in state.items()}
        if signature != self.signature:
            self.signature, self.last_change = signature, now
            return
        if now - self.last_change > self.timeout_s:
            silent = [n for n, s in state.items() if isinstance(s, str) and s.startswith(UNRESPONSIVE)]
            who = ""
            if silent:
                who = "; " + ", ".join(f"{n} is {UNRESPONSIVE}, its last state: "
                                       f"{self.last_state.get(n, 'none (it never answered)')}" for n in silent)
            raise RunFailed(f"no progress for {now - self.last_change:.0f}s (trainer.progress_timeout_s="
                            f"{self.timeout_s:g}){who}; state: {state}")

    def touch(self) -> None:
        """Something the counters do not show made progress (a checkpoint the driver itself took)."""
        self.last_change = time.monotonic()
