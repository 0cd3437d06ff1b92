"""Model FLOPs of a training pass and the devices' peak throughput, for `perf/mfu/actor` (layer 0, pure).

MFU = FLOPs the update needed / update seconds / (devices x peak FLOP/s of one device), as verl's FlopsCounter
(verl/utils/flops_counter.py) and its actor workers (`update_actor` in verl/workers/fsdp_workers.py and
megatron_workers.py) compute it.  The FLOPs of one forward + backward pass over sequences of lengths s_i:

    6 x N x sum(s_i)                              dense matmuls: 2 per parameter and token forward, 4 backward
  + 12 x head_dim x heads x sum_layers sum_i P_i  attention scores and their weighted sum (QK^T, AV), 3 x 4 per
                                                  query-key pair and head dimension, forward + backward

N counts the matmul weights a token goes through: per layer q/k/v/o projections and the MLP (3 matrices for
gated SwiGLU/GeGLU MLPs, 2 otherwise; for MoE layers the router and the top-k experts a token is routed to,
plus a shared expert), and the lm_head.  P_i is the number of query-key pairs a causal layer scores, s^2/2
(the causal half, so 6 x s^2 x head_dim x heads per layer: verl's current term, which follows Megatron-LM),
and for a sliding-window layer of window w < s: w^2/2 + (s - w) x w.

Differences from verl (as of volcengine/verl b178a3c, Jan 2026):
  * `perf/mfu/actor` counts the input embedding in N as verl does (`vocab x hidden x 2`, count_embedding=True),
    so the curves compare with verl's by name, although an embedding lookup is a gather, not a matmul
    (for Qwen2.5-0.5B the embedding is ~22% of N): estimate_flops(..., count_embedding=False) leaves it out.
  * sliding-window layers count w x s pairs once s > w (verl: s x w / 2, and only for Gemma 3 / gpt-oss: a
    Mistral-style window on every layer counts here too), and Qwen2-MoE's shared expert is counted (verl
    leaves it out).
Norms, biases, rotary embeddings and the softmax are not counted (each well under 1% of the total).

Architectures this formula does not describe (multi-head latent attention, linear/state-space layers, MoE
other than Qwen2/Qwen3-MoE) give None: no MFU rather than a wrong one.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

# model_type values whose MLP has two matrices (up, down) instead of the gated three (gate, up, down)
NON_GATED_MLP_TYPES = frozenset({"gpt_neox", "phi", "starcoder2", "apertus", "gpt_bigcode", "gpt2", "gptj",
                                 "falcon", "opt", "bloom", "mpt", "stablelm_epoch"})
# checked by name and tested; any other model_type with the same fields uses the generic dense estimate
DENSE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text"})
MOE_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe"})
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def _text_config(config: Any) -> Any:
    """The language model's config (multimodal configs nest it as `text_config`)."""
    text = _get(config, "text_config")
    return text if text is not None and _get(text, "hidden_size") is not None else config


