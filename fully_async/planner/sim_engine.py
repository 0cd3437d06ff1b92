"""The simulator's building blocks (layer 1: pure Python, no torch): stage costs, the workload, the result record
and one continuously batching engine replica.  pipeline_sim.py (sync, split and elastic async) and colocated_sim.py
(colocated async) run their schedules on them, so every mode pays for a decode step, a prefill and a trainer step
the same way and their results compare.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

EPS = 1e-12


def data_parallel_speedup(devices: int, efficiency: float) -> float:
    """How many one-device trainers `devices` data-parallel trainer devices are worth: each doubling of the devices
    keeps `efficiency` of the per-device rate, devices x efficiency^log2(devices) (2 devices: 2e, 4: 4e^2).
    Why per doubling: at the 0.5B shape on H200 with the per-device batch held (fsdp2), the update cost 5.4 / 6.6-7.2
    / 8.8 us per device and token at 1 / 2 / 4 devices (docs/measurements/seed_4gpu_h200), ~0.78 kept at each
    doubling; one efficiency for every count >1 priced 4 devices as 2 (0.9: one device 7.8 us against 5.4 measured)."""
    return devices * efficiency ** math.log2(devices) if devices > 1 else float(max(devices, 0))


@dataclass(frozen=True)
class StageCosts:
    """What one device costs per unit of work (seconds); measured (bench_pipeline / run logs) or estimated."""

    decode_step_s: float            # fixed seconds of one decode step of a replica (launch / weight read bound)
    train_token_s: float            # seconds per trained token on ONE trainer device (fwd + bwd + optimizer)
    decode_seq_s: float = 0.0       # extra seconds of a decode step per sequence in flight
    decode_kv_token_s: float = 0.0  # extra seconds of a decode step per cached token its sequences attend over
    prefill_token_s: float = 0.0    # seconds per prefilled token (new requests, resumed partial prefixes)
    train_step_s: float = 0.0       # fixed seconds per trainer step (batch assembly, optimizer launch, ...)
    weight_sync_s: float = 0.0      # async: one weight update (trainer push + engines load; both stall)
    weight_load_s: float = 0.0      # split / elastic async: the engines' load after a push that does not wait for it
    #                                 (object store): they generate again only after it, the trainer goes on
    sync_step_s: float = 0.0        # sync mode: per-step switch (engine sleep/wake + local weight load)
    swap_s: float = 0.0             # colocated async: a freeing switch's KV swap of the responses in flight (out + in)
    turn_switch_s: float = 0.0      # colocated async: a turn switch (engines sleep, the trainer onloads, and back)
    #                                 and the step's scoring; sync's per-step switch is this plus its weight load
    dp_efficiency: float = 1.0      # data-parallel scaling kept per doubling of trainer devices, in (0, 1]
    first_train_s: float = 0.0      # extra seconds of the trainer's first step (its compiling): 0 for the planner's
    #                                 steady recommendation; a prediction of a whole measured run adds it
    source: str = ""                # where the numbers came from (printed with the prediction)

    def __post_init__(self) -> None:
        for name in ("decode_step_s", "train_token_s", "decode_seq_s", "decode_kv_token_s", "prefill_token_s",
                     "train_step_s", "weight_sync_s", "weight_load_s", "sync_step_s", "swap_s", "turn_switch_s",
                     "first_train_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"stage cost {name}={value!r} must be a number >= 0")
        if self.decode_step_s + self.decode_seq_s <= 0.0:
            raise ValueError("stage costs: a decode step must cost something (decode_step_s + decode_seq_s > 0)")
        if not 0.0 < self.dp_efficiency <= 1.0:
            raise ValueError(f"stage cost dp_efficiency={self.dp_efficiency!r} must be in (0, 1]")

    def step_time(self, in_flight: int, cached: float = 0.0) -> float:
        """One decode step of `in_flight` sequences holding `cached` tokens between them."""
        return self.decode_step_s + self.decode_seq_s * in_flight + self.decode_kv_token_s * cached

    def steps_time(self, steps: int, in_flight: int, cached: float) -> float:
        """`steps` decode steps of `in_flight` sequences from `cached` tokens: each step caches one more per sequence,
        so the cached tokens grow by in_flight a step."""
        return steps * self.step_time(in_flight, cached) + self.decode_kv_token_s * in_flight * steps * (steps - 1) / 2

    def steps_within(self, seconds: float, in_flight: int, cached: float, most: int) -> int:
        """The most whole decode steps (at most `most`) that fit in `seconds` (steps_time inverted)."""
        if seconds <= 0 or most <= 0:
            return 0
        a, half = self.step_time(in_flight, cached), self.decode_kv_token_s * in_flight / 2
        if half > 0:   # half s^2 + (a - half) s <= seconds
            b = a - half
            guess = int((-b + math.sqrt(b * b + 4 * half * seconds)) / (2 * half))
        else:
            guess = int(seconds / a)
        steps = max(0, min(most, guess))
        slack = seconds * (1 + 1e-9) + EPS
        while steps < most and self.steps_time(steps + 1, in_flight, cached) <= slack:
            steps += 1
        while steps > 0 and self.steps_time(steps, in_flight, cached) > slack:
            steps -= 1
        return steps

    def train_time(self, tokens: int, devices: int, first: bool = False) -> float:
        """One trainer step of `tokens` on `devices`; `first`: the run's first step, which also compiles."""
        compiling = self.first_train_s if first else 0.0
        return compiling + self.train_step_s + tokens * self.train_token_s / data_parallel_speedup(
            devices, self.dp_efficiency)

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
    elastic_replicas: int = 0       # elastic: engine replicas on the trainer's devices (generate while it waits)
    pause_mode: str = "abort"       # a weight update's responses in flight: abort (resume, prefix prefilled again)
    #                                 or keep (they continue on the new weights over their cache)
    holds_in_flight: bool = True    # colocated: the engines keep what is in flight through a turn switch (the
    #                                 embedded engine swaps its KV; vLLM only while resident): no prefill again

    def __post_init__(self) -> None:
        if self.pause_mode not in ("abort", "keep"):
            raise ValueError(f"AsyncSetup.pause_mode={self.pause_mode!r} must be 'abort' or 'keep'")


