"""Devices and model shapes the planner knows without touching either (layer 1, pure data).

DEVICES: memory, dense bf16 peak and HBM bandwidth of one device, from the vendors' data sheets (the
planner prints which row it used; every field can be overridden with plan.device_* keys).  Peaks are
dense (no sparsity); an Ascend 910C is one package of two dies, counted as one device as Ascend's tools do.

MODEL_SHAPES: the architecture fields of the models the recipes train, copied from their config.json on the
Hugging Face Hub, so `plan` can size a model whose weights are not on this machine
(actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct or a name below).  A local path always wins.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_gib: float        # device memory
    tflops: float            # dense bf16 peak, TFLOP/s
    hbm_gbs: float           # memory bandwidth, GB/s
    link_gbs: float          # device-to-device bandwidth used by weight sync, GB/s (intra-node, one direction)


DEVICES = {
    "ascend910b": DeviceSpec("Ascend 910B (64 GB)", 64.0, 313.0, 1600.0, 56.0),
    "ascend910c": DeviceSpec("Ascend 910C (128 GB)", 128.0, 752.0, 3200.0, 112.0),
    "h100": DeviceSpec("NVIDIA H100 SXM (80 GB)", 80.0, 989.0, 3350.0, 450.0),
    "h200": DeviceSpec("NVIDIA H200 (141 GB)", 141.0, 989.0, 4800.0, 450.0),
    "a100": DeviceSpec("NVIDIA A100 SXM (80 GB)", 80.0, 312.0, 2039.0, 300.0),
    "a100_40g": DeviceSpec("NVIDIA A100 SXM (40 GB)", 40.0, 312.0, 1555.0, 300.0),
}

_QWEN2 = dict(model_type="qwen2", attention_bias=True, qk_norm=False)
_QWEN3 = dict(model_type="qwen3", attention_bias=False, qk_norm=True)
MODEL_SHAPES = {
    "Qwen2.5-0.5B": dict(_QWEN2, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN2, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, head_dim=128, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN2, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False),
    "Qwen3-4B": dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     tie_word_embeddings=True),
    "Qwen3-8B": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False),
}


def known_shape(path: str) -> tuple[str, dict] | None:
    """(name, shape) when the last path component of `path` names a built-in shape (case-insensitive; an
    -Instruct / -Base / -Math suffix is allowed), else None."""
    tail = path.rstrip("/").split("/")[-1].lower()
    for name, shape in MODEL_SHAPES.items():
        low = name.lower()
        if tail == low or any(tail == f"{low}-{s}" for s in ("instruct", "base", "math")):
            return name, dict(shape)
    return None


@dataclass(frozen=True)
class Shape:
    """The fields of a dense decoder the planner needs (from config.json or MODEL_SHAPES)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, config: dict) -> "Shape":
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if not config.get(k)]
        if missing:
            raise ValueError(f"model config has no {', '.join(missing)}: the planner sizes dense decoders only")
        if any(config.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts")):
            raise ValueError(f"model_type {config.get('model_type')!r} is a mixture-of-experts model: the planner "
                             "sizes dense decoders only")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        mtype = str(config.get("model_type", "?"))
        return cls(mtype, hidden, int(config["num_hidden_layers"]), heads,
                   int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                   int(config["intermediate_size"]), int(config["vocab_size"]),
                   bool(config.get("tie_word_embeddings", False)),
                   bool(config.get("attention_bias", mtype == "qwen2")),
                   bool(config.get("qk_norm", mtype == "qwen3")))

    @classmethod
    def from_dir(cls, path: str) -> "Shape | None":
        """The shape of the model in the local folder `path` (its config.json; a multimodal model's text_config),
        or None where the folder has no config.json.  A config.json that is not a readable dense decoder raises
        ValueError naming the file."""
        config_json = os.path.join(str(path), "config.json")
        if not os.path.isfile(config_json):
            return None
        try:
            with open(config_json) as fh:
                config = json.load(fh)
            return cls.of(config.get("text_config", config) if "hidden_size" not in config else config)
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{config_json}: {exc}") from exc

    @classmethod
    def of_model(cls, cfg: Any) -> "Shape | None":
        """The shape of the run's model (actor_rollout_ref.model.path) where its folder has a readable dense
        decoder's config.json, else None: for estimates that fall back to a default rather than refuse."""
        try:
            return cls.from_dir(str(cfg.actor_rollout_ref.model.path))
        except ValueError:
            return None

    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return attn + 3 * h * self.intermediate + norms

    def linear_weights(self) -> int:
        """The decoder layers' matmul weights (attention and MLP; no biases, norms, embedding or lm_head): what an
        fp8 rollout quantises."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate)

    def params(self) -> int:
        """Every parameter (embedding, untied lm_head, layers, final norm)."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def matmul_params(self) -> int:
        """Parameters a token goes through as matmuls (layers + lm_head; not the embedding lookup)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes
