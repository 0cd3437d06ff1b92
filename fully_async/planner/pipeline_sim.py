"""Discrete-event simulation of the async pipeline and of the sync loop (layer 1: pure Python, no torch).

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
            A prompt group (its n responses) goes whole to the least-loaded replica with room for n
            (engines/pool.py), and is admitted only while the staleness bound allows (core/staleness.py,
            the StalenessManager itself): groups admitted since the last version, with carry-over of the
            groups in flight or queued at each version, stay under
            required x (1 + staleness_threshold) x trigger_parameter_sync_step.
  trainer   takes `required` complete groups from the queue (waiting is its idle time), trains for
            train_step_s + tokens x train_token_s / (devices x dp efficiency), and every
            trigger_parameter_sync_step steps updates the weights: both sides stall weight_sync_s; with
            partial_rollout the engines are interrupted first (progress kept), without it they drain
            their in-flight responses on the old weights before the load (scheduler.apply_weights).
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
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from fully_async.core.staleness import StalenessManager
from fully_async.core.trainer_state import TrainerState

EPS = 1e-12


@dataclass(frozen=True)
class StageCosts:
    """What one device costs per unit of work (seconds); measured (bench_pipeline / run logs) or estimated."""

    decode_step_s: float            # fixed seconds of one decode step of a replica (launch / weight read bound)
    train_token_s: float            # seconds per trained token on ONE trainer device (fwd + bwd + optimizer)
    decode_seq_s: float = 0.0       # extra seconds of a decode step per sequence in flight
    prefill_token_s: float = 0.0    # seconds per prefilled token (new requests, resumed partial prefixes)
    train_step_s: float = 0.0       # fixed seconds per trainer step (batch assembly, optimizer launch, ...)
    weight_sync_s: float = 0.0      # async: one weight update (trainer push + engines load; both stall)
    sync_step_s: float = 0.0        # sync mode: per-step switch (engine sleep/wake + local weight load)
    dp_efficiency: float = 1.0      # data-parallel scaling of a trainer on several devices, in (0, 1]
    source: str = ""                # where the numbers came from (printed with the prediction)

    def __post_init__(self) -> None:
        for name in ("decode_step_s", "train_token_s", "decode_seq_s", "prefill_token_s", "train_step_s",
                     "weight_sync_s", "sync_step_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"stage cost {name}={value!r} must be a number >= 0")
        if self.decode_step_s + self.decode_seq_s <= 0.0:
            raise ValueError("stage costs: a decode step must cost something (decode_step_s + decode_seq_s > 0)")
        if not 0.0 < self.dp_efficiency <= 1.0:
            raise ValueError(f"stage cost dp_efficiency={self.dp_efficiency!r} must be in (0, 1]")

    def step_time(self, in_flight: int) -> float:
        return self.decode_step_s + self.decode_seq_s * in_flight

    def train_time(self, tokens: int, devices: int) -> float:
        eff = self.dp_efficiency if devices > 1 else 1.0
        return self.train_step_s + tokens * self.train_token_s / (devices * eff)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """What a step trains on.  `length(sample_id)` gives a response's length (workload.LengthProfile.target)."""

    n: int                          # responses per prompt group
    prompt_len: int                 # tokens per prompt
    length: Callable[[str], int]    # sample id "e0-p<i>-s<j>" -> response tokens
    steps: int = 16                 # trainer steps simulated


@dataclass(frozen=True)
class AsyncSetup:
    replicas: int                   # rollout engine replicas (rollout devices / rollout tensor parallel size)
    trainer_devices: int
    max_num_seqs: int               # slots of one replica
    required: int                   # groups per trainer step (ppo_mini_batch_size x require_batches)
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 1
    partial_rollout: bool = True


@dataclass
class SimResult:
    mode: str
    steps: int
    tokens: int
    seconds: float
    step_ends: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    trainer_wait_s: float = 0.0     # async: trainer waiting for groups; sync: generation time
    rollout_busy_s: float = 0.0     # replica-seconds with at least one sequence in flight
    rollout_replica_s: float = 0.0  # replicas x seconds
    interrupted: int = 0            # responses interrupted by weight updates (partial rollout)
    bound_pauses: int = 0           # times the staleness bound stopped admission

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def steady_tokens_per_s(self, skip: int) -> float:
        """tokens/s of the steps after the first `skip` (the pipeline fill left out; a long run's rate)."""
        if not 0 < skip < len(self.step_ends):
            return self.tokens_per_s
        return sum(self.step_tokens[skip:]) / (self.step_ends[-1] - self.step_ends[skip - 1])

    @property
    def time_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else float("nan")

    @property
    def trainer_idle_ratio(self) -> float:
        return self.trainer_wait_s / self.seconds if self.seconds > 0 else float("nan")

    @property
    def rollout_idle_ratio(self) -> float:
        if self.rollout_replica_s <= 0:
            return float("nan")
        return max(0.0, 1.0 - self.rollout_busy_s / self.rollout_replica_s)

    def as_dict(self, skip: int = 0) -> dict:
        """skip: steps left out of steady_tokens_per_s (0: the same as tokens_per_s)."""
        return {"mode": self.mode, "steps": self.steps, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "steady_tokens_per_s": self.steady_tokens_per_s(skip),
                "time_per_step_s": self.time_per_step,
                "trainer_idle_ratio": self.trainer_idle_ratio, "rollout_idle_ratio": self.rollout_idle_ratio,
                "interrupted_responses": self.interrupted, "staleness_bound_pauses": self.bound_pauses}


