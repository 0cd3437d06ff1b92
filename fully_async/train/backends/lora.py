"""LoRA for the torch/fsdp2 actor (actor_rollout_ref.model.lora_rank > 0; verl's keys, peft's numbers).

Each targeted linear layer (`target_modules`: "all-linear" is every nn.Linear but the output head, as peft; else
module names or name suffixes; minus `exclude_modules`) becomes a `LoRALinear`: the same frozen `weight`/`bias`
parameters under the same names, plus trainable `lora_A` (r x in, peft's kaiming-uniform init) and `lora_B`
(out x r, zero), so that y = x W^T + b + (alpha / r) x A^T B^T.  Everything else is frozen; the optimizer holds
the LoRA parameters only.  The reference model is the base (built before the adapters).

What leaves the trainer is always the merged model, under the base names (`merged_parameters`: W + (alpha / r) B A
per layer, every rank iterating under FSDP2): the engines load plain weights, the checkpoint's actor/ folder is a
plain Hugging Face model.  The adapter itself is saved next to it in peft's format (`save_adapter`:
adapter_config.json + adapter_model.safetensors, keys `base_model.model.<layer>.lora_A.weight`), which is what
`lora_adapter_path` (verl's key) starts from and what peft or vLLM load.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.nn.functional as F

from fully_async.core import safe_write

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def init_lora_a_(a: torch.Tensor, method: str, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """lora_A's initialisation in place (verl's lora_A_init_method, megatron-bridge's names): kaiming (peft's
    default: kaiming_uniform_ with a=sqrt(5)), xavier (megatron-bridge's default: xavier_normal_) or normal
    (N(0, 0.2)); lora_B starts at zero."""
    if method == "xavier":
        return torch.nn.init.xavier_normal_(a, generator=generator)
    if method == "normal":
        return torch.nn.init.normal_(a, 0.0, 0.2, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    raise ValueError(f"actor_rollout_ref.model.lora_A_init_method={method!r} is not xavier, kaiming or normal")


class LoRALinear(torch.nn.Linear):
    """nn.Linear with a low-rank trainable update; `weight` and `bias` are the base layer's own parameters."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, init: str = "kaiming"):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = torch.nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        init_lora_a_(self.lora_A, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """The update of the weight, (alpha / r) B A, from full (gathered) A and B."""
        return (lora_b.float() @ lora_a.float()) * self.scaling


def _matches(name: str, spec: Union[str, list, None]) -> bool:
    """peft's rule: a string is a regex over the full module name, a list holds names or name suffixes."""
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec)


def _targets(model: torch.nn.Module, target_modules: Union[str, list, None], exclude: Union[str, list, None]
             ) -> list[str]:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        hit = target_modules in (None, "all-linear") or _matches(name, target_modules)
        if hit and not _matches(name, exclude):
            names.append(name)
    return names


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: Union[str, list, None] = "all-linear",
               exclude_modules: Union[str, list, None] = None, init: str = "kaiming") -> list[str]:
    """Freeze `model` and put LoRALinear layers in place of its targeted linear layers (lora_A initialised by
    `init`: kaiming, xavier or normal); returns their names."""
    names = _targets(model, target_modules, exclude_modules)
    if not names:
        raise ValueError(f"actor_rollout_ref.model.target_modules={target_modules!r} matches no linear layer of "
                         f"{type(model).__name__}")
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, init))
    return names


def lora_settings(model_cfg: Any) -> Optional[tuple[int, float, Any, Any]]:
    """(rank, alpha, target_modules, exclude_modules) of actor_rollout_ref.model, None without LoRA; from the adapter's
    own config with lora_adapter_path (as verl: peft reads it from there)."""
    if model_cfg.lora_adapter_path:
        config = read_adapter_config(model_cfg.lora_adapter_path)
        return (int(config["r"]), float(config.get("lora_alpha", 8)), config.get("target_modules") or "all-linear",
                config.get("exclude_modules"))
    if model_cfg.lora_rank > 0:
        targets = model_cfg.target_modules
        exclude = model_cfg.exclude_modules
        return (model_cfg.lora_rank, float(model_cfg.lora_alpha),
                targets if isinstance(targets, str) else list(targets),
                exclude if exclude is None or isinstance(exclude, str) else list(exclude))
    return None


def lora_layers(model: torch.nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merged_parameters(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (name, full tensor) of `model`'s parameters in registration order, with each LoRA layer's weight
    merged (W + (alpha / r) B A) and its lora_A / lora_B left out: the plain model's parameters."""
    layers = lora_layers(model)
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        layer = layers.get(owner)
        if layer is None:
            yield name, tensor
            continue
        # weight, bias, lora_A, lora_B (registered in that order): the merged weight, then the bias, once A and B
        # are in, so the names come in the plain model's order
        held[leaf] = tensor
        if "lora_A" in held and "lora_B" in held:
            weight = held["weight"]
            yield f"{owner}.weight", (weight.float() + layer.delta(held["lora_A"], held["lora_B"])).to(weight.dtype)
            if "bias" in held:
                yield f"{owner}.bias", held["bias"]
            held = {}


def adapter_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """peft's adapter keys of the (full) lora_A / lora_B tensors in `named`."""
    return {f"{PEFT_PREFIX}{name}.weight": t.detach().cpu().contiguous()
            for name, t in named if name.endswith((".lora_A", ".lora_B"))}


def save_adapter(folder: str, state: dict[str, torch.Tensor], rank: int, alpha: float, targets: list[str],
                 base_model: str) -> None:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "bias": "none", "target_modules": sorted(targets),
              "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True}
    safe_write.write_json(os.path.join(folder, ADAPTER_CONFIG), config, indent=2)
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS))


def read_adapter_config(folder: str) -> dict[str, Any]:
    """A peft LoRA adapter's config; errors name the folder."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} holds no {ADAPTER_CONFIG}: not a peft adapter folder")
    with open(path) as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or not config.get("r"):
        raise ValueError(f"{path} is not a LoRA adapter (peft_type={config.get('peft_type')!r}, r={config.get('r')!r})")
    return config


def load_adapter(model: torch.nn.Module, folder: str) -> None:
    """Copy a peft-format adapter's lora_A / lora_B into `model`'s LoRA layers (FSDP2: each rank its shard); every
    layer must be covered and every tensor used."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    wanted = {f"{PEFT_PREFIX}{name}.weight": param for name, param in model.named_parameters()
              if name.endswith((".lora_A", ".lora_B"))}
    missing, unused = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if missing or unused:
        more = lambda names: "..." if len(names) > 4 else ""   # noqa: E731
        raise RuntimeError(f"adapter {folder} does not match the model's LoRA layers: missing {missing[:4]}"
                           f"{more(missing)}, unused {unused[:4]}{more(unused)}")
    with torch.no_grad():
        for key, param in wanted.items():
            value = state[key].to(param.dtype)
            if isinstance(param, DTensor):   # FSDP2: this rank's shard
                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            param.copy_(value)
