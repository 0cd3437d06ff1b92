"""In-process failure runs for test_reliability.py: the run in the test's process under the shared Ray, and a thread
that waits for the run's console lines (or its checkpoints) and then acts on one of its actors' processes (SIGKILL,
SIGSTOP).

The thread's waits count from the moment the run's first step line appears, or from the run's end: a slow machine's
start (CI's took 144 s to start two rollout replicas' actors) uses none of them, and a wait whose event the run ended
without ends with the run, saying so (`Injection.run`).

An actor's process is found among this process's descendants (the shared Ray's raylet is its child, the workers
the raylet's) by Ray's process title, `ray::<Class>` / `ray::<Class>.<method>`."""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import psutil


class Console:
    """sys.stdout while a run is in this process: what the run prints (its step lines) is kept to wait on, and
    passed on to the stream it replaced."""

    def __init__(self, passed_on):
        self.passed_on = passed_on
        self.text = ""
        self._lock = threading.Lock()
        self.ended = threading.Event()   # the run returned or raised (Injection.run)

    def write(self, s: str) -> int:
        with self._lock:
            self.text += s
        return self.passed_on.write(s)

    def flush(self) -> None:
        self.passed_on.flush()

    def isatty(self) -> bool:
        return False

    def wait_until(self, done, what: str, timeout: float = 180.0) -> None:
        """Until done() is true: the timeout counts from the run's first step line (the actors' start, minutes on a
        loaded 2-core machine, is the run's own business); a run that ended first fails the wait at once."""
        deadline = None
        while not done():
            if self.ended.is_set():
                raise AssertionError(f"the run ended before {what}:\n{self.text[-3000:]}")
            if deadline is None and re.search(r"^step 1 \|", self.text, re.M):
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() > deadline:
                raise AssertionError(f"no {what} {timeout:.0f} s after step 1:\n{self.text[-3000:]}")
            time.sleep(0.1)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> None:
        self.wait_until(lambda: re.search(pattern, self.text, re.M), f"line matching {pattern!r}", timeout)


def actor_pid(cls_name: str, since: float, timeout: float = 60.0) -> int:
    """The pid of the process of this process's Ray titled `ray::<cls_name>`: the only one, or the only one created
    after `since` (time.time; an actor of an earlier run may still be on its way out, while an actor may also take
    over an idle worker started before this run)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for proc in psutil.Process().children(recursive=True):
            try:
                if re.match(rf"ray::{cls_name}(\.|\s|$)", " ".join(proc.cmdline())):
                    found[proc.pid] = proc.create_time()
            except psutil.Error:
                continue
        new = [pid for pid, created in found.items() if created >= since]
        if len(found) == 1 or len(new) == 1:
            return next(iter(found)) if len(found) == 1 else new[0]
        assert time.monotonic() < deadline, f"no single ray::{cls_name} process of this run: {found}"
        time.sleep(0.2)


class Injection:
    """Replaces sys.stdout with a Console (monkeypatch) and runs `act(console)` in a thread while the test runs the
    run in the main thread (where the launcher's signal handlers must be); what the thread raised is re-raised by
    `check()`."""

    def __init__(self, monkeypatch, act):
        self.console = Console(sys.stdout)
        monkeypatch.setattr(sys, "stdout", self.console)
        self.errors: list[BaseException] = []
        self.started = time.time()

        def body():
            try:
                act(self.console, self.started)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread by check()
                self.errors.append(exc)

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def run(self, fn):
        """fn() (the run) in this thread; then the injecting thread's own failure, if it had one, ahead of fn's
        outcome: a run that did not fail because the injection never acted says why."""
        try:
            return fn()
        finally:
            self.console.ended.set()
            self.check()

    def check(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the injecting thread did not end"
        if self.errors:
            raise self.errors[0]


def printed(pattern: str):
    """wait(): until the run printed a line matching `pattern` (its step lines)."""
    return lambda console: console.wait_for(pattern)


def checkpointed(root: str, step: int, timeout: float = 180.0):
    """wait(): until the run's checkpoint of `step` under `root` is complete (the trainer's state is written last)."""
    def wait(console: Console) -> None:
        from fully_async.core.checkpoint import list_checkpoints

        console.wait_until(lambda: step in list_checkpoints(root), f"checkpoint of step {step} under {root}", timeout)
    return wait


def kill_after(wait, cls_name: str, killed_at: list):
    """act(): SIGKILL of the run's `cls_name` actor once `wait(console)` returned; its time.monotonic() into
    killed_at.  The actor's process is found at the run's first step, so the kill follows the event within a poll
    (after the step-4 checkpoint, the rest of a short run can take CI 2 s)."""
    def act(console: Console, since: float) -> None:
        console.wait_for(r"^step 1 \|")
        pid = actor_pid(cls_name, since)
        wait(console)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
    return act


def ensure_gone(pid: int, timeout: float = 15.0) -> None:
    """A process this test stopped (SIGSTOP) continues; should the run's teardown have left it alive, it is killed:
    a stopped worker of the shared Ray would hold its CPU from the runs of later tests."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
