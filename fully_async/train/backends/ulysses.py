"""Ulysses sequence parallelism for the torch/fsdp2 strategy (actor_rollout_ref.actor.ulysses_sequence_parallel_size).

The trainer's W ranks form W / sp groups of sp consecutive ranks.  The ranks of one group get the same rows (one
data-parallel shard: train/sharding.py cuts a mini-batch into W / sp shards) and each computes 1/sp of every
packed micro-batch's tokens: `split_packed` pads the packed (1, T) row to a multiple of sp (the padding is a
sequence of its own) and hands rank i tokens [i T/sp, (i+1) T/sp).  Everything but attention is per token; the
attention function registered here as "ulysses" turns the sequence split into a head split with an all-to-all
(each rank then holds all T tokens of H/sp heads and attends within each packed sequence, the boundaries being
the whole row's), runs the device's varlen attention (`base`: "varlen", or flash_attention_2 on Ascend) and turns
the result back with a second all-to-all.  Key/value heads fewer than sp, or not a multiple of it, are repeated
first (grouped-query attention stays aligned: sp divides the query heads, config_checks/prepare say so).

The per-token outputs (log-probs, entropy, values) are gathered over the group (`gather_tokens`; its backward
keeps this rank's slice of the gradient), so every rank of a group computes the same loss of its shard.  FSDP2
averages gradients over all W ranks, and the sum over one group's ranks of their slices' gradients is the
shard's gradient: the backend multiplies the loss by W (not W / sp) to get the mini-batch's gradient back, the
same numbers as one device.  Metrics are reported by the group's first rank only.

All ranks build every group (torch.distributed.new_group is collective); the group is process-wide state, set once
by the backend before its models are built (gradient checkpointing reruns attention during backward, outside any
call the backend could scope).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fully_async.core import varlen_attention

NAME = "ulysses"


@dataclass(frozen=True)
class SequenceParallel:
    group: Any       # this rank's torch.distributed group of `size` consecutive ranks
    size: int
    rank: int        # this rank's place in the group
    base: str        # the attention implementation each rank runs on its heads ("varlen", "flash_attention_2", ...)


_CURRENT: Optional[SequenceParallel] = None


def current() -> Optional[SequenceParallel]:
    """This process's sequence-parallel group (None: no sequence parallelism)."""
    return _CURRENT


def setup(size: int, base: str) -> Optional[SequenceParallel]:
    """Join the sequence-parallel groups of `size` consecutive ranks of the trainer's process group (collective:
    every rank calls it) and register the "ulysses" attention over `base`; None (nothing done) for size 1."""
    global _CURRENT
    if size <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the trainer's {world} ranks")
    if _CURRENT is not None:
        if (_CURRENT.size, _CURRENT.base) != (size, base):
            raise RuntimeError(f"sequence parallelism is already set up at {_CURRENT.size} over {_CURRENT.base}")
        return _CURRENT
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    _CURRENT = SequenceParallel(mine, size, rank % size, base)
    return _CURRENT


# ------------------------------------------------------------------------------------------------- collectives
def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk `x` along scatter_dim, send chunk j to rank j, concatenate what arrives along gather_dim (rank order)."""
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherTokens(torch.autograd.Function):
    """All-gather along the last dim; backward: this rank's slice of the gradient (every rank computes the same loss
    from the gathered values, so no sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.rank, ctx.n = sp.rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


# ------------------------------------------------------------------------------------------------- tokens
def split_packed(inputs: dict[str, Any], targets: torch.Tensor, sp: SequenceParallel
                 ) -> tuple[dict[str, Any], torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(this rank's forward inputs, its targets, gather) of a packed (1, T) micro-batch: the row padded to a
    multiple of sp (pad tokens form a sequence of their own, position 0..), rank i's contiguous T'/sp tokens, the
    sequence boundaries of the whole row.  `gather(values)` takes this rank's per-token values (flattened) back to
    the whole row's T (flattened), differentiably."""
    ids, pos = inputs["input_ids"], inputs["position_ids"]
    if ids.shape[0] != 1:
        raise ValueError("sequence parallelism needs packed micro-batches (actor_rollout_ref.model."
                         "use_remove_padding=true)")
    total = ids.shape[1]
    pad = (-total) % sp.size
    if pad:
        ids = F.pad(ids, (0, pad))
        targets = F.pad(targets, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1)
    n = ids.shape[1] // sp.size
    mine = slice(sp.rank * n, (sp.rank + 1) * n)
    local = dict(inputs, input_ids=ids[:, mine], position_ids=pos[:, mine], **_whole_row_bounds(inputs, pos, pad))

    def gather(values: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(values.reshape(-1), sp)[:total]

    return local, targets[:, mine], gather


def _whole_row_bounds(inputs: dict[str, Any], pos: torch.Tensor, pad: int) -> dict[str, Any]:
    """The padded row's sequence boundaries: the packed inputs' own (torch_backend.model_inputs, worked out on the
    host: core/batch.PackedRows) with the pad sequence appended, so nothing is read back from the device."""
    cu, longest = inputs["cu_seq_lens_q"], inputs["max_length_q"]
    if pad:
        cu = torch.cat([cu, cu.new_tensor([int(pos.shape[1])])])
        longest = max(int(longest), pad)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


# ------------------------------------------------------------------------------------------------- attention
def _base_attention(name: str) -> Callable:
    if name == varlen_attention.NAME:
        return varlen_attention.varlen_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _repeat_kv(key: torch.Tensor, value: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, T, D) key/value with each head repeated so that `size` divides the head count (grouped-query
    attention stays aligned when `size` divides the query heads)."""
    rep = size // math.gcd(key.shape[1], size)
    if rep == 1:
        return key, value
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


@torch.compiler.disable   # compiled decoder layers (actor.use_torch_compile) run the collectives eagerly
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (1, Hq, T/sp, D), key/value (1, Hkv, T/sp, D) of this rank's tokens -> (1, T/sp, Hq, D): all heads of
    its tokens, attended over the whole row."""
    sp = _CURRENT
    if sp is None:
        raise RuntimeError("attn_implementation=ulysses outside a sequence-parallel trainer (ulysses.setup)")
    if query.shape[1] % sp.size:
        raise ValueError(f"{query.shape[1]} attention heads do not split over ulysses_sequence_parallel_size="
                         f"{sp.size}")
    key, value = _repeat_kv(key, value, sp.size)
    kwargs.pop("position_ids", None)   # this rank's slice: the boundaries are the whole row's cu_seq_lens_*
    # sequence split -> head split: (1, H, T/sp, D) -> (1, H/sp, T, D)
    q, k, v = (_AllToAll.apply(t, sp.group, 1, 2) for t in (query, key, value))
    out, _ = _base_attention(sp.base)(module, q, k, v, attention_mask, **kwargs)   # (1, T, H/sp, D)
    # head split -> sequence split: (1, T, H/sp, D) -> (1, T/sp, H, D)
    return _AllToAll.apply(out, sp.group, 1, 2), None


def teardown() -> None:
    """Forget this process's group (its process group is being destroyed); a later setup starts afresh."""
    global _CURRENT
    _CURRENT = None
