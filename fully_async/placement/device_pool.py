"""A device pool shared by several jobs (layer 3, the placement package): the lease book behind a lock, the Ray
actor that serves it, and its two clients.

`DevicePoolService` runs `placement.leases.LeaseBook` with the wall clock, a lock and a ticker thread (expiry of
overstayed leases, jobs that stopped heartbeating), and writes the pool's Perfetto timeline: one process per
job, one track per device (the leases and what the job did inside them: onload, offload, generate, train)
plus a track of its waits.  `DevicePool` / `get_or_create_pool` make it a named Ray actor (detached for a pool of
several jobs: it outlives the job that created it; one run's private pool for colocated async); the stress test
runs the service with plain threads.  Later jobs find a pool by name in the `fully_async_pools` namespace, whatever
their own namespaces; the actor is threaded (max_concurrency): a job blocked in `acquire` does not block the others'
releases and heartbeats.

`PoolMembership` is the driver's side: it registers the job and heartbeats from a thread, so a job whose
driver dies (SIGKILL) stops heartbeating and the pool frees its leases `multi_job.heartbeat_timeout_s` later;
Ray kills that driver's actors at the same time, so nobody still uses the devices.  `LeaseClient` is the
worker's side: `with client.phase("train") as ph:` blocks until the job holds its devices, and gives them
back (with the spans recorded in `ph`) when the block ends.  Which pool devices each side leases is the placement's
device layout (`job_devices`, `rollout_devices` below).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional

from fully_async.placement.leases import LeaseBook, LeaseError, LeaseExpired, PoolEvent

logger = logging.getLogger(__name__)

POOL_NAMESPACE = "fully_async_pools"   # every pool actor lives here, whatever the jobs' own namespaces


def pool_actor_name(pool: str) -> str:
    return f"fully_async_pool:{pool}"


class DevicePoolService:
    def __init__(self, name: str, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float,
                 timeline_path: Optional[str] = None, tick_s: float = 0.1, write_every_s: float = 1.0,
                 clock: Callable[[], float] = time.time, co_tenancy: bool = True):
        self.name = name
        self.book = LeaseBook(num_devices, max_hold_s, heartbeat_timeout_s, co_tenancy=co_tenancy)
        self.timeline_path = timeline_path
        self.clock = clock
        self.cond = threading.Condition()
        self._write_lock = threading.Lock()
        self.spans: list[PoolEvent] = []
        self._dirty = False
        self._written = 0.0
        self._write_every_s = write_every_s
        self._stopped = False
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,), daemon=True, name="pool-ticker")
        self._ticker.start()

    # ------------------------------------------------------------------ membership
    def register(self, job: str, num_devices: int, max_hold_s: Optional[float] = None) -> dict:
        with self.cond:
            self.book.register(job, num_devices, self.clock(), max_hold_s)
            logger.info("pool %s: job %s joined (%d jobs)", self.name, job, len(self.book.jobs))
            return {"pool": self.name, "num_devices": self.book.num_devices, "timeline": self.timeline_path,
                    "max_hold_s": self.book.max_hold_s, "heartbeat_timeout_s": self.book.heartbeat_timeout_s,
                    "co_tenancy": self.book.co_tenancy}

    def heartbeat(self, job: str) -> None:
        with self.cond:
            self.book.heartbeat(job, self.clock())

    def unregister(self, job: str) -> None:
        with self.cond:
            if job in self.book.jobs:
                self.book.unregister(job, self.clock())
                logger.info("pool %s: job %s left", self.name, job)
            self._changed()

    # ------------------------------------------------------------------ leases
    def acquire(self, job: str, holder: str, phase: str, devices: list[int], timeout_s: float,
                need_gib: Optional[float] = None, capacity_gib: Optional[float] = None) -> Optional[dict]:
        """Queue the request (first call) and wait up to `timeout_s` for the grant: the lease, or None (call
        again; the request keeps its place), or {"drop": True} when the state this holder kept on the devices is
        in another request's way (take it off, say `dropped`, call again).  need_gib / capacity_gib: see
        LeaseBook.request.  Each call also counts as a heartbeat of the job."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.book.heartbeat(job, self.clock())
            if self.book.granted(job, holder) is None and holder not in self.book.waiting_holders():
                self.book.request(job, holder, phase, devices, self.clock(), need_gib, capacity_gib)
                self._changed()
            while True:
                lease = self.book.granted(job, holder)
                if lease is not None:
                    return {"devices": sorted(lease.devices), "phase": lease.phase, "granted_at": lease.granted_at,
                            "waited_s": lease.granted_at - lease.requested_at, "expires_at": lease.expires_at,
                            "shared": lease.need_gib is not None}
                if self.book.must_drop(holder):
                    return {"drop": True}
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.5))

    def release(self, job: str, holder: str, spans: Optional[list[dict]] = None) -> dict:
        """Give the lease back with what the job did inside it (spans: name, start, end in wall seconds, args)."""
        with self.cond:
            lease = self.book.release(job, holder, self.clock())
            for s in spans or []:
                for d in sorted(lease.devices):
                    self.spans.append(PoolEvent(job, f"device {d}", s["name"], s["start"], s["end"],
                                                dict(s.get("args", {}))))
            self._changed()
            return {"held_s": self.clock() - lease.granted_at}

    def keep(self, job: str, holder: str, gib: float) -> bool:
        """May the holder leave its state on the devices as it releases them (LeaseBook.keep)?"""
        with self.cond:
            ok = self.book.keep(job, holder, gib, self.clock())
            if ok:
                logger.info("pool %s: %s keeps %.1f GiB on devices %s between its leases", self.name, holder, gib,
                            self.book.holders().get(holder))
            return ok

    def dropped(self, job: str, holder: str, spans: Optional[list[dict]] = None) -> None:
        """The holder took the state it kept off its devices (asked to by `acquire`), with the spans of doing so."""
        with self.cond:
            devices = sorted(self.book.footprint.get(holder, (frozenset(), None))[0])
            self.book.kept_dropped(job, holder, self.clock())
            for sp in spans or []:
                for d in devices:
                    self.spans.append(PoolEvent(job, f"device {d}", sp["name"], sp["start"], sp["end"],
                                                dict(sp.get("args", {}))))
            logger.info("pool %s: %s took its kept state off devices %s", self.name, holder, devices)
            self._changed()

    def renew(self, job: str, holder: str) -> bool:
        """A side keeping its lease: its time limit restarts unless someone waits for its devices; returns whether
        someone does (leases.LeaseBook.renew).  Also a heartbeat."""
        with self.cond:
            return self.book.renew(job, holder, self.clock())

    # ------------------------------------------------------------------ views
    def state(self) -> dict:
        with self.cond:
            return {"jobs": sorted(self.book.jobs), "held": self.book.holders(), "waiting": self.book.waiting_holders(),
                    "log": list(self.book.log), "num_devices": self.book.num_devices, "memory": self.book.memory()}

    def write_timeline(self) -> Optional[str]:
        """The pool's trace so far (also written by the ticker at most once per write_every_s while it changes)."""
        from fully_async.telemetry.timeline import write_pool_trace

        with self.cond:
            self.spans += self.book.drain_events()
            spans = list(self.spans)
            self._dirty = False
            self._written = time.monotonic()
        if self.timeline_path:
            with self._write_lock:   # the actor serves calls concurrently, and every writer uses one temp name
                write_pool_trace(self.timeline_path, spans)
        return self.timeline_path

    def stop(self) -> None:
        self._stopped = True

    # ------------------------------------------------------------------ internals
    def _changed(self) -> None:
        self._dirty = True
        self.cond.notify_all()

    def _tick_loop(self, tick_s: float) -> None:
        while not self._stopped:
            time.sleep(tick_s)
            with self.cond:
                for line in self.book.tick(self.clock()):
                    logger.warning("pool %s: %s", self.name, line)
                    self._dirty = True
                if self._dirty:
                    self.cond.notify_all()
                # the whole trace is rewritten: the longer it is, the less often (1 s per 2,000 spans, at least
                # write_every_s); a job ending and write_timeline() write it at once
                every = max(self._write_every_s, len(self.spans) / 2000)
                due = self._dirty and time.monotonic() - self._written >= every
            if due and self.timeline_path:
                try:
                    self.write_timeline()
                except OSError as exc:
                    logger.warning("pool %s: cannot write %s: %s", self.name, self.timeline_path, exc)


