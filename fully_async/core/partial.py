"""Partial rollouts (layer 0): a response that may be cut by weight updates and resumed.

At a weight update the engine returns what each in-flight request produced so far.  We keep
those tokens, their behaviour log-probs and the version that produced each one, and resume the
request with `prompt + partial response` as its prefix and the remaining token budget.  The
final response is the concatenation, so per-token versions tell exactly which weights produced
which token, and `max_partial_span` (last version - first version) measures the mix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fully_async.core.types import GenOutput, GenRequest, Sample, SamplingParams


@dataclass
class PendingResponse:
    uid: str                        # group id
    sample_id: str                  # unique id of this response
    prompt_ids: list[int]
    params: SamplingParams          # max_tokens is the budget of the whole response
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_interruptions: int = 0
    finish_reason: str = ""
    # benchmark-only synthetic EOS (fully_async.core.workload): the response ends with finish_reason "stop"
    # after this many tokens when that is below params.max_tokens; None: only the engine decides
    target_len: Optional[int] = None
    # multi-turn tool rollouts (rollout/tools.py): 0 on appended tool answers (empty: all generated), where the
    # current assistant turn starts in token_ids, and the turns so far
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0
    assistant_turns: int = 0
    user_turns: int = 0

    @property
    def budget(self) -> int:
        """Tokens this response may have in total (max_tokens, or the synthetic length when shorter)."""
        if self.target_len is None:
            return self.params.max_tokens
        return min(self.params.max_tokens, self.target_len)

    def request(self) -> GenRequest:
        """The request that (re)starts generation from prompt + what is already generated."""
        remaining = self.budget - len(self.token_ids)
        params = SamplingParams(self.params.temperature, self.params.top_p, self.params.top_k, remaining)
        return GenRequest(self.sample_id, self.prompt_ids + self.token_ids, params, group_id=self.uid)

    def extend(self, out: GenOutput) -> bool:
        """Append an engine output; returns True when the response is complete."""
        if out.request_id != self.sample_id:
            raise ValueError(f"output {out.request_id} does not belong to {self.sample_id}")
        if not (len(out.token_ids) == len(out.log_probs) == len(out.versions)):
            raise ValueError(f"output {out.request_id}: tokens, log-probs and versions differ in length")
        self.token_ids += out.token_ids
        self.log_probs += out.log_probs
        self.versions += out.versions
        if self.mask:
            self.mask += [1] * len(out.token_ids)
        if out.finish_reason == "abort":
            self.num_interruptions += 1
            if len(self.token_ids) < self.budget:
                return False
            self.finish_reason = self._budget_reason()  # cut exactly at the budget: nothing left to resume
            return True
        self.finish_reason = self._budget_reason() if out.finish_reason == "length" else out.finish_reason
        return True

    def observe(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not generate (a tool's answer in the chat template): outside the loss (mask
        0), log-prob 0, stamped with the version of the token before them; the next assistant turn starts after."""
        if not self.mask:
            self.mask = [1] * len(self.token_ids)
        version = self.versions[-1] if self.versions else 0
        self.token_ids += token_ids
        self.log_probs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.mask += [0] * len(token_ids)
        self.turn_start = len(self.token_ids)
        self.user_turns += 1
        self.finish_reason = ""

    def _budget_reason(self) -> str:
        """'length' at max_tokens; 'stop' at a synthetic length below it (it stands for an EOS)."""
        return "length" if len(self.token_ids) >= self.params.max_tokens else "stop"

    def to_sample(self) -> Sample:
        return Sample(uid=self.uid, sample_id=self.sample_id, prompt_ids=list(self.prompt_ids),
                      response_ids=list(self.token_ids), rollout_log_probs=list(self.log_probs),
                      versions=list(self.versions), finish_reason=self.finish_reason,
                      num_interruptions=self.num_interruptions,
                      response_mask=list(self.mask) if 0 in self.mask else None,
                      num_turns=self.assistant_turns + self.user_turns)
