"""`mode=sync` on a device pool shared with other jobs (`multi_job.pool`): the sync loop in two leased phases.

Each step is two phases, and the job keeps weights on its devices only inside them:
  * rollout: lease -> wake the engines -> generate -> engines sleep -> release;
  * train (with the weight update): lease -> trainer onload -> update (and a checkpoint when due) -> the sleeping
    engines load the new weights into their host copies -> trainer offload -> release.
(An engine that cannot load while asleep -- vLLM -- loads at its next wake-up instead, in the rollout phase: the
trainer comes on the devices for the copy and leaves.)
Rewards are scored between the two, holding nothing.  Merging the weight update into one of the two phases is
what keeps a job at one lease at a time: the failure seen in practice was job A holding the rollout lock and
job B the update lock, each waiting for the other's devices.  The lease rules themselves (FIFO, all-or-nothing,
expiry, owner death) are core/leases.py.

Per phase and event the job reports the device memory before and after (rank 0's process: allocated and
reserved device memory on accelerators, the host RSS everywhere; on CPU nothing moves, so the RSS is the only,
honest, number) and the durations, as `multi_job/<phase>/<event>...` metrics, and sends the spans to the pool,
whose timeline shows every job on every device.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from fully_async.actors.sync_loop import SyncWorker
from fully_async.core.config import FullyAsyncConfig, typed_config

logger = logging.getLogger(__name__)


class SharedSyncWorker(SyncWorker):
    def __init__(self, cfg: FullyAsyncConfig, *args: Any, **kwargs: Any):
        from fully_async.cluster.device_pool import LeaseClient, job_devices, job_name

        typed = typed_config(cfg)
        self.lease = LeaseClient(typed.multi_job.pool, job_name(typed), job_devices(typed))
        self.engine_version = 0
        # the embedded engine loads weights in place wherever they are, so a sleeping one takes them into its host
        # copies at the end of the train phase while the trainer is still on the devices (one device-to-host copy);
        # other engines load at their next wake-up, the trainer coming on the devices for the copy
        self.update_in_train = typed.actor_rollout_ref.rollout.name == "hf"
        # building loads the engine and the trainer onto the devices: that too happens under a lease
        with self.lease.phase("setup") as ph:
            with ph.span("build"):
                super().__init__(typed, *args, **kwargs)
            self.engine_version = self.version     # a resume pushed its weights in the constructor
            self._event(ph, "setup", "offload", self._park)

    def _rank_options(self, cfg: FullyAsyncConfig, device: Any) -> Optional[Callable[[int], dict]]:
        from fully_async.cluster.device_pool import pinned_actor_options

        return lambda rank: pinned_actor_options(device, cfg, rank)

    def progress(self) -> dict:
        """The driver's watchdog also sees the lease polls: waiting for the devices is not being stuck (a phase that
        hangs holding them shows no polls, and its lease is revoked after multi_job.max_lease_s)."""
        return dict(super().progress(), lease_polls=self.lease.polls)

    # ------------------------------------------------------------------ phases
    def _park(self) -> None:
        self.pool.sleep(1)
        self.backend.offload()

    def _event(self, ph: Any, phase: str, event: str, fn: Callable[[], Any]) -> dict:
        from fully_async.cluster.device_pool import timed_event

        return timed_event(self.device, ph, phase, event, fn)

    def _engine_on(self, ph: Any, phase: str) -> dict:
        """Wake the engines and, when the trainer is ahead, load its weights (the weight update of the phase)."""
        m = self._event(ph, phase, "onload", self.pool.wake_up)
        m[f"multi_job/{phase}/lease_wait_s"] = ph.waited_s
        if self.engine_version != self.version:
            start = time.perf_counter()
            with ph.span("param_sync", version=self.version):
                self.backend.onload()
                m.update(self.weight_sync.push(self.version))
                self.backend.offload()
            m[f"multi_job/{phase}/param_sync_s"] = time.perf_counter() - start
            self.engine_version = self.version
        return m

    def validate(self) -> dict:
        """Validation needs the engines: inside a lease of its own unless a phase holds one already."""
        if self.lease.current is not None:
            return super().validate()
        with self.lease.phase("validate") as ph:
            switch = self._engine_on(ph, "validate")
            with ph.span("validate"):
                metrics = super().validate()
            switch.update(self._event(ph, "validate", "offload", lambda: self.pool.sleep(1)))
        return dict(metrics, **switch)

    def _save(self) -> dict:
        if self.lease.current is not None:
            return super()._save()
        with self.lease.phase("save") as ph:
            self._event(ph, "save", "onload", self.backend.onload)
            out = super()._save()
            self._event(ph, "save", "offload", self.backend.offload)
        return out

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        from fully_async.core.metrics import engine_metrics
        from fully_async.rollout.generation import run_to_completion

        cfg = self.cfg
        if cfg.trainer.val_before_train and self.val_records and self.step == 0:
            self._emit(0, self.validate())
        while self.step < self.total_steps and not self.stream.exhausted and not self._stop_requested:
            t_step = time.perf_counter()
            groups_in = self._draw_groups()
            # ---- rollout phase: engines on, new weights in, generate, engines off
            with self.lease.phase("rollout") as ph:
                metrics = self._engine_on(ph, "rollout")
                engines_before = self.pool.engine_stats()
                t = time.perf_counter()
                with ph.span("generate"), self.timeline.span("generate"):
                    run_to_completion(self.pool, [p for *_, ps in groups_in for p in ps])
                metrics["timing_s/gen"] = time.perf_counter() - t
                metrics.update(engine_metrics(self.pool.engine_stats(), engines_before, metrics["timing_s/gen"]))
                metrics.update(self._event(ph, "rollout", "offload", lambda: self.pool.sleep(1)))
            t = time.perf_counter()
            groups = self._score_groups(groups_in)
            metrics["timing_s/reward"] = time.perf_counter() - t
            # ---- train phase: trainer on, update (and checkpoint), trainer off
            with self.lease.phase("train") as ph:
                metrics.update(self._event(ph, "train", "onload", self.backend.onload))
                metrics["multi_job/train/lease_wait_s"] = ph.waited_s
                with ph.span("update_actor"):
                    metrics.update(self._train(groups))
                self.step += 1
                self.version += 1
                if self._save_due():
                    metrics.update(self._save())
                if self.update_in_train:   # the sleeping engines take the new weights into their host copies
                    start = time.perf_counter()
                    with ph.span("param_sync", version=self.version):
                        metrics.update(self.weight_sync.push(self.version))
                    self.engine_version = self.version
                    metrics["multi_job/train/param_sync_s"] = time.perf_counter() - start
                metrics.update(self._event(ph, "train", "offload", self.backend.offload))
            self._end_step(metrics, time.perf_counter() - t_step)
        return self._result()
