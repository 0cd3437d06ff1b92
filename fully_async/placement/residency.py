"""Where a side's weights live between pieces of work (layer 3, the placement package): the one place that decides
when an engine or a trainer comes onto its devices and leaves them.  The placement objects (base.py and one file
per placement) choose which residency each side gets: `placement_of(cfg).residency(side, ...)`.

A loop (the rollouter, the trainer, the sync worker) hands its residency its own two transitions once -- `on(phase)`
puts its state on the devices, `off(phase, why)` takes it off; each returns its metrics -- and then calls it at a few
named points:
    hold(phase)        before work that needs the devices (returns the onload's metrics; None: stopped while waiting)
    wanted()           at a point where the side could give the devices back: does someone else wait for them?
    give_back(why)     take the state off and let the devices go
    phase(name)        around a piece of work that holds the devices only while it runs (sync mode's phases)
    keep(update)       a weight update that arrives while away: kept (the newest wins, they are whole snapshots)
                       and taken by the side's `on` with `take_kept()` before anything runs on the devices
The residency decides whether and when the transitions run:
  * `Dedicated`: the devices are this side's alone (the default).  Held from start to end: `on`/`off` never run,
    nothing is wanted, nothing is kept.
  * `PoolLease`: a lease of a device pool shared with other jobs (device_pool.py; the lease rules are
    leases.py).  The state is on the devices only while the lease is held; building happens under a lease
    too (`setup()`), after which the state goes off.  A side keeps an uncontended lease and gives a wanted one back
    at its next safe point, so no side waits for another while holding devices someone wants.
  * `Turns`: an engine and a trainer taking turns on the same devices (sync mode; colocated async builds on it),
    inside a `Dedicated` or a `PoolLease`.  `phase("engines" | "trainer", name)` puts the other tenant off and this
    one on.  On dedicated devices the tenant that ran stays on until the other needs the devices; on a pool both
    are off whenever the lease goes back.
  * `Elastic`: split async's trainer devices lent to the rollouter while the trainer waits for samples
    (async_training.placement=elastic): a `Turns` on the trainer's own devices whose engine tenant, the engines on
    the trainer's ranks, works in the rollouter's pool.  `wanted()` is true while they are not lent (the rollout
    pool can use them whenever the trainer waits), `give_back` lends them, `hold` takes them back (their in-flight
    responses parked as partial rollouts, continued on the rollout devices) before the trainer works.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional, Protocol

Transition = Callable[..., dict]
logger = logging.getLogger(__name__)


class Stopped(Exception):
    """The side was stopped while it waited for its devices (raised by the `serve` callback of `hold`)."""


class _NoPhase:
    """The phase of dedicated devices: spans go nowhere (the actors' own timelines record them)."""

    waited_s = 0.0

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict]:
        yield dict(args)


NO_PHASE = _NoPhase()


class Residency(Protocol):
    polls: int          # lease polls so far: waiting for devices is not being stuck (the driver's watchdog)
    poll_s: float       # how often a side that waits for work should look up (it may have to give devices back)

    @property
    def holding(self) -> bool: ...

    def attach(self, on: Transition, off: Transition) -> None: ...

    def setup(self) -> contextlib.AbstractContextManager: ...

    def hold(self, phase: str, serve: Optional[Callable[[], None]] = None) -> Optional[dict]: ...

    def wanted(self, min_held_s: float = 0.0) -> bool: ...

    def give_back(self, why: str) -> dict: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager: ...

    def keep(self, update: Any) -> bool: ...

    def take_kept(self) -> Any: ...

    def has_kept(self) -> bool: ...

    def pop_metrics(self) -> dict: ...


class Dedicated:
    """The side's own devices: always held."""

    polls = 0
    poll_s = 5.0
    holding = True
    current = NO_PHASE

    def attach(self, on: Transition, off: Transition) -> None:
        pass

    @contextlib.contextmanager
    def setup(self) -> Iterator[Any]:
        yield NO_PHASE

    def hold(self, phase: str, serve: Optional[Callable[[], None]] = None) -> Optional[dict]:
        return {}

    def wanted(self, min_held_s: float = 0.0) -> bool:
        return False

    def give_back(self, why: str) -> dict:
        return {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Any]:
        yield NO_PHASE

    def keep(self, update: Any) -> bool:
        return False

    def take_kept(self) -> Any:
        return None

    def has_kept(self) -> bool:
        return False

    def pop_metrics(self) -> dict:
        return {}


