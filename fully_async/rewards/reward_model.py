"""What a reward model reads for a response (reward_model.enable; verl's RewardModelWorker._switch_chat_template).

With `reward_model.model.input_tokenizer` set (verl's default: the policy's model path) the response is decoded
with the policy's tokenizer, its EOS text removed, appended to the prompt's chat messages as the assistant's turn
and rendered with the reward model's own chat template (no generation prompt), then tokenised with the reward
model's tokenizer and cut to `reward_model.max_length` tokens from the left (verl truncates on the right).  With
`input_tokenizer=null` the reward model reads the policy's token ids as they are (prompt + response).  The scores
themselves come from the trainer's backend (train/backends/reward_model.py): the model's output at the last token.
"""
from __future__ import annotations

from typing import Any, Optional

from fully_async.core.types import PromptRecord, Sample


class RewardModelInputs:
    def __init__(self, cfg: Any, policy_tokenizer: Any):
        rm = cfg.reward_model
        self.policy = policy_tokenizer
        self.max_length: Optional[int] = rm.max_length
        self.tokenizer: Optional[Any] = None     # the reward model's, when responses are re-templated
        if rm.model.input_tokenizer is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code)

    def ids(self, record: PromptRecord, sample: Sample) -> list[int]:
        """The reward model's input tokens for `sample`, a response to `record`."""
        if self.tokenizer is None:
            ids = list(record.prompt_ids) + list(sample.response_ids)
        else:
            if record.messages is None:
                raise ValueError(f"prompt {record.index} is a plain string, but reward_model.model.input_tokenizer "
                                 "re-templates chat messages: set reward_model.model.input_tokenizer=null")
            response = self.policy.decode(sample.response_ids)
            eos = getattr(self.policy, "eos_token", None)
            if eos:
                response = response.replace(eos, "")
            chat = list(record.messages) + [{"role": "assistant", "content": response}]
            text = self.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids[:self.max_length] if self.max_length else ids