class DevicePool(DevicePoolService):
    """The service as a Ray actor (its log lines name the pool)."""

    def __init__(self, name: str, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float,
                 timeline_path: Optional[str], co_tenancy: bool = True):
        logging.basicConfig(level=logging.INFO, format=f"[pool {name}] %(message)s", force=True)
        super().__init__(name, num_devices, max_hold_s, heartbeat_timeout_s, timeline_path, co_tenancy=co_tenancy)

    def ready(self) -> bool:
        return True


def get_or_create_pool(name: str, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float,
                       timeline_path: Optional[str], detached: bool = True, co_tenancy: bool = True) -> Any:
    """The pool actor `name`; created (no resources; detached unless it is one run's private pool) when no job
    created it yet (co_tenancy: whether it lets jobs whose memory fits together share a device, its creator's
    multi_job.co_tenancy)."""
    import ray

    handle = ray.remote(DevicePool).options(
        name=pool_actor_name(name), namespace=POOL_NAMESPACE, lifetime="detached" if detached else None,
        get_if_exists=True,
        num_cpus=0, max_concurrency=64, max_restarts=0).remote(name, num_devices, max_hold_s, heartbeat_timeout_s,
                                                              timeline_path, co_tenancy)
    ray.get(handle.ready.remote(), timeout=120)
    return handle


