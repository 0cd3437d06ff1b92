"""Hugging Face <-> Megatron-core GPTModel weight conversion for Qwen2 / Qwen2.5 / Qwen3 (dense) / Llama (layer 5,
pure torch).

The Megatron side is GPTModel built from the *local* layer spec (`get_gpt_layer_local_spec`, no
Transformer Engine), whose parameter names are:

    embedding.word_embeddings.weight                 <- model.embed_tokens.weight      (vocab-split)
    decoder.layers.{i}.input_layernorm.weight        <- input_layernorm.weight         (replicated)
    decoder.layers.{i}.self_attention.linear_qkv.weight / .bias
                                                     <- q/k/v_proj, fused per query group (column-split)
    decoder.layers.{i}.self_attention.linear_proj.weight  <- o_proj.weight           (row-split)
    decoder.layers.{i}.self_attention.q_layernorm.weight  <- self_attn.q_norm.weight  (Qwen3; replicated: an
    decoder.layers.{i}.self_attention.k_layernorm.weight  <- self_attn.k_norm.weight   RMSNorm over head_dim,
                                                     shared by every head, so each TP rank holds all of it;
                                                     megatron builds them with qk_layernorm=True)
    decoder.layers.{i}.pre_mlp_layernorm.weight      <- post_attention_layernorm.weight (replicated)
    decoder.layers.{i}.mlp.linear_fc1.weight         <- cat(gate_proj, up_proj)        (column-split)
    decoder.layers.{i}.mlp.linear_fc2.weight         <- down_proj.weight               (row-split)
    decoder.final_layernorm.weight                   <- model.norm.weight
    output_layer.weight                              <- lm_head.weight (absent when tied; vocab-split)

Fused QKV layout: Megatron views the linear_qkv output as [ng, (q_per_group + 2) * head_dim], i.e.
for each query group g the rows are q-heads of g, then k_g, then v_g.  A tensor-parallel rank owns
ng / tp whole groups, so its shard is a contiguous row block of the fused tensor.  linear_fc1 is
[gate; up] *per rank* (the GLU chunks its local output in two), so gate and up are split first and
each rank's pieces concatenated.  Layer indices in a pipeline stage's state dict are local
(0 .. layers_per_stage - 1); `pp_rank`/`pp_size` select and renumber them (even split).

This module imports no megatron: it is unit-tested on CPU.  The `mbridge` package (PyPI) does the
same for the Transformer-Engine spec; we keep our own so the local spec and TP/PP slicing are ours.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Iterator, Mapping

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

_LAYER_MAP = {  # megatron suffix -> HF suffix, for the tensors that map one to one (TP handled by _TP_DIM)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TP_DIM = {"self_attention.linear_proj.weight": 1, "mlp.linear_fc2.weight": 1}  # row-parallel: split inputs
_QK_NORM_MAP = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",   # Qwen3 (qk_layernorm=True)
                "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}


def has_qk_norm(hf_config: Any) -> bool:
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    return hf_config.model_type == "qwen3"


def _heads(hf_config: Any) -> tuple[int, int, int]:
    """(num_heads, num_query_groups, head_dim)."""
    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    return nh, ng, hd


def _rope(hf_config: Any) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) for transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None)) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), ({} if kind == "default" else params)


def check_supported(hf_config: Any) -> None:
    """Raise NotImplementedError for HF configs this conversion does not cover."""
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {hf_config.model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {hf_config.hidden_act!r}: only silu (SwiGLU) is mapped")
    if hf_config.model_type == "llama" and (getattr(hf_config, "attention_bias", False)
                                            or getattr(hf_config, "mlp_bias", False)):
        raise NotImplementedError("llama with attention_bias/mlp_bias (o_proj / MLP biases) is not mapped")
    if hf_config.model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise NotImplementedError("qwen3 with attention_bias is not mapped")
    if getattr(hf_config, "use_sliding_window", False):
        raise NotImplementedError("sliding-window attention is not mapped")
    _, scaling = _rope(hf_config)
    if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise NotImplementedError(f"rope scaling {scaling} is not mapped (only llama3)")


def transformer_config_kwargs(hf_config: Any, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Megatron TransformerConfig arguments for the HF config (no parallel sizes, no fusions)."""
    check_supported(hf_config)
    nh, ng, hd = _heads(hf_config)
    return dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=nh, num_query_groups=ng, kv_channels=hd,
        layernorm_epsilon=hf_config.rms_norm_eps, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype, pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        # torch fallbacks: no Apex / Transformer Engine kernels are assumed
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def gpt_model_kwargs(hf_config: Any) -> dict:
    """GPTModel constructor arguments (besides config and layer spec) for the HF config."""
    theta, scaling = _rope(hf_config)
    kwargs = dict(vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                  position_embedding_type="rope", rotary_base=theta,
                  share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)))
    if scaling:
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling.get("factor", 8.0)))
    return kwargs


