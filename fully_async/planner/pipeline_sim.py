"""Discrete-event simulation of the async pipeline (split and elastic) and of the sync loop (layer 1: pure Python,
no torch; colocated async is colocated_sim.py, the engine replica and records sim_engine.py).

Why a simulation and not a formula: the throughput of an async run is not min(rollout, train).  The
staleness bound stops admission until the trainer's next weight update (with staleness_threshold=0.1 a
1+1 split on a GPU ran nearly serially: generate one step's groups, train, sync, repeat), a step waits
for the slowest response of its groups (the long tail of the length distribution), a weight update
interrupts in-flight responses (partial rollout: they resume after the load and pay their prefix again)
or drains them (no partial rollout), and continuous batching makes a decode step cost depend on how many
sequences are in flight.  Those interactions are what decide whether async beats sync, so they are
simulated event by event, with the run's own rules:

  rollout   K replicas, each a continuously batching engine with `max_num_seqs` slots.  A decode step of
            a replica with b sequences in flight takes  decode_step_s + decode_seq_s x b  and advances
            each by one token; sequences that join pay  prefill_token_s x (prompt + resumed prefix)  once.
            With decode_kv_token_s a step also pays for the tokens its sequences have cached (their
            attention's reads), which grow by b a step.
            A prompt group (its n responses) goes whole to the least-loaded replica with room for n
            (engines/pool.py), and is admitted only while the staleness bound allows (core/staleness.py,
            the StalenessManager itself): groups admitted since the last version, with carry-over of the
            groups in flight or queued at each version, stay under
            required x (1 + staleness_threshold) x trigger_parameter_sync_step.
  trainer   takes `required` complete groups from the queue (waiting is its idle time), trains for
            train_step_s + tokens x train_token_s / (devices x dp efficiency), and every
            trigger_parameter_sync_step steps updates the weights: both sides stall weight_sync_s; with
            partial_rollout the engines are interrupted first (progress kept; pause_mode=abort: they resume
            from prompt + partial response, prefilled again; keep: over their cache), without it they drain
            their in-flight responses on the old weights before the load (scheduler.apply_weights).  A push
            that hands the weights over without waiting for the engines' load (the object store: weight_load_s
            > 0) stalls only the trainer, for weight_sync_s; the engines go on meanwhile, then stop as above
            and load for weight_load_s while the trainer goes on to its next batch, whose push waits for that
            load (weight_sync/object_store.py, PendingLoad.flush).
  elastic   split, plus one engine replica per trainer device group (`elastic_replicas`) that joins the pool
            while the trainer waits for groups; when the trainer's batch is ready those replicas are
            pre-empted (their unfinished responses parked, resumed first on any replica with room) and the
            trainer starts after sync_step_s (engines sleep, trainer onloads; as sync mode's switch).  When
            the batch is already there at the end of a step they stay asleep and nothing is paid.
  sync      per step, train_batch_size groups split evenly over the N colocated ranks; each rank's engine
            generates its share (same replica model); the step waits for the slowest rank, then trains
            on all N devices and pays sync_step_s (engine sleep/wake and the local weight load).

Tokens are counted as perf/total_num_tokens counts them (prompt + response of every trained sample), and
tokens/s as compare_lib does: total tokens / the time the last step ends (the pipeline fill included).

Between events a replica's batch is constant, so the simulation jumps from one completion to the next
instead of stepping every token: a run of thousands of devices and 8k-token responses takes seconds.
"""
from __future__ import annotations

import heapq
import itertools

from fully_async.core.staleness import StalenessManager
from fully_async.core.trainer_state import TrainerState
from fully_async.planner.sim_engine import (EPS, AsyncSetup, SimResult, StageCosts, Workload, _group,  # noqa: F401
                                            _Replica, _Seq, fold_finished, generate_time)


