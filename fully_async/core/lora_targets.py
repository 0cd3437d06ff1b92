"""Which layers get LoRA adapters under strategy=megatron (layer 0, pure: config checks and the backend share it).

verl's megatron LoRA is megatron-bridge's fused `lora`: one adapter per megatron linear layer of each decoder layer,
`linear_qkv` (q, k and v fused), `linear_proj` (o_proj), `linear_fc1` (gate and up fused) and `linear_fc2` (down_proj),
all four by default.  `target_modules` takes those names, Hugging Face's names of the same layers (q_proj, k_proj and
v_proj only together, as gate_proj and up_proj: a fused layer has one adapter), `all-linear`, or wildcard patterns
over the full module names (`*.layers.0.*.linear_qkv`: decoder.layers.<global layer>.self_attention.linear_qkv) or
full Hugging Face names (`model.layers.0.self_attn.q_proj`, as a peft adapter's config lists them);
`exclude_modules` removes layers the same way.  A string other than all-linear is a regular expression over the
full names (peft's rule).
"""
from __future__ import annotations

import fnmatch
import re
from typing import Any, Optional, Union

MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")      # output split over the tensor ranks; the others: input split
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                  "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
MEGATRON_TO_HF = {"linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "linear_proj": ("self_attn.o_proj",), "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
                  "linear_fc2": ("mlp.down_proj",)}
SUBMODULE = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
             "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
# lora_A's initialisation (verl's lora.lora_A_init_method; megatron-bridge's names): null is the strategy's default,
# kaiming (peft's) on torch / fsdp2 and xavier (megatron-bridge's) on megatron; lora_B starts at zero
LORA_A_INITS = ("xavier", "kaiming", "normal")
Spec = Union[str, list, None]


class TargetError(ValueError):
    """A target or exclusion megatron's fused LoRA cannot take; `key` is target_modules or exclude_modules."""

    def __init__(self, key: str, message: str):
        super().__init__(f"actor_rollout_ref.model.{key}: {message}")
        self.key, self.message = key, message


def _as_list(spec: Any) -> Optional[list]:
    if spec is None or isinstance(spec, str):
        return spec
    return list(spec)


def megatron_targets(target_modules: Spec, exclude_modules: Spec = None) -> tuple[Spec, Spec]:
    """(targets, excludes) with Hugging Face names turned into megatron's; TargetError naming what cannot be adapted
    (a fused layer's part on its own, a name no megatron linear layer has)."""
    targets, excludes = _as_list(target_modules), _as_list(exclude_modules)
    return _translate(targets, "target_modules"), _translate(excludes, "exclude_modules")


HF_FULL_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")


def _parse(name: str) -> tuple[Optional[str], str]:
    """(global layer index or None, leaf) of a target: `q_proj`, or a full Hugging Face name (a peft adapter's)."""
    m = HF_FULL_NAME.fullmatch(name)
    return (m.group(1), m.group(2)) if m and m.group(2) in HF_TO_MEGATRON else (None, name)


def _translate(spec: Spec, key: str) -> Spec:
    if spec is None or isinstance(spec, str):
        return spec
    parsed = [_parse(str(name)) for name in spec]
    out: list[str] = []
    for layer, name in parsed:
        if any(c in name for c in "*?["):
            out.append(name)
        elif name in MEGATRON_LINEARS and layer is None:
            out.append(name)
        elif name in HF_TO_MEGATRON:
            fused = HF_TO_MEGATRON[name]
            parts = [p for p, m in HF_TO_MEGATRON.items() if m == fused]
            if not set(parts) <= {n for lay, n in parsed if lay == layer}:
                verb = "name" if key == "target_modules" else "exclude"
                where = "" if layer is None else f" of layer {layer}"
                raise TargetError(key, f"{list(spec)}: under strategy=megatron {name}{where} is part of the fused "
                                       f"{fused}, which has one adapter: {verb} all of {parts} or {fused}")
            out.append(fused if layer is None else f"decoder.layers.{layer}.{SUBMODULE[fused]}")
        else:
            raise TargetError(key, f"{name!r} is no linear layer of the megatron model (its layers: "
                                   f"{list(MEGATRON_LINEARS)}, or Hugging Face's {sorted(HF_TO_MEGATRON)}, or a "
                                   "wildcard pattern over decoder.layers.<i>.<self_attention|mlp>.<layer>)")
    return list(dict.fromkeys(out))


def _hit(full_name: str, spec: Spec) -> bool:
    leaf = full_name.rsplit(".", 1)[-1]
    if spec is None:
        return False
    if isinstance(spec, str):
        return spec == "all-linear" or re.fullmatch(spec, full_name) is not None
    return any(fnmatch.fnmatchcase(full_name, t) if any(c in t for c in "*?[") else
               full_name == t if "." in t else leaf == t for t in spec)


def is_target(full_name: str, targets: Spec, excludes: Spec) -> bool:
    """Whether the megatron linear layer `full_name` (decoder.layers.<global i>.<submodule>) gets an adapter."""
    return (targets is None or _hit(full_name, targets)) and not _hit(full_name, excludes)


def layer_names(num_layers: int) -> list[str]:
    """Every adaptable layer's full name, in the model's order."""
    return [f"decoder.layers.{i}.{SUBMODULE[m]}" for i in range(num_layers) for m in MEGATRON_LINEARS]
