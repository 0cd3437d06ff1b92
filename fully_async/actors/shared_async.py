"""`mode=async` on a device pool shared with other jobs (`multi_job.pool`): each side leases its own devices.

The rollouter and the trainer are two holders of the pool (`<job>/rollout` on multi_job.rollout_devices,
`<job>/train` on multi_job.job_devices) and keep their weights on their devices only while they hold their lease:
  * the rollouter takes its lease before it admits or generates, and gives it back -- partial responses parked
    (partial_rollout) or finished (without), engines asleep -- when another request wants its devices and it has
    generated for multi_job.min_slice_s, or at once when it has nothing to generate (at the staleness bound, or
    every prompt done).  Weight updates that arrive while it holds no lease are kept (the newest replaces an
    older one: they are whole snapshots) and loaded when it next wakes its engines, before anything generates.
  * the trainer takes its lease once a step's samples are in, keeps it for the next step while nobody else
    wants its devices, and gives it back -- trainer offloaded -- when someone does, right after its step or while
    it waits for samples.
A side never waits for the other while holding a wanted lease, and the rollouter takes updates without one, so
the pool's deadlock argument (core/leases.py) holds per side; both sides of one job may even share devices (they
then take turns).  Per side and event the device memory before and after an onload/offload and its duration are
`multi_job/<rollout|train>/...` metrics (the rollouter's in the trainer step they fell in); the spans go to the
pool's timeline.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from fully_async.actors.rollouter import Rollouter
from fully_async.actors.trainer import Trainer
from fully_async.core.config import FullyAsyncConfig, typed_config

logger = logging.getLogger(__name__)


class _Stopped(Exception):
    """The rollouter was stopped while it waited for its lease."""


class SharedRollouter(Rollouter):
    def __init__(self, cfg: FullyAsyncConfig, *args: Any, **kwargs: Any):
        from fully_async.cluster.device_pool import LeaseClient, job_name, rollout_devices

        typed = typed_config(cfg)
        self.lease = LeaseClient(typed.multi_job.pool, job_name(typed), rollout_devices(typed), side="rollout",
                                 poll_s=0.5)
        self.min_slice_s = typed.multi_job.min_slice_s
        self._staged: Optional[tuple[Callable[[], None], int]] = None   # an update that came while not holding
        self._lease_metrics: dict = {}
        self._gen_from: Optional[float] = None
        self._served = False
        ph = self.lease.acquire("setup")   # the engines load onto the devices under the lease too
        try:
            with ph.span("build"):
                super().__init__(typed, *args, **kwargs)
            self._lease_metrics.update(self._timed(ph, "setup", "offload", lambda: self.pool.sleep(1)))
        finally:
            self.lease.release(failing=True)

    def _replica_options(self, cfg: FullyAsyncConfig) -> Optional[Callable[[int], dict]]:
        from fully_async.cluster.device_pool import pinned_actor_options, rollout_devices
        from fully_async.cluster.placement import rollout_layout
        from fully_async.device import get_device

        tp = rollout_layout(cfg)[1]
        devs, device = rollout_devices(cfg), get_device(cfg.trainer.device)
        return lambda i: pinned_actor_options(device, cfg, 0, devices=devs[i * tp:(i + 1) * tp])

    def _timed(self, ph: Any, phase: str, event: str, fn: Callable[[], Any]) -> dict:
        from fully_async.cluster.device_pool import timed_event

        return timed_event(self.device, ph, phase, event, fn)

    def progress(self) -> dict:
        return dict(super().progress(), lease_polls=self.lease.polls)

    def pop_step_metrics(self) -> dict:
        """The window's metrics and the lease events that fell in it (the last of each; yields counted)."""
        metrics, self._lease_metrics = dict(super().pop_step_metrics(), **self._lease_metrics), {}
        return metrics

    # ------------------------------------------------------------------ the lease
    def _serve(self) -> None:
        """Between two polls for the lease: weight updates and checkpoint calls go on (not when the wait itself
        runs inside one of them: the driver's validation)."""
        if self._served:
            return
        self._served = True
        try:
            self._run_commands(block=False)
        finally:
            self._served = False
        if self.stopped:
            raise _Stopped()

    def _take_lease(self, phase: str, serve: bool = True) -> bool:
        """Hold the rollout devices with the engines awake and the newest weights loaded (False: stopped while
        waiting).  serve: take weight updates and checkpoint calls while waiting (the loop's wait; not a wait
        that is itself one of those calls)."""
        if self.lease.current is not None:
            return True
        try:
            with self.timeline.span("lease_wait"):
                ph = self.lease.acquire(phase, serve=self._serve if serve else None)
        except _Stopped:
            return False
        if self._gen_from is not None:   # a served call (validation) took it meanwhile and woke the engines
            return True
        m = self._timed(ph, "rollout", "onload", self.pool.wake_up)
        m["multi_job/rollout/lease_wait_s"] = ph.waited_s
        self._lease_metrics.update(m)
        if self._staged is not None:
            load, version = self._staged
            self._staged = None
            with ph.span("param_sync", version=version):
                super()._apply_weights(load, version)
        if not self.held:   # (a checkpoint's hold resumes them at its release)
            self.scheduler.resume()   # responses parked when the lease went back continue here
        self._gen_from = time.time()
        return True

    def _give_back(self, why: str) -> None:
        ph = self.lease.current
        if ph is None:
            return
        sched = self.scheduler
        if self._gen_from is not None:
            ph.spans.append({"name": "generate", "start": self._gen_from, "end": time.time(), "args": {}})
        if sched.partial_rollout or why == "done":
            sched.stats["interrupted_samples"] += sched.park()
        else:
            sched.drain()   # without partial rollouts a response never spans two turns (or two versions)
        m = self._timed(ph, "rollout", "offload", lambda: self.pool.sleep(1))
        m["multi_job/rollout/held_s"] = time.time() - (self._gen_from or time.time())
        m["multi_job/rollout/yields"] = self._lease_metrics.get("multi_job/rollout/yields", 0) + 1
        self._lease_metrics.update(m)
        self._gen_from = None
        with self.timeline.span("lease_release", why=why):
            self.lease.release()

    # ------------------------------------------------------------------ the loop's hooks
    def _before_admit(self) -> bool:
        sched = self.scheduler
        # the devices are needed to generate, to continue parked responses, and to load an update that came
        # meanwhile (at the staleness bound only that update lets generation go on)
        if self.lease.current is None and (sched.in_flight() or sched.parked or self._staged is not None
                                           or not (sched.at_bound() or sched.stream.exhausted)):
            return self._take_lease("rollout")
        return True

    def _on_idle(self) -> None:
        if self.lease.current is not None and self.lease.renew():
            self._give_back("idle")

    def _after_step(self) -> None:
        if self.lease.current is None or not self.lease.renew():
            return
        if self._gen_from is not None and time.time() - self._gen_from >= self.min_slice_s:
            self._give_back("wanted")

    def _loop(self) -> dict:
        try:
            return super()._loop()
        finally:
            self._give_back("done")

    # ------------------------------------------------------------------ commands
    def _apply_weights(self, load: Callable[[], None], version: int) -> dict:
        """Without the lease the engines sleep: keep the update for the next onload (the newest wins)."""
        if self.lease.current is None:
            self._staged = (load, version)
            return {}   # nothing loaded yet: the load's timings come with the onload that does it
        return super()._apply_weights(load, version)

    def _resume_restored(self) -> None:
        """Restored partial responses stay parked until the first turn on the devices (_before_admit)."""

    def _validate(self, version: int, resume: bool = True, publish: bool = True) -> dict:
        if self.lease.current is None and not self._take_lease("validate", serve=False):
            return {}
        return super()._validate(version, resume, publish)

    def _release(self) -> None:
        """After a checkpoint: parked responses resume now only if the engines are awake (else at the next turn)."""
        self.held = False
        if self.lease.current is not None:
            self.scheduler.resume()


