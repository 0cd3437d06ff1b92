"""Leases on a shared device pool (the placement package, layer 3; pure: no Ray, no threads, no clock of its own).

Several independent jobs time-slice one set of devices: a job holds a device set only for one phase
(sync mode's "rollout + weight update" or "train"), keeps its weights on the devices only while it holds
the lease, and offloads them before releasing.  `LeaseBook` decides who may hold what; the caller passes
the time in, so every rule is tested deterministically (tests/unit/placement/test_leases.py).

Why it cannot deadlock.  A deadlock needs a holder that waits for more while holding (Coffman's
hold-and-wait).  Here a holder (one side of one job) holds at most one lease, asks for its whole device
set in one request, and gets all of it or nothing: `request()` while holding is refused.  So no holder
ever waits while holding, and the wait-for graph has no edges out of holders: no cycle.

Why nobody starves.  Requests wait in one FIFO queue.  A request is granted only when none of its devices
is held *and* none is wanted by an earlier waiting request (no overtaking on a shared device; requests
on disjoint devices go ahead, so a 1-device job need not wait for an unrelated 2-device one).  So a request
waits at most for the requests ahead of it that share a device, each of which waits for the same, and
every lease ends within its job's `max_hold_s` (it is revoked then) or when its owner stops heartbeating: the wait is
bounded by the sum of the time limits of the requests ahead of it (and of the current holders).

Async jobs.  Their rollout and train sides are two holders (`<job>/rollout`, `<job>/train`), each with at most
one lease, and neither waits for anything while holding one: a side waiting for the other side of its job (the
trainer for samples, the rollouter at the staleness bound) gives its lease back first when another request wants
its devices (`contended`), and the rollouter takes weight updates without a lease (it loads them at its next
onload).  So the argument above holds per side.  A side may keep an uncontended lease between two pieces of work
(`renew` restarts its time limit only while nobody waits for its devices).

Overstaying.  A lease past `max_hold_s` is revoked at the next `tick()`: its devices go to the next
request, and the holder's next call (`release`, `request`, `heartbeat`) raises `LeaseExpired` with the
reason, so the job fails loudly instead of using devices someone else now has.

Sharing the memory (co-tenancy).  A pool that knows its devices' memory (`capacity_gib`, reported with the requests)
may give one device to several holders at once, when what each of them declared (`need_gib`: its measured peak on
that device, all of its state on) fits the device together, leaving `margin` free.  A request without a need (a
job's first phases, before its memory is measured) or on a pool without capacities holds its devices alone, as
above.  A holder that ends a phase may keep its state on the devices (`keep`) while nobody waits for them; its
footprint still counts.  When a waiting request would fit but for such kept state, the kept holders are asked to
take it off (`evicting`: their next call learns it, they say `kept_dropped` once done), so a kept footprint delays
a request by at most the time its owner takes to call again.  The deadlock argument holds unchanged: co-holders
are granted all-or-nothing too, and a kept footprint belongs to no lease (its owner waits for nothing while it
drops it).

Owner death.  Every job heartbeats (its driver, in a thread); a job silent for `heartbeat_timeout_s` is
dropped at the next `tick()`: its leases are released and its waiting requests removed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional


class LeaseError(RuntimeError):
    """A request the pool refuses (unknown job, device out of range, a second lease while holding one)."""


class LeaseExpired(RuntimeError):
    """The holder's lease was revoked (held past max_hold_s, or its job was declared dead)."""


@dataclass
class Lease:
    holder: str                 # "<job>/<side>", e.g. "jobA/colocated"
    job: str
    phase: str                  # rollout | train | setup | validate ...
    devices: frozenset
    requested_at: float
    max_hold_s: float = 0.0     # the job's own limit (multi_job.max_lease_s of that job)
    need_gib: Optional[float] = None   # per device, while held (None: the devices alone)
    granted_at: Optional[float] = None
    expires_at: Optional[float] = None


@dataclass
class PoolEvent:
    """One span for the pool's timeline: a lease held (or a wait) on one device, or a job-reported span."""
    job: str
    track: str                  # "device <i>" or "wait"
    name: str
    start: float                # seconds (the caller's clock: wall time in the pool actor)
    end: float
    args: dict = field(default_factory=dict)


