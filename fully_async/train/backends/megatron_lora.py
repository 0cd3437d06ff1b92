"""LoRA for strategy=megatron (actor_rollout_ref.model.lora_rank > 0): verl's megatron LoRA, megatron-bridge's fused
`lora` type, on our local-spec GPTModel (layer 5).

Each targeted megatron linear layer (core/lora_targets.py: linear_qkv, linear_proj, linear_fc1, linear_fc2 by
default) becomes a `LoRAParallelLinear`: the frozen layer plus a trainable lora_A (r x in) and lora_B (out x r), so
that y = x W^T (+ b) + (alpha / r) x A^T B^T, one adapter per fused layer as megatron-bridge's (q, k and v share A).
lora_A starts as `lora_A_init_method` says (megatron-bridge's default xavier: xavier_normal_; kaiming: kaiming_uniform_
with a=sqrt(5); normal: N(0, 0.2)), drawn for the whole matrix from a generator of the seed and the layer's global
name, so every layout starts from the same adapter; lora_B starts at zero.  Tensor parallelism follows the base layer:
a column-parallel layer (qkv, fc1) splits B's rows as its own and keeps A whole on every tensor rank (its gradient is
the same on each: the input of B is copied with an all-reduce of its gradient); a row-parallel layer (proj, fc2)
splits A's columns as its own input, sums A x over the tensor ranks and keeps B whole (under sequence parallelism
that sum is a reduce-scatter over the sequence and B's gradient is all-reduced over the tensor ranks with the norms').

Everything else is frozen; megatron's DDP and optimizer hold the adapters only.  The reference model is the same
model with its adapters switched off (`adapters_disabled`), as verl's.  What leaves the trainer is the merged model
(`merged_local_state`: W + (alpha / r) B A per layer, computed on each rank's own shard) under the base names; the
adapter is saved next to the checkpoint's actor/ folder in peft's format under Hugging Face's module names
(`adapter_to_peft`: a fused layer's A is every part's A, B is split as the weight is), which torch / fsdp2 runs,
peft and vLLM load; `peft_to_local` reads such an adapter back (lora_adapter_path, resume), refusing one whose q/k/v
(or gate/up) parts have different A, which a fused adapter cannot hold.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F

from fully_async.core.lora_targets import COLUMN_PARALLEL, MEGATRON_TO_HF, SUBMODULE, is_target, megatron_targets
from fully_async.train.backends import hf_megatron
from fully_async.train.backends.lora import PEFT_PREFIX, init_lora_a_

LORA_KEYS = (".lora_A", ".lora_B")


def init_lora_a(rank: int, in_features: int, method: str, seed: int, name: str) -> torch.Tensor:
    """The whole (rank x in_features) lora_A of layer `name`, float32, the same on every rank and layout."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)
    return init_lora_a_(torch.empty(rank, in_features), method, gen)