# ----------------------------------------------------------------------------------- one engine replica
class _Seq:
    __slots__ = ("uid", "length", "left", "prompt", "finish")

    def __init__(self, uid: str, length: int, prompt: int):
        self.uid, self.length, self.left, self.prompt = uid, length, length, prompt
        self.finish = 0             # the replica's decode-step count at which it completes

    @property
    def done(self) -> int:
        return self.length - self.left


class _Replica:
    """A continuously batching engine: all sequences in flight advance one token per decode step.  Sequences
    sit in a heap by the step count at which they finish, so an event costs O(log b), not O(b)."""

    def __init__(self, costs: StageCosts, slots: int):
        self.costs, self.slots = costs, slots
        self.heap: list = []        # (finish step, tie, seq)
        self.k = 0                  # decode steps run so far
        self.clock = 0.0            # time the next step starts (steps are atomic)
        self.busy_s = 0.0
        self.gen = 0                # invalidates scheduled events when the batch changes
        self._tie = itertools.count()

    @property
    def seqs(self) -> int:
        return len(self.heap)

    def free(self) -> int:
        return self.slots - len(self.heap)

    def advance(self, t: float) -> list[_Seq]:
        """Run whole decode steps up to time t (none past the next completion); returns the finished sequences."""
        if not self.heap or t <= self.clock:
            return []
        tau = self.costs.step_time(len(self.heap))
        steps = min(int((t - self.clock) / tau + 1e-9), self.heap[0][0] - self.k)
        if steps <= 0:
            return []
        self.clock += steps * tau
        self.busy_s += steps * tau
        self.k += steps
        finished = []
        while self.heap and self.heap[0][0] <= self.k:
            seq = heapq.heappop(self.heap)[2]
            seq.left = 0
            finished.append(seq)
        return finished

    def join(self, seqs: list[_Seq], t: float) -> None:
        """New or resumed requests join at t and pay their prefill."""
        if not self.heap:
            self.clock = max(self.clock, t)
        prefill = self.costs.prefill_token_s * sum(s.prompt + s.done for s in seqs)
        self.clock += prefill
        self.busy_s += prefill
        for s in seqs:
            s.finish = self.k + s.left
            heapq.heappush(self.heap, (s.finish, next(self._tie), s))

    def next_finish(self) -> Optional[float]:
        if not self.heap:
            return None
        return self.clock + (self.heap[0][0] - self.k) * self.costs.step_time(len(self.heap))

    def interrupt(self) -> list[_Seq]:
        out = [item[2] for item in self.heap]
        for s in out:
            s.left = s.finish - self.k
        self.heap = []
        return out


def _group(work: Workload, index: int) -> tuple[str, list[_Seq]]:
    uid = f"e0-p{index}"
    return uid, [_Seq(uid, max(1, int(work.length(f"{uid}-s{j}"))), work.prompt_len) for j in range(work.n)]


