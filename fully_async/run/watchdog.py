"""The run's watchdog (layer 7): fails a run whose actors all stood still for trainer.progress_timeout_s.

Why apart from the launcher: it is the one piece of supervision that must never wait on an actor.  It asks each
actor for its progress through `Calls` (one outstanding call per actor, never waited on past a moment), so an actor
that stops answering -- stopped with SIGSTOP, wedged, or holding the GIL in a reward function -- counts as standing
still and is named, with the last state it reported, when the run is failed.

It watches every actor from its creation: the actors it holds through their progress, and every actor process of
the run -- those it holds, the engine replicas and trainer ranks they create -- through their heartbeats
(cluster/heartbeat.py), so an actor stalled in its constructor (start-up, before any call can reach it) or one the
driver holds no handle of is named with what it was doing (`check_start` while the actors start, `check` after).
"""
from __future__ import annotations

import time
from typing import Any, Optional

START_FLOOR_S = 30.0   # the least time an actor process gets to send its first heartbeat


class Watchdog:
    """Fails the run when the progress counters of every actor stood still for `timeout_s`.  It never waits on an
    actor: each poll asks every actor for its progress (one outstanding call each, `Calls`) and an actor that does
    not answer counts as standing still -- "not responding", with the last state it reported -- so a stopped
    (SIGSTOP) or wedged actor, or one whose Python holds the GIL, ends the run named."""

    def __init__(self, actors: dict, timeout_s: float, poll_s: float = 5.0, calls: Any = None, beats: Any = None,
                 beating: tuple = (), clock: Any = time.monotonic):
        from fully_async.cluster.ray_utils import Calls

        self.actors = actors
        self.timeout_s = timeout_s
        self.poll_s = min(poll_s, timeout_s / 4)
        self.clock = clock
        self.created = self.last_change = clock()
        self.last_poll = -float("inf")
        self.signature: Any = None
        self.calls = calls if calls is not None else Calls()
        self.last_state: dict = {}
        self.beats = beats          # cluster.heartbeat.Heartbeats: every actor process of the run, or None
        self.beating = tuple(beating)   # the roles that must beat (the actors that run), named if they never do

    def _due(self) -> bool:
        now = self.clock()
        if now - self.last_poll < self.poll_s:
            return False
        self.last_poll = now
        if self.beats is not None:
            self.beats.poll()
        return True

    def stalled(self, bound_s: Optional[float] = None) -> list[str]:
        """Every actor process whose heartbeat stood still for bound_s (default timeout_s), with where it was."""
        return self.beats.stalled(self.timeout_s if bound_s is None else bound_s) if self.beats is not None else []

    def check_start(self) -> None:
        """While the actors start (their constructors, where no call reaches them): fail naming any actor whose
        heartbeat stood still for timeout_s, or that never beat within timeout_s of its creation (its process never
        started, or was stopped before its first line); in start-up the bound is at least START_FLOOR_S."""
        from fully_async.cluster.ray_utils import RunFailed

        if not self._due():
            return
        key = f"trainer.progress_timeout_s={self.timeout_s:g}"
        # a process's first line comes after its interpreter and imports start, and its constructor imports more
        # (torch's compiler, on first use, holds the interpreter long enough to stop the heartbeat): on a loaded
        # machine each alone took over 4-5 s (the suite's two workers on 2 cores), so in start-up a short timeout
        # is not applied
        bound = max(self.timeout_s, START_FLOOR_S)
        stalled = self.stalled(bound)
        if stalled:
            raise RunFailed(f"start-up stalled ({key}, at least {START_FLOOR_S:g}s in start-up): " + "; ".join(stalled))
        silent_s = self.clock() - self.created
        missing = [r for r in self.beating if r not in self.beats.roles()] if self.beats is not None else []
        if missing and silent_s > bound:
            raise RunFailed(f"start-up stalled ({key}, at least {START_FLOOR_S:g}s for a process to start): "
                            f"{', '.join(missing)} gave no sign of life within {silent_s:.0f}s of being created "
                            "(its process never started -- Ray could not place it -- or it was stopped before its "
                            "first line)")

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

        if not self._due():
            return
        now = self.clock()
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
            stalled = self.stalled()
            if stalled:
                who += "; stalled: " + "; ".join(stalled)
            raise RunFailed(f"no progress for {now - self.last_change:.0f}s (trainer.progress_timeout_s="
                            f"{self.timeout_s:g}){who}; state: {state}")

    def touch(self) -> None:
        """Something the counters do not show made progress (a checkpoint the driver itself took)."""
        self.last_change = self.clock()


def run_watchdog(actors: dict, timeout_s: float) -> Watchdog:
    """The run's watchdog, made before its actors: it watches `actors` (filled as they are created, the queue
    included) and, through their heartbeats, every actor process of the run (cluster/heartbeat.py)."""
    from fully_async.cluster.heartbeat import Heartbeats

    beats = Heartbeats()
    beats.kv.clear()   # beats of an earlier run of this driver (a Ray session it shares) are not this run's
    return Watchdog(actors, timeout_s, beats=beats)