class LoRAParallelLinear(torch.nn.Module):
    """A megatron Column/RowParallelLinear (`base`, frozen) with a low-rank update; forward returns (output, bias)
    as the base does.  `kind` is the megatron layer name (linear_qkv, ...)."""

    def __init__(self, base: torch.nn.Module, kind: str, rank: int, alpha: float, lora_a: torch.Tensor,
                 tp_rank: int, tp: int, sequence_parallel: bool):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.base, self.kind, self.rank, self.alpha = base, kind, rank, alpha
        self.scaling = alpha / rank
        self.column = kind in COLUMN_PARALLEL
        self.tp, self.sequence_parallel = tp, sequence_parallel and tp > 1
        self.enabled = True
        weight = base.weight                    # this rank's shard: (out/tp, in) column, (out, in/tp) row
        base.requires_grad_(False)
        kw = dict(device=weight.device, dtype=weight.dtype)
        if self.column:
            self.lora_A = torch.nn.Parameter(lora_a.to(**kw))                                 # whole
            self.lora_B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, **kw))       # rows split
            set_tensor_model_parallel_attributes(self.lora_B, True, 0, 1)
        else:
            self.lora_A = torch.nn.Parameter(torch.chunk(lora_a, tp, dim=1)[tp_rank].to(**kw))  # columns split
            self.lora_B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, **kw))       # whole
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
            setattr(self.lora_B, "sequence_parallel", self.sequence_parallel)  # grads summed over tp (finalize)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:                 # what megatron reads of the layer (weight, config, ...)
            return getattr(self._modules["base"], name)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        out, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        from megatron.core import tensor_parallel as tpl

        if self.column:    # x: whole hidden (sequence-split under SP); out: this rank's columns
            if self.sequence_parallel:
                x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            h = F.linear(x, self.lora_A)
            if self.tp > 1:
                h = tpl.copy_to_tensor_model_parallel_region(h)   # A's gradient summed over B's row shards
            delta = F.linear(h, self.lora_B)
        else:              # x: this rank's input columns; out: whole (sequence-split under SP)
            h = F.linear(x, self.lora_A)
            if self.sequence_parallel:
                h = tpl.reduce_scatter_to_sequence_parallel_region(h)
            elif self.tp > 1:
                h = tpl.reduce_from_tensor_model_parallel_region(h)
            delta = F.linear(h, self.lora_B)
        return out + delta * self.scaling, bias

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha / r) B A (in W's dtype)."""
        w = self.base.weight
        return (w.float() + (self.lora_B.float() @ self.lora_A.float()) * self.scaling).to(w.dtype)


def apply_lora(model: torch.nn.Module, settings: tuple, init: str, seed: int, layer_offset: int, tp_rank: int,
               tp: int, sequence_parallel: bool) -> list[str]:
    """Freeze `model` (one pipeline stage's GPTModel, its first layer the model's `layer_offset`-th) and wrap its
    targeted linear layers; returns their global names (decoder.layers.<i>.<submodule>)."""
    rank, alpha, target_modules, exclude_modules = settings
    targets, excludes = megatron_targets(target_modules, exclude_modules)
    model.requires_grad_(False)
    if getattr(model, "embedding", None) is not None:     # the first stage's chunk
        model.embedding.register_forward_hook(input_requires_grad)
    names = []
    for local, layer in enumerate(model.decoder.layers):
        for kind, sub in SUBMODULE.items():
            full = f"decoder.layers.{layer_offset + local}.{sub}"
            if not is_target(full, targets, excludes):
                continue
            parent_name, _, child = sub.rpartition(".")
            parent = layer.get_submodule(parent_name)
            base = getattr(parent, child)
            setattr(parent, child, LoRAParallelLinear(base, kind, rank, alpha,
                                                      init_lora_a(rank, base.input_size, init, seed, full),
                                                      tp_rank, tp, sequence_parallel))
            names.append(full)
    return names


def input_requires_grad(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
    """Forward hook on the frozen embedding: its output requires grad while training.  Megatron's activation
    recompute (reentrant: a checkpointed layer's output requires grad only if its input does) would otherwise give
    the decoder output no gradient path and the adapters no gradients (peft's enable_input_require_grads)."""
    if isinstance(output, torch.Tensor) and torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def lora_layers(model: torch.nn.Module) -> dict[str, LoRAParallelLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAParallelLinear)}


@contextlib.contextmanager
def adapters_disabled(*models: torch.nn.Module) -> Iterator[None]:
    """The base model (the reference policy): every adapter of `models` (a model's chunks) off inside the block."""
    layers = [layer for model in models for layer in lora_layers(model).values()]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def merged_local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's megatron state dict of the merged model, under the base names (no adapters)."""
    layers = lora_layers(model)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("_extra_state") or name.endswith(LORA_KEYS):
            continue
        owner, _, leaf = name.rpartition(".base.")
        if owner in layers:
            name = f"{owner}.{leaf}"
            t = layers[owner].merged_weight() if leaf == "weight" else t
        out[name] = t
    return out


def adapter_local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's lora_A / lora_B shards, megatron names (decoder.layers.<local i>.<submodule>.lora_A)."""
    return {name: p.detach() for name, p in model.named_parameters() if name.endswith(LORA_KEYS)}


def _peft(i: int, module: str, which: str) -> str:
    return f"{PEFT_PREFIX}model.layers.{i}.{module}.{which}.weight"


def adapter_to_peft(shards: list[Mapping[str, torch.Tensor]], hf_config: Any, pp_rank: int = 0,
                    pp: int = 1) -> dict[str, torch.Tensor]:
    """peft's adapter tensors (Hugging Face module names, CPU) of one pipeline stage from every tensor rank's
    adapter_local_state: a fused layer's A goes to each of its parts, B is cut as the layer's weight is."""
    nh, ng, hd = hf_megatron._heads(hf_config)
    out: dict[str, torch.Tensor] = {}

    def cat(key: str, dim: int) -> torch.Tensor:
        return torch.cat([s[key].cpu() for s in shards], dim=dim)

    for local, i in enumerate(hf_megatron._stage_layers(hf_config, pp_rank, pp)):
        for kind, sub in SUBMODULE.items():
            key = f"decoder.layers.{local}.{sub}"
            if key + ".lora_A" not in shards[0]:
                continue
            if kind in COLUMN_PARALLEL:
                a = shards[0][key + ".lora_A"].cpu()
                if kind == "linear_qkv":
                    bs = hf_megatron.split_qkv(cat(key + ".lora_B", 0), nh, ng, hd)
                else:                          # each rank's rows are [gate; up] of its own columns
                    halves = [torch.chunk(s[key + ".lora_B"].cpu(), 2, dim=0) for s in shards]
                    bs = (torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
            else:
                a, bs = cat(key + ".lora_A", 1), (shards[0][key + ".lora_B"].cpu(),)
            for module, b in zip(MEGATRON_TO_HF[kind], bs):
                out[_peft(i, module, "lora_A")] = a.clone().contiguous()
                out[_peft(i, module, "lora_B")] = b.clone().contiguous()
    return out


def peft_to_local(state: Mapping[str, torch.Tensor], wanted: list[str], hf_config: Any, tp_rank: int, tp: int,
                  pp_rank: int, pp: int, source: str) -> dict[str, torch.Tensor]:
    """This rank's lora_A / lora_B (megatron local names) for the wrapped layers `wanted` (their local names) from a
    peft adapter's tensors; errors name the adapter `source` and what does not fit."""
    _, ng, _ = hf_megatron._heads(hf_config)
    offset = hf_megatron._stage_layers(hf_config, pp_rank, pp).start
    out: dict[str, torch.Tensor] = {}
    used = set()
    for key in wanted:                         # decoder.layers.<local>.<submodule>
        local = int(key.split(".")[2])
        kind = key.rsplit(".", 1)[-1]
        modules = MEGATRON_TO_HF[kind]
        names = [(_peft(local + offset, m, "lora_A"), _peft(local + offset, m, "lora_B")) for m in modules]
        missing = [n for pair in names for n in pair if n not in state]
        if missing:
            raise RuntimeError(f"adapter {source} does not cover the model's LoRA layer {key}: missing {missing[:2]}")
        used.update(n for pair in names for n in pair)
        a_parts, b_parts = [state[a] for a, _ in names], [state[b] for _, b in names]
        if any(not torch.equal(a_parts[0], a) for a in a_parts[1:]):
            raise RuntimeError(f"adapter {source}: {', '.join(modules)} of layer {local + offset} have different "
                               "lora_A; strategy=megatron's fused LoRA shares one A across them (an adapter trained "
                               "by strategy=fsdp / torch loads there, not here)")
        if kind == "linear_qkv":
            b = torch.chunk(hf_megatron.fuse_qkv(*b_parts, ng), tp, dim=0)[tp_rank]
        elif kind == "linear_fc1":
            b = torch.cat([torch.chunk(p, tp, dim=0)[tp_rank] for p in b_parts])
        else:
            b = b_parts[0]
        a = a_parts[0] if kind in COLUMN_PARALLEL else torch.chunk(a_parts[0], tp, dim=1)[tp_rank]
        out[key + ".lora_A"], out[key + ".lora_B"] = a.contiguous(), b.contiguous()
    stage = {n for n in state if n.startswith(PEFT_PREFIX + "model.layers.")
             and int(n.split(".")[4]) in hf_megatron._stage_layers(hf_config, pp_rank, pp)}
    unused = sorted(stage - used)
    if unused:
        raise RuntimeError(f"adapter {source} holds layers this model's LoRA does not have (target_modules): "
                           f"{unused[:4]}")
    return out


@torch.no_grad()
def load_local(model: torch.nn.Module, local: Mapping[str, torch.Tensor]) -> None:
    """Copy `local` (peft_to_local's output) into the model's adapters."""
    params = dict(model.named_parameters())
    for name, value in local.items():
        params[name].copy_(value.to(params[name].dtype))

