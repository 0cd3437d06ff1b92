"""Engine sizes that cannot fit are named before allocating (issue 42): the embedded engine's weights + KV cache
(max_num_seqs x max_model_len x layers x kv heads x head_dim x dtype bytes x 2) + logits against its device's room,
vLLM's gpu_memory_utilization against what is free; the error names the key and what would fit, and what it says
fits does fit.  A fake device with fixed room; the shape of Qwen2.5-0.5B as config.json gives it."""
import math
from types import SimpleNamespace

import pytest

from fully_async.core.config import ConfigError
from fully_async.rollout.engine_fit import GIB, check_engine_fit, engine_size
from fully_async.run.hydra_setup import load_config

QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
GPU = SimpleNamespace(name="cuda", is_accelerator=True)
CPU = SimpleNamespace(name="cpu", is_accelerator=False)


def cfg(*overrides):
    return load_config(["actor_rollout_ref.rollout.max_num_seqs=256", "actor_rollout_ref.rollout.max_model_len=4096",
                        "actor_rollout_ref.rollout.dtype=bfloat16",
                        *overrides])


def test_a_kv_cache_that_cannot_fit_is_named_with_what_would():
    c = cfg()
    with pytest.raises(ConfigError) as err:
        check_engine_fit(c, GPU, QWEN_05B, room=(8 * GIB, 80 * GIB))
    msg = str(err.value)
    # 256 x 4096 tokens x (2 x 24 layers x 2 kv heads x 64 dims x 2 bytes) = 12 GiB of KV
    assert msg.startswith("config error at 'actor_rollout_ref.rollout.max_num_seqs': the embedded engine needs "), msg
    assert ("KV cache max_num_seqs=256 x max_model_len=4096 x 24 layers x 2 kv heads x 64 head_dim x 2 bytes x 2 = "
            "12.00 GiB") in msg, msg
    assert "8.00 GiB free to it now" in msg and "one cuda device" in msg
    fit_seqs = int(msg.split("max_num_seqs <= ")[1].split()[0])
    fit_len = int(msg.split("max_model_len <= ")[1].split()[0])
    size = engine_size(c, QWEN_05B)
    assert size.need(fit_seqs, 4096) <= 8 * GIB < size.need(fit_seqs + 1, 4096)   # what it says fits, fits
    assert size.need(256, fit_len) <= 8 * GIB < size.need(256, fit_len + 1)
    assert 140 < fit_seqs < 160 and 2200 < fit_len < 2700


def test_a_size_that_fits_passes_and_shared_devices_count_their_total():
    check_engine_fit(cfg(), GPU, QWEN_05B, room=(16 * GIB, 80 * GIB))
    with pytest.raises(ConfigError):
        check_engine_fit(cfg(), GPU, QWEN_05B, room=(8 * GIB, 80 * GIB))
    # colocated: the trainer holds the device now and leaves at the engine's turn: the device's total counts
    check_engine_fit(cfg("async_training.placement=colocated"), GPU, QWEN_05B, room=(8 * GIB, 80 * GIB))
    with pytest.raises(ConfigError, match=r"its total 10.00 GiB \(the devices are shared in time\)"):
        check_engine_fit(cfg("async_training.placement=colocated"), GPU, QWEN_05B, room=(1 * GIB, 10 * GIB))


def test_on_cpu_the_hosts_ram_is_the_room():
    with pytest.raises(ConfigError, match=r"on the host's RAM but has 4.00 GiB free to it now"):
        check_engine_fit(cfg(), CPU, QWEN_05B, room=(4 * GIB, 16 * GIB))


def test_weights_alone_over_the_room_say_so():
    with pytest.raises(ConfigError, match=r"not even one sequence of max_model_len fits beside the weights"):
        check_engine_fit(cfg(), GPU, QWEN_05B, room=(0.5 * GIB, 80 * GIB))


def test_vllm_utilization_over_the_free_memory_and_a_share_without_room_for_one_sequence():
    c = cfg("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9")
    with pytest.raises(ConfigError) as err:
        check_engine_fit(c, GPU, QWEN_05B, room=(40 * GIB, 80 * GIB))
    msg = str(err.value)
    assert "'actor_rollout_ref.rollout.gpu_memory_utilization'" in msg and "72.00 GiB at start-up" in msg
    assert "what fits: gpu_memory_utilization <= 0.50" in msg
    c = cfg("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
            "actor_rollout_ref.rollout.max_model_len=131072")
    with pytest.raises(ConfigError) as err:   # 0.1 x 16 GiB - 0.92 GiB of weights < 1.5 GiB of one 128k sequence
        check_engine_fit(c, GPU, QWEN_05B, room=(16 * GIB, 16 * GIB))
    msg = str(err.value)
    assert "'actor_rollout_ref.rollout.max_model_len'" in msg and "holds no sequence of max_model_len=131072" in msg
    wanted = float(msg.split("gpu_memory_utilization >= ")[1].split(",")[0])
    size = engine_size(c, QWEN_05B)
    assert wanted * 16 * GIB - size.weights >= 131072 * size.kv_per_token
    assert math.isclose(size.kv_per_token, 2 * 24 * 2 * 64 * 2)
    check_engine_fit(cfg("actor_rollout_ref.rollout.name=vllm"), CPU, QWEN_05B, room=(1.0, 1.0))   # cpu: not vLLM's


def test_the_device_reports_its_room():
    from fully_async.device import get_device

    free, total = get_device("cpu").memory_room()
    assert 0 < free and 0 < total