# ----------------------------------------------------------------------------------- async
class _AsyncSim:
    def __init__(self, setup: AsyncSetup, costs: StageCosts, work: Workload):
        if setup.replicas < 1 or setup.trainer_devices < 1:
            raise ValueError(f"async needs >= 1 rollout replica and >= 1 trainer device (got {setup.replicas} "
                             f"replica(s), {setup.trainer_devices} trainer device(s))")
        if setup.required < 1 or work.n < 1 or work.steps < 1:
            raise ValueError("required groups, n and steps must be >= 1")
        self.s, self.c, self.w = setup, costs, work
        self.replicas = [_Replica(costs, max(setup.max_num_seqs, work.n)) for _ in range(setup.replicas)]
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
        # the real trainer's step and push rules (core/trainer_state.py)
        self.trainer = TrainerState(total_steps=work.steps, trigger=setup.trigger_parameter_sync_step)
        self.result = SimResult("async", 0, 0, 0.0)

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
        for s in finished:
            g = self.groups[s.uid]
            g[0] -= 1
            g[1] += s.prompt + s.length
            if g[0] == 0:
                del self.groups[s.uid]
                self.queue.append(g[1])

    # -- rollouter
    def _touch(self, i: int) -> None:
        """Replica i's free slots changed: index it for least-loaded routing (stale entries skipped later)."""
        heapq.heappush(self.free_heap, (-self.replicas[i].free(), i))

    def _admit(self, t: float) -> None:
        if self.syncing or self.draining:
            return
        n = self.w.n
        while True:
            if not self.bound.can_admit():
                self.bound.note_stop()
                return
            while self.free_heap and -self.free_heap[0][0] != self.replicas[self.free_heap[0][1]].free():
                heapq.heappop(self.free_heap)
            if not self.free_heap or -self.free_heap[0][0] < n:
                return
            i = self.free_heap[0][1]
            uid, seqs = _group(self.w, self.next_prompt)
            self.next_prompt += 1
            self._collect(i, t)
            self.replicas[i].join(seqs, t)
            self._touch(i)
            self.groups[uid] = [n, 0]
            self.bound.on_admit()
            self._schedule(i)

    # -- trainer
    def _try_train(self, t: float) -> None:
        if self.trainer_busy or self.syncing or self.draining or len(self.queue) < self.s.required:
            return
        taken, self.queue = self.queue[:self.s.required], self.queue[self.s.required:]
        self.result.tokens += sum(taken)
        self.result.step_tokens.append(sum(taken))
        self.result.trainer_wait_s += t - self._trainer_free_since
        self.trainer_busy = True
        self._push(t + self.c.train_time(sum(taken), self.s.trainer_devices), "trained")

    def _on_trained(self, t: float) -> None:
        self.trainer.step += 1
        if self.trainer.push_due():
            self.syncing = True
            if self.s.partial_rollout:
                self._interrupt(t)
                self._push(t + self.c.weight_sync_s, "synced")
            else:
                self.draining = True
                self._maybe_drained(t)
            return
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
            self._push(t + self.c.weight_sync_s, "synced")

    def _on_synced(self, t: float) -> None:
        self.syncing = False
        self.bound.on_version(self.bound.state.version + 1, in_flight=len(self.groups), queued=len(self.queue))
        parked, self.parked = self.parked, []
        for i, seqs in parked:
            self.replicas[i].join(seqs, t)
            self._touch(i)
            self._schedule(i)
        self._step_done(t)

    def _step_done(self, t: float) -> None:
        self.trainer_busy = False
        self.result.step_ends.append(t)
        self._trainer_free_since = t
        self._admit(t)
        self._try_train(t)

    def run(self) -> SimResult:
        self._trainer_free_since = 0.0
        self._admit(0.0)
        t = 0.0
        while not self.trainer.done() or self.syncing or self.draining:
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
            elif kind == "synced":
                self._on_synced(t)
            if self.trainer.done() and not self.syncing and not self.draining:
                break
        res = self.result
        res.steps, res.seconds = self.trainer.step, res.step_ends[-1]
        res.rollout_busy_s = sum(min(r.busy_s, res.seconds) for r in self.replicas)
        res.rollout_replica_s = res.seconds * len(self.replicas)
        res.bound_pauses = self.bound.state.pauses
        return res


def simulate_async(setup: AsyncSetup, costs: StageCosts, work: Workload) -> SimResult:
    """Tokens/s and idle ratios of an async run (module docstring for the model)."""
    return _AsyncSim(setup, costs, work).run()


# ----------------------------------------------------------------------------------- sync
def generate_time(groups: list[list[_Seq]], costs: StageCosts, slots: int) -> tuple[float, int]:
    """Seconds one engine needs to generate `groups` from an empty start (groups join as slots free up), and
    the tokens (prompt + response) it produced."""
    r = _Replica(costs, max(slots, max((len(g) for g in groups), default=1)))
    pending, t, tokens = list(groups), 0.0, 0
    while pending or r.heap:
        while pending and r.free() >= len(pending[0]):
            r.join(pending.pop(0), t)
        t = r.next_finish()
        for s in r.advance(t):
            tokens += s.prompt + s.length
    return max(t, r.clock), tokens


def simulate_sync(devices: int, train_batch_size: int, max_num_seqs: int, costs: StageCosts,
                  work: Workload) -> SimResult:
    """The colocated loop on `devices` devices: every rank generates its share, then all train."""
    if devices < 1 or train_batch_size < 1:
        raise ValueError(f"sync needs >= 1 device and train_batch_size >= 1 (got {devices}, {train_batch_size})")
    res = SimResult("sync", work.steps, 0, 0.0)
    t, prompt = 0.0, 0
    for _ in range(work.steps):
        groups = [_group(work, prompt + i)[1] for i in range(train_batch_size)]
        prompt += train_batch_size
        per_rank = [groups[k::devices] for k in range(devices)]   # contiguous shares differ only in order
        gens = [generate_time(share, costs, max_num_seqs) for share in per_rank if share]
        gen_s = max(g for g, _ in gens)
        tokens = sum(tok for _, tok in gens)
        step_s = gen_s + costs.train_time(tokens, devices) + costs.sync_step_s
        res.tokens += tokens
        res.step_tokens.append(tokens)
        res.trainer_wait_s += gen_s
        res.rollout_busy_s += sum(g for g, _ in gens)
        t += step_s
        res.step_ends.append(t)
    res.seconds = t
    res.rollout_replica_s = t * devices
    return res
