"""Rollout engines (layer 5); each implementation lives in its own file and is imported lazily."""
from __future__ import annotations

from typing import Any, Optional

from fully_async.core.config import num_seqs
from fully_async.rollout.engines.base import RolloutEngine


def build_engine(cfg: Any, device: Any, eos_token_ids: list[int], pad_token_id: int,
                 replica: int = 0) -> RolloutEngine:
    """Engine named by actor_rollout_ref.rollout.name; replica i of a pool samples with seed + i."""
    rollout = cfg.actor_rollout_ref.rollout
    seed = cfg.trainer.seed + replica
    hf_kwargs = dict(device=device, dtype=rollout.dtype, max_num_seqs=num_seqs(rollout),
                     eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, seed=seed,
                     trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                     max_model_len=rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
                     enforce_eager=rollout.enforce_eager, graph_batch_sizes=rollout.cudagraph_capture_sizes,
                     free_cache_engine=rollout.free_cache_engine, fused_decode=rollout.fused_decode,
                     keep_in_flight=rollout.pause_mode == "keep")
    if rollout.quantization is not None:  # only then: a user engine with HFEngine's older constructor still works
        hf_kwargs["quantization"] = rollout.quantization
    if ":" not in rollout.name:   # a size that cannot fit is refused here, naming its key, before any allocation
        from fully_async.rollout.engine_fit import check_engine_fit

        check_engine_fit(cfg, device)
    if ":" in rollout.name:  # a user engine "package.module:Class" with HFEngine's constructor
        import importlib

        module, _, cls_name = rollout.name.partition(":")
        return getattr(importlib.import_module(module), cls_name)(cfg.actor_rollout_ref.model.path, **hf_kwargs)
    if rollout.name == "hf":
        from fully_async.device_memory.policy import engine_memory_mode
        from fully_async.rollout.engines.hf_engine import HFEngine

        from fully_async.placement import placement_of

        job = cfg.multi_job.job_name or cfg.trainer.experiment_name
        auto = engine_memory_mode(cfg)[0] == "auto"
        # engines that sleep with responses in flight (their KV swapped to host memory through the trainer's turn,
        # placement/colocated.py) pin the swap's buffer at start-up (HFEngine.prepare_staging)
        return HFEngine(cfg.actor_rollout_ref.model.path, max_num_batched_tokens=rollout.max_num_batched_tokens,
                        chunked_prefill=rollout.enable_chunked_prefill,
                        keep_when_fits=auto, trainer_estimate_bytes=_trainer_estimate(cfg, device) if auto else None,
                        memory_tag=f"{job}/rollout{replica}", stage_swaps=placement_of(cfg).holds_through_turns, **hf_kwargs)
    if rollout.name == "vllm":
        from fully_async.rollout.engines.vllm_engine import VLLMEngine
        return VLLMEngine.from_config(cfg, device, eos_token_ids, seed=seed)
    raise ValueError(f"actor_rollout_ref.rollout.name={rollout.name!r} is not one of ['hf', 'vllm'] "
                     "or 'package.module:Class'")


def _trainer_estimate(cfg: Any, device: Any) -> Optional[float]:
    """The memory model's estimate of the trainer's peak per device (planner/memory_model.py trainer_estimate_bytes),
    which decides the first switch of free_cache_engine=true, for `device`'s memory (which decides an unset
    enable_gradient_checkpointing as the trainer decides it); None where the model's shape is not readable here."""
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import trainer_estimate_bytes

    shape = Shape.of_model(cfg)
    return None if shape is None else trainer_estimate_bytes(cfg, shape, device.total_memory())


__all__ = ["RolloutEngine", "build_engine"]