# ---------------------------------------------------------------------------------------------- clients
def get_pool(pool: str) -> Any:
    """The running pool actor named `pool` (RunFailed naming the key when there is none)."""
    import ray

    from fully_async.cluster.ray_utils import RunFailed

    try:
        return ray.get_actor(pool_actor_name(pool), namespace=POOL_NAMESPACE)
    except ValueError:
        raise RunFailed(f"no device pool named {pool!r} runs in this Ray cluster (multi_job.pool); the job's driver "
                        "creates it, so this worker's driver is gone or joined another cluster") from None


def _unwrap(exc: BaseException) -> BaseException:
    from fully_async.cluster.ray_utils import root_cause

    cause = root_cause(exc)
    return cause if isinstance(cause, (LeaseError, LeaseExpired)) else exc


class PoolMembership:
    """The driver's registration and heartbeat thread (see the module docstring)."""

    def __init__(self, pool_handle: Any, job: str, num_devices: int, heartbeat_timeout_s: float,
                 max_hold_s: Optional[float] = None):
        import ray

        self.pool, self.job = pool_handle, job
        deadline = time.monotonic() + heartbeat_timeout_s + 2
        while True:
            try:
                self.info = ray.get(pool_handle.register.remote(job, num_devices, max_hold_s), timeout=60)
                break
            except Exception as exc:  # noqa: BLE001 - LeaseError: wrong device count, a live job of this name
                cause = _unwrap(exc)
                # the same job restarted right after its driver died: its old entry expires within the timeout
                if isinstance(cause, LeaseError) and "live job named" in str(cause) and time.monotonic() < deadline:
                    time.sleep(0.5)
                    continue
                raise cause from None
        if self.info["heartbeat_timeout_s"] != heartbeat_timeout_s:
            logger.warning("device pool %s: its heartbeat timeout is %gs (set by the job that created it), not this "
                           "job's multi_job.heartbeat_timeout_s=%g", self.info["pool"],
                           self.info["heartbeat_timeout_s"], heartbeat_timeout_s)
        self.interval_s = max(0.1, min(heartbeat_timeout_s, self.info["heartbeat_timeout_s"]) / 5)
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="pool-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        import ray

        while not self._stop.wait(self.interval_s):
            try:
                ray.get(self.pool.heartbeat.remote(self.job), timeout=max(5.0, self.interval_s))
            except Exception as exc:  # noqa: BLE001 - the worker's next lease call fails with the reason
                cause = _unwrap(exc)
                if isinstance(cause, LeaseExpired) and self.lost is None:
                    self.lost = str(cause)
                    logger.error("device pool: %s", cause)

    def close(self) -> None:
        import ray

        self._stop.set()
        self._thread.join(5)
        try:
            ray.get(self.pool.unregister.remote(self.job), timeout=10)
        except Exception as exc:  # noqa: BLE001 - the pool drops us on the missing heartbeat anyway
            logger.warning("device pool: could not unregister %s: %s", self.job, exc)