def _stage_layers(hf_config: Any, pp_rank: int, pp_size: int) -> range:
    n = hf_config.num_hidden_layers
    if n % pp_size:
        raise ValueError(f"num_hidden_layers={n} is not divisible by pipeline_model_parallel_size={pp_size}")
    per = n // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _check_tp(hf_config: Any, tp_size: int) -> None:
    nh, ng, _ = _heads(hf_config)
    for what, value in (("num_key_value_heads", ng), ("num_attention_heads", nh), ("vocab_size", hf_config.vocab_size),
                        ("intermediate_size", hf_config.intermediate_size)):
        if value % tp_size:
            raise ValueError(f"{what}={value} is not divisible by tensor_model_parallel_size={tp_size}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int) -> torch.Tensor:
    """q (nh*hd, ...), k/v (ng*hd, ...) -> megatron's per-group [q_g; k_g; v_g] (ng*(nh/ng+2)*hd, ...)."""
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, nh: int, ng: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (nh // ng + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [nh // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    return torch.chunk(t, size, dim=dim)[rank].clone()


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Any, tp_rank: int = 0, tp_size: int = 1,
                   pp_rank: int = 0, pp_size: int = 1, lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Megatron state dict of TP rank `tp_rank` (and pipeline stage `pp_rank`) from a full HF state dict;
    `lm_head=False`: no output layer (a critic's trunk, whose value head is not an LM head)."""
    check_supported(hf_config)
    _check_tp(hf_config, tp_size)
    nh, ng, hd = _heads(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _shard(hf_state["model.embed_tokens.weight"], tp_rank, tp_size)
    for local, i in enumerate(_stage_layers(hf_config, pp_rank, pp_size)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        for m_name, h_name in _LAYER_MAP.items():
            dim = _TP_DIM.get(m_name)
            t = hf_state[src + h_name]
            out[dst + m_name] = t.clone() if dim is None else _shard(t, tp_rank, tp_size, dim)
        if has_qk_norm(hf_config):
            for m_name, h_name in _QK_NORM_MAP.items():
                out[dst + m_name] = hf_state[src + h_name].clone()
        for kind in ("weight", "bias"):
            if src + f"self_attn.q_proj.{kind}" in hf_state:
                q, k, v = (hf_state[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv")
                out[dst + f"self_attention.linear_qkv.{kind}"] = _shard(fuse_qkv(q, k, v, ng), tp_rank, tp_size)
        gate = _shard(hf_state[src + "mlp.gate_proj.weight"], tp_rank, tp_size)
        up = _shard(hf_state[src + "mlp.up_proj.weight"], tp_rank, tp_size)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
        if lm_head and not tied:
            out["output_layer.weight"] = _shard(hf_state["lm_head.weight"], tp_rank, tp_size)
        elif lm_head and pp_size > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = _shard(hf_state["model.embed_tokens.weight"], tp_rank, tp_size)
    return out


def megatron_to_hf(mcore_states_per_tp_rank: list[Mapping[str, torch.Tensor]], hf_config: Any,
                   pp_rank: int = 0, pp_size: int = 1, lm_head: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict (tied lm_head omitted) from the state dicts of every TP rank of one pipeline stage;
    `lm_head=False`: the stage has no LM head to convert (a critic's trunk)."""
    check_supported(hf_config)
    nh, ng, hd = _heads(hf_config)
    shards = [{k: v for k, v in s.items() if not k.endswith("_extra_state")} for s in mcore_states_per_tp_rank]
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out: dict[str, torch.Tensor] = {}
    first = shards[0]
    if "embedding.word_embeddings.weight" in first:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight")
    for local, i in enumerate(_stage_layers(hf_config, pp_rank, pp_size)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
        for m_name, h_name in _LAYER_MAP.items():
            dim = _TP_DIM.get(m_name)
            out[dst + h_name] = first[src + m_name].clone() if dim is None else cat(src + m_name, dim)
        if has_qk_norm(hf_config):
            for m_name, h_name in _QK_NORM_MAP.items():
                out[dst + h_name] = first[src + m_name].clone()
        for kind in ("weight", "bias"):
            if src + f"self_attention.linear_qkv.{kind}" in first:
                q, k, v = split_qkv(cat(src + f"self_attention.linear_qkv.{kind}"), nh, ng, hd)
                for p, t in zip("qkv", (q, k, v)):
                    out[dst + f"self_attn.{p}_proj.{kind}"] = t.contiguous()
        halves = [torch.chunk(s[src + "mlp.linear_fc1.weight"], 2, dim=0) for s in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
    if "decoder.final_layernorm.weight" in first:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if lm_head and not tied:
            out["lm_head.weight"] = cat("output_layer.weight")
    return out


class SafetensorsFolder(Mapping):
    """Read-on-demand view of a Hugging Face folder's *.safetensors: each rank reads only its slices."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"{folder} has no *.safetensors weights")
        self._where = {k: h for h in (safe_open(f, framework="pt") for f in files) for k in h.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
