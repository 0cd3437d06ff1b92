"""Rollouter actor (layer 3): keeps the engine busy, scores groups, feeds the queue.

One thread owns the engine.  `run()` is that thread's loop: admit prompts while the staleness
bound allows, advance the engine, turn finished responses into scored groups, push them.  Other
callers (the trainer's weight push, the driver's validation and stop) never touch the engine:
they enqueue a command that the loop executes between two engine steps and wait for its result.
That keeps weight updates, interrupts and validation strictly ordered with generation.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue as queue_mod
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fully_async.engines.base import receives_weights_directly
from fully_async.generation import group_pendings, make_group, score_samples, validate
from fully_async.partial import PendingResponse
from fully_async.types import GenOutput, PromptRecord, SampleGroup, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    record: PromptRecord
    epoch: int
    admitted_version: int
    done: list = field(default_factory=list)


class Rollouter:
    def __init__(self, cfg: Any, queue: Any, train_records: list[PromptRecord], val_records: list[PromptRecord],
                 eos_token_ids: list[int], pad_token_id: int, resume_state: Optional[dict] = None):
        from fully_async.actor_setup import actor_init, build_tokenizer
        from fully_async.data import PromptStream
        from fully_async.engines import build_engine
        from fully_async.rewards import build_reward_manager
        from fully_async.staleness import StalenessManager
        from fully_async.timeline import Timeline

        self.cfg, self.device = actor_init(cfg, "rollouter")
        cfg = self.cfg
        self.queue = queue
        self.tokenizer = build_tokenizer(cfg)
        self.engine = build_engine(cfg, self.device, eos_token_ids, pad_token_id)
        self.reward = build_reward_manager(cfg)
        self.staleness = StalenessManager.from_config(cfg)
        total = cfg.rollout.total_rollout_steps
        self.stream = PromptStream(train_records, shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                                   total_epochs=cfg.trainer.total_epochs, total_prompts=total)
        self.val_records = val_records
        r = cfg.actor_rollout_ref.rollout
        self.n = r.n
        self.params = SamplingParams(r.temperature, r.top_p, r.top_k, cfg.data.max_response_length)
        self.max_num_seqs = r.max_num_seqs
        self.partial_rollout = cfg.async_training.partial_rollout
        test_freq = cfg.rollout.test_freq if cfg.rollout.test_freq is not None else cfg.trainer.test_freq
        self.test_freq = test_freq
        self.groups: dict[str, _Group] = {}
        self.pending: dict[str, PendingResponse] = {}
        self.interrupted: list[PendingResponse] = []
        self.commands: queue_mod.Queue = queue_mod.Queue()
        self.stopped = False
        self.closed = False
        self.loop_running = False
        self._loop_lock = threading.Lock()
        self.stats = {"idle_s": 0.0, "wall_s": 0.0, "generated_samples": 0, "pushed_groups": 0,
                      "interrupted_samples": 0, "bound_pauses": 0, "staleness_samples": 0, "version": 0}
        self._start = time.perf_counter()
        self.timeline = Timeline("rollouter", cfg.trainer.timeline)
        self.resumed = resume_state is not None
        if resume_state is not None:
            self._restore(resume_state)

    # ------------------------------------------------------------------ called by others
    def update_weights(self, named_tensors: dict, version: int) -> dict:
        load = functools.partial(self.engine.update_weights, named_tensors, version)
        return self._call(lambda: self._apply_weights(load, version))

    # Collective path (fully_async.weight_sync.collective).  An engine that receives the broadcast in
    # its own processes (engines.base.DirectWeightReceiver: vLLM's workers) gets the group and the
    # buckets directly; otherwise this actor is the one receiver and feeds its engine the stream.
    def weight_receivers(self) -> int:
        """Ranks this rollouter adds to the trainer's weight-broadcast group."""
        return self.engine.weight_receivers() if receives_weights_directly(self.engine) else 1

    def init_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the trainer's weight-broadcast group as ranks rank .. rank + weight_receivers() - 1."""
        if receives_weights_directly(self.engine):
            return self._call(lambda: self.engine.init_weight_group(addr, port, rank, world))
        self.weight_pg = self.device.new_group(addr, port, rank, world)

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        """Pause, then load buckets as they arrive from trainer rank 0."""
        if receives_weights_directly(self.engine):
            load = functools.partial(self.engine.receive_weights, metas, buckets, dtype, version)
        else:
            import torch

            from fully_async.weight_sync.collective import receive

            stream = receive(self.weight_pg, metas, buckets, getattr(torch, dtype.split(".")[-1]),
                             self.device.torch_device())
            load = functools.partial(self.engine.update_weights, stream, version)
        return self._call(lambda: self._apply_weights(load, version))

    def validate(self) -> dict:
        return self._call(lambda: self._validate(self.engine.version))

    def stop(self) -> None:
        self.stopped = True
        self.commands.put(None)

    def snapshot(self) -> dict:
        """Everything not yet trained on, for a checkpoint (taken between two engine steps)."""
        return self._call(self._snapshot)

    def get_stats(self) -> dict:
        return dict(self.stats, in_flight_requests=len(self.pending), in_flight_groups=len(self.groups),
                    prompts_emitted=self.stream.num_emitted, loop_running=self.loop_running)

    def progress(self) -> dict:
        """Counters the driver's watchdog compares between polls."""
        keys = ("engine_steps", "validations", "generated_samples", "staleness_samples", "bound_pauses", "version")
        return dict({k: self.stats.get(k, 0) for k in keys}, in_flight_requests=len(self.pending),
                    prompts_emitted=self.stream.num_emitted, loop_running=self.loop_running,
                    paused_at_bound=not self.staleness.can_admit_peek())

    def get_timeline(self) -> list[dict]:
        return self.timeline.drain()

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
        if self.interrupted:  # partial responses restored from a checkpoint
            self.engine.submit([p.request() for p in self.interrupted])
            self.interrupted = []
        elif self.cfg.trainer.val_before_train and self.val_records and not self.resumed:
            self._validate(self.engine.version)
        while not self.stopped:
            self._run_commands(block=False)
            if self.stopped:
                break
            self._admit()
            if self.engine.num_in_flight() == 0:
                if self.stream.exhausted and not self.groups and not self.closed:
                    ray_get(self.queue.close.remote())
                    self.closed = True
                    logger.info("rollouter: all %d prompts generated; serving weight updates and validation",
                                self.stream.num_emitted)
                idle_from = time.perf_counter()
                self._run_commands(block=True, timeout=0.5)
                self.stats["idle_s"] += time.perf_counter() - idle_from
                continue
            with self.timeline.span("generate"):
                outputs = self.engine.collect()
            self.stats["engine_steps"] = self.stats.get("engine_steps", 0) + 1
            self._handle(outputs)
        return self.get_stats()

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

    def _admit(self) -> None:
        while (self.engine.num_in_flight() < self.max_num_seqs and not self.stream.exhausted
               and not self.stopped):
            if not self.staleness.can_admit():
                if self.staleness.state.pauses != self.stats["bound_pauses"]:
                    self.stats["bound_pauses"] = self.staleness.state.pauses
                    logger.info("rollouter paused: %s", self.staleness.pause_reason())
                break
            epoch, record = self.stream.next()
            uid = f"e{epoch}-p{record.index}"
            self.groups[uid] = _Group(record, epoch, self.engine.version)
            pends = group_pendings(uid, record, self.n, self.params)
            self.pending.update((p.sample_id, p) for p in pends)
            self.engine.submit([p.request() for p in pends])
            self.staleness.on_admit()
        self.stats["staleness_samples"] = self.staleness.state.admitted

    def _handle(self, outputs: list[GenOutput]) -> None:
        complete: list[SampleGroup] = []
        for out in outputs:
            pend = self.pending[out.request_id]
            if not pend.extend(out):
                self.interrupted.append(pend)
                continue
            del self.pending[out.request_id]
            group = self.groups[pend.uid]
            group.done.append(pend.to_sample())
            if len(group.done) == self.n:
                del self.groups[pend.uid]
                complete.append(self._score(pend.uid, group))
        if complete:
            self.stats["generated_samples"] += self.n * len(complete)
            self.stats["last_progress"] = time.time()
            self.stats["pushed_groups"] += len(complete)
            self._refresh_stats()
            ray_get(self.queue.put_many.remote(complete, dict(self.stats)))

    def _score(self, uid: str, group: _Group) -> SampleGroup:
        with self.timeline.span("reward"):
            score_samples(self.tokenizer, self.reward, group.record, group.done)
        return make_group(uid, group.record, group.epoch, group.admitted_version, group.done)

    def _refresh_stats(self) -> None:
        self.stats["wall_s"] = time.perf_counter() - self._start
        self.stats["version"] = self.engine.version

    # ------------------------------------------------------------------ commands
    def _apply_weights(self, load: Callable[[], None], version: int) -> dict:
        """Pause the engine's work as the config says, run `load` (the engine's update), resume."""
        with self.timeline.span("param_sync", version=version):
            return self._apply_weights_inner(load, version)

    def _apply_weights_inner(self, load: Callable[[], None], version: int) -> dict:
        t0 = time.perf_counter()
        # an engine that keeps in-flight requests (vLLM pause_mode=keep) continues them on the new
        # weights inside the engine's update, stamping later tokens with the new version
        keep = self.partial_rollout and getattr(self.engine, "keeps_in_flight", False)
        if keep:
            pass
        elif self.partial_rollout:
            aborted = self.engine.interrupt()
            self.stats["interrupted_samples"] += len(aborted)
            self._handle(aborted)
        else:  # finish in-flight requests on the old weights
            while self.engine.num_in_flight():
                self._handle(self.engine.collect())
        t1 = time.perf_counter()
        load()
        t2 = time.perf_counter()
        queued = ray_get(self.queue.size.remote())
        self.staleness.on_version(version, in_flight=len(self.groups), queued=queued)
        timings = {"pause": t1 - t0, "load": t2 - t1}
        if keep:
            timings.update(self.engine.last_update_timings)  # the engine's own pause/load/resume
        if self.test_freq > 0 and version % self.test_freq == 0 and self.val_records:
            self._validate(version)
        t3 = time.perf_counter()
        self.engine.submit([p.request() for p in self.interrupted])
        self.interrupted = []
        timings["resume"] = time.perf_counter() - t3
        self._refresh_stats()
        return timings

    def _validate(self, version: int) -> dict:
        """Validation on the weights of `version`; in-flight work is parked and resumed after."""
        if self.engine.num_in_flight():
            self._handle(self.engine.interrupt())
        with self.timeline.span("validate", version=version):
            metrics = validate(self.engine, self.tokenizer, self.reward, self.val_records, self.cfg, version)
        self.stats["validations"] = self.stats.get("validations", 0) + 1
        self.stats["last_progress"] = time.time()
        ray_get(self.queue.put_val_metrics.remote(version, metrics))
        logger.info("validation at param version %d: %s", version,
                    ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
        self.engine.submit([p.request() for p in self.interrupted])
        self.interrupted = []
        return metrics


    # ------------------------------------------------------------------ checkpoint
    def _snapshot(self) -> dict:
        if self.engine.num_in_flight():  # park in-flight requests: their partial state goes in the snapshot
            self._handle(self.engine.interrupt())
        state = {
            "stream": self.stream.state_dict(),
            "staleness": self.staleness.state_dict(),
            "groups": {uid: (g.record, g.epoch, g.admitted_version, list(g.done)) for uid, g in self.groups.items()},
            "pending": list(self.pending.values()),
            # taken while this loop is parked, so no group moves between rollouter and queue meanwhile
            "queue": ray_get(self.queue.snapshot.remote()),
            "closed": self.closed,
        }
        self.engine.submit([p.request() for p in self.interrupted])
        self.interrupted = []
        return state

    def _restore(self, state: dict) -> None:
        """Continue exactly where a checkpoint left off; the driver refills the queue itself."""
        self.stream.load_state_dict(state["stream"])
        self.staleness.load_state_dict(state["staleness"])
        self.groups = {uid: _Group(rec, epoch, version, list(done))
                       for uid, (rec, epoch, version, done) in state["groups"].items()}
        self.pending = {p.sample_id: p for p in state["pending"]}
        self.interrupted = list(self.pending.values())  # resubmitted when the loop starts
        self.closed = False
        logger.info("rollouter resumed: %d prompts already emitted, %d groups in flight (%d partial responses)",
                    self.stream.num_emitted, len(self.groups), len(self.pending))


def ray_get(ref: Any) -> Any:
    import ray
    return ray.get(ref)