class Phase:
    """What a job did while holding one lease: its spans go to the pool's timeline at release."""

    def __init__(self, name: str, waited_s: float, devices: list[int], shared: bool = False):
        self.name, self.waited_s, self.devices = name, waited_s, devices
        self.shared = shared    # granted on the holder's declared need: other holders whose needs fit may share it
        self.spans: list[dict] = []

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict]:
        """Record `name` (args may be filled in inside the block: the dict is yielded)."""
        record = {"name": name, "start": time.time(), "args": dict(args)}
        try:
            yield record["args"]
        finally:
            record["end"] = time.time()
            self.spans.append(record)


class LeaseClient:
    """A job side's handle on the pool: `with client.phase("rollout") as ph: ...` (sync mode), or `acquire()`,
    `renew()` and `release()` for a side that keeps its lease between pieces of work (async mode)."""

    def __init__(self, pool: str, job: str, devices: list[int], side: str = "colocated", poll_s: float = 2.0,
                 renew_every_s: float = 0.05):
        self.pool_name, self.job, self.devices = pool, job, list(devices)
        self.holder = f"{job}/{side}"
        self.poll_s = poll_s
        self.renew_every_s = renew_every_s
        self.pool = get_pool(pool)
        self.current: Optional[Phase] = None
        self.polls = 0   # acquire calls: a job waiting its turn is not stuck (the driver's watchdog reads this)
        self._renewed = (0.0, False)   # (monotonic time, contended) of the last renewal
        self._asking: Any = None       # the renewal on its way to the pool (its reply not read yet)
        # co-tenancy (leases.py): what this side holds on each device with all its state on (GiB, None: unmeasured,
        # it takes the devices alone), each device's memory, and how to take off state it kept between leases
        self.need_gib: Optional[float] = None
        self.capacity_gib: Optional[float] = None
        self.on_drop: Optional[Callable[[Phase], None]] = None
        self.drops = 0

    def acquire(self, name: str, serve: Optional[Callable[[], Any]] = None, poll_s: Optional[float] = None) -> Phase:
        """Block until this side holds its devices; `serve()` runs between two polls (a rollouter keeps taking
        weight updates and checkpoint calls while it waits).  Holding already: the current phase."""
        import ray

        if self.current is not None:
            return self.current
        start = time.perf_counter()
        try:
            while True:
                got = ray.get(self.pool.acquire.remote(self.job, self.holder, name, self.devices,
                                                       self.poll_s if poll_s is None else poll_s, self.need_gib,
                                                       self.capacity_gib))
                self.polls += 1
                if got is not None and got.get("drop"):
                    self._drop()
                    continue
                if got is not None:
                    break
                if serve is not None:
                    serve()
                    if self.current is not None:   # a call it served took the lease meanwhile (same request)
                        return self.current
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None
        self.current = Phase(name, time.perf_counter() - start, got["devices"], bool(got.get("shared")))
        self._renewed, self._asking = (time.monotonic(), False), None
        return self.current

    def keep(self, gib: float) -> bool:
        """Ending the current lease: may this side leave its state (`gib` per device) on the devices?"""
        import ray

        if self.current is None or not gib > 0:
            return False
        try:
            return bool(ray.get(self.pool.keep.remote(self.job, self.holder, float(gib))))
        except Exception as exc:  # noqa: BLE001
            raise _unwrap(exc) from None

    def _drop(self) -> None:
        """The pool wants the state this side kept on the devices off them: take it off, then say so."""
        import ray

        if self.on_drop is None:
            raise LeaseError(f"{self.holder}: the pool asks to take kept state off the devices, but this side "
                             "keeps none (no on_drop)")
        ph = Phase("drop", 0.0, list(self.devices))
        self.on_drop(ph)
        self.drops += 1
        ray.get(self.pool.dropped.remote(self.job, self.holder, ph.spans))

    def renew(self) -> bool:
        """Whether another request waits for this side's devices, as the pool last said (an uncontended lease's time
        limit restarts).  The question goes out at most every renew_every_s and is not waited for: its reply is read
        at a later call once it is there, so a side that asks between two engine steps never stalls on the pool, and
        a side waiting for the devices is seen within ~renew_every_s plus one round trip."""
        if self.current is None:
            return False
        at, contended = self._renewed
        if self._asking is not None:
            if not self._asking.done():   # a future's flag: no call into Ray between two engine steps
                return contended
            asked, self._asking = self._asking, None
            try:
                contended = bool(asked.result())
            except Exception as exc:  # noqa: BLE001
                raise _unwrap(exc) from None
            self._renewed = (time.monotonic(), contended)
            return contended
        if time.monotonic() - at >= self.renew_every_s:
            self._asking = self.pool.renew.remote(self.job, self.holder).future()
        return contended

    def release(self, failing: bool = False) -> None:
        """Give the lease back with the phase's spans (failing: the job is unwinding an error; a failed release
        is then only logged)."""
        import ray

        ph, self.current = self.current, None
        self._asking = None   # a reply about this lease says nothing about the next
        if ph is None:
            return
        try:
            ray.get(self.pool.release.remote(self.job, self.holder, ph.spans))
        except Exception as exc:  # noqa: BLE001 - an overstayed lease fails the job, unless it is failing already
            if not failing:
                raise _unwrap(exc) from None
            logger.warning("device pool: releasing %s after an error: %s", ph.name, _unwrap(exc))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        ph = self.acquire(name)
        ok = False
        try:
            yield ph
            ok = True
        finally:
            self.release(failing=not ok)


