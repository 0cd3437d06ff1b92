"""Engine replicas (layer 5): one engine, driven either in the caller's thread or in its own process.

An engine pool (engines/pool.py) talks to every replica through the same small handle:
`submit(requests)`, `poll(timeout_s) -> Future[list[GenOutput]]` and `call(method, *args) -> Future`.

  InlineReplica  the engine lives in the calling process (the rollouter's own engine when there is
                 one replica, sync-mode rank 0): `step()` runs one engine iteration in the caller's
                 thread, so a single replica costs exactly what the bare engine costs.
  RemoteReplica  the engine lives in a Ray actor (`EngineReplica`, or a sync-mode `TrainWorker`) that
                 mixes in `EngineHost`: an `EngineDriver` thread keeps generating between calls, so the
                 device never waits for the pool's round trip; `poll` returns what finished meanwhile.

Calls that touch the engine (submit, interrupt, weight loads, sleep/wake) run on the driver thread in
the order they were made, between two engine iterations; `interrupt` also hands back outputs that
finished but were not yet polled, so no output is lost between the two.

Weights by collective broadcast: an engine that receives the broadcast itself (vLLM's workers,
`DirectWeightReceiver`) is delegated to; any other engine gets a `ProcessReceiver`: this process joins
the trainer's group as one rank and streams the buckets into `engine.update_weights`.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fully_async.rollout.engines.base import receives_weights_directly
from fully_async.core.types import GenOutput, GenRequest


@dataclass
class IterationCounters:
    """Engine iterations (`collect()` calls) run by a replica and the seconds spent inside them, cumulative:
    seconds / iterations is the engine's own time per step, whatever the pool and Ray add around it; and the
    tokens its decode steps' sequences had cached, summed over the steps (engines that count them:
    `cached_token_steps`), so a window's tokens cached per step are known."""
    iterations: int = 0
    engine_s: float = 0.0
    kv_tokens: int = 0

    def add(self, seconds: float, engine: Any = None) -> None:
        self.iterations += 1
        self.engine_s += seconds
        self.kv_tokens = int(getattr(engine, "cached_token_steps", 0))