class LeaseBook:
    def __init__(self, num_devices: int, max_hold_s: float, heartbeat_timeout_s: float, co_tenancy: bool = True,
                 margin_fraction: float = 0.1, margin_min_gib: float = 2.0):
        if num_devices < 1:
            raise LeaseError(f"a device pool needs at least one device (got {num_devices})")
        self.num_devices = num_devices
        self.max_hold_s = max_hold_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.co_tenancy = co_tenancy
        self.margin_fraction, self.margin_min_gib = margin_fraction, margin_min_gib
        self.capacity: dict[int, float] = {}        # device -> GiB (the smallest any request reported)
        self.footprint: dict[str, tuple[frozenset, Optional[float]]] = {}   # holder -> (devices, GiB): held or kept
        self.kept: set[str] = set()                  # holders whose state stays on devices they no longer lease
        self.evicting: set[str] = set()              # kept holders asked to take their state off
        self.jobs: dict[str, float] = {}            # job -> last heartbeat
        self.max_hold: dict[str, float] = {}        # job -> its lease time limit (default: the pool's)
        self.waiting: deque[Lease] = deque()        # FIFO
        self.held: dict[str, Lease] = {}            # holder -> lease
        self.owners: dict[int, set[str]] = {}       # device -> its holders (several only when their needs fit)
        self.revoked: dict[str, str] = {}           # holder -> why (reported once, at its next call)
        self.dropped: dict[str, str] = {}           # job -> why it was declared dead
        self.events: list[PoolEvent] = []
        self.log: list[str] = []                    # what the pool did on its own (revocations, dead jobs)

    # ------------------------------------------------------------------ membership
    def register(self, job: str, num_devices: int, now: float, max_hold_s: Optional[float] = None) -> None:
        """A job joins (with its own lease time limit, default the pool's); refused when the pool's device count
        differs from the one it was configured with, or when a live job already has this name (two jobs would
        share each other's leases and run folders)."""
        if num_devices != self.num_devices:
            raise LeaseError(f"this pool has {self.num_devices} device(s) but the job was configured for "
                             f"{num_devices} (multi_job.devices): use the pool's device count or another "
                             "multi_job.pool")
        if job in self.jobs and now - self.jobs[job] <= self.heartbeat_timeout_s:
            raise LeaseError(f"a live job named {job!r} is already in this pool: give each job its own "
                             "multi_job.job_name (default: trainer.experiment_name)")
        self.jobs[job] = now
        self.max_hold[job] = self.max_hold_s if max_hold_s is None else max_hold_s
        self.dropped.pop(job, None)
        self.revoked = {h: why for h, why in self.revoked.items() if not h.startswith(f"{job}/")}

    def heartbeat(self, job: str, now: float) -> None:
        self._known(job)
        self.jobs[job] = now

    def unregister(self, job: str, now: float) -> None:
        """A job ends: everything it holds or waits for is given back."""
        self._drop(job, now, reason=None)

    # ------------------------------------------------------------------ leases
    def request(self, job: str, holder: str, phase: str, devices: Iterable[int], now: float,
                need_gib: Optional[float] = None, capacity_gib: Optional[float] = None) -> None:
        """Queue `holder`'s request for all of `devices`; granted by `grant()` (called here too).  need_gib: what it
        holds on each device while the lease runs (None: it takes the devices alone); capacity_gib: each device's
        memory as the requester's process sees it (the pool keeps the smallest reported)."""
        self._known(job)
        self._raise_revoked(holder)
        devs = frozenset(int(d) for d in devices)
        if not devs or any(not 0 <= d < self.num_devices for d in devs):
            raise LeaseError(f"devices {sorted(devs)} are not a non-empty subset of this pool's "
                             f"0..{self.num_devices - 1}")
        if holder in self.held or any(w.holder == holder for w in self.waiting):
            raise LeaseError(f"{holder} asked for a second lease while holding or awaiting one (one lease per "
                             "holder at a time is what keeps the pool free of deadlock)")
        if need_gib is not None and not need_gib > 0:
            raise LeaseError(f"{holder} declared need_gib={need_gib}: a need is a positive number of GiB (or None)")
        if capacity_gib is not None:
            for d in devs:
                self.capacity[d] = min(self.capacity.get(d, capacity_gib), capacity_gib)
        self.jobs[job] = now
        self.waiting.append(Lease(holder, job, phase, devs, now, self.max_hold.get(job, self.max_hold_s),
                                  need_gib if self.co_tenancy else None))
        self.grant(now)

    def granted(self, job: str, holder: str) -> Optional[Lease]:
        """The holder's lease once granted (None while it waits); raises LeaseExpired if it was revoked."""
        self._known(job)
        self._raise_revoked(holder)
        return self.held.get(holder)

    def release(self, job: str, holder: str, now: float) -> Lease:
        """Give the lease back; raises LeaseExpired when it had been revoked meanwhile."""
        self._known(job)
        self._raise_revoked(holder)
        lease = self.held.get(holder)
        if lease is None:
            raise LeaseError(f"{holder} releases a lease it does not hold")
        self._end(lease, now, "kept" if holder in self.kept else "released")
        self.grant(now)
        return lease

    def keep(self, job: str, holder: str, gib: float, now: float) -> bool:
        """May `holder`, ending its lease, leave its state (`gib` per device) on the devices?  Yes when the pool
        shares memory, knows these devices' capacity and nobody waits for them; the footprint then counts until
        the holder says `kept_dropped` (asked to, through `evicting`, when a waiting request needs the room)."""
        self._known(job)
        self._raise_revoked(holder)
        lease = self.held.get(holder)
        if lease is None:
            raise LeaseError(f"{holder} asks to keep its state on devices it does not hold")
        ok = (self.co_tenancy and gib > 0 and all(d in self.capacity for d in lease.devices)
              and not any(w.devices & lease.devices for w in self.waiting))
        if ok:
            self.kept.add(holder)
            self.footprint[holder] = (lease.devices, float(gib))
        return ok

    def must_drop(self, holder: str) -> bool:
        """Is `holder`'s kept state wanted off its devices (it calls `kept_dropped` once it is off)?"""
        return holder in self.evicting

    def kept_dropped(self, job: str, holder: str, now: float) -> None:
        """`holder`'s kept state is off its devices."""
        self._known(job)
        self._forget_kept(holder)
        self.grant(now)

    def _forget_kept(self, holder: str) -> None:
        if holder in self.kept:
            self.kept.discard(holder)
            self.evicting.discard(holder)
            if holder not in self.held:
                self.footprint.pop(holder, None)

    def usable_gib(self, device: int) -> Optional[float]:
        """What holders may declare on `device` together (its capacity less the margin), None when unknown."""
        from fully_async.planner.memory_model import co_tenant_usable_gib

        cap = self.capacity.get(device)
        if cap is None or not self.co_tenancy:
            return None
        return co_tenant_usable_gib(cap, self.margin_fraction, self.margin_min_gib)

    def _fits(self, lease: Lease, with_kept: bool = True) -> bool:
        """Could `lease` hold its devices now, given the holders and (with_kept) the kept state on them?"""
        for d in lease.devices:
            others = [h for h, (devs, _) in self.footprint.items()
                      if d in devs and h != lease.holder and (with_kept or h not in self.kept)]
            if not others:
                continue
            usable = self.usable_gib(d)
            needs = [self.footprint[h][1] for h in others]
            if usable is None or lease.need_gib is None or any(n is None for n in needs):
                return False
            if sum(needs) + lease.need_gib > usable:
                return False
        return True

    def contended(self, holder: str) -> bool:
        """Whether a waiting request wants a device of `holder`'s lease (False when it holds none)."""
        lease = self.held.get(holder)
        return lease is not None and any(w.devices & lease.devices for w in self.waiting)

    def shared_now(self, holder: str) -> bool:
        """Was `holder`'s lease granted on its declared need (its devices shared when the needs fit)?"""
        lease = self.held.get(holder)
        return lease is not None and lease.need_gib is not None

    def renew(self, job: str, holder: str, now: float) -> bool:
        """A holder that keeps its lease between two pieces of work (async mode's sides hold theirs while nobody
        waits) restarts its time limit -- only while no waiting request wants its devices: a contended lease keeps
        its deadline, so the holder must give it back within max_hold_s of the last uncontended renewal.  Returns
        whether the lease is contended (the holder should give it back soon); LeaseExpired if it was revoked."""
        self._known(job)
        self._raise_revoked(holder)
        lease = self.held.get(holder)
        if lease is None:
            raise LeaseError(f"{holder} renews a lease it does not hold")
        self.jobs[job] = now
        if self.contended(holder):
            return True
        lease.expires_at = now + lease.max_hold_s
        return False

    def grant(self, now: float) -> list[Lease]:
        """Grant every waiting request whose devices are free and wanted by no earlier waiting request."""
        granted, blocked = [], set()
        self.evicting = set()   # asked afresh: only kept state still in a waiting request's way
        for lease in list(self.waiting):
            if lease.devices & blocked or not self._fits(lease):
                if not lease.devices & blocked and self._fits(lease, with_kept=False):
                    # only state kept by holders between their leases is in the way: ask them to take it off
                    self.evicting |= {h for h in self.kept
                                      if self.footprint[h][0] & lease.devices and h != lease.holder}
                blocked |= lease.devices
                continue
            self.waiting.remove(lease)
            lease.granted_at, lease.expires_at = now, now + lease.max_hold_s
            self.held[lease.holder] = lease
            self.kept.discard(lease.holder)           # its kept state (if any) is now its lease's
            self.evicting.discard(lease.holder)
            self.footprint[lease.holder] = (lease.devices, lease.need_gib)
            for d in lease.devices:
                self.owners.setdefault(d, set()).add(lease.holder)
            if now - lease.requested_at >= 1e-3:   # a real wait: on the job's wait track
                self.events.append(PoolEvent(lease.job, "wait", f"wait {lease.phase}", lease.requested_at, now))
            granted.append(lease)
        return granted

    def tick(self, now: float) -> list[str]:
        """Revoke leases held past max_hold_s and drop jobs silent past heartbeat_timeout_s; returns what it did."""
        done: list[str] = []
        for lease in [h for h in self.held.values() if h.expires_at is not None and now > h.expires_at]:
            why = (f"lease of {sorted(lease.devices)} for phase {lease.phase!r} revoked after "
                   f"{now - lease.granted_at:.1f}s > multi_job.max_lease_s={lease.max_hold_s:g}: the phase "
                   "overstayed (raise multi_job.max_lease_s, or make the phase shorter)")
            self.revoked[lease.holder] = why
            self._end(lease, now, "revoked")
            done.append(f"{lease.holder}: {why}")
        for job in [j for j, seen in self.jobs.items() if now - seen > self.heartbeat_timeout_s]:
            why = (f"job {job} sent no heartbeat for {now - self.jobs[job]:.1f}s > "
                   f"{self.heartbeat_timeout_s:g}s (its driver died?): its leases are released")
            self._drop(job, now, reason=why)
            done.append(why)
        self.log += done
        if done:
            self.grant(now)
        return done

    # ------------------------------------------------------------------ views
    def holders(self) -> dict[str, list[int]]:
        return {h: sorted(lease.devices) for h, lease in self.held.items()}

    def memory(self) -> dict[int, dict]:
        """Per device: its capacity, what holders and kept state declare on it (GiB), who is asked to drop."""
        out = {}
        for d in range(self.num_devices):
            on = {h: gib for h, (devs, gib) in self.footprint.items() if d in devs}
            out[d] = {"capacity_gib": self.capacity.get(d), "usable_gib": self.usable_gib(d),
                      "held": {h: g for h, g in on.items() if h in self.held},
                      "kept": {h: g for h, g in on.items() if h in self.kept},
                      "evicting": sorted(h for h in self.evicting if h in on)}
        return out

    def waiting_holders(self) -> list[str]:
        return [w.holder for w in self.waiting]

    def drain_events(self) -> list[PoolEvent]:
        out, self.events = self.events, []
        return out

    # ------------------------------------------------------------------ internals
    def _known(self, job: str) -> None:
        if job in self.dropped:
            raise LeaseExpired(self.dropped[job])
        if job not in self.jobs:
            raise LeaseError(f"job {job} is not registered in this pool")

    def _raise_revoked(self, holder: str) -> None:
        why = self.revoked.pop(holder, None)
        if why is not None:
            raise LeaseExpired(f"{holder}: {why}")

    def _end(self, lease: Lease, now: float, how: str) -> None:
        del self.held[lease.holder]
        if lease.holder not in self.kept:
            self.footprint.pop(lease.holder, None)
        for d in lease.devices:
            holders = self.owners.get(d, set())
            holders.discard(lease.holder)
            if not holders:
                self.owners.pop(d, None)
        for d in sorted(lease.devices):
            self.events.append(PoolEvent(lease.job, f"device {d}", lease.phase, lease.granted_at, now,
                                         {"how": how, "holder": lease.holder}))

    def _drop(self, job: str, now: float, reason: Optional[str]) -> None:
        for holder in [h for h in self.kept if h.startswith(f"{job}/")]:   # its process is gone, and its memory
            self._forget_kept(holder)
        for lease in [h for h in self.held.values() if h.job == job]:
            self._end(lease, now, "job lost" if reason else "job ended")
        if reason is not None:
            self.dropped[job] = reason
        self.waiting = deque(w for w in self.waiting if w.job != job)
        self.jobs.pop(job, None)
        self.max_hold.pop(job, None)
        self.grant(now)