def unsupported_reason(model_config: Any) -> Optional[str]:
    """Why `estimate_flops` cannot describe this architecture (None: it can)."""
    c = _text_config(model_config)
    mtype = _get(c, "model_type", "")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
               if not _get(c, k)]
    if missing:
        return f"model_type {mtype!r}: config has no {', '.join(missing)}"
    if _get(c, "kv_lora_rank") or _get(c, "q_lora_rank"):
        return f"model_type {mtype!r}: multi-head latent attention is not modelled"
    experts = any(_get(c, k, 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    if experts and mtype not in MOE_MODEL_TYPES:
        return f"model_type {mtype!r}: mixture-of-experts is modelled for {sorted(MOE_MODEL_TYPES)} only"
    if mtype in MOE_MODEL_TYPES and not (_get(c, "moe_intermediate_size") and _get(c, "num_experts_per_tok")):
        return f"model_type {mtype!r}: config has no moe_intermediate_size / num_experts_per_tok"
    if not experts and not _get(c, "intermediate_size"):
        return f"model_type {mtype!r}: config has no intermediate_size"
    other = set(_get(c, "layer_types", None) or []) - _ATTENTION_LAYER_TYPES
    if other:
        return f"model_type {mtype!r}: layer types {sorted(other)} are not modelled"
    return None


def _mlp_params(c: Any, layer: int) -> float:
    hidden, mtype = _get(c, "hidden_size"), _get(c, "model_type", "")
    matrices = 2 if mtype in NON_GATED_MLP_TYPES else 3
    experts = _get(c, "num_experts", 0)
    sparse = (mtype in MOE_MODEL_TYPES and experts > 0 and layer not in (_get(c, "mlp_only_layers", None) or [])
              and (layer + 1) % _get(c, "decoder_sparse_step", 1) == 0)  # transformers' Qwen2/Qwen3-MoE rule
    if not sparse:
        return matrices * hidden * _get(c, "intermediate_size")
    n = hidden * experts + 3 * hidden * _get(c, "moe_intermediate_size") * _get(c, "num_experts_per_tok")
    shared = _get(c, "shared_expert_intermediate_size", 0)
    if shared:
        n += 3 * hidden * shared + hidden  # the shared expert and its sigmoid gate (Qwen2-MoE)
    return n


def _causal_pairs(s: int, window: Optional[int]) -> float:
    if window is None or s <= window:
        return s * s / 2
    return window * window / 2 + (s - window) * window


def estimate_flops(model_config: Any, seq_lens: Sequence[int], count_embedding: bool = False) -> Optional[float]:
    """FLOPs of one forward + backward pass over sequences of `seq_lens` tokens (see the module docstring).

    `model_config`: a transformers config, or a dict of its fields.  None when the architecture is not one
    this estimate describes (`unsupported_reason`)."""
    if unsupported_reason(model_config) is not None:
        return None
    c = _text_config(model_config)
    hidden, layers, vocab = _get(c, "hidden_size"), _get(c, "num_hidden_layers"), _get(c, "vocab_size")
    heads = _get(c, "num_attention_heads")
    kv_heads = _get(c, "num_key_value_heads", heads)
    head_dim = _get(c, "head_dim", hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attn_params = hidden * (q + 2 * kv) + q * hidden  # q, k, v projections and the output projection
    params = sum(attn_params + _mlp_params(c, i) for i in range(layers)) + vocab * hidden  # + lm_head
    if count_embedding:
        params += vocab * hidden
    lens = [int(s) for s in seq_lens]
    window = _get(c, "sliding_window") or None
    # no layer_types (Mistral, Phi-3, Starcoder2): the window, where set and not switched off, is every layer's
    everywhere = window is not None and _get(c, "use_sliding_window", True) is not False
    layer_types = list(_get(c, "layer_types", None)
                       or [("sliding_attention" if everywhere else "full_attention")] * layers)
    pairs = 0.0
    for kind in layer_types[:layers]:
        w = window if kind == "sliding_attention" else None
        pairs += sum(_causal_pairs(s, w) for s in lens)
    return 6.0 * params * sum(lens) + 12.0 * head_dim * heads * pairs


# Peak dense bf16 tensor throughput of one device, TFLOP/s (one device = what the framework counts as one: a
# GPU, an Ascend die).  Values verl's get_device_flops uses (verl/utils/flops_counter.py `_DEVICE_FLOPS`) where
# verl has the part; NVIDIA's datasheets (the "with sparsity" figure / 2) for PCIe/NVL variants verl folds into
# the SXM number; Ascend 910C from public reporting (Huawei publishes no per-die figure).
PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,          # verl
    "B200": 2250.0,           # verl
    "GH200": 989.0,           # NVIDIA GH200 datasheet: 1,979 TFLOPS bf16 with sparsity
    "H100 SXM": 989.0,        # verl "H100"; NVIDIA H100 datasheet: 1,979 with sparsity
    "H100 NVL": 835.0,        # NVIDIA H100 datasheet: 1,671 with sparsity
    "H100 PCIe": 756.0,       # NVIDIA H100 datasheet: 1,513 with sparsity
    "H200 SXM": 989.0,        # verl "H200"; NVIDIA H200 datasheet: 1,979 with sparsity
    "H200 NVL": 835.0,        # NVIDIA H200 datasheet: 1,671 with sparsity
    "H800 SXM": 989.0,        # verl "H800"
    "H800 PCIe": 756.0,       # same silicon and clocks as H100 PCIe
    "H20": 148.0,             # verl
    "A100": 312.0,            # verl; NVIDIA A100 datasheet (SXM and PCIe): 312 dense
    "A800": 312.0,            # verl
    "L40S": 362.05,           # verl
    "L40": 181.05,            # verl
    "A40": 149.7,             # verl
    "L20": 119.5,             # verl
    # verl: "910B": 354e12 (all 910B variants).  Public per-variant figures differ (910B3 ~313, 910B4 ~280
    # TFLOPS fp16); Huawei publishes none, so verl's number is kept for comparable MFU: set
    # trainer.device_peak_tflops for a variant-exact denominator.
    "Ascend 910B": 354.0,
    # Ascend 910C (Atlas A3, SoC Ascend910_93xx): two dies, each its own torch device.  ~780 TFLOPS bf16 dense per
    # package (TechPowerUp / DigiTimes, Apr 2025; SemiAnalysis: CloudMatrix384 = 384 910C = ~300 PFLOPS bf16
    # dense, 781 per package), so 390 per die.  verl has no 910C entry (its generic "Ascend910" gives 354).
    "Ascend 910C": 390.0,
}

# device name (as the framework reports it: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Ascend910B2",
# "Ascend910_9391") -> PEAK_TFLOPS key; the first pattern that matches wins, so variants come before the base
# part.  Word boundaries keep H20 from matching H200, L40 from L40S, A40 from an RTX A4000.
_DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"\bGB200\b", "GB200"), (r"\bB200\b", "B200"), (r"\bGH200\b", "GH200"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"), (r"\bH100\b.*\bPCIe\b", "H100 PCIe"), (r"\bH100\b", "H100 SXM"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"), (r"\bH200\b", "H200 SXM"),
    (r"\bH800\b.*\bPCIe\b", "H800 PCIe"), (r"\bH800\b", "H800 SXM"), (r"\bH20\b", "H20"),
    (r"\bA100\b", "A100"), (r"\bA800\b", "A800"),
    (r"\bL40S\b", "L40S"), (r"\bL40\b", "L40"), (r"\bA40\b", "A40"), (r"\bL20\b", "L20"),
    (r"^\s*Ascend\s*910B", "Ascend 910B"), (r"^\s*Ascend\s*910_93", "Ascend 910C"),
]


def match_device(device_name: Optional[str]) -> Optional[str]:
    """The PEAK_TFLOPS key of a device name, None when unknown (or no name: cpu)."""
    if not device_name:
        return None
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return key
    return None


def peak_tflops(device_name: Optional[str], override: Optional[float] = None) -> Optional[float]:
    """bf16 dense peak TFLOP/s of one device: `override` (trainer.device_peak_tflops) when set, else the table's
    entry for the device name; None when neither (MFU is then not reported)."""
    if override is not None:
        return float(override)
    key = match_device(device_name)
    return PEAK_TFLOPS[key] if key is not None else None


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops_per_device: float) -> float:
    """Achieved FLOP/s over the devices' promised FLOP/s."""
    return flops / seconds / (num_devices * peak_tflops_per_device * 1e12)