@dataclass
class SimResult:
    mode: str
    steps: int
    tokens: int
    seconds: float
    step_ends: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    trainer_wait_s: float = 0.0     # async: trainer waiting for groups; sync / colocated: generation time
    rollout_busy_s: float = 0.0     # replica-seconds with at least one sequence in flight (rollout replicas; sync
    #                                 and colocated: every engine)
    rollout_replica_s: float = 0.0  # replicas x seconds
    interrupted: int = 0            # responses interrupted by weight updates (partial rollout) or parked
    bound_pauses: int = 0           # times the staleness bound stopped admission
    train_s: float = 0.0            # seconds the trainer computed (steps' train_time)
    switch_s: float = 0.0           # sync / colocated: per-step switches; elastic: pre-empting the trainer's engines
    trainer_engines: int = 0        # elastic: engine replicas on the trainer's devices
    trainer_engine_busy_s: float = 0.0  # elastic: their replica-seconds with a sequence in flight
    max_admitted: int = 0           # most groups ever counted against one param version (carry-over included)

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
        """Share of the run the trainer waits for groups; elastic: minus the time its own engines generated (the
        trainer's devices idle); sync / colocated: the generation phase's share (the devices generate then)."""
        if self.seconds <= 0:
            return float("nan")
        own = self.trainer_engine_busy_s / self.trainer_engines if self.trainer_engines else 0.0
        return max(0.0, self.trainer_wait_s - own) / self.seconds

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
                "interrupted_responses": self.interrupted, "staleness_bound_pauses": self.bound_pauses,
                "generate_s_per_step": self.trainer_wait_s / self.steps if self.steps else float("nan"),
                "train_s_per_step": self.train_s / self.steps if self.steps else float("nan"),
                "switch_s_per_step": self.switch_s / self.steps if self.steps else float("nan"),
                "max_admitted_per_version": self.max_admitted}


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
        self.cached = 0             # tokens cached by the sequences in flight (prompt + tokens generated so far)
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
        n = len(self.heap)
        steps = self.costs.steps_within(t - self.clock, n, self.cached, self.heap[0][0] - self.k)
        if steps <= 0:
            return []
        spent = self.costs.steps_time(steps, n, self.cached)
        self.clock += spent
        self.busy_s += spent
        self.k += steps
        self.cached += n * steps
        finished = []
        while self.heap and self.heap[0][0] <= self.k:
            seq = heapq.heappop(self.heap)[2]
            seq.left = 0
            self.cached -= seq.prompt + seq.length
            finished.append(seq)
        return finished

    def join(self, seqs: list[_Seq], t: float, prefill: bool = True) -> None:
        """New or resumed requests join at t; with `prefill` they pay it (prompt + the tokens they have), without
        it they resume over the cache they kept (held through a turn switch)."""
        if not self.heap:
            self.clock = max(self.clock, t)
        cost = self.costs.prefill_token_s * sum(s.prompt + s.done for s in seqs) if prefill else 0.0
        self.clock += cost
        self.busy_s += cost
        for s in seqs:
            s.finish = self.k + s.left
            self.cached += s.prompt + s.done
            heapq.heappush(self.heap, (s.finish, next(self._tie), s))

    def next_finish(self) -> Optional[float]:
        if not self.heap:
            return None
        return self.clock + self.costs.steps_time(self.heap[0][0] - self.k, len(self.heap), self.cached)

    def interrupt(self) -> list[_Seq]:
        out = [item[2] for item in self.heap]
        for s in out:
            s.left = s.finish - self.k
        self.heap = []
        self.cached = 0
        return out


def fold_finished(finished: list[_Seq], groups: dict[str, list], queue: list[int]) -> None:
    """Count finished responses against their groups ([responses left, tokens so far] by uid); a group whose last
    response finished leaves `groups` and its tokens join `queue` (the trainer's queue, in completion order)."""
    for s in finished:
        g = groups[s.uid]
        g[0] -= 1
        g[1] += s.prompt + s.length
        if g[0] == 0:
            del groups[s.uid]
            queue.append(g[1])


def _group(work: Workload, index: int) -> tuple[str, list[_Seq]]:
    uid = f"e0-p{index}"
    return uid, [_Seq(uid, max(1, int(work.length(f"{uid}-s{j}"))), work.prompt_len) for j in range(work.n)]



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
