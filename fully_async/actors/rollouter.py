"""Rollouter actor (layer 6): a thin Ray shell around the rollout scheduler and the engine pool.

One thread owns the engines.  `run()` is that thread's loop: let the scheduler (scheduler.py: admission
under the staleness bound, partial responses, grouping) admit prompts and advance the engine pool
(engines/pool.py: one inline engine or K replicas on their own devices), score the groups it completes
and push them to the queue.  Its own metrics go out on the shortest path: per trainer step to the trainer
(`pop_step_metrics`, idle ratio and engine metrics computed here), validation results to the driver (the
metrics outbox, `pop_metrics`).  Other callers (the trainer's weight push, the driver's validation,
checkpoint part and stop) never touch the engines: they enqueue a command that the loop executes
between two engine steps and wait for its result.  That keeps weight updates, interrupts and
validation strictly ordered with generation.  With DAPO's dynamic sampling (algorithm.filter_groups) a scored
group whose responses all agree is dropped here, before the queue: counted (and checkpointed) as filtered, its
admission slot freed for another prompt.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import os
import queue as queue_mod
import threading
import time
from typing import Any, Callable, Optional

from fully_async.core.config import FullyAsyncConfig, generates_baseline, typed_config, validation_only
from fully_async.actors.actor_setup import MetricsOutbox
from fully_async.algorithms.dynamic_sampling import GroupFilter
from fully_async.rollout.tools import ToolLoop
from fully_async.rollout.generation import (attach_reward_model_inputs, make_group, score_samples, validate,
                                            validation_samples, validation_texts)
from fully_async.telemetry.metrics import rollouter_version_metrics, rollouter_window_metrics
from fully_async.cluster.ray_utils import ray_get
from fully_async.rollout.scheduler import CompletedGroup, RolloutScheduler
from fully_async.core.trainer_state import TrainerState
from fully_async.core.types import PromptRecord, SampleGroup, SamplingParams

logger = logging.getLogger(__name__)


class Rollouter(MetricsOutbox):
    def __init__(self, cfg: FullyAsyncConfig, queue: Any, train_records: list[PromptRecord],
                 val_records: list[PromptRecord],
                 eos_token_ids: list[int], pad_token_id: int, resume_path: Optional[str] = None,
                 placement: Optional[Any] = None):
        from fully_async.actors.actor_setup import actor_init, build_tokenizer
        from fully_async.core.data import PromptStream
        from fully_async.actors.engine_replica import build_async_pool
        from fully_async.placement import placement_of
        from fully_async.rewards import build_reward_manager
        from fully_async.core.staleness import StalenessManager
        from fully_async.telemetry.timeline import Timeline
        from fully_async.core.workload import LengthProfile

        # how the devices are shared (placement/): the engines' layout, their residency, what a turn keeps
        self.placement = placement_of(typed_config(cfg))
        # with several replicas the engines live in their own actors and this shell holds no device
        self.cfg, self.device = actor_init(cfg, "rollouter", uses_device=self.placement.engine_layout()[0] == 1)
        cfg = self.cfg
        # the engines' devices: their own, or a lease on a pool held while generating and given back when
        # wanted (partial responses parked; updates that come meanwhile kept and loaded at the next hold)
        self.residency = self.placement.residency("rollout")
        self.residency.attach(on=self._devices_on, off=self._devices_off)
        self.min_slice_s = cfg.multi_job.min_slice_s
        self._serving = False
        self._gen_from: Optional[float] = None   # wall time the engines came on (a pool's generate span)
        self._yields = 0                         # times the engines gave a wanted pool lease back
        # colocated with engines that keep their cache while asleep (placement.keeps_in_flight): responses in flight
        # wait through the trainer's turn with their KV cache, held (engines in their own actors stop advancing them:
        # the turn is the trainer's alone, on one device or several); exact: no weights change meanwhile; a weight
        # update parks them and they continue on the new weights from prompt + partial response, as in split async
        # (pause_mode=keep: they continue over their KV cache)
        self._keeps_in_flight = self.placement.keeps_in_flight
        self._holds_through_turns = self.placement.holds_through_turns   # (placement/colocated.py)
        self._held_through = False
        self.queue = queue
        self.tokenizer = build_tokenizer(cfg)
        self.tools = ToolLoop.from_config(cfg, self.tokenizer)   # multi-turn tool rollouts, or None
        with self.residency.setup():   # the engines load onto the devices: on a pool, under a lease
            self.pool = build_async_pool(cfg, self.device, eos_token_ids, pad_token_id, placement,
                                         self.placement.replica_options(self.device))
        self.reward = build_reward_manager(cfg)
        self.rm_inputs: Optional[Any] = None   # reward_model.enable: responses carry its tokens; the trainer scores
        if cfg.reward_model.enable:
            from fully_async.rewards.reward_model import RewardModelInputs

            self.rm_inputs = RewardModelInputs(cfg, self.tokenizer)
        # validations whose responses the trainer scores with the reward model in its own turn (pop_rm_validations)
        self.rm_validations: collections.deque = collections.deque()
        stream = PromptStream(train_records, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                              total_epochs=cfg.trainer.total_epochs, total_prompts=cfg.rollout.total_rollout_steps)
        r = cfg.actor_rollout_ref.rollout
        self.lengths = LengthProfile.from_config(cfg)
        if self.lengths is not None:
            logger.info("benchmark workload: %s", self.lengths.describe())
        self.scheduler = RolloutScheduler(
            self.pool, stream, StalenessManager.from_config(cfg), r.n,
            SamplingParams(r.temperature, r.top_p, r.top_k, cfg.data.max_response_length),
            max_in_flight=self.pool.capacity, partial_rollout=cfg.async_training.partial_rollout,
            on_complete=self._push, lengths=self.lengths, baseline=generates_baseline(cfg), tools=self.tools)
        # DAPO's dynamic sampling: groups whose responses all agree never reach the queue
        self.filter = GroupFilter.from_config(cfg, self.scheduler.staleness.required)
        if self.filter is not None:
            self.scheduler.stats["filtered_groups"] = 0
            # a dropped group is replaced by another prompt (within the epochs) until the steps' groups are kept
            wanted = cfg.trainer.total_training_steps * self.scheduler.staleness.required
            self.scheduler.demand = lambda: wanted - self.filter.kept
        self.val_records = val_records
        test_freq = cfg.rollout.test_freq if cfg.rollout.test_freq is not None else cfg.trainer.test_freq
        self.test_freq = test_freq
        # which trainer step pushed a version (the trainer's rule; total_training_steps is filled in by
        # run/prepare.py before the actors start)
        self.trainer_state = TrainerState.of(cfg, cfg.trainer.total_training_steps)
        self._init_outbox()
        self.commands: queue_mod.Queue = queue_mod.Queue()
        self.stopped = False
        self.closed = False
        self.held = False  # a checkpoint is being taken: nothing is generated or pushed until release()
        self.loop_running = False
        self._loop_lock = threading.Lock()
        self._published_val: Optional[int] = None   # the last version whose validation went to the outbox
        self.stats = {"idle_s": 0.0, "wall_s": 0.0, "version": 0, "validations": 0, "elastic_lends": 0,
                      "elastic_parked": 0}
        self._lent: list[int] = []   # pool indices of the trainer's engines while it lends them (placement=elastic)
        self._lent_from: Optional[tuple[float, list[dict]]] = None
        self._pushed: dict = {}        # the counters as of the last push (the end of the current step window)
        self._put: Optional[Any] = None   # the queue's put of the last push, until it is known to have arrived
        self._window_start: dict = {}  # the counters that ended the previous trainer step's window
        self._version_mark: Optional[tuple[float, float]] = None  # (time, idle_s) the current param version began
        self._start = time.perf_counter()
        self.timeline = Timeline("rollouter", cfg.trainer.timeline)
        self.resumed = resume_path is not None
        if resume_path is not None:
            from fully_async.core.checkpoint import ROLLOUT_STATE, read_state

            saved = read_state(os.path.join(resume_path, ROLLOUT_STATE))
            self.scheduler.load_state_dict(saved)
            self._load_filter(saved.get("filter"))
            logger.info("rollouter resumed: %d prompts already emitted, %d groups in flight (%d partial responses)",
                        stream.num_emitted, len(self.scheduler.groups), len(self.scheduler.pending))

    # ------------------------------------------------------------------ called by others
    def update_weights(self, named_tensors: Any, version: int) -> dict:
        """Object-store path: `named_tensors` is a dict, or [ObjectRef] (passed on unresolved, so every
        engine replica reads the one object-store copy)."""
        if isinstance(named_tensors, list) and len(named_tensors) == 1:
            named_tensors = named_tensors[0]
        load = functools.partial(self.pool.update_weights, named_tensors, version)
        return self._call(lambda: self._update(load, version))

    # Collective path (fully_async.weight_sync.collective): the pool is one DirectWeightReceiver whose
    # ranks are those of every replica (an engine that receives in its own workers, vLLM, or one rank
    # per replica process that streams the buckets into its engine).
    def weight_receivers(self) -> int:
        """Ranks the rollout side adds to the trainer's weight-broadcast group."""
        return self._call(self.pool.weight_receivers)

    def init_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the trainer's weight-broadcast group as ranks rank .. rank + weight_receivers() - 1."""
        return self._call(lambda: self.pool.init_weight_group(addr, port, rank, world))

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        """Pause, then load buckets as they arrive from trainer rank 0."""
        load = functools.partial(self.pool.receive_weights, metas, buckets, dtype, version)
        return self._call(lambda: self._update(load, version))

    # Elastic trainer devices (async_training.placement=elastic; the trainer's side is residency.Elastic): while the
    # trainer waits for samples its devices' engines join this pool, and leave it before the trainer trains.
    def lend_engines(self, engines: list[tuple[str, Any, bool]], version: int) -> dict:
        """The trainer lends its engines ((name, actor, threaded) triples, each an EngineHost holding the trainer's
        weights of `version`, loaded in its own process) to this pool until `reclaim_engines`."""
        return self._call(lambda: self._lend(engines, version))

    def reclaim_engines(self) -> dict:
        """The trainer's batch is ready: its engines leave the pool; what they had in flight is parked as partial
        responses (tokens and per-token versions kept) and continues on this pool's own replicas.  Returns what
        the lent engines did over the lend (`fully_async/elastic/...`)."""
        return self._call(self._reclaim)

    def validate(self) -> Optional[dict]:
        """The driver's final validation, on the last weights, for the caller (not put in the outbox).  An update
        still kept while away (a shared pool, colocated) is loaded first; None when that version was validated
        and published already (loading it validated it, or the update ran just before this call): its metrics
        are in the outbox the driver drains next, and no version is validated twice."""
        def final() -> Optional[dict]:
            self.residency.hold("validate")   # the devices, and the update kept while away (validated at test_freq)
            if self._published_val == self.pool.version:
                return None
            return self._validate(self.pool.version, publish=False)

        return self._call(final)

    def pop_rm_validations(self) -> list[dict]:
        """reward_model.enable: the validations generated since the last call, unscored, for the trainer to score
        in its own turn and report at their steps ({step, pairs, n, seconds}: rollout/generation.py
        rm_validation_metrics)."""
        out = []
        while self.rm_validations:
            out.append(self.rm_validations.popleft())
        return out

    def pop_step_metrics(self) -> dict:
        """The rollouter's metrics over the trainer step whose batch was just taken (the trainer calls this once
        per step, right after the take, and forwards them).  The window runs from the counters of the last push
        before the previous take to those of the last push before this one (metrics.rollouter_window_metrics);
        no push in between: an empty window."""
        current = self._pushed
        metrics = rollouter_window_metrics(current, self._window_start)
        if current:
            self._window_start = current
        return dict(metrics, **self.residency.pop_metrics())   # a pool's lease events in the window

    def stop(self) -> None:
        self.stopped = True
        self.commands.put(None)

    def save_part(self, folder: str) -> None:
        """This rollouter's part of a checkpoint (between two engine steps): park the in-flight work, write
        everything not yet handed to the queue, and hold -- generate and push nothing -- until `release()`,
        so that the queue's part, written meanwhile, is the same cut."""
        return self._call(lambda: self._save_part(folder))

    def release(self) -> None:
        """The checkpoint's other parts are written: resume the parked work and generate again."""
        return self._call(self._release)

    def get_stats(self) -> dict:
        return dict(self._stats(), in_flight_requests=len(self.scheduler.pending),
                    in_flight_groups=len(self.scheduler.groups), prompts_emitted=self.scheduler.stream.num_emitted,
                    loop_running=self.loop_running)

    def progress(self) -> dict:
        """Counters the driver's watchdog compares between polls."""
        stats = self._stats()
        keys = ("engine_steps", "validations", "generated_samples", "staleness_samples", "bound_pauses", "version")
        return dict({k: stats.get(k, 0) for k in keys}, in_flight_requests=len(self.scheduler.pending),
                    prompts_emitted=self.scheduler.stream.num_emitted, loop_running=self.loop_running,
                    paused_at_bound=self.scheduler.at_bound(), lease_polls=self.residency.polls)

    def get_timeline(self) -> list[dict]:
        return self.timeline.drain() + self.pool.drain_timeline()

    def filtered_groups(self) -> list[str]:
        """The uids of the groups dynamic sampling dropped so far (checkpointed runs included): with the trainer's
        trained samples they account for every prompt generated."""
        return self._call(lambda: list(self.filter.filtered_uids) if self.filter is not None else [])

    def ready(self) -> bool:
        return True

    def _call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._loop_lock:
            if not self.loop_running:  # before run() (initial weights) or after it: nobody else drives the engine
                return fn()
            self.commands.put((fn, fut))
        return fut.result()

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        self._start = time.perf_counter()
        self._version_mark = (self._start, self.stats["idle_s"])
        self.loop_running = True
        try:
            return self._loop()
        finally:
            with self._loop_lock:
                self.loop_running = False
                while not self.commands.empty():
                    item = self.commands.get_nowait()
                    if item is not None:
                        item[1].set_exception(RuntimeError("the rollouter's loop has ended"))

    def _loop(self) -> dict:
        try:
            return self._generate_until_stopped()
        finally:
            self.residency.give_back("done")

    def _generate_until_stopped(self) -> dict:
        sched, residency = self.scheduler, self.residency
        if validation_only(self.cfg):   # trainer.val_only: the validation, then only the driver's calls until stopped
            if self.val_records and not self.resumed:
                self._validate(self.pool.version)
            while not self.stopped:
                self._run_commands(block=True, timeout=0.5)
            return self.get_stats()
        if sched.parked:  # partial responses restored from a checkpoint: back to the engines once they are on
            if residency.holding:
                sched.resume()
        elif self.cfg.trainer.val_before_train and self.val_records and not self.resumed:
            self._validate(self.pool.version)
        while not self.stopped:
            self._run_commands(block=False)
            if self.stopped:
                break
            if self.held:
                self._run_commands(block=True, timeout=0.5)
                continue
            if self._needs_devices() and residency.hold("rollout", serve=self._serve) is None:
                break   # stopped while waiting for the devices
            if self.held:   # a checkpoint began meanwhile
                continue
            sched.admit()
            if sched.in_flight() == 0:
                if sched.exhausted and not self.closed:
                    self._flush_puts()
                    ray_get(self.queue.close.remote())
                    self.closed = True
                    logger.info("rollouter: all %d prompts generated; serving weight updates and validation",
                                sched.stream.num_emitted)
                    if self.filter is not None and sched.demand is not None and sched.demand() > 0:
                        logger.warning("rollouter: the data ran out %d groups short of the run's steps: dynamic "
                                       "sampling dropped %d of the %d prompts generated", sched.demand(),
                                       self.filter.filtered, sched.stream.num_emitted)
                if residency.wanted():
                    residency.give_back("idle")   # nothing to generate: whoever waits for the devices goes first
                idle_from = time.perf_counter()
                # holding a shared lease: look again soon (a trainer may be waiting for these devices)
                self._run_commands(block=True, timeout=min(0.5, residency.poll_s))
                self.stats["idle_s"] += time.perf_counter() - idle_from
                continue
            with self.timeline.span("generate"):
                sched.step()
            if residency.wanted(min_held_s=self.min_slice_s):
                residency.give_back("wanted")
        sched.log_pauses()  # the last version's pauses
        self._flush_puts()
        return self.get_stats()

    def _needs_devices(self) -> bool:
        """To generate, to continue parked responses, or to load an update kept while away (at the staleness bound
        only that update lets generation go on)."""
        sched = self.scheduler
        return bool(sched.in_flight() or sched.parked or self.residency.has_kept()
                    or not (sched.at_bound() or sched.drawn_out()))

    def _serve(self) -> None:
        """Between two polls for the devices: weight updates and checkpoint calls go on (not when the wait itself
        runs inside one of them)."""
        from fully_async.placement.residency import Stopped

        if self._serving:
            return
        self._serving = True
        try:
            self._run_commands(block=False)
        finally:
            self._serving = False
        if self.stopped:
            raise Stopped()

    # ------------------------------------------------------------------ the engines on and off the devices
    def _devices_on(self, ph: Any, phase: str) -> dict:
        """The engines wake, load an update kept while away, and continue the responses parked when they left."""
        from fully_async.placement.device_pool import timed_event

        m = timed_event(self.device, ph, "rollout", "onload", self.pool.wake_up)
        m["multi_job/rollout/lease_wait_s"] = ph.waited_s
        kept = self.residency.take_kept()
        if kept is not None:
            load, version = kept
            with ph.span("param_sync", version=version):
                self._apply_weights(load, version)
        if not self.held:   # (a checkpoint's hold resumes them at its release)
            self.scheduler.resume()
        if self._held_through:
            self._held_through = False
            self.pool.release()   # the responses kept through the trainer's turn go on
        m.update(self.pool.memory_report())
        self._gen_from = time.time()
        return m

    def _devices_off(self, ph: Any, why: str) -> dict:
        """Park the in-flight responses (finish them without partial rollouts: a response never spans two turns or
        two versions), then the engines sleep."""
        from fully_async.placement.device_pool import timed_event

        if why == "setup":
            return timed_event(self.device, ph, "setup", "offload", lambda: self.pool.sleep(1))
        sched = self.scheduler
        if self._gen_from is not None:
            ph.spans.append({"name": "generate", "start": self._gen_from, "end": time.time(), "args": {}})
        self._yields += 1
        if self._holds_through_turns and why != "done" and self._holds_through():
            self._gen_from = None
            self._held_through = True
            self.pool.hold()   # engines in their own actors would go on decoding in the trainer's turn otherwise
            m = {"multi_job/rollout/yields": self._yields, "fully_async/rollouter/kept_in_flight":
                 float(sched.in_flight())}
            if self.pool.swaps_in_flight:   # resident (nothing moves), or the KV of what is in flight swapped out
                m.update(timed_event(self.device, ph, "rollout", "offload", lambda: self.pool.sleep(1, True)))
            return m
        if sched.partial_rollout or why == "done":
            sched.stats["interrupted_samples"] += sched.park()
        else:
            sched.drain()
        m = timed_event(self.device, ph, "rollout", "offload", lambda: self.pool.sleep(1))
        m.update(self.pool.memory_report())
        m["multi_job/rollout/held_s"] = time.time() - (self._gen_from or time.time())
        m["multi_job/rollout/yields"] = self._yields
        self._gen_from = None
        return m

    def _holds_through(self) -> bool:
        """Hold the responses in flight through the trainer's turn (not park them)?  The engines keep their memory
        (free_cache_engine=false, or the trainer fits beside them), or swap what is in flight to host memory."""
        if self._keeps_in_flight:
            return True
        return self.pool.keeps_resident() or self.pool.swaps_in_flight

    def _run_commands(self, block: bool, timeout: float = 0.0) -> None:
        while True:
            try:
                item = self.commands.get(block=block, timeout=timeout if block else None)
            except queue_mod.Empty:
                return
            block = False
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
                raise

    def _push(self, complete: list[CompletedGroup]) -> None:
        """The scheduler completed these groups: score them and hand them to the trainer's queue."""
        with self.timeline.span("reward"):
            groups: list[SampleGroup] = []
            for g in complete:
                if self.rm_inputs is not None:   # the trainer scores them with the reward model before it trains
                    attach_reward_model_inputs(self.rm_inputs, [(g.record, g.samples)])
                else:
                    score_samples(self.tokenizer, self.reward, g.record, g.samples)
                groups.append(make_group(g.uid, g.record, g.epoch, g.admitted_version, g.samples))
        groups = self._filter(groups)
        self._pushed = self._stats()
        if groups:
            # not waited for here: with the engine in this thread (one inline replica) waiting for the queue
            # actor's answer idled the engine at every completion (4.4 ms a push against a 3 ms decode step on the
            # 2-core CPU run); one put in flight at a time keeps the groups in order
            self._flush_puts()
            self._put = self.queue.put_many.remote(groups)

    def _flush_puts(self) -> None:
        """Wait until the queue holds every group pushed so far (before anything reads its size, closes it or
        checkpoints it; a put that failed raises here)."""
        put, self._put = self._put, None
        if put is not None:
            ray_get(put)

    def _queued(self) -> int:
        """Groups waiting in the trainer's queue, the ones pushed so far included."""
        self._flush_puts()
        return ray_get(self.queue.size.remote())

    def _filter(self, groups: list[SampleGroup]) -> list[SampleGroup]:
        """Dynamic sampling: the groups to train.  A dropped group frees its admission slot (the staleness bound
        counts only groups that can be trained), so another prompt takes its place; it is counted, not lost."""
        if self.filter is None:
            return groups
        kept, dropped = self.filter.split(groups)
        if dropped:
            self.scheduler.staleness.on_filtered(len(dropped))
            self.scheduler.stats["filtered_groups"] += len(dropped)
        return kept

    def _load_filter(self, state: Optional[dict]) -> None:
        """The dynamic-sampling counts of a checkpoint (none in one taken without it: counts start at 0)."""
        if self.filter is not None and state is not None:
            self.filter.load_state_dict(state)
            self.scheduler.stats["filtered_groups"] = self.filter.filtered

    def _stats(self) -> dict:
        """Cumulative counters (step windows are differences of two of them)."""
        self.stats["wall_s"] = time.perf_counter() - self._start
        self.stats["version"] = self.pool.version
        return dict(self.stats, **self.scheduler.stats, engines=self.pool.engine_stats())

    # ------------------------------------------------------------------ commands
    def _update(self, load: Callable[[], None], version: int) -> dict:
        """A weight update from the trainer: loaded now, or kept while the engines are off their devices (loaded
        when they next come on; its timings come with that onload)."""
        if self.residency.keep((load, version)):
            return {}
        return self._apply_weights(load, version)

    def _apply_weights(self, load: Callable[[], None], version: int) -> dict:
        """Pause the engines' work as the config says, run `load` (every replica's update), resume."""
        validate_now = self.test_freq > 0 and version % self.test_freq == 0 and bool(self.val_records)
        self._end_version(version)
        with self.timeline.span("param_sync", version=version):
            out = self.scheduler.apply_weights(load, version, queued=self._queued,
                                               before_resume=(lambda: self._validate(version, resume=False))
                                               if validate_now else None)
        if self._version_mark is not None:  # the new version begins once it is loaded (and validated), as verl's
            self._version_mark = (time.perf_counter(), self.stats["idle_s"])
        return out

    def _step_of(self, version: int) -> int:
        """The trainer step that pushed `version` (core/trainer_state.py)."""
        return self.trainer_state.step_of(version)

    def _end_version(self, version: int) -> None:
        """verl's per-version rollouter metrics (metrics.rollouter_version_metrics) of the version that `version`
        replaces, to the driver at the trainer step that pushed `version` (nothing before run(): the initial
        weights)."""
        if self._version_mark is None:
            return
        start, idle_at_start = self._version_mark
        metrics = rollouter_version_metrics(time.perf_counter() - start, self.stats["idle_s"] - idle_at_start)
        if metrics:
            self._emit(self._step_of(version), metrics)

    def _validate(self, version: int, resume: bool = True, publish: bool = True) -> dict:
        """Validation on the weights of `version`; in-flight work is parked and resumed after (resume=False:
        inside a weight update, which resumes the parked work itself).  publish: into the outbox the driver
        drains, at the trainer step that pushed `version` (version x trigger_parameter_sync_step)."""
        self.residency.hold("validate")   # the engines' devices (a pool lease: waiting without serving commands)
        self.scheduler.park()
        with self.timeline.span("validate", version=version):
            scored = self._scored_validation if self.rm_inputs is None else self._rm_validation
            metrics = scored(version, publish)
        self.stats["validations"] += 1
        if resume:
            self.scheduler.resume()
        return metrics

    def _scored_validation(self, version: int, publish: bool) -> dict:
        """The validation metrics (rule/custom rewards), published at the step that pushed `version`."""
        metrics = validate(self.pool, self.tokenizer, self.reward, self.val_records, self.cfg, version, self.tools)
        metrics["rollouter/validate_time"] = metrics["timing_s/testing"]  # verl's name for the rollouter's validation
        if publish:
            self._emit(self._step_of(version), dict(metrics))
            self._published_val = version
        logger.info("validation at param version %d: %s", version,
                    ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if isinstance(v, float)))
        return metrics

    def _rm_validation(self, version: int, publish: bool) -> dict:
        """The validation responses with the reward model's tokens attached, for the trainer to score: queued for
        its next step (publish), or returned to the driver as {"rm_validation": ...} (its final validation)."""
        start = time.perf_counter()
        pairs = validation_samples(self.pool, self.val_records, self.cfg, version, self.tools)
        attach_reward_model_inputs(self.rm_inputs, pairs)
        item = {"step": self._step_of(version), "pairs": pairs, "seconds": time.perf_counter() - start,
                "n": self.cfg.actor_rollout_ref.rollout.val_kwargs.n,
                "texts": validation_texts(self.tokenizer, pairs, self.cfg)}   # the trainer has no tokenizer
        logger.info("validation at param version %d: %d responses generated in %.1fs; the trainer scores them with "
                    "the reward model", version, sum(len(s) for _, s in pairs), item["seconds"])
        if publish:
            self.rm_validations.append(item)
            return {}
        return {"rm_validation": item}

    # ------------------------------------------------------------------ elastic: the trainer's engines lent
    def _lend(self, engines: list[tuple[str, Any, bool]], version: int) -> dict:
        from fully_async.rollout.engines.replica import RemoteReplica

        if version != self.pool.version:   # the trainer flushes its push before it lends: a mismatch is a bug
            raise RuntimeError(f"elastic: the trainer lends engines holding version {version} but the rollout pool "
                               f"holds {self.pool.version}")
        self._lent = self.pool.join([RemoteReplica(actor, name, threaded) for name, actor, threaded in engines])
        self.scheduler.max_in_flight = self.pool.capacity
        self._lent_from = (time.perf_counter(), [dict(s) for s in self.pool.engine_stats()])
        self.stats["elastic_lends"] += 1
        return {}

    def _reclaim(self) -> dict:
        if not self._lent:
            return {}
        sched, lent = self.scheduler, self._lent
        # they continue on this pool's own replicas (during a checkpoint's hold: at its release)
        parked = sched.take_back(self.pool.leave(lent), resume=not self.held)
        sched.max_in_flight = self.pool.capacity
        start, stats0 = self._lent_from
        now = self.pool.engine_stats()
        self.stats["elastic_parked"] += parked
        self._lent, self._lent_from = [], None
        return {"fully_async/elastic/lent_s": time.perf_counter() - start,
                "fully_async/elastic/parked": float(parked),
                "fully_async/elastic/busy_s": sum(now[i]["busy_s"] - stats0[i]["busy_s"] for i in lent),
                "fully_async/elastic/tokens": float(sum(now[i]["tokens"] - stats0[i]["tokens"] for i in lent)),
                "fully_async/elastic/finished": float(sum(now[i]["finished"] - stats0[i]["finished"] for i in lent))}

    # ------------------------------------------------------------------ checkpoint
    def _save_part(self, folder: str) -> None:
        from fully_async.core.checkpoint import ROLLOUT_STATE, write_state

        self.scheduler.park()  # in-flight requests' partial state goes into the checkpoint
        state = self.scheduler.state_dict()
        if self.filter is not None:
            state["filter"] = self.filter.state_dict()
        write_state(os.path.join(folder, ROLLOUT_STATE), state)
        self._flush_puts()   # the queue's part, written next, holds every group this part no longer does
        self.held = True

    def _release(self) -> None:
        """After a checkpoint: parked responses resume now if the engines are on (else when they next come on)."""
        self.held = False
        if self.residency.holding:
            self.scheduler.resume()

