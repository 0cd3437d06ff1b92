"""Trainer actor (layer 4): take a step's groups from the queue, update, push weights.

Per step: wait for `required_samples` groups (that wait is the trainer's idle time), then the step
both modes share (train_step.py: batch, old/ref log-probs, advantages, mini-batch updates).  Every
`trigger_parameter_sync_step` steps the weights go to the rollouter and the param version
increments.  Metrics, with the rollouter's own metrics of the step (asked for right after the take),
accumulate in a list the driver drains (`pop_metrics`).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any, Optional

from fully_async.core.config import FullyAsyncConfig
from fully_async.actors.actor_setup import DriverFacing
from fully_async.cluster.ray_utils import ray_get
from fully_async.core.metrics import StaleCounter
from fully_async.core.staleness import required_samples
from fully_async.train.train_step import train_step
from fully_async.core.types import SampleGroup

logger = logging.getLogger(__name__)


def save_trainer_part(backend: Any, cfg: FullyAsyncConfig, folder: str, step: int, version: int,
                      trained_ids: list[str]) -> None:
    """The trainer's part of a checkpoint (see checkpoint.py): the backend's model and optimizer files, and
    trainer_state.json (written last: the part is complete when it exists)."""
    import os

    from fully_async.core.checkpoint import TRAINER_STATE, write_json

    backend.save(folder)
    write_json(os.path.join(folder, TRAINER_STATE),
               {"step": step, "version": version, "trained_sample_ids": trained_ids,
                "model_path": cfg.actor_rollout_ref.model.path, "mode": cfg.mode})


def load_trainer_state(path: str) -> dict:
    import os

    from fully_async.core.checkpoint import TRAINER_STATE, read_json
    return read_json(os.path.join(path, TRAINER_STATE))


class Trainer(DriverFacing):
    def __init__(self, cfg: FullyAsyncConfig, queue: Any, rollouter: Any, total_steps: int, num_devices: int,
                 pad_token_id: int, resume_path: Optional[str] = None, placement: Optional[Any] = None):
        from fully_async.actors.actor_setup import actor_init
        from fully_async.cluster.network import free_port, node_ip
        from fully_async.core.timeline import Timeline
        from fully_async.actors.train_worker import TrainWorker
        from fully_async.train.group import connect_trainer_group, total_optimizer_steps
        from fully_async.weight_sync import build_weight_sync

        self.cfg, self.device = actor_init(cfg, "trainer")
        cfg = self.cfg
        at = cfg.async_training
        self.queue = queue
        self.rollouter = rollouter
        self.total_steps = total_steps
        self.num_devices = num_devices
        self.pad_token_id = pad_token_id
        self.required = required_samples(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, at.require_batches)
        self.trigger = at.trigger_parameter_sync_step
        optimizer_steps = total_optimizer_steps(cfg, total_steps, at.require_batches)
        # rank 0 of the data-parallel group; ranks 1..W-1 are spawned (one device each) and joined here
        self.backend = connect_trainer_group(cfg, self.device, optimizer_steps, (node_ip(), free_port()),
                                             self.device.ray_actor_options(1), placement,
                                             rank_options=self._rank_options(cfg), worker=TrainWorker)
        self.weight_sync = build_weight_sync(cfg, self.backend, rollouter, self.device)
        self.timeline = Timeline("trainer", cfg.trainer.timeline)
        self.stale = StaleCounter()
        self.step = 0
        self.version = 0
        self.trained_sample_ids: list[str] = []
        self.response_lengths: collections.Counter = collections.Counter()   # of the samples trained here
        if resume_path:
            state = load_trainer_state(resume_path)
            self.backend.load(resume_path)
            self.step, self.version = state["step"], state["version"]
            self.trained_sample_ids = list(state["trained_sample_ids"])
            logger.info("resumed from %s: step %d, param version %d", resume_path, self.step, self.version)
        self._init_driver_facing()
        self.last_checkpoint: Optional[str] = None

    def sync_initial_weights(self) -> dict:
        """Send the current weights as the current version (random dummy engine weights, or a resume)."""
        out = self.weight_sync.push(self.version)
        out.update(self.weight_sync.flush())  # the engine holds these weights before anything generates
        return out

    def progress(self) -> dict:
        return {"step": self.step, "version": self.version, "total_steps": self.total_steps}

    def run(self) -> dict:
        save_freq = self.cfg.trainer.save_freq
        last_end = time.perf_counter()
        while self.step < self.total_steps and not self._stop_requested:
            wait_start = time.perf_counter()
            with self.timeline.span("queue_wait"):
                res = ray_get(self.queue.get_batch.remote(self.required, self._wait_poll_s()))
                while not res["groups"] and not res["closed"] and not self._stop_requested:
                    self._waiting()
                    res = ray_get(self.queue.get_batch.remote(self.required, self._wait_poll_s()))
            wait_s = time.perf_counter() - wait_start
            if not res["groups"]:
                if res["closed"]:
                    logger.info("queue closed and empty after %d steps: training ends", self.step)
                break
            rollouter_metrics = self.rollouter.pop_step_metrics.remote()  # its window ends at this take
            lease_metrics = self._before_train()
            metrics = self._train(res["groups"])
            metrics.update(lease_metrics)
            self.step += 1
            if self.step % self.trigger == 0 or self.step == self.total_steps:
                metrics.update(self._sync_weights())
                if save_freq > 0 and (self.version % save_freq == 0 or self.step == self.total_steps):
                    metrics.update(self._save())  # every save_freq versions and at the end, as verl
            now = time.perf_counter()
            step_s = now - last_end
            last_end = now
            metrics.update(self._pipeline_metrics(wait_s, step_s, metrics["perf/total_num_tokens"]))
            metrics.update(ray_get(rollouter_metrics))
            metrics.update(self._after_train())
            self._emit(self.step, metrics)
        if self.step % self.trigger != 0 and self.step != self.total_steps:
            self._emit(self.step, self._sync_weights())  # the last weights reach the engine for validation
        if self._stop_requested:
            self._emit(self.step, self._save())
        self.weight_sync.flush()  # the final weights are loaded before the driver validates them
        return {"steps": self.step, "version": self.version, "trained_sample_ids": self.trained_sample_ids,
                "response_lengths": dict(self.response_lengths),
                "checkpoint": self.last_checkpoint, "stopped": self._stop_requested}

    # hooks of a trainer that shares its devices with other jobs (actors/shared_async.py); here: no-ops
    def _rank_options(self, cfg: FullyAsyncConfig) -> Optional[Any]:
        """Ray options of trainer rank r >= 1 (None: the device's own, in the trainer placement group)."""
        return None

    def _wait_poll_s(self) -> float:
        return 5.0

    def _waiting(self) -> None:
        """Between two polls of the queue while waiting for a step's samples."""

    def _before_train(self) -> dict:
        """Before the step's update (its metrics)."""
        return {}

    def _after_train(self) -> dict:
        """After the step's update, weight push and checkpoint (its metrics)."""
        return {}

    def save_part(self, folder: str) -> None:
        """The trainer's part of the checkpoint run() is waiting for (called by the driver)."""
        save_trainer_part(self.backend, self.cfg, folder, self.step, self.version, self.trained_sample_ids)

    def _save(self) -> dict:
        """A checkpoint of this step: the driver has the rollouter, the queue and this trainer (`save_part`)
        each write their part, then makes the folder visible; nothing is trained meanwhile."""
        from fully_async.core.checkpoint import dir_size_bytes

        start = time.perf_counter()
        with self.timeline.span("save"):
            self.weight_sync.flush()  # the rollouter's part must see the pushed version applied
            self.last_checkpoint = self._await_checkpoint(self.version)
        elapsed = time.perf_counter() - start
        size = dir_size_bytes(self.last_checkpoint)
        logger.info("checkpoint %s: %.1f MB in %.2fs", self.last_checkpoint, size / 1e6, elapsed)
        return {"timing_s/save_checkpoint": elapsed, "checkpoint/size_mb": size / 1e6}

    def _train(self, groups: list[SampleGroup]) -> dict:
        metrics, samples = train_step(self.backend, self.cfg, groups, self.pad_token_id, self.step + 1, self.version,
                                      self.timeline)
        self.trained_sample_ids.extend(s.sample_id for s in samples)
        self.response_lengths.update(len(s.response_ids) for s in samples)
        metrics.update(self.stale.add(groups, self.version))
        return metrics

    def _sync_weights(self) -> dict:
        self.version += 1
        with self.timeline.span("param_sync"):
            return self.weight_sync.push(self.version)

    def _pipeline_metrics(self, wait_s: float, step_s: float, tokens: float) -> dict:
        """verl's: the wait for the step's samples (`timing_s/gen`, `fully_async/total_wait_time`) over the step
        (`trainer/idle_ratio`)."""
        return {"timing_s/gen": wait_s, "fully_async/total_wait_time": wait_s, "timing_s/step": step_s,
                "perf/time_per_step": step_s, "perf/throughput": tokens / step_s / self.num_devices,
                "trainer/idle_ratio": min(1.0, wait_s / step_s)}