class PoolLease:
    """A lease of a shared device pool (`client`: device_pool.LeaseClient, or a test's fake)."""

    def __init__(self, client: Any, waiting_poll_s: float = 0.05):
        self.client = client
        self.waiting_poll_s = waiting_poll_s
        self._on: Optional[Transition] = None
        self._off: Optional[Transition] = None
        self._is_on = False
        self._held_from: Optional[float] = None
        self._kept: Any = None
        self._metrics: dict = {}

    @property
    def polls(self) -> int:
        return self.client.polls

    @property
    def holding(self) -> bool:
        return self.client.current is not None

    @property
    def current(self) -> Any:
        return self.client.current

    @property
    def poll_s(self) -> float:
        return self.waiting_poll_s if self.holding else 5.0

    def attach(self, on: Transition, off: Transition) -> None:
        self._on, self._off = on, off

    @contextlib.contextmanager
    def setup(self) -> Iterator[Any]:
        """Building loads onto the devices: under a lease, and the state goes off before it is given back."""
        ph = self.client.acquire("setup")
        try:
            with ph.span("build"):
                yield ph
            self._metrics.update(self._off(ph, "setup"))
        finally:
            self.client.release(failing=True)

    def hold(self, phase: str, serve: Optional[Callable[[], None]] = None) -> Optional[dict]:
        if self.holding and self._is_on:
            return {}
        try:
            ph = self.client.acquire(phase, serve=serve)
        except Stopped:
            return None
        if self._is_on:   # a call served while waiting took the lease and put the state on meanwhile
            return {}
        self._is_on = True
        metrics = self._on(ph, phase)
        self._held_from = time.time()
        self._metrics.update(metrics)
        return metrics

    def wanted(self, min_held_s: float = 0.0) -> bool:
        if not self.holding or not self.client.renew():
            return False
        return self._held_from is None or time.time() - self._held_from >= min_held_s

    def give_back(self, why: str) -> dict:
        ph = self.client.current
        if ph is None:
            return {}
        metrics = self._off(ph, why) if self._is_on else {}
        self._is_on, self._held_from = False, None
        self._metrics.update(metrics)
        self.client.release()
        return metrics

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Any]:
        with self.client.phase(name) as ph:
            yield ph

    def held_since(self) -> Optional[float]:
        """Wall time the state came on (None: off)."""
        return self._held_from

    def keep(self, update: Any) -> bool:
        if self.holding and self._is_on:
            return False
        self._kept = update
        return True

    def take_kept(self) -> Any:
        kept, self._kept = self._kept, None
        return kept

    def has_kept(self) -> bool:
        return self._kept is not None

    def pop_metrics(self) -> dict:
        out, self._metrics = self._metrics, {}
        return out


