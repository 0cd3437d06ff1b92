"""What every actor does first (layer 3): logging, config object, device, threads, tokenizer."""
from __future__ import annotations

import logging
import os
from typing import Any


def actor_init(cfg: Any, role: str) -> tuple[Any, Any]:
    """Rebuild the config from the plain dict Ray shipped, pick the device, pin CPU threads."""
    import torch
    from omegaconf import OmegaConf

    from fully_async.device import get_device

    logging.basicConfig(level=logging.INFO, format=f"[{role}] %(message)s", force=True)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    cfg = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    device = get_device(cfg.trainer.device)
    if device.is_accelerator:
        device.set_device(0)  # Ray exposes exactly this actor's devices, renumbered from 0
    else:
        # one core per actor: the rollouter and the trainer run side by side
        torch.set_num_threads(max(1, int(os.environ.get("FULLY_ASYNC_THREADS_PER_ACTOR", "1"))))
    torch.manual_seed(cfg.trainer.seed)
    return cfg, device


def build_tokenizer(cfg: Any) -> Any:
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    return AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
