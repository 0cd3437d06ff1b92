"""Simulation of colocated async (async_training.placement=colocated; layer 1: pure Python, no torch).

Every one of the N devices holds an engine replica and a trainer rank that take turns, as in sync mode; what
differs from sync is that generation never waits for the tail:

  generate  parked responses resume first, on the replica that parked them: over the cache they kept where the
            engines hold what is in flight through a switch (the embedded engine, or any while resident), paying
            their prefill again where they do not or where a weight update aborted them since; then
            groups are admitted under the staleness bound (the StalenessManager itself, carry-over counted:
            at most required x (1 + staleness_threshold) x trigger_parameter_sync_step groups per param
            version), each whole to the replica with the most room.  The phase ends the moment `required`
            groups are complete; when the queue already holds them at the start, there is no phase.
  park      every unfinished response is parked with its tokens (counted in `interrupted`).
  switch    engines sleep, the trainer onloads, the engines wake: turn_switch_s (sync's per-step switch without its
            weight load: colocated loads weights only at an update; the scoring stays, the rollouter's time either way),
            plus swap_s where the engines free at a switch (the KV of the responses in flight out and back)
            (charged every step).
  update    at the steps that push (every trigger_parameter_sync_step-th): weight_sync_s, the trainer's push and
            the engines' load, one after the other on the same devices; with pause_mode=abort the parked responses
            will resume from prompt + partial response (prefilled again), with keep over their cache.
  train     `required` groups on N trainer devices; the trainer's push rule (core/trainer_state.TrainerState)
            decides when a param version ends, and the bound moves to it with the parked groups and the
            queued ones carried over.

With staleness_threshold = 0 the bound admits exactly one step's groups per version, so every phase waits for all
of them: the schedule is sync's (plus the parked tails of nothing).  The looser the bound, the more groups run
ahead and the sooner `required` of them are complete.
"""
from __future__ import annotations

from fully_async.core.staleness import StalenessManager
from fully_async.core.trainer_state import TrainerState
from fully_async.planner.sim_engine import (AsyncSetup, SimResult, StageCosts, Workload, _group, _Replica, _Seq,
                                            fold_finished)


class _ColocatedSim:
    def __init__(self, devices: int, setup: AsyncSetup, costs: StageCosts, work: Workload):
        if devices < 1 or setup.required < 1 or work.n < 1 or work.steps < 1:
            raise ValueError(f"colocated async needs >= 1 device, required groups, n and steps >= 1 (got {devices} "
                             f"device(s), required {setup.required}, n {work.n}, steps {work.steps})")
        self.n_dev, self.s, self.c, self.w = devices, setup, costs, work
        self.replicas = [_Replica(costs, max(setup.max_num_seqs, work.n)) for _ in range(devices)]
        self.bound = StalenessManager(setup.required, 1, setup.staleness_threshold, setup.trigger_parameter_sync_step)
        self.trainer = TrainerState(total_steps=work.steps, trigger=setup.trigger_parameter_sync_step)
        self.groups: dict[str, list] = {}       # uid -> [responses left, tokens so far]
        self.queue: list[int] = []              # tokens of each complete group, in completion order
        self.parked: list[tuple[int, list[_Seq]]] = []
        self.reprefill = not setup.holds_in_flight   # the parked pay their prefix again when they resume
        self.next_prompt = 0
        self.result = SimResult("colocated", 0, 0, 0.0)

    def _collect(self, i: int, t: float) -> None:
        fold_finished(self.replicas[i].advance(t), self.groups, self.queue)

    def _admit(self, t: float) -> None:
        n = self.w.n
        while True:
            if not self.bound.can_admit():
                self.bound.note_stop()
                return
            i = max(range(self.n_dev), key=lambda k: self.replicas[k].free())
            if self.replicas[i].free() < n:
                return
            uid, seqs = _group(self.w, self.next_prompt)
            self.next_prompt += 1
            self._collect(i, t)
            self.replicas[i].join(seqs, t)
            self.groups[uid] = [n, 0]
            self.bound.on_admit()
            self.result.max_admitted = max(self.result.max_admitted, self.bound.state.admitted)

    def _generate(self, t: float) -> float:
        """One generation phase from t; returns when `required` groups are complete (t when they already are)."""
        if len(self.queue) >= self.s.required:
            return t
        for i, seqs in self.parked:
            self.replicas[i].join(seqs, t, prefill=self.reprefill)
        self.parked, self.reprefill = [], not self.s.holds_in_flight
        self._admit(t)
        while len(self.queue) < self.s.required:
            nxt = [(r.next_finish(), i) for i, r in enumerate(self.replicas) if r.heap]
            if not nxt:
                raise RuntimeError("colocated simulation stalled: nothing in flight and fewer than required groups "
                                   "complete (staleness bound below one step?)")
            t, i = min(nxt)
            self._collect(i, t)
            self._admit(t)
        for i, r in enumerate(self.replicas):   # park the unfinished responses, tokens kept
            self._collect(i, t)
            seqs = r.interrupt()
            if seqs:
                self.result.interrupted += len(seqs)
                self.parked.append((i, seqs))
        return t

    def run(self) -> SimResult:
        res, t = self.result, 0.0
        while not self.trainer.done():
            start = t
            t = self._generate(t)
            res.trainer_wait_s += t - start
            taken, self.queue = self.queue[:self.s.required], self.queue[self.s.required:]
            tokens = sum(taken)
            train = self.c.train_time(tokens, self.n_dev, first=self.trainer.step == 0)
            t += self.c.turn_switch_s + self.c.swap_s + train
            res.switch_s += self.c.turn_switch_s + self.c.swap_s
            res.train_s += train
            res.tokens += tokens
            res.step_tokens.append(tokens)
            res.step_ends.append(t)
            self.trainer.step += 1
            if self.trainer.push_due():
                t += self.c.weight_sync_s
                res.switch_s += self.c.weight_sync_s
                self.trainer.bump_version()
                self.reprefill = self.reprefill or self.s.pause_mode == "abort"
                self.bound.on_version(self.trainer.version, in_flight=len(self.groups), queued=len(self.queue))
                res.max_admitted = max(res.max_admitted, self.bound.state.admitted)
        res.steps, res.seconds = self.trainer.step, t
        res.rollout_busy_s = sum(min(r.busy_s, t) for r in self.replicas)
        res.rollout_replica_s = t * self.n_dev
        res.bound_pauses = self.bound.state.pauses
        return res


def simulate_colocated(devices: int, setup: AsyncSetup, costs: StageCosts, work: Workload) -> SimResult:
    """Colocated async on `devices` devices (module docstring); setup.replicas and trainer_devices are ignored
    (every device is both), its required groups, slots, staleness and trigger apply."""
    return _ColocatedSim(devices, setup, costs, work).run()