class Turns:
    """Engines and a trainer taking turns on one set of devices, inside `outer` (Dedicated or a PoolLease held per
    phase).  `engines` and `trainer` are (on, off) transitions of each tenant: on(ph) / off(ph) -> metrics.

    On a pool that shares memory (leases.py, co-tenancy), `measure(phase)` (the job's, called at the end of each
    phase while the lease is held) returns what the job holds on each device then (GiB) and the device's memory:
    once a rollout and a train phase are measured the job declares the sum (both tenants on at once, plus what the
    engines hold outside the allocator, which the caller adds) as its need.  A lease granted on that need holds
    both tenants: nothing goes off at the switch, and at its end the job keeps its state on the devices when the
    pool lets it (nobody waits), else puts it off as before.  Kept state the pool later wants off goes off in the
    job's next lease request (`on_drop`)."""

    def __init__(self, outer: Any, engines: tuple[Transition, Transition], trainer: tuple[Transition, Transition],
                 measure: Optional[Callable[[str], tuple[Optional[float], Optional[float]]]] = None):
        self.outer = outer
        self.tenants = {"engines": engines, "trainer": trainer}
        self.on: dict[str, bool] = {"engines": True, "trainer": True}   # both come up built on the devices
        self.shared = isinstance(outer, PoolLease)
        self.measure = measure if self.shared else None
        self.measured: dict[str, float] = {}     # phase kind (rollout | train) -> the most the job held at its end
        self.kept = False                        # the state stayed on the devices after the last lease
        self.counts = {"shared": 0, "kept": 0, "dropped": 0}
        if self.shared:   # a lease client without co-tenancy (a test's) simply never declares a need
            outer.client.on_drop = self._drop

    @property
    def polls(self) -> int:
        return self.outer.polls

    @property
    def holding(self) -> bool:
        return self.outer.holding

    def declare(self, need_gib: Optional[float], capacity_gib: Optional[float]) -> None:
        """On a pool that shares memory: the job's need before anything is measured (the memory model's estimate;
        measurements only raise it) and its devices' memory."""
        if self.shared:
            self.outer.client.need_gib, self.outer.client.capacity_gib = need_gib, capacity_gib

    @contextlib.contextmanager
    def setup(self) -> Iterator[Any]:
        """Building puts both tenants on the devices; on a pool both go off before the lease is given back, unless
        the lease was granted on a declared need and the pool lets the job keep them on."""
        if not self.shared:
            yield NO_PHASE
            return
        with self.outer.phase("setup") as ph:
            with ph.span("build"):
                yield ph
            if self._keep_on(getattr(ph, "shared", False)):
                return
            self.put_off(ph, "engines", "setup")
            self.put_off(ph, "trainer", "setup")

    def put_on(self, ph: Any, tenant: str, phase: str) -> dict:
        if self.on[tenant]:
            return {}
        self.on[tenant] = True
        return self.tenants[tenant][0](ph, phase)

    def put_off(self, ph: Any, tenant: str, phase: str) -> dict:
        if not self.on[tenant]:
            return {}
        self.on[tenant] = False
        return self.tenants[tenant][1](ph, phase)

    @contextlib.contextmanager
    def phase(self, tenant: str, name: str) -> Iterator[tuple[Any, dict]]:
        """Hold the devices (a pool lease: for this phase only) with `tenant` on them and the other off; yields
        (the lease phase, the switch's metrics).  On a pool, `tenant` goes off again before the lease goes back."""
        other = "trainer" if tenant == "engines" else "engines"
        with self.outer.phase(name) as ph:
            together = self.shared and getattr(ph, "shared", False)   # granted on the job's need: both may stay on
            self.kept = False
            metrics = {} if together else self.put_off(ph, other, name)
            metrics.update(self.put_on(ph, tenant, name))
            if self.shared:
                metrics[f"multi_job/{name}/lease_wait_s"] = ph.waited_s
                metrics[f"multi_job/{name}/shared"] = float(together)
                self.counts["shared"] += together
            try:
                yield ph, metrics
            except Exception as exc:
                if together and out_of_memory(exc):
                    raise self._shared_oom(name, exc) from exc
                raise
            if self.shared:
                self._measure(tenant, together)
                need = getattr(self.outer.client, "need_gib", None)
                if not self._keep_on(together):
                    metrics.update(self.put_off(ph, other, name))
                    metrics.update(self.put_off(ph, tenant, name))
                metrics[f"multi_job/{name}/kept"] = float(self.kept)
                metrics["multi_job/need_gib"] = need or 0.0

    def _keep_on(self, granted_on_need: bool) -> bool:
        """Ending a lease granted on the job's declared need: does the pool let its state stay on the devices?"""
        need = getattr(self.outer.client, "need_gib", None)
        if not granted_on_need or need is None or not self.outer.client.keep(need):
            return False
        self.kept = True
        self.counts["kept"] += 1
        return True

    def _measure(self, tenant: str, together: bool) -> None:
        """At the end of a phase, still holding: what the job holds now.  A phase with one tenant on measures that
        tenant (rollout or train); both measured, their sum is the job's need.  A phase with both on measures the
        need itself (it only grows: the pool counts what was declared)."""
        if self.measure is None:
            return
        kind = "rollout" if tenant == "engines" else "train"
        held, capacity = self.measure(kind)
        client = self.outer.client
        client.capacity_gib = capacity
        if held is None or capacity is None:
            return
        if together:
            declared = getattr(client, "need_gib", None) or 0.0
            if held > declared + 0.5:
                logger.warning("device pool: this job holds %.1f GiB on its device, more than the %.1f it declared "
                               "and shares the device on; it declares %.1f from now on (jobs granted meanwhile were "
                               "counted against the smaller figure: the pool's margin absorbs what it can)", held,
                               declared, held)
            client.need_gib = max(declared, held)
            return
        self.measured[kind] = max(self.measured.get(kind, 0.0), held)
        if len(self.measured) == 2:
            client.need_gib = max(getattr(client, "need_gib", None) or 0.0, sum(self.measured.values()))

    def _shared_oom(self, phase: str, exc: BaseException) -> Exception:
        """The device ran out of memory in a phase this job held beside other jobs: say what was declared and how
        to take turns instead (the allocator's own message follows as the cause)."""
        from fully_async.cluster.ray_utils import RunFailed

        client = self.outer.client
        need, capacity = getattr(client, "need_gib", None), getattr(client, "capacity_gib", None)
        declared = (f"this job declared {need:.1f} GiB of the device's {capacity:.1f}" if need and capacity else
                    "this job's declared need")
        return RunFailed(f"the device ran out of memory in the {phase} phase while this job shared it with other "
                         f"jobs (multi_job.co_tenancy=true; {declared}): a job's memory grew past what it declared. "
                         "Set multi_job.co_tenancy=false to take turns on the device, or a smaller "
                         f"multi_job.device_memory_gib to leave more room ({type(exc).__name__}: {exc})")

    def _drop(self, ph: Any) -> None:
        """The pool wants the state this job kept on the devices off them (another job's request needs the room)."""
        for tenant in ("engines", "trainer"):
            self.put_off(ph, tenant, "drop")
        self.kept = False
        self.counts["dropped"] += 1