def done_future(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """A future already holding fn()'s result (or exception)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
        fut.set_exception(exc)
    return fut


class ProcessReceiver:
    """The collective-receive side for an engine whose weights live in this process."""

    def __init__(self, engine: Any, device: Any):
        self.engine = engine
        self.device = device
        self.pg: Any = None

    def weight_receivers(self) -> int:
        return 1

    def init_weight_group(self, addr: str, port: int, first_rank: int, world: int) -> None:
        self.pg = self.device.new_group(addr, port, first_rank, world)

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> None:
        import torch

        from fully_async.weight_sync.collective import receive

        stream = receive(self.pg, metas, buckets, getattr(torch, dtype.split(".")[-1]), self.device.torch_device())
        self.engine.update_weights(stream, version)


def weight_receiver(engine: Any, device: Any) -> Any:
    return engine if receives_weights_directly(engine) else ProcessReceiver(engine, device)


ENGINE_METHODS = ("update_weights", "sleep", "wake_up")
RECEIVER_METHODS = ("weight_receivers", "init_weight_group", "receive_weights")
LOADS = ("update_weights", "receive_weights", "load_trainer_weights")  # return the engine's update timings
# an engine in its own driver thread stops advancing its requests ("hold") and goes on ("release"), requests and KV
# cache kept: colocated async's engines while the trainer has its turn on their devices
HOLDS = ("hold", "release")
# what a sleep will do with the engine's memory (device_memory/policy.py), and what it did
MEMORY_QUERIES: dict[str, Callable[[Any], Any]] = {
    "keeps_resident": lambda engine: not getattr(engine, "free_cache_engine", True),
    "swaps_in_flight": lambda engine: False,
    "memory_report": lambda engine: {}}


def engine_command(engine: Any, receiver: Any, method: str, args: tuple,
                   extra: Optional[dict[str, Callable[..., Any]]] = None) -> Any:
    """What a replica does for pool.call(method, *args); runs where the engine lives.  A weight load returns
    the engine's own timings of it (`last_update_timings`: pause/load/resume of a keep-mode vLLM engine)."""
    if method == "interrupt":
        return engine.interrupt()
    if method == "keeps_in_flight":
        return bool(getattr(engine, "keeps_in_flight", False))
    if method in MEMORY_QUERIES:   # engines without them: freed at every sleep as configured, no swap, no report
        if hasattr(engine, method):
            attr = getattr(engine, method)
            return attr() if callable(attr) else attr
        return MEMORY_QUERIES[method](engine)
    if method in HOLDS:   # an engine in its caller's thread advances only when the caller collects: nothing to hold
        return None
    if extra and method in extra:
        out = extra[method](*args)
    elif method in RECEIVER_METHODS:
        out = getattr(receiver, method)(*args)
    elif method == "update_weights":
        from fully_async.weight_sync.device_ipc import open_weights

        out = engine.update_weights(open_weights(args[0]), *args[1:])   # a device-IPC handle opens here
    elif method in ENGINE_METHODS:
        out = getattr(engine, method)(*args)
    else:
        raise ValueError(f"unknown engine replica command {method!r}")
    return dict(getattr(engine, "last_update_timings", {}) or {}) if method in LOADS else out


class InlineReplica:
    """The engine in the caller's process and thread."""

    inline = True        # the pool steps it in its own thread
    in_process = True    # weights are handed over as they are (no object store)

    def __init__(self, engine: Any, device: Any, name: str = "engine0",
                 extra: Optional[dict[str, Callable[..., Any]]] = None):
        self.engine = engine
        self.name = name
        self.receiver = weight_receiver(engine, device)
        self.extra = extra
        self.counters = IterationCounters()

    def submit(self, requests: list[GenRequest]) -> None:
        self.engine.submit(requests)

    def step(self, timeout_s: float) -> list[GenOutput]:
        start = time.perf_counter()
        out = self.engine.collect(timeout_s)
        self.counters.add(time.perf_counter() - start, self.engine)
        return out

    def call(self, method: str, *args: Any) -> concurrent.futures.Future:
        return done_future(lambda: engine_command(self.engine, self.receiver, method, args, self.extra))


class RemoteReplica:
    """A Ray actor that mixes in EngineHost (EngineReplica, or a sync-mode TrainWorker)."""

    inline = False
    in_process = False   # weights reach it through one shared object-store copy

    def __init__(self, actor: Any, name: str, threaded: bool = False):
        self.actor = actor
        self.name = name
        self.counters = IterationCounters()   # as of the last poll
        # a threaded actor (the elastic trainer's rank 0) runs calls out of order: a command waits until the
        # submissions made before it have run, so an interrupt never overtakes the requests it must hand back
        self.threaded = threaded
        self._unacked: list = []

    def submit(self, requests: list[GenRequest]) -> None:
        ref = self.actor.submit.remote(requests)  # ordered before every later call (the actor runs one at a time)
        if self.threaded:
            self._unacked.append(ref)

    def poll(self, timeout_s: float) -> concurrent.futures.Future:
        """Future of the outputs finished meanwhile; the engine's iteration counters ride along."""
        if self._unacked:   # submissions that have run need no waiting for any more
            import ray

            self._unacked = ray.wait(self._unacked, num_returns=len(self._unacked), timeout=0)[1]
        inner, outer = self.actor.poll.remote(timeout_s).future(), concurrent.futures.Future()

        def unpack(fut: concurrent.futures.Future) -> None:
            try:
                polled = fut.result()
            except BaseException as exc:  # noqa: BLE001 - the pool reads it from the future
                outer.set_exception(exc)
                return
            self.counters = IterationCounters(**polled["counters"])
            outer.set_result(polled["outputs"])
        inner.add_done_callback(unpack)
        return outer

    def call(self, method: str, *args: Any) -> concurrent.futures.Future:
        if self._unacked:
            import ray

            ray.get(self._unacked)
            self._unacked = []
        return self.actor.engine_call.remote(method, *args).future()


class EngineDriver:
    """Runs an engine in its own thread; submissions and commands run between two engine iterations."""

    def __init__(self, engine: Any, name: str = "engine"):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._outbox: list[GenOutput] = []
        self._error: Optional[BaseException] = None
        self._closed = False
        self._held = False   # requests in flight wait (read and written on the driver thread only)
        self.counters = IterationCounters()
        self._thread = threading.Thread(target=self._run, name=f"{name}-driver", daemon=True)
        self._thread.start()

    def submit(self, requests: list[GenRequest]) -> None:
        self._put(("submit", requests, None))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the driver thread (after everything submitted before)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def poll(self, timeout_s: float) -> list[GenOutput]:
        """Outputs finished since the last poll; waits up to timeout_s for the first one."""
        with self._cv:
            self._cv.wait_for(lambda: self._outbox or self._error is not None or self._closed, timeout_s)
            self._raise_if_failed()
            out, self._outbox = self._outbox, []
        return out

    def take_outputs(self) -> list[GenOutput]:
        """Finished outputs nobody polled yet (call from the driver thread, e.g. inside an interrupt)."""
        with self._cv:
            out, self._outbox = self._outbox, []
        return out

    def hold(self, held: bool) -> concurrent.futures.Future:
        """From the next iteration on, the engine stops advancing what it has in flight (held) or goes on; the future
        is done once the iteration running now has finished.  Submissions and calls still run while held."""
        def set_held(_engine: Any) -> None:
            self._held = held
        return self.call(set_held)

    def interrupt(self) -> list[GenOutput]:
        """Unpolled finished outputs plus the partial outputs of everything in flight."""
        return self.interrupt_later().result()

    def interrupt_later(self) -> concurrent.futures.Future:
        return self.call(lambda engine: self.take_outputs() + engine.interrupt())

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine failed: {type(self._error).__name__}: {self._error}") from self._error

    def _put(self, item: tuple) -> None:
        with self._cv:
            self._raise_if_failed()
            self._inbox.append(item)
            self._cv.notify_all()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not self._closed and (self._held or not engine.num_in_flight()):
                        self._cv.wait()
                    if self._closed:
                        return
                    items = list(self._inbox)
                    self._inbox.clear()
                for kind, arg, fut in items:
                    if kind == "submit":
                        engine.submit(arg)
                        continue
                    try:
                        fut.set_result(arg(engine))
                    except BaseException as exc:  # noqa: BLE001 - the caller gets it
                        fut.set_exception(exc)
                if engine.num_in_flight() and not self._held:
                    start = time.perf_counter()
                    outputs = engine.collect()
                    self.counters.add(time.perf_counter() - start, engine)
                    if outputs:
                        with self._cv:
                            self._outbox.extend(outputs)
                            self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - every later poll/call reports it
            with self._cv:
                self._error = exc
                for _, _, fut in self._inbox:
                    if fut is not None:
                        fut.set_exception(exc)
                self._inbox.clear()
                self._cv.notify_all()


class EngineHost:
    """Mixin for a Ray actor that serves one engine to an EnginePool (methods submit / poll / engine_call)."""

    def _host_engine(self, engine: Any, device: Any, name: str,
                     extra: Optional[dict[str, Callable[..., Any]]] = None) -> None:
        self._driver = EngineDriver(engine, name)
        self._receiver = weight_receiver(engine, device)
        self._extra = extra or {}

    def submit(self, requests: list[GenRequest]) -> None:
        self._driver.submit(requests)

    def poll(self, timeout_s: float) -> dict:
        outputs = self._driver.poll(timeout_s)
        return {"outputs": outputs, "counters": vars(self._driver.counters).copy()}

    def engine_call(self, method: str, *args: Any) -> Any:
        return self.engine_future(method, *args).result()

    def engine_future(self, method: str, *args: Any) -> concurrent.futures.Future:
        """`engine_call` without waiting (the host's own process commands its engine so: HostedReplica)."""
        if method == "interrupt":
            return self._driver.interrupt_later()
        if method in HOLDS:
            return self._driver.hold(method == "hold")
        if method == "init_weight_group" and isinstance(self._receiver, ProcessReceiver):
            return done_future(lambda: self._receiver.init_weight_group(*args))  # a rendezvous, not an engine call
        return self._driver.call(lambda engine: engine_command(engine, self._receiver, method, args, self._extra))


class HostedReplica:
    """The engine of an EngineHost in this very process, as its own actor commands it (the elastic trainer's rank 0:
    weight loads, sleep, wake-up while the engine is not lent).  Commands only: requests come through the pool that
    borrows the engine (a RemoteReplica of the same actor)."""

    inline = False
    in_process = True

    def __init__(self, host: EngineHost, name: str):
        self.host = host
        self.name = name

    def call(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self.host.engine_future(method, *args)