# ----------------------------------------------------------------------------------- async
class _AsyncSim:
    def __init__(self, setup: AsyncSetup, costs: StageCosts, work: Workload):
        if setup.replicas < 1 or setup.trainer_devices < 1:
            raise ValueError(f"async needs >= 1 rollout replica and >= 1 trainer device (got {setup.replicas} "
                             f"replica(s), {setup.trainer_devices} trainer device(s))")
        if setup.required < 1 or work.n < 1 or work.steps < 1:
            raise ValueError("required groups, n and steps must be >= 1")
        self.s, self.c, self.w = setup, costs, work
        # rollout replicas first, then the elastic ones on the trainer's devices (awake while the trainer waits)
        self.replicas = [_Replica(costs, max(setup.max_num_seqs, work.n))
                         for _ in range(setup.replicas + setup.elastic_replicas)]
        self.elastic = range(setup.replicas, len(self.replicas))
        self.awake = [True] * len(self.replicas)
        self.homeless: list[_Seq] = []          # pre-empted responses: resumed first, on any replica with room
        self.bound = StalenessManager(setup.required, 1, setup.staleness_threshold, setup.trigger_parameter_sync_step)
        self.events: list = []
        self.free_heap = [(-r.free(), i) for i, r in enumerate(self.replicas)]
        heapq.heapify(self.free_heap)
        self.tick = itertools.count()
        self.next_prompt = 0
        self.groups: dict[str, list] = {}       # uid -> [responses left, tokens so far]
        self.queue: list[int] = []              # tokens of each complete group, in order
        self.parked: list[tuple[int, list[_Seq]]] = []
        self.trainer_busy = False
        self.syncing = False
        self.draining = False
        self.pushing = False                    # weight_load_s: the trainer pushes (or waits to)
        self.updating = False                   # weight_load_s: a pushed update the engines have not loaded yet
        self._push_waits = False                # the trainer's next push waits for that load
        # the real trainer's step and push rules (core/trainer_state.py)
        self.trainer = TrainerState(total_steps=work.steps, trigger=setup.trigger_parameter_sync_step)
        self.result = SimResult("elastic" if setup.elastic_replicas else "async", 0, 0, 0.0)

    # -- events
    def _push(self, t: float, kind: str, payload: int = 0, gen: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self.tick), kind, payload, gen))

    def _schedule(self, i: int) -> None:
        r = self.replicas[i]
        r.gen += 1
        t = r.next_finish()
        if t is not None:
            self._push(t, "replica", i, r.gen)

    def _collect(self, i: int, t: float) -> None:
        finished = self.replicas[i].advance(t)
        if finished:
            self._touch(i)
        fold_finished(finished, self.groups, self.queue)

    # -- rollouter
    def _touch(self, i: int) -> None:
        """Replica i's free slots changed: index it for least-loaded routing (stale entries skipped later)."""
        heapq.heappush(self.free_heap, (-self.replicas[i].free(), i))

    def _roomiest(self) -> tuple[int, int]:
        """(replica, free slots) of the awake replica with the most room ((-1, 0) when none)."""
        heap = self.free_heap
        while heap and (not self.awake[heap[0][1]] or -heap[0][0] != self.replicas[heap[0][1]].free()):
            heapq.heappop(heap)
        return (heap[0][1], -heap[0][0]) if heap else (-1, 0)

    def _resume_homeless(self, t: float) -> None:
        while self.homeless:
            i, free = self._roomiest()
            if free < 1:
                return
            seqs, self.homeless = self.homeless[:free], self.homeless[free:]
            self._collect(i, t)
            self.replicas[i].join(seqs, t)
            self._touch(i)
            self._schedule(i)

    def _admit(self, t: float) -> None:
        if self.syncing or self.draining or self.updating:
            return
        self._resume_homeless(t)
        if self.homeless:
            return
        n = self.w.n
        while True:
            if not self.bound.can_admit():
                self.bound.note_stop()
                return
            i, free = self._roomiest()
            if free < n:
                return
            uid, seqs = _group(self.w, self.next_prompt)
            self.next_prompt += 1
            self._collect(i, t)
            self.replicas[i].join(seqs, t)
            self._touch(i)
            self.groups[uid] = [n, 0]
            self.bound.on_admit()
            self.result.max_admitted = max(self.result.max_admitted, self.bound.state.admitted)
            self._schedule(i)

    # -- trainer
    def _try_train(self, t: float) -> None:
        if (self.trainer.done() or self.trainer_busy or self.syncing
                or len(self.queue) < self.s.required):
            return   # (a step past the run's last would count tokens no step time pays for)
        taken, self.queue = self.queue[:self.s.required], self.queue[self.s.required:]
        first = not self.result.step_tokens
        self.result.tokens += sum(taken)
        self.result.step_tokens.append(sum(taken))
        self.result.trainer_wait_s += t - self._trainer_free_since
        self.trainer_busy = True
        start = t + self._preempt(t)
        train = self.c.train_time(sum(taken), self.s.trainer_devices, first)
        self.result.train_s += train
        self._push(start + train, "trained")

    def _preempt(self, t: float) -> float:
        """Elastic: the trainer's batch is ready; its engines stop, their responses parked for any replica.
        Returns the switch seconds (0 when they were asleep already)."""
        woken = [i for i in self.elastic if self.awake[i]]
        for i in woken:
            self._collect(i, t)
            seqs = self.replicas[i].interrupt()
            self.result.interrupted += len(seqs)
            self.homeless.extend(seqs)
            self.awake[i] = False
            self.replicas[i].gen += 1
        if not woken:
            return 0.0
        self.result.switch_s += self.c.sync_step_s
        self._admit(t)      # the parked responses go first to rollout replicas with room
        return self.c.sync_step_s

    def _on_trained(self, t: float) -> None:
        self.trainer.step += 1
        if not self.trainer.push_due():
            self._step_done(t)
        elif self.c.weight_load_s > 0:   # the push hands the weights over: the engines go on until they load them
            self.pushing = True
            if self.updating:
                self._push_waits = True   # until the previous update is loaded
            else:
                self._push(t + self.c.weight_sync_s, "pushed")
        else:
            self.syncing = True
            self._stop_engines(t)

    def _stop_engines(self, t: float) -> None:
        """The engines stop for a weight update: interrupted (progress kept) with partial_rollout, else drained."""
        if self.s.partial_rollout:
            self._interrupt(t)
            self._load(t)
        else:
            self.draining = True
            self._maybe_drained(t)

    def _load(self, t: float) -> None:
        """The engines have stopped: the update takes weight_sync_s (both sides), or weight_load_s after a push that
        did not wait for it."""
        self._push(t + (self.c.weight_load_s if self.updating else self.c.weight_sync_s), "synced")

    def _on_pushed(self, t: float) -> None:
        """weight_load_s: the trainer's push is done and it goes on to its next batch; the engines stop and load."""
        self.pushing, self.updating = False, True
        self._stop_engines(t)
        self._step_done(t)

    def _interrupt(self, t: float) -> None:
        for i, r in enumerate(self.replicas):
            self._collect(i, t)
            seqs = r.interrupt()
            self._touch(i)
            if seqs:
                self.result.interrupted += len(seqs)
                self.parked.append((i, seqs))
            r.gen += 1

    def _maybe_drained(self, t: float) -> None:
        if self.draining and all(not r.heap for r in self.replicas):
            self.draining = False
            self._load(t)

    def _on_synced(self, t: float) -> None:
        self.syncing = False
        pushed, self.updating = self.updating, False   # (the trainer's step ended at its push)
        self.bound.on_version(self.bound.state.version + 1, in_flight=len(self.groups), queued=len(self.queue))
        self.result.max_admitted = max(self.result.max_admitted, self.bound.state.admitted)
        parked, self.parked = self.parked, []
        for i, seqs in parked:   # pause_mode=keep: they waited out the load over their cache
            self.replicas[i].join(seqs, t, prefill=self.s.pause_mode == "abort")
            self._touch(i)
            self._schedule(i)
        if not pushed:
            self._step_done(t)
            return
        self._admit(t)
        if self._push_waits:
            self._push_waits = False
            self._push(t + self.c.weight_sync_s, "pushed")

    def _step_done(self, t: float) -> None:
        self.trainer_busy = False
        self.result.step_ends.append(t)
        self._trainer_free_since = t
        if not self.trainer.done() and len(self.queue) < self.s.required:
            for i in self.elastic:   # the trainer will wait: its engines join the pool
                self.awake[i] = True
                self._touch(i)
        self._admit(t)
        self._try_train(t)

    def run(self) -> SimResult:
        self._trainer_free_since = 0.0
        self._admit(0.0)
        t = 0.0
        while not self.trainer.done() or self.syncing or self.draining or self.pushing:
            if not self.events:
                raise RuntimeError("pipeline simulation stalled: no event left (staleness bound below one step?)")
            t, _, kind, payload, gen = heapq.heappop(self.events)
            if kind == "replica":
                if gen != self.replicas[payload].gen:
                    continue
                self._collect(payload, t)
                self._schedule(payload)
                self._maybe_drained(t)
                self._admit(t)
                self._try_train(t)
            elif kind == "trained":
                self._on_trained(t)
            elif kind == "pushed":
                self._on_pushed(t)
            elif kind == "synced":
                self._on_synced(t)
            if self.trainer.done() and not self.syncing and not self.draining and not self.pushing:
                break   # (a load after the last push ends no step)
        res = self.result
        res.steps, res.seconds = self.trainer.step, res.step_ends[-1]
        rollout = self.replicas[:self.s.replicas]
        res.rollout_busy_s = sum(min(r.busy_s, res.seconds) for r in rollout)
        res.rollout_replica_s = res.seconds * len(rollout)
        res.trainer_engines = self.s.elastic_replicas
        res.trainer_engine_busy_s = sum(min(self.replicas[i].busy_s, res.seconds) for i in self.elastic)
        res.bound_pauses = self.bound.state.pauses
        return res