def out_of_memory(exc: BaseException) -> bool:
    """A device allocator's out-of-memory error (torch's, or one whose message says so: NPU, a Ray-wrapped one)."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


class Elastic(Dedicated):
    """The trainer's side of placement=elastic (its own devices, always held: Dedicated's keep / kept / metrics).
    `lend(ph, phase)` puts the trainer's engines to work in the rollouter's pool, `reclaim(ph, phase)` takes them
    back; both return metrics.  The trainer stays on its devices throughout (offloading it is refused for elastic:
    config_checks), so its own transitions (`attach`) never run.
    The metrics of a lend ride with those of the reclaim that ends it (`hold`'s), so a trainer step reports the lend
    of the wait before it."""

    def __init__(self, lend: Transition, reclaim: Transition, lent_poll_s: float = 0.5, poll_s: float = 0.05):
        nothing: Transition = lambda ph, phase: {}   # noqa: E731 - the trainer tenant stays on its devices
        self.turns = Turns(Dedicated(), engines=(lend, reclaim), trainer=(nothing, nothing))
        self.turns.on["engines"] = False     # the engines come up asleep, not lent
        self.lent_poll_s, self.unlent_poll_s = lent_poll_s, poll_s
        self._lend_metrics: dict = {}

    @property
    def lent(self) -> bool:
        return self.turns.on["engines"]

    @property
    def poll_s(self) -> float:
        """A trainer still holding its engines looks at its queue again soon: a short queue lends them at once."""
        return self.lent_poll_s if self.lent else self.unlent_poll_s

    def hold(self, phase: str, serve: Optional[Callable[[], None]] = None) -> Optional[dict]:
        """The trainer's turn: its engines leave the rollout pool; the metrics of the lend that ends here."""
        if not self.lent:
            return {}
        metrics, self._lend_metrics = self._lend_metrics, {}
        metrics.update(self.turns.put_off(NO_PHASE, "engines", phase))
        return metrics

    def wanted(self, min_held_s: float = 0.0) -> bool:
        return not self.lent

    def give_back(self, why: str) -> dict:
        """Lend the engines ("done": the run ends, take them back for good)."""
        if why == "done":
            return self.hold(why) or {}
        self._lend_metrics.update(self.turns.put_on(NO_PHASE, "engines", why))
        return {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Any]:
        self.hold(name)
        yield NO_PHASE

