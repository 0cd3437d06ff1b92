"""Runs the sympy-based scorers (prime_math, geo3k, math-verify) in a worker process with a time limit.

Why a process: sympy (and math-verify on top of it) can take minutes or hang on pathological
answers.  verl bounds that with `signal.alarm` (math-verify) or a fresh process per comparison
(prime_math).  Our rewards run in Ray actor threads, where `signal` cannot be used (math-verify's
own timeouts raise ValueError there), and a thread that overruns cannot be stopped: it would keep
a core and the GIL.  So these scorers run in a small spawn-started process pool: in the worker the
scorer runs in the main thread, so its own signal-based limits work as in verl, and a call that
overruns the overall limit gets the scorer's no-answer score (0.0) and a warning while the worker
is killed and replaced (the next call starts a fresh one, ~1-2 s).  The pool starts on first use.

A user's custom reward function runs in a pool of its own when `reward_model.timeout_s` is set (manager.py):
there an overrun is an error naming the function and the sample, not a default score.

Knobs of the built-in rules' pool (environment variables, read at each call):
  FULLY_ASYNC_REWARD_TIMEOUT_S  overall limit of one call in seconds (default 60); 0 runs the scorer
                                in the calling thread with no limit of ours (debugging)
  FULLY_ASYNC_REWARD_WORKERS    worker processes per scoring process (default 1; scoring is
                                sequential in the rollouter)
"""
from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_WORKERS = 1


def timeout_s() -> float:
    return float(os.environ.get("FULLY_ASYNC_REWARD_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _workers() -> int:
    return max(1, int(os.environ.get("FULLY_ASYNC_REWARD_WORKERS", DEFAULT_WORKERS)))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


class ScoringTimeout(Exception):
    """A call (stage "call") or a fresh worker's warm-up (stage "start") overran its limit; the worker was killed
    (the next call starts a fresh one)."""

    def __init__(self, limit: float, stage: str = "call"):
        super().__init__(limit, stage)
        self.limit = limit
        self.stage = stage


class ScoringWorkerDied(Exception):
    """The worker process died during a call (out of memory, a crash in native code, os._exit)."""


class ScoringPool:
    """A lazily started spawn process pool whose overrunning workers are killed."""

    def __init__(self, workers: Optional[int] = None):
        self._requested_workers = workers
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._slots: Optional[threading.BoundedSemaphore] = None
        self.restarts = 0

    def _get(self) -> tuple[concurrent.futures.ProcessPoolExecutor, threading.BoundedSemaphore]:
        with self._lock:
            if self._executor is None:
                workers = self._requested_workers or _workers()
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
                if self._slots is None:
                    self._slots = threading.BoundedSemaphore(workers)
            return self._executor, self._slots

    def _kill(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is executor:
                self._executor = None
                self.restarts += 1
            executor._fa_killed = True  # type: ignore[attr-defined]
        for proc in list((getattr(executor, "_processes", None) or {}).values()):
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        executor.shutdown(wait=False, cancel_futures=True)

    def kill(self) -> None:
        """Kill the workers now, busy or not (a caller that gave up on them); the next call starts a fresh pool."""
        with self._lock:
            executor = self._executor
        if executor is not None:
            self._kill(executor)

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float,
            warmup: Optional[tuple[Callable[..., Any], tuple, float]] = None) -> Any:
        """fn(*args) in a worker, or raise ScoringTimeout (after `timeout` seconds; the worker is killed) or
        ScoringWorkerDied (the worker crashed).  `fn` must be importable by name (a module-level function);
        exceptions raised by fn come back.  `warmup` = (fn, args, limit): run first on each fresh pool with its
        own limit, so that starting the worker (a spawned interpreter re-imports its parent's main module: Ray's
        in an actor, seconds on a busy host) and importing what fn needs do not count against `timeout`."""
        for attempt in range(2):
            executor, slots = self._get()
            with slots:  # at most `workers` calls in flight, so the limit times the call, not a queue
                stage, limit = "call", timeout
                try:
                    if warmup is not None and not getattr(executor, "_fa_warm", False):
                        stage, limit = "start", warmup[2]
                        executor.submit(warmup[0], *warmup[1]).result(timeout=limit)
                        executor._fa_warm = True  # type: ignore[attr-defined]
                        stage, limit = "call", timeout
                    future = executor.submit(fn, *args)
                    return future.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    self._kill(executor)
                    raise ScoringTimeout(limit, stage) from None
                except BrokenProcessPool:
                    if getattr(executor, "_fa_killed", False) and attempt == 0:
                        continue  # another call's timeout killed the pool under us: run again on a fresh one
                    self._kill(executor)
                    raise ScoringWorkerDied() from None
        raise ScoringWorkerDied()  # the fresh pool broke too

    def call(self, fn: Callable[..., Any], *args: Any, default: Any, label: str,
             timeout: Optional[float] = None) -> Any:
        """fn(*args) in a worker; `default` (with a warning) when it overruns `timeout` or kills its worker."""
        limit = timeout_s() if timeout is None else timeout
        if limit <= 0:
            return fn(*args)
        try:
            return self.run(fn, *args, timeout=limit)
        except ScoringTimeout:
            logger.warning("%s: scoring took more than %.0f s (FULLY_ASYNC_REWARD_TIMEOUT_S); scored %r and "
                           "restarted the scoring worker. Inputs: %s", label, limit, default, _short(args))
        except ScoringWorkerDied:
            logger.warning("%s: the scoring worker died (out of memory or a crash in native code); scored "
                           "%r and restarted it. Inputs: %s", label, default, _short(args))
        return default


_POOL = ScoringPool()


def call(fn: Callable[..., Any], *args: Any, default: Any, label: str, timeout: Optional[float] = None) -> Any:
    """Run `fn(*args)` in this process's shared scoring pool (see the module docstring)."""
    return _POOL.call(fn, *args, default=default, label=label, timeout=timeout)


def pool() -> ScoringPool:
    return _POOL