def simulate_async(setup: AsyncSetup, costs: StageCosts, work: Workload) -> SimResult:
    """Tokens/s and idle ratios of an async run, split or (setup.elastic_replicas > 0) elastic (module
    docstring for the model)."""
    return _AsyncSim(setup, costs, work).run()


# ----------------------------------------------------------------------------------- sync
def simulate_sync(devices: int, train_batch_size: int, max_num_seqs: int, costs: StageCosts,
                  work: Workload) -> SimResult:
    """The colocated loop on `devices` devices: every rank generates its share, then all train."""
    if devices < 1 or train_batch_size < 1:
        raise ValueError(f"sync needs >= 1 device and train_batch_size >= 1 (got {devices}, {train_batch_size})")
    res = SimResult("sync", work.steps, 0, 0.0)
    t, prompt = 0.0, 0
    for step in range(work.steps):
        groups = [_group(work, prompt + i)[1] for i in range(train_batch_size)]
        prompt += train_batch_size
        per_rank = [groups[k::devices] for k in range(devices)]   # contiguous shares differ only in order
        gens = [generate_time(share, costs, max_num_seqs) for share in per_rank if share]
        gen_s = max(g for g, _ in gens)
        tokens = sum(tok for _, tok in gens)
        train_s = costs.train_time(tokens, devices, first=step == 0)
        step_s = gen_s + train_s + costs.sync_step_s
        res.train_s += train_s
        res.switch_s += costs.sync_step_s
        res.tokens += tokens
        res.step_tokens.append(tokens)
        res.trainer_wait_s += gen_s
        res.rollout_busy_s += sum(g for g, _ in gens)
        t += step_s
        res.step_ends.append(t)
    res.seconds = t
    res.rollout_replica_s = t * devices
    return res
