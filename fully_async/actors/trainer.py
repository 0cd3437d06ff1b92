"""Trainer actor (layer 6): take a step's groups from the queue, update, push weights.

Per step: wait for `required_samples` groups (that wait is the trainer's idle time), then the step
both modes share (train_step.py: batch, old/ref log-probs, advantages, mini-batch updates).  Every
`trigger_parameter_sync_step` steps the weights go to the rollouter and the param version
increments.  Metrics, with the rollouter's own metrics of the step (asked for right after the take),
accumulate in a list the driver drains (`pop_metrics`).  With async_training.placement=elastic the wait is also
when its devices' engines generate for the rollouter (residency.Elastic lends them; its `hold` before the step takes
them back).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from fully_async.core.config import FullyAsyncConfig, validation_only
from fully_async.actors.actor_setup import DriverFacing
from fully_async.cluster.ray_utils import ray_get
from fully_async.telemetry import generations
from fully_async.telemetry.metrics import StaleCounter
from fully_async.core.trainer_state import TrainerState
from fully_async.rollout.engines.replica import EngineHost
from fully_async.train.backends import TrainBackend
from fully_async.core.staleness import required_samples
from fully_async.train.train_step import train_step
from fully_async.core.types import SampleGroup

logger = logging.getLogger(__name__)


def save_trainer_part(backend: TrainBackend, cfg: FullyAsyncConfig, folder: str, state: TrainerState) -> None:
    """The trainer's part of a checkpoint (see checkpoint.py): the backend's model and optimizer files, and
    trainer_state.json (written last: the part is complete when it exists)."""
    import os

    from fully_async.core.checkpoint import TRAINER_STATE, write_json

    backend.save(folder)
    write_json(os.path.join(folder, TRAINER_STATE), state.to_json(cfg.actor_rollout_ref.model.path, cfg.mode))


def load_trainer_state(path: str) -> dict:
    import os

    from fully_async.core.checkpoint import TRAINER_STATE, read_json
    return read_json(os.path.join(path, TRAINER_STATE))


class Trainer(DriverFacing, EngineHost):
    """Rank 0 of the trainer group.  With async_training.placement=elastic it also hosts an engine beside its rank, as
    ranks 1.. do in their TrainWorkers (EngineHost: the rollouter's pool drives it while it is lent; residency.Elastic
    decides when), which loads the trainer's weights in this process at every push."""

    def __init__(self, cfg: FullyAsyncConfig, queue: Any, rollouter: Any, total_steps: int, num_devices: int,
                 pad_token_id: int, resume_path: Optional[str] = None, placement: Optional[Any] = None,
                 eos_token_ids: Optional[list[int]] = None):
        from fully_async.actors.actor_setup import actor_init
        from fully_async.cluster.network import free_port, node_ip
        from fully_async.telemetry.timeline import Timeline
        from fully_async.actors.train_worker import TrainWorker
        from fully_async.placement import placement_of
        from fully_async.train.group import connect_trainer_group, total_optimizer_steps
        from fully_async.weight_sync import build_weight_sync

        self.cfg, self.device = actor_init(cfg, "trainer")
        cfg = self.cfg
        self.tokenizer = None   # trainer.rollout_data_dir decodes the trained responses (loaded on first use)
        at = cfg.async_training
        self.placement = placement_of(cfg)   # how the devices are shared (placement/)
        # engines beside the trainer ranks, lent to the rollouter while the trainer waits for samples (elastic)
        self.elastic = self.placement.trainer_hosts_engines
        # the trainer's devices: its own, or a lease on a pool it holds for its steps and gives back when
        # wanted, or (elastic) its own with their engines lent to the rollouter while it waits for samples
        self.residency = self.placement.residency("train", lend=self._lend, reclaim=self._reclaim)
        # between its turns on the devices the trainer offloads on a pool shared with other jobs, and, colocated with
        # its own engines, when the config asks (as sync mode: the engines sleep, the trainer stays unless told)
        offload = self.placement.trainer_offloads
        self.residency.attach(on=self._timed("onload", lambda: offload and self.backend.onload()),
                              off=self._timed("offload", lambda: offload and self.backend.offload()))
        self.queue = queue
        self.rollouter = rollouter
        self.num_devices = num_devices
        self.pad_token_id = pad_token_id
        self.required = required_samples(cfg.actor_rollout_ref.actor.ppo_mini_batch_size, at.require_batches)
        self.state = TrainerState.of(cfg, total_steps)
        optimizer_steps = total_optimizer_steps(cfg, total_steps, at.require_batches)
        with self.residency.setup():   # building loads onto the devices: on a pool, under a lease
            # rank 0 of the data-parallel group; ranks 1..W-1 are spawned (one device each) and joined here
            engine_args = ((eos_token_ids or [], pad_token_id, self.placement.engine_layout()[0]) if self.elastic
                           else None)
            self.backend = connect_trainer_group(cfg, self.device, optimizer_steps, (node_ip(), free_port()),
                                                 self.device.ray_actor_options(1), placement, engine_args=engine_args,
                                                 rank_options=self.placement.rank_options(self.device),
                                                 worker=TrainWorker)
            self.weight_sync = build_weight_sync(cfg, self.backend, rollouter, self.device)
            if self.elastic:   # the engines beside the ranks load each push in their own processes
                from fully_async.actors.engine_replica import host_trainer_engines
                from fully_async.weight_sync import ElasticWeightSync

                self.engines, self.lendable = host_trainer_engines(self, cfg, self.device, self.backend, engine_args)
                self.weight_sync = ElasticWeightSync(self.weight_sync, self.engines)
            if resume_path:
                self.state.load_json(load_trainer_state(resume_path))
                self.backend.load(resume_path)
                logger.info("resumed from %s: step %d, param version %d", resume_path, self.state.step,
                            self.state.version)
        self.timeline = Timeline("trainer", cfg.trainer.timeline)
        self.stale = StaleCounter()
        self._init_driver_facing()
        self.last_checkpoint: Optional[str] = None

    def _timed(self, event: str, fn: Callable[[], None]) -> Callable[[Any, str], dict]:
        """An onload/offload on a pool lease, timed with the device memory around it (multi_job/train/...)."""
        def run(ph: Any, phase: str) -> dict:
            from fully_async.placement.device_pool import timed_event

            m = timed_event(self.device, ph, "setup" if phase == "setup" else "train", event, fn)
            if event == "onload":
                m["multi_job/train/lease_wait_s"] = ph.waited_s
            return m
        return run

    # ------------------------------------------------------------------ elastic: the engines on this side's devices
    def _lend(self, ph: Any, phase: str) -> dict:
        """The engines wake and join the rollouter's pool.  They hold the pushed version (loaded at the push), and
        the rollouter's own engines must too before the two generate side by side: the push is flushed first."""
        start = time.perf_counter()
        metrics = self.weight_sync.flush()
        with self.timeline.span("elastic_lend"):
            self.engines.wake_up()
            ray_get(self.rollouter.lend_engines.remote(self.lendable, self.state.version))
        metrics["fully_async/elastic/lend_s"] = time.perf_counter() - start
        return metrics

    def _reclaim(self, ph: Any, phase: str) -> dict:
        """The engines leave the rollouter's pool (their in-flight responses parked there) and sleep: the trainer
        works on these devices now."""
        start = time.perf_counter()
        with self.timeline.span("elastic_reclaim"):
            metrics = ray_get(self.rollouter.reclaim_engines.remote())
            self.engines.sleep(1)
        metrics["fully_async/elastic/reclaim_s"] = time.perf_counter() - start
        return metrics

    def sync_initial_weights(self) -> dict:
        """Send the current weights as the current version (random dummy engine weights, or a resume)."""
        out = self.residency.hold("train") or {}
        out.update(self.weight_sync.push(self.state.version))
        out.update(self.weight_sync.flush())  # the engine holds these weights before anything generates
        return out

    def progress(self) -> dict:
        return {"step": self.state.step, "version": self.state.version, "total_steps": self.state.total_steps,
                "lease_polls": self.residency.polls}

    def _check_length(self) -> None:
        """The queue closed: the rollouter has no prompts left.  Short of the steps asked for, the run fails
        naming why (trainer_state.check_run_length)."""
        from fully_async.core.trainer_state import check_run_length

        if self.state.done():
            return
        filtered = None
        if self.cfg.algorithm.filter_groups.enable:
            try:
                filtered = len(ray_get(self.rollouter.filtered_groups.remote()))
            except Exception:  # noqa: BLE001 - only the message's count is lost
                pass
        note = check_run_length(self.state.step, self.state.total_steps, self.cfg, filtered)
        if note:
            logger.warning("%s", note)

    def run(self) -> dict:
        try:
            if validation_only(self.cfg):   # trainer.val_only: no step; the driver validates these weights
                return self.state.result(self.last_checkpoint, False)
            return self._run()
        finally:
            self.residency.give_back("done")

    def _run(self) -> dict:
        state, residency = self.state, self.residency
        last_end = time.perf_counter()
        while not state.done() and not self._stop_requested:
            wait_start = time.perf_counter()
            with self.timeline.span("queue_wait"):
                res = ray_get(self.queue.get_batch.remote(self.required, residency.poll_s))
                while not res["groups"] and not res["closed"] and not self._stop_requested:
                    if residency.wanted():
                        residency.give_back("waiting")   # waiting for samples: whoever wants the devices goes first
                    res = ray_get(self.queue.get_batch.remote(self.required, residency.poll_s))
            wait_s = time.perf_counter() - wait_start
            if not res["groups"]:
                if res["closed"]:
                    logger.info("queue closed and empty after %d steps: training ends", state.step)
                    self._check_length()
                break
            rollouter_metrics = self.rollouter.pop_step_metrics.remote()  # its window ends at this take
            metrics = residency.hold("train") or {}
            metrics.update(self._train(res["groups"]))
            self._score_validations()
            if state.push_due():
                metrics.update(self._sync_weights())
                if state.save_due():
                    metrics.update(self._save())
            now = time.perf_counter()
            step_s = now - last_end
            last_end = now
            metrics.update(self._pipeline_metrics(wait_s, step_s, metrics["perf/total_num_tokens"]))
            metrics.update(self._elastic_metrics(metrics, wait_s, step_s))
            metrics.update(ray_get(rollouter_metrics))
            if residency.wanted() and not self._keeps_turn():
                metrics.update(residency.give_back("wanted"))
            self._emit(state.step, metrics)
        if not state.push_due():
            self._emit(state.step, self._sync_weights())  # the last weights reach the engine for validation
        if self.cfg.reward_model.enable:
            self.residency.hold("train")
            self._score_validations()
        if self._stop_requested:
            self._emit(state.step, self._save())
        self.weight_sync.flush()  # the final weights are loaded before the driver validates them
        return self.state.result(self.last_checkpoint, self._stop_requested)

    def _keeps_turn(self) -> bool:
        """Colocated with its own engines, the trainer keeps the devices while the next step's samples are already
        queued (on a pool shared with other jobs it gives a wanted lease back after every step); elastic, it lends
        its engines only when the next step's samples are not."""
        if self.cfg.async_training.placement not in ("colocated", "elastic") or self.state.done():
            return False
        return ray_get(self.queue.size.remote()) >= self.required

    def save_part(self, folder: str) -> None:
        """The trainer's part of the checkpoint run() is waiting for (called by the driver)."""
        save_trainer_part(self.backend, self.cfg, folder, self.state)

    def _save(self) -> dict:
        """A checkpoint of this step: the driver has the rollouter, the queue and this trainer (`save_part`)
        each write their part, then makes the folder visible; nothing is trained meanwhile."""
        from fully_async.core.checkpoint import dir_size_bytes

        self.residency.hold("train")
        start = time.perf_counter()
        with self.timeline.span("save"):
            self.weight_sync.flush()  # the rollouter's part must see the pushed version applied
            self.last_checkpoint = self._await_checkpoint(self.state.version)
        elapsed = time.perf_counter() - start
        size = dir_size_bytes(self.last_checkpoint)
        logger.info("checkpoint %s: %.1f MB in %.2fs", self.last_checkpoint, size / 1e6, elapsed)
        return {"timing_s/save_checkpoint": elapsed, "checkpoint/size_mb": size / 1e6}

    def _train(self, groups: list[SampleGroup]) -> dict:
        state = self.state
        scored = self._reward_model_scores([s for g in groups for s in g.samples])
        metrics, samples = train_step(self.backend, self.cfg, groups, self.pad_token_id, state.step + 1,
                                      state.version, self.timeline)
        if self.cfg.trainer.rollout_data_dir:   # the driver dumps them (run_logging)
            if self.tokenizer is None:
                from fully_async.actors.actor_setup import build_tokenizer

                self.tokenizer = build_tokenizer(self.cfg)
            metrics[generations.ROLLOUT_GENERATIONS] = generations.trained_rows(self.tokenizer, samples)
        metrics.update(scored)
        metrics.update(self.stale.add(groups, state.version))
        state.record([s.sample_id for s in samples], [len(s.response_ids) for s in samples])
        return metrics

    def _reward_model_scores(self, samples: list) -> dict:
        """reward_model.enable: the responses carry the reward model's tokens (the rollouter attached them); their
        rewards are its scores, computed here, in the trainer's turn, before the step trains on them."""
        if not self.cfg.reward_model.enable:
            return {}
        from fully_async.rollout.generation import score_attached

        start = time.perf_counter()
        with self.timeline.span("reward_model"):
            score_attached(samples, self.backend.compute_rm_scores)
        return {"timing_s/reward_model": time.perf_counter() - start}

    def _score_validations(self) -> None:
        """reward_model.enable: the rollouter's validations since the last call, scored with the reward model and
        reported at their own steps."""
        if not self.cfg.reward_model.enable:
            return
        from fully_async.rollout.generation import rm_validation_metrics

        for item in ray_get(self.rollouter.pop_rm_validations.remote()):
            with self.timeline.span("reward_model"):
                self._emit(item["step"], rm_validation_metrics(item, self.backend.compute_rm_scores))

    def score_validation(self, item: dict) -> dict:
        """The driver's final validation with a reward model (rollouter.validate() returned it unscored): scored
        on the trainer's devices once its loop has ended."""
        from fully_async.rollout.generation import rm_validation_metrics

        self.residency.hold("train")
        return rm_validation_metrics(item, self.backend.compute_rm_scores)

    def _sync_weights(self) -> dict:
        self.residency.hold("train")   # (the final push after the loop)
        version = self.state.bump_version()
        with self.timeline.span("param_sync"):
            return self.weight_sync.push(version)

    def _pipeline_metrics(self, wait_s: float, step_s: float, tokens: float) -> dict:
        """verl's: the wait for the step's samples (`timing_s/gen`, `fully_async/total_wait_time`) over the step
        (`trainer/idle_ratio`)."""
        return {"timing_s/gen": wait_s, "fully_async/total_wait_time": wait_s, "timing_s/step": step_s,
                "perf/time_per_step": step_s, "perf/throughput": tokens / step_s / self.num_devices,
                "trainer/idle_ratio": min(1.0, wait_s / step_s)}

    def _elastic_metrics(self, metrics: dict, wait_s: float, step_s: float) -> dict:
        """Elastic: how much of the step the trainer's devices generated (`fully_async/elastic/busy_ratio`: the lent
        engines' seconds with work per device) and how much they idled after all (`.../trainer_idle_ratio`, against
        `trainer/idle_ratio`, the wait without lending)."""
        if not self.elastic or step_s <= 0:
            return {}
        per_device = metrics.get("fully_async/elastic/busy_s", 0.0) / max(1, len(self.lendable))
        return {"fully_async/elastic/busy_ratio": min(1.0, per_device / step_s),
                "fully_async/elastic/trainer_idle_ratio": max(0.0, min(1.0, (wait_s - per_device) / step_s))}