def timed_event(device: Any, ph: Phase, phase: str, event: str, fn: Callable[[], Any]) -> dict:
    """Run `fn` (an onload or offload) inside lease phase `ph`, timed, with the device memory before and after
    (device.memory_stats(): allocated/reserved on accelerators, the host RSS everywhere) as the span's args and
    as `multi_job/<phase>/<event>...` metrics."""
    before = device.memory_stats()
    start = time.perf_counter()
    with ph.span(event) as args:
        fn()
        device.synchronize()
    elapsed = time.perf_counter() - start
    after = device.memory_stats()
    args.update({f"{k}_before": round(v, 4) for k, v in before.items()})
    args.update({f"{k}_after": round(v, 4) for k, v in after.items()})
    m = {f"multi_job/{phase}/{event}_s": elapsed}
    for k in before:
        m[f"multi_job/{phase}/{event}/{k}_before"] = before[k]
        m[f"multi_job/{phase}/{event}/{k}_after"] = after[k]
    return m


def job_devices(cfg: Any) -> list[int]:
    """The pool devices this job's trainer leases (sync: the whole job, engines included): multi_job.job_devices;
    null: all of the pool's in sync mode, the first trainer-world ones in async mode (config_checks.py checked it)."""
    mj = cfg.multi_job
    if mj.job_devices is not None:
        return list(mj.job_devices)
    if cfg.mode == "async":
        return list(range(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node))
    return list(range(mj.devices))


def rollout_devices(cfg: Any) -> list[int]:
    """The pool devices an async job's rollout side leases: multi_job.rollout_devices; null: the ones after the
    trainer's (the trainer world .. + rollout.nnodes x rollout.n_gpus_per_node)."""
    mj = cfg.multi_job
    if mj.rollout_devices is not None:
        return list(mj.rollout_devices)
    first = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    return list(range(first, first + cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node))


def job_name(cfg: Any) -> str:
    return cfg.multi_job.job_name or cfg.trainer.experiment_name


def pool_timeline_path(cfg: Any) -> str:
    return os.path.abspath(os.path.join(cfg.multi_job.pool_dir, cfg.multi_job.pool, "timeline.json"))


def pinned_actor_options(device: Any, cfg: Any, rank: int, num_cpus: float = 1,
                         devices: Optional[list[int]] = None) -> dict:
    """Ray options of trainer rank `rank` of a job on a shared pool (`devices`: pin these pool devices instead, an
    engine replica's).  On accelerators: no device resource (the jobs share the devices; the leases keep them
    apart in time) and the pool devices pinned; on CPU the device's own options (pool devices are logical)."""
    if not device.is_accelerator:
        return device.ray_actor_options(1, num_cpus=num_cpus)
    pinned = [job_devices(cfg)[rank]] if devices is None else list(devices)
    return dict(device.ray_actor_options(0, num_cpus=num_cpus),
                runtime_env={"env_vars": device.pinned_env(pinned)})


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (before data is loaded) when the shared Ray cluster's address does not answer."""
    import socket

    from fully_async.cluster.ray_utils import RunFailed

    if address == "auto" or "://" in address:
        return  # ray.init resolves these itself
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise RunFailed(f"multi_job.pool: no Ray cluster answers at {address} (multi_job.ray_address or "
                        f"RAY_ADDRESS): {exc}.  Start one first: `ray start --head --port=<port>`") from None
