"""perf/mfu/actor inputs: the FLOPs estimate against hand counts and verl's formula, and the device peak table."""
import pytest

from fully_async.device import CPU
from fully_async.core.flops import PEAK_TFLOPS, estimate_flops, match_device, mfu, peak_tflops, unsupported_reason

# the shape of tests/conftest.py's random model (a Qwen2)
TINY = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=48)
# Qwen2.5-0.5B's shape
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)


def test_dense_flops_match_a_hand_count():
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; gated MLP 3 x 64x128 = 24576
    # N = 2 x (12288 + 24576) + lm_head 48x64 = 76800 (the input embedding is a lookup, not counted)
    dense = 6 * 76800 * (3 + 5)
    # causal pairs per layer (3^2 + 5^2) / 2 = 17, two layers; 12 FLOPs per pair, head dim and head
    attention = 12 * 32 * 2 * (2 * 17)
    assert estimate_flops(TINY, [3, 5]) == dense + attention == 3_712_512


def test_with_the_embedding_counted_it_is_verls_qwen2_formula():
    """verl/utils/flops_counter.py `_estimate_qwen2_flops` (volcengine/verl b178a3c), restated."""
    c, lens = QWEN25_05B, [700, 1200, 35]
    hd = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    dense_n = (c["hidden_size"] * c["intermediate_size"] * 3 + c["hidden_size"] * (q + kv + kv + q)) \
        * c["num_hidden_layers"] + c["vocab_size"] * c["hidden_size"] * 2
    attention = 6 * sum(s * s for s in lens) * hd * c["num_attention_heads"] * c["num_hidden_layers"]
    verl = 6 * dense_n * sum(lens) + attention
    assert estimate_flops(c, lens, count_embedding=True) == pytest.approx(verl, rel=1e-12)
    # without the embedding lookup: N is smaller by vocab x hidden, ~22% of verl's N for this model
    ours = estimate_flops(c, lens)
    assert verl - ours == pytest.approx(6 * c["vocab_size"] * c["hidden_size"] * sum(lens), rel=1e-12)
    assert 0.20 < c["vocab_size"] * c["hidden_size"] / dense_n < 0.23


def test_transformers_config_object(random_model_dir):
    from transformers import AutoConfig
    assert estimate_flops(AutoConfig.from_pretrained(random_model_dir), [3, 5]) == 3_712_512


def test_sliding_window_layers_count_window_pairs():
    c = dict(TINY, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    base = 6 * 76800 * 10
    # s=10: full 10^2/2 = 50 pairs; window 4: 4^2/2 + 6 x 4 = 32 pairs
    assert estimate_flops(c, [10]) == base + 12 * 32 * 2 * (32 + 50)
    assert estimate_flops(c, [3]) == estimate_flops(TINY, [3])  # shorter than the window: no difference


def test_non_gated_mlp_has_two_matrices():
    c = dict(TINY, model_type="gpt_neox")
    assert estimate_flops(TINY, [4]) - estimate_flops(c, [4]) == 6 * 2 * (64 * 128) * 4


def test_qwen3_moe_counts_router_and_routed_experts():
    c = dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             decoder_sparse_step=1, mlp_only_layers=[1])
    # layer 0 sparse: router 64x8 + 2 experts x 3 x 64x16 = 6656; layer 1 dense MLP 24576
    n = 2 * 12288 + 6656 + 24576 + 48 * 64
    assert estimate_flops(c, [4]) == 6 * n * 4 + 12 * 32 * 2 * (2 * 8)
    shared = dict(c, model_type="qwen2_moe", shared_expert_intermediate_size=32)
    assert estimate_flops(shared, [4]) - estimate_flops(c, [4]) == 6 * (3 * 64 * 32 + 64) * 4


def test_multimodal_config_uses_its_text_config():
    assert estimate_flops({"model_type": "qwen2_5_vl", "text_config": TINY}, [3, 5]) == 3_712_512


@pytest.mark.parametrize("config,why", [
    (dict(TINY, model_type="deepseek_v3", kv_lora_rank=512, n_routed_experts=8), "latent attention"),
    (dict(TINY, model_type="mixtral", num_local_experts=8), "mixture-of-experts"),
    (dict(TINY, model_type="qwen3_next", layer_types=["linear_attention", "full_attention"]), "linear_attention"),
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}, "no hidden_size"),
])
def test_unmodelled_architectures_give_none(config, why):
    assert why in unsupported_reason(config)
    assert estimate_flops(config, [4]) is None


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H20", "H20"), ("NVIDIA H800", "H800 SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"), ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"),
    ("Ascend910B2", "Ascend 910B"), ("Ascend910B2C", "Ascend 910B"), ("Ascend910B4", "Ascend 910B"),
    ("Ascend910_9391", "Ascend 910C"), ("Ascend910_9362", "Ascend 910C"),
])
def test_known_device_names(name, key):
    assert match_device(name) == key
    assert peak_tflops(name) == PEAK_TFLOPS[key]


def test_peak_values_of_the_main_parts():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Ascend910B2") == 354.0


@pytest.mark.parametrize("name", [None, "", "cpu", "NVIDIA RTX A4000", "NVIDIA GeForce RTX 4090",
                                  "Tesla V100-SXM2-16GB", "Ascend910A", "Ascend910ProB", "AMD Instinct MI300X"])
def test_unknown_devices_have_no_peak(name):
    assert peak_tflops(name) is None


def test_override_wins():
    assert peak_tflops("NVIDIA H100 80GB HBM3", 500.0) == 500.0
    assert peak_tflops(None, 100) == 100.0
    assert peak_tflops(CPU.device_name()) is None and CPU.device_name() is None


def test_mfu_arithmetic():
    # 989e12 FLOPs in 1 s on 2 devices of 989 TFLOP/s: half the promised throughput
    assert mfu(989e12, 1.0, 2, 989.0) == pytest.approx(0.5)


def test_a_window_without_layer_types_is_every_layers_unless_switched_off():
    mistral = dict(TINY, model_type="mistral", sliding_window=4)
    assert estimate_flops(mistral, [10]) == 6 * 76800 * 10 + 12 * 32 * 2 * (2 * 32)
    qwen2_off = dict(TINY, sliding_window=4, use_sliding_window=False)
    assert estimate_flops(qwen2_off, [10]) == estimate_flops(TINY, [10])
