"""Rollout scheduler (layer 5: pure Python, no Ray, no torch): what to generate, when, and what is done.

The rollouter actor used to mix this logic with its Ray plumbing; here it stands alone so it can be
tested with a scripted fake engine.  It talks to an engine only through the `RolloutEngine` contract
(engines/base.py: submit / collect / num_in_flight / interrupt / update_weights, plus the optional
`keeps_in_flight`), so one engine, an engine pool of K replicas and a test fake are driven alike.

What it owns:
  * admission: a new prompt group (its `n` responses) is admitted while the engine has room
    (`max_in_flight` sequences) and the staleness bound allows (staleness.py);
  * bookkeeping: groups in flight (`groups`), responses in flight (`pending`), responses parked by
    an interrupt (`parked`), and the grouping of finished responses into complete prompt groups,
    which go to `on_complete` (the rollouter scores them and puts them in the queue);
  * weight updates (`apply_weights`): how in-flight work stops depends on the mode --
      keep   (partial_rollout and an engine that keeps requests, vLLM pause_mode=keep): the engine
             loads with requests in flight and continues them on the new weights;
      abort  (partial_rollout): interrupt, keep each response's tokens/log-probs/versions, resubmit
             prompt + partial after the load (partial.py);
      drain  (no partial rollout): finish everything on the old weights first --
    then the staleness bound moves to the new version, counting the groups still in flight or queued
    as carried over;
  * engines that leave (`take_back`, placement=elastic): what they held is parked and continues elsewhere;
  * snapshot / restore of everything not yet handed to `on_complete`, for checkpoints.
Nothing is dropped and nothing is generated twice: every admitted response is, at any time, in exactly
one of `pending` (in the engine or parked) or a completed group.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from fully_async.rollout.generation import group_pendings
from fully_async.core.partial import PendingResponse
from fully_async.core.types import GenOutput, PromptRecord, Sample, SamplingParams

if TYPE_CHECKING:   # typing only: this module stays free of torch (engines/base.py imports it)
    from fully_async.core.data import PromptStream
    from fully_async.core.staleness import StalenessManager
    from fully_async.core.workload import LengthProfile
    from fully_async.rollout.engines.base import VersionedEngine
    from fully_async.rollout.tools import ToolLoop

logger = logging.getLogger(__name__)


@dataclass
class GroupState:
    """A prompt group in flight: its finished responses so far."""

    record: PromptRecord
    epoch: int
    admitted_version: int
    done: list[Sample] = field(default_factory=list)


@dataclass
class CompletedGroup:
    """All `n` responses of a prompt, unscored (the rollouter scores them)."""

    uid: str
    record: PromptRecord
    epoch: int
    admitted_version: int
    samples: list[Sample]


class RolloutScheduler:
    def __init__(self, engine: VersionedEngine, stream: PromptStream, staleness: StalenessManager, n: int,
                 params: SamplingParams, max_in_flight: int, partial_rollout: bool,
                 on_complete: Callable[[list[CompletedGroup]], None], lengths: Optional[LengthProfile] = None,
                 baseline: bool = False, tools: Optional[ToolLoop] = None):
        self.engine = engine
        self.stream = stream              # data.PromptStream: next() -> (epoch, record), exhausted
        self.staleness = staleness        # staleness.StalenessManager
        self.n = n
        self.baseline = baseline          # remax: each group also generates one greedy baseline response
        self.size = n + (1 if baseline else 0)   # responses generated per group
        self.params = params
        self.max_in_flight = max_in_flight
        self.partial_rollout = partial_rollout
        self.on_complete = on_complete
        self.lengths = lengths            # workload.LengthProfile (benchmarks) or None
        # groups the run still wants completed (dynamic sampling: kept ones; None: every prompt the stream has)
        self.demand: Optional[Callable[[], int]] = None
        self.groups: dict[str, GroupState] = {}
        self.pending: dict[str, PendingResponse] = {}
        self.parked: list[PendingResponse] = []
        # multi-turn (rollout/tools.py): responses between two turns, their tools running (futures of the tokens
        # to append); they are in `pending` but in neither the engine nor `parked`
        self.tools = tools
        self.tooling: dict[str, tuple[PendingResponse, Any]] = {}
        self.stats = {"generated_samples": 0, "interrupted_samples": 0, "bound_pauses": 0,
                      "staleness_samples": 0, "engine_steps": 0}
        # pauses at the staleness bound, summed over the current param version (one log line per version)
        self._pauses = {"count": 0, "seconds": 0.0, "since": None, "reason": ""}

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def exhausted(self) -> bool:
        """Every prompt was admitted and every group completed."""
        return self.drawn_out() and not self.groups

    def drawn_out(self) -> bool:
        """No prompt is admitted any more: the stream has none left, or the groups in flight are all the run still
        wants (`demand`)."""
        return self.stream.exhausted or (self.demand is not None and self.demand() <= len(self.groups))

    def in_flight(self) -> int:
        """Responses being generated: inside the engine or between two turns, their tools running (parked ones
        excluded)."""
        return self.engine.num_in_flight() + len(self.tooling)

    def at_bound(self) -> bool:
        return not self.staleness.can_admit()

    # ------------------------------------------------------------------ generation
    def admit(self) -> int:
        """Admit prompt groups while the engine has room and the staleness bound allows; returns how many."""
        admitted = 0
        room = max(self.max_in_flight, self.size)
        while self.engine.num_in_flight() + self.size <= room and not self.drawn_out():
            if not self.staleness.can_admit():
                if self.staleness.note_stop():
                    self.stats["bound_pauses"] = self.staleness.state.pauses
                    self._pauses["count"] += 1
                    self._pauses["since"] = time.perf_counter()
                    self._pauses["reason"] = self.staleness.pause_reason()
                break
            self._pause_ended()
            item = self.stream.next()
            if item is None:
                break
            epoch, record = item
            uid = f"e{epoch}-p{record.index}"
            self.groups[uid] = GroupState(record, epoch, self.engine.version)
            pends = group_pendings(uid, record, self.n, self.params, self.lengths, self.baseline)
            self.pending.update((p.sample_id, p) for p in pends)
            self.engine.submit([p.request() for p in pends])
            self.staleness.on_admit()
            admitted += 1
        self.stats["staleness_samples"] = self.staleness.state.admitted
        return admitted

    def _pause_ended(self) -> None:
        since = self._pauses["since"]
        if since is not None:
            self._pauses["seconds"] += time.perf_counter() - since
            self._pauses["since"] = None

    def log_pauses(self) -> None:
        """One debug line for the param version ending now, if the staleness bound paused admission in it: how many
        pauses, how long in all, and why (the last reason).  Called at every weight update and at the end.  Debug:
        pausing at the bound is async mode's normal operation; the run's count is in the end-of-run summary
        (metric fully_async/rollouter/bound_pauses)."""
        self._pause_ended()
        p = self._pauses
        if p["count"]:
            logger.debug("rollouter paused %d time(s), %.1fs in all, at param version %d: %s", p["count"],
                        p["seconds"], self.staleness.state.version, p["reason"])
        self._pauses = {"count": 0, "seconds": 0.0, "since": None, "reason": ""}

    def step(self, timeout_s: float = 0.05) -> int:
        """One engine collect; finished groups go to on_complete, responses whose tools answered go back to the
        engine.  Returns the outputs handled."""
        outputs = self.engine.collect(timeout_s)
        self.stats["engine_steps"] += 1
        self.handle(outputs)
        if self.tooling:
            self.handle_tools(wait_s=0.0 if self.engine.num_in_flight() else timeout_s)
        return len(outputs)

    def handle_tools(self, wait_s: float = 0.0, park: bool = False) -> None:
        """Responses whose tool step finished (waiting up to `wait_s` for one; with `park`, for all): their
        answers appended, they continue in the engine (or in `parked`), or end and complete their group."""
        import concurrent.futures

        futures = [f for _, f in self.tooling.values()]
        if park:
            concurrent.futures.wait(futures)
        elif wait_s > 0:
            concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        resubmit, complete = self.tools.settle(self.tooling)
        if park:
            self.parked += resubmit
        elif resubmit:
            self.engine.submit([p.request() for p in resubmit])
        self._complete(complete)

    def handle(self, outputs: list[GenOutput]) -> None:
        """Fold engine outputs into their responses; aborted ones are parked, ones that call tools wait for
        them, complete groups are emitted."""
        finished = []
        for out in outputs:
            pend = self.pending.get(out.request_id)
            if pend is None:
                raise RuntimeError(f"the engine returned request {out.request_id!r}, which is not in flight")
            if not pend.extend(out):
                self.parked.append(pend)
                continue
            if self.tools is None or not self.tools.after_turn(pend, self.tooling):
                finished.append(pend)
        self._complete(finished)

    def _complete(self, finished: list[PendingResponse]) -> None:
        complete: list[CompletedGroup] = []
        for pend in finished:
            del self.pending[pend.sample_id]
            group = self.groups[pend.uid]
            group.done.append(pend.to_sample())
            if len(group.done) == self.size:
                del self.groups[pend.uid]
                complete.append(CompletedGroup(pend.uid, group.record, group.epoch, group.admitted_version,
                                               group.done))
        if complete:
            self.stats["generated_samples"] += self.size * len(complete)
            self.on_complete(complete)

    # ------------------------------------------------------------------ interrupt / resume
    def park(self) -> int:
        """Interrupt everything in the engine; partial responses wait in `parked`, those between two turns once
        their tools answered.  Returns how many."""
        before = len(self.parked)
        if self.engine.num_in_flight():
            self.handle(self.engine.interrupt())
        if self.tooling:
            self.handle_tools(park=True)
        return len(self.parked) - before

    def resume(self) -> int:
        """Resubmit parked responses (prompt + partial response as the prefix)."""
        parked, self.parked = self.parked, []
        if parked:
            self.engine.submit([p.request() for p in parked])
        return len(parked)

    def take_back(self, outputs: list[GenOutput], resume: bool) -> int:
        """Outputs handed back by engines that left (placement=elastic: the trainer's engines, reclaimed for its
        step): finished ones complete their groups, partial ones are parked -- tokens, behaviour log-probs and
        per-token versions kept, as at a weight update -- and, with `resume`, continue on the engines that remain.
        Returns how many were parked."""
        before = len(self.parked)
        self.handle(outputs)
        parked = len(self.parked) - before
        self.stats["interrupted_samples"] += parked
        if resume:
            self.resume()
        return parked

    def drain(self) -> None:
        """Generate until the engine holds nothing and no tool runs (finishes in-flight work on the current
        weights)."""
        while self.engine.num_in_flight() or self.tooling:
            self.step()

    def apply_weights(self, load: Callable[[], Any], version: int, queued: Callable[[], int],
                      before_resume: Optional[Callable[[], Any]] = None) -> dict[str, float]:
        """Stop in-flight work as the mode says, `load()` the new weights, move the bound, resume.

        `queued()` counts groups waiting in the trainer's queue (carried over to the new version);
        `before_resume()` runs on the new weights while the partial responses are still parked (the
        rollouter validates there).  Returns the timings of the phases (pause / load / resume)."""
        t0 = time.perf_counter()
        keep = self.partial_rollout and getattr(self.engine, "keeps_in_flight", False)
        if keep:
            pass  # the engine continues its requests on the new weights inside load()
        elif self.partial_rollout:
            self.stats["interrupted_samples"] += self.park()
        else:
            self.drain()
        t1 = time.perf_counter()
        load()
        t2 = time.perf_counter()
        self.log_pauses()  # the version that ends now
        self.staleness.on_version(version, in_flight=len(self.groups), queued=queued())
        timings = {"pause": t1 - t0, "load": t2 - t1}
        if keep:
            timings.update(getattr(self.engine, "last_update_timings", {}) or {})
        if before_resume is not None:
            before_resume()
        t3 = time.perf_counter()
        self.resume()
        timings["resume"] = time.perf_counter() - t3
        return timings

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Everything not yet completed (call after park(): partial responses are then complete records)."""
        if self.tooling:
            raise RuntimeError(f"{len(self.tooling)} responses wait for their tools: park() before state_dict()")
        return {
            "stream": self.stream.state_dict(),
            "staleness": self.staleness.state_dict(),
            "groups": {uid: (g.record, g.epoch, g.admitted_version, list(g.done)) for uid, g in self.groups.items()},
            "pending": list(self.pending.values()),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where a snapshot left off; every pending response is parked until resume()."""
        self.stream.load_state_dict(state["stream"])
        self.staleness.load_state_dict(state["staleness"])
        self.groups = {uid: GroupState(rec, epoch, version, list(done))
                       for uid, (rec, epoch, version, done) in state["groups"].items()}
        self.pending = {p.sample_id: p for p in state["pending"]}
        self.parked = list(self.pending.values())