class SharedTrainer(Trainer):
    def __init__(self, cfg: FullyAsyncConfig, *args: Any, **kwargs: Any):
        from fully_async.cluster.device_pool import LeaseClient, job_devices, job_name

        typed = typed_config(cfg)
        self.lease = LeaseClient(typed.multi_job.pool, job_name(typed), job_devices(typed), side="train",
                                 poll_s=0.5)
        self._onloaded = False
        ph = self.lease.acquire("setup")
        try:
            with ph.span("build"):
                super().__init__(typed, *args, **kwargs)
            self._timed(ph, "setup", "offload", self.backend.offload)
        finally:
            self.lease.release(failing=True)

    def _rank_options(self, cfg: FullyAsyncConfig) -> Optional[Any]:
        from fully_async.cluster.device_pool import pinned_actor_options
        from fully_async.device import get_device

        device = get_device(cfg.trainer.device)
        return lambda rank: pinned_actor_options(device, cfg, rank)

    def _timed(self, ph: Any, phase: str, event: str, fn: Callable[[], Any]) -> dict:
        from fully_async.cluster.device_pool import timed_event

        return timed_event(self.device, ph, phase, event, fn)

    def progress(self) -> dict:
        return dict(super().progress(), lease_polls=self.lease.polls)

    def _hold(self) -> dict:
        """Hold the trainer devices with the trainer on them (its onload's metrics; {} when it already was)."""
        if self.lease.current is not None:
            return {}
        with self.timeline.span("lease_wait"):
            ph = self.lease.acquire("train")
        m = self._timed(ph, "train", "onload", self.backend.onload)
        m["multi_job/train/lease_wait_s"] = ph.waited_s
        return m

    def _give_back(self) -> dict:
        ph = self.lease.current
        if ph is None:
            return {}
        m = self._timed(ph, "train", "offload", self.backend.offload)
        self.lease.release()
        return m

    # ------------------------------------------------------------------ the loop's hooks
    def _wait_poll_s(self) -> float:
        return 0.5 if self.lease.current is not None else 5.0

    def _waiting(self) -> None:
        if self.lease.current is not None and self.lease.renew():
            self._give_back()   # waiting for samples: whoever wants these devices goes first

    def _before_train(self) -> dict:
        return self._hold()

    def _after_train(self) -> dict:
        return self._give_back() if self.lease.renew() else {}

    # ------------------------------------------------------------------ what else needs the trainer on its devices
    def sync_initial_weights(self) -> dict:
        out = self._hold()
        out.update(super().sync_initial_weights())
        return out

    def _sync_weights(self) -> dict:
        self._hold()   # the final push after the loop
        return super()._sync_weights()

    def _save(self) -> dict:
        self._hold()
        return super()._save()

    def run(self) -> dict:
        try:
            return super().run()
        finally:
            self._give_back()
