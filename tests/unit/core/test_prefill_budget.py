"""actor_rollout_ref.rollout.max_num_batched_tokens / enable_chunked_prefill before anything starts: vLLM's rule
(without chunked prefill the budget must cover the longest sequence) for both engines, and the embedded engine's
one difference where it prefills padded (a longer request alone instead of split) said once."""
import logging

import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

LONG = ["data.max_prompt_length=512", "data.max_response_length=1024"]


def test_budgets_vllm_would_refuse_are_refused_before_anything_starts():
    for name in ("hf", "vllm"):
        cfg = load_config([*LONG, f"actor_rollout_ref.rollout.name={name}",
                           "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
                           "actor_rollout_ref.rollout.enable_chunked_prefill=false"])
        with pytest.raises(ConfigError, match=r"max_num_batched_tokens.*1024.*\(1536.*>= 1536"):
            validate(cfg)
    cfg = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_num_seqs=64",
                       "actor_rollout_ref.rollout.max_num_batched_tokens=32"])
    with pytest.raises(ConfigError, match=r"32 is below max_num_seqs \(64\), which vLLM refuses"):
        validate(cfg)
    for bad in ("0", "-5"):
        with pytest.raises(ConfigError, match="max_num_batched_tokens"):
            validate(load_config([f"actor_rollout_ref.rollout.max_num_batched_tokens={bad}"]))


def test_the_embedded_engine_says_it_prefills_a_longer_request_alone(caplog):
    """where it prefills padded; on CUDA or an NPU in 16-bit with the fused decode it splits it (enable_chunked_prefill)."""
    caplog.set_level(logging.WARNING, logger="fully_async.core.config_checks")
    validate(load_config([*LONG, "actor_rollout_ref.rollout.max_num_batched_tokens=1024"]))
    assert "prefills a request longer than the budget alone" in caplog.text
    caplog.clear()
    for device in ("cuda", "npu"):
        validate(load_config([*LONG, "actor_rollout_ref.rollout.max_num_batched_tokens=1024", f"trainer.device={device}",
                              "actor_rollout_ref.rollout.dtype=bfloat16"]))
        assert "max_num_batched_tokens" not in caplog.text, device
    caplog.clear()
    validate(load_config([*LONG, "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
                          "actor_rollout_ref.rollout.enable_chunked_prefill=false"]))   # covers 1536: nothing said
    validate(load_config(LONG))                                                          # verl's 8192
    assert "max_num_batched_tokens" not in caplog.text


def test_the_engine_is_built_with_the_budget(random_model_dir):
    from fully_async.device import CPU
    from fully_async.rollout.engines import build_engine

    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}",
                       "actor_rollout_ref.rollout.max_num_batched_tokens=96"])
    engine = build_engine(cfg, CPU, [], 0)
    assert engine.max_num_batched_tokens == 96 and engine.chunked_prefill
    cfg = load_config([f"actor_rollout_ref.model.path={random_model_dir}",
                       "actor_rollout_ref.rollout.enable_chunked_prefill=false"])
    assert not build_engine(cfg, CPU, [], 0).chunked_prefill


def test_gpu_memory_utilization_on_the_embedded_engine_is_said_to_do_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="fully_async.core.config_checks")
    validate(load_config(["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]))
    assert "gpu_memory_utilization=0.6 has no effect on the embedded engine" in caplog.text
    caplog.clear()
    validate(load_config(["actor_rollout_ref.rollout.name=vllm",
                          "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]))
    validate(load_config([]))
    assert "gpu_memory_utilization" not in caplog.text

