"""Records that cross module and actor boundaries (layer 0: no internal imports, no ray).

Everything here is a plain dataclass of Python lists/scalars so it pickles cheaply through
Ray's object store and can be checkpointed as-is.  Per-token lists (`response_ids`,
`rollout_log_probs`, `versions`) always have equal length: one entry per generated token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class PromptRecord:
    """One row of a verl-format dataset after tokenisation."""

    index: int                      # row index in the dataset (stable across epochs)
    prompt_ids: list[int]           # tokenised prompt (chat template applied when the prompt is messages)
    data_source: str                # selects the reward function (gsm8k, arithmetic, ...)
    ground_truth: Any               # reward_model.ground_truth
    extra_info: dict = field(default_factory=dict)
    raw_prompt: str = ""            # the prompt text after the chat template (for logging)
    messages: Optional[list] = None  # the prompt's chat messages (None: a plain-string prompt); a reward model
    #                                  re-templates them (reward_model.model.input_tokenizer)


@dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                 # -1 disables top-k
    max_tokens: int = 16            # new tokens to generate for this request


@dataclass
class GenRequest:
    """One sequence to generate.  `prompt_ids` already includes any partial response to resume."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    group_id: str = ""              # the prompt group (an engine pool keeps a group on one replica)


@dataclass
class GenOutput:
    """What an engine returns for a request: finished, or cut short by `interrupt()`."""

    request_id: str
    token_ids: list[int]            # newly generated tokens (excludes prompt_ids)
    log_probs: list[float]          # behaviour log-prob of each token under the sampling weights
    versions: list[int]             # param version of the weights that produced each token
    finish_reason: str              # "stop" (EOS), "length" (max_tokens) or "abort" (interrupted)


@dataclass
class Sample:
    """One response of a group, with everything the trainer needs."""

    uid: str                        # group id (prompt index + epoch); shared by the n responses
    sample_id: str                  # unique per response; used to prove nothing is trained twice
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    versions: list[int]             # per response token
    finish_reason: str = "stop"
    reward: float = 0.0
    reward_extra: dict = field(default_factory=dict)
    data_source: str = ""
    ground_truth: Any = None        # its prompt's reward_model.ground_truth (trainer.rollout_data_dir's `gts`)
    num_interruptions: int = 0      # how often this response was cut by a weight update
    reward_baseline: Optional[float] = None  # remax: the reward of its prompt's greedy response
    rm_input_ids: Optional[list[int]] = None  # async with a reward model: its tokens, scored by the trainer
    # multi-turn tool rollouts: 1 on the tokens the policy generated, 0 on the tool answers appended between its
    # turns (no loss there; their rollout log-probs are 0); None: every response token is the policy's
    response_mask: Optional[list[int]] = None
    num_turns: int = 0                 # multi-turn: assistant turns + tool answers (verl's num_turns - 1); 0: single

    @property
    def param_version_start(self) -> int:
        return self.versions[0] if self.versions else -1

    @property
    def param_version_end(self) -> int:
        return self.versions[-1] if self.versions else -1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def verl_num_turns(self) -> int:
        """verl's num_turns of a multi-turn response (the user prompt, the assistant turns and the tool answers);
        0 for a single-turn one."""
        return self.num_turns + 1 if self.num_turns else 0


@dataclass
class SampleGroup:
    """The `rollout.n` responses to one prompt; the unit the queue and staleness bound count."""

    uid: str
    prompt_index: int
    epoch: int
    samples: list[Sample]
    admitted_version: int           # param version current when the prompt was admitted
