"""Everything the driver checks and loads before Ray starts (layer 4 helper).

Fail fast and cheaply: config rules, files, tokenizer, dataset (tokenised once here, then
shipped to the rollouter), derived step counts.  Nothing here touches a device.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from fully_async.config import ConfigError, as_file_list, validate, validate_with_data
from fully_async.types import PromptRecord

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    cfg_dict: dict                 # resolved plain config shipped to the actors
    train: list[PromptRecord]
    val: list[PromptRecord]
    total_prompts: int             # prompts the rollouter generates
    total_steps: int               # trainer steps
    eos_token_ids: list[int]
    pad_token_id: int


def eos_ids(tokenizer: Any, model_path: str) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    except (OSError, ValueError):
        pass
    if not ids:
        raise ConfigError("actor_rollout_ref.model.path",
                          f"the tokenizer at {model_path} defines no eos_token: responses could never stop")
    return sorted(ids)


def prepare(cfg: Any) -> Prepared:
    from omegaconf import OmegaConf

    from fully_async.actor_setup import build_tokenizer
    from fully_async.data import load_prompts

    validate(cfg)
    tokenizer = build_tokenizer(cfg)
    data = cfg.data
    kwargs = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                  truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                  reward_fn_key=data.reward_fn_key)
    train = load_prompts(as_file_list(data.train_files), tokenizer, **kwargs)
    val = load_prompts(as_file_list(data.val_files), tokenizer, **kwargs) if data.val_files else []
    validate_with_data(cfg, len(train))

    at = cfg.async_training
    required = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * at.require_batches
    if cfg.mode == "sync":
        required = cfg.data.train_batch_size  # prompts per step
    total_prompts = cfg.rollout.total_rollout_steps or cfg.trainer.total_epochs * len(train)
    if cfg.trainer.total_training_steps is not None:
        total_steps = cfg.trainer.total_training_steps
        total_prompts = min(total_prompts, total_steps * required) if not cfg.rollout.total_rollout_steps \
            else total_prompts
    else:
        total_steps = max(1, math.ceil(total_prompts / required))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict["rollout"]["total_rollout_steps"] = total_prompts
    cfg_dict["trainer"]["total_training_steps"] = total_steps
    logger.info("data: %d train prompts, %d val prompts; %d prompts to generate, %d trainer steps of %d groups",
                len(train), len(val), total_prompts, total_steps, required)
    return Prepared(cfg_dict, train, val, total_prompts, total_steps, eos_ids(tokenizer, cfg.actor_rollout_ref.model.path),
                    int(pad))
