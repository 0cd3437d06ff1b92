"""Packed-sequence attention for model.use_remove_padding, registered with transformers as "varlen".

Why: a packed micro-batch is one (1, T) row holding many sequences.  transformers' sdpa/eager
keep them apart with a dense (T, T) block-diagonal mask, so attention costs T^2 however short
the sequences are; its flex_attention path recompiles whenever the packed length or the
train/eval mode changes (measured on 1x H200: 58 s per log-prob pass).  This function takes the
sequence boundaries (transformers' FlashAttentionKwargs `cu_seq_lens_q/k`, `max_length_q/k`,
passed by torch_backend.token_log_probs) and attends within each sequence only:
- CUDA, half precision: `torch.nn.attention.varlen.varlen_attn`, the FlashAttention varlen kernel
  that ships with torch (no flash-attn package needed);
- Ascend NPU, half precision: torch_npu's npu_fusion_attention over the packed (TND) batch;
- anything else (CPU, float32): causal sdpa per sequence (sum of l_i^2 work, no mask).
A call without boundaries treats each row as one causal sequence (right-padded rows: real
tokens never see the padding after them).  Ascend's trainer uses transformers' flash_attention_2, which
maps onto the same torch_npu kernel (device.py picks it); the embedded engine's packed prefill calls this.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

from fully_async.core import triton_attention

NAME = "varlen"


@functools.lru_cache(maxsize=1)
def _flash_varlen() -> Optional[tuple[Any, set[str]]]:
    """torch's varlen_attn and its keyword names (they changed between torch releases), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: Optional[float]) -> torch.Tensor:
    """FlashAttention's varlen kernel, causal: where a sequence has fewer queries than keys, the mask is aligned to
    the bottom right (its queries are the last of its keys), FlashAttention 2's rule for both signatures."""
    fn, params = _flash_varlen()
    kwargs: dict[str, Any] = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)           # causal, in the newer signature
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def flash_varlen_available() -> bool:
    """This torch ships the FlashAttention varlen kernel (torch.nn.attention.varlen)."""
    return _flash_varlen() is not None


def flash_runs(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """The FlashAttention varlen kernel runs for these: CUDA, 16-bit floats, head_dim <= 256, a torch that ships it."""
    return (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and flash_varlen_available())


# FULLY_ASYNC_PACKED_ATTENTION picks the CUDA kernel of packed_causal_attention: "flash" (torch's FlashAttention
# varlen), "triton" (core/triton_attention.py), or "auto" (the default: `resolve_packed_kernel`); read at import
PACKED_KERNEL = os.environ.get("FULLY_ASYNC_PACKED_ATTENTION", "auto")
if PACKED_KERNEL not in ("auto", "flash", "triton"):
    raise ValueError(f"FULLY_ASYNC_PACKED_ATTENTION={PACKED_KERNEL!r}: use auto, flash or triton")
_AUTO: list[str] = []     # what "auto" chose, once a process (one kind of CUDA device a process)


def resolve_packed_kernel(device: torch.device) -> str:
    """What "auto" runs on this CUDA device: the Triton kernels on Hopper (compute capability 9.x, the one measured:
    at the seed-003 update's micro-batches on 1x H200, forward 0.27-0.32 ms against FlashAttention's 0.63-0.67;
    docs/measurements/triton_attention_h200/) at the head sizes measured faster there
    (triton_attention.FASTER_ON_HOPPER), FlashAttention on the others.  Decided once; the trainer and the
    engine call this at set-up, before their layers are compiled, so the compiled code only reads the answer."""
    if not _AUTO:
        from fully_async.device import get_device

        capability = get_device(device.type).compute_capability(device.index or 0) if device.type == "cuda" else None
        _AUTO.append("triton" if capability is not None and capability[0] == 9 else "flash")
    return _AUTO[0]


def fused_kernel(query: torch.Tensor) -> Optional[str]:
    """The CUDA kernel packed_causal_attention runs for this query: "triton", "flash" or None (neither runs)."""
    device_type, dtype, head_dim = query.device.type, query.dtype, query.shape[-1]
    if device_type != "cuda":
        return None
    if PACKED_KERNEL == "auto":
        on_hopper = (_AUTO[0] if _AUTO else resolve_packed_kernel(query.device)) == "triton"
        want = "triton" if on_hopper and head_dim in triton_attention.FASTER_ON_HOPPER else "flash"
    else:
        want = PACKED_KERNEL
    if want == "triton" and triton_attention.supported(device_type, dtype, head_dim) is None:
        return "triton"
    return "flash" if flash_runs(device_type, dtype, head_dim) else None


def fused_varlen_runs(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """A fused varlen attention kernel runs for these: FlashAttention's (`flash_runs`) or, on an Ascend NPU in 16-bit
    floats, torch_npu's npu_fusion_attention (packed_causal_attention uses whichever is there)."""
    if device_type == "npu":
        return dtype in (torch.float16, torch.bfloat16)
    return flash_runs(device_type, dtype, head_dim)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Causal sdpa over (..., H, T, D), keys (..., Hkv, S, D) with S >= T: query i sees keys [0, S - T + i] (aligned
    to the bottom right: torch's CausalBias, no materialised mask, where S > T).  Grouped kv heads are repeated
    (sdpa's enable_gqa needs torch 2.5); 3-d inputs get a batch dimension (sdpa's fused kernels take 4-d only)."""
    if q.dim() == 3:
        return _causal_sdpa(q[None], k[None], v[None], scale)[0]
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    if k.shape[-2] == q.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                          scale=scale)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                             dropout: float = 0.0, sliding_window: Optional[int] = None, **kwargs: Any
                             ) -> tuple[torch.Tensor, None]:
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D), as transformers expects."""
    if sliding_window is not None:
        raise NotImplementedError("attn_implementation=varlen does not implement sliding-window attention; "
                                  "use sdpa for this model")
    if dropout:
        raise NotImplementedError(f"attn_implementation=varlen has no attention dropout (got {dropout}); set "
                                  "override_config.attention_dropout=0")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        return _causal_sdpa(query, key, value, scaling).transpose(1, 2).contiguous(), None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))          # (T, H, D)
    return packed_causal_attention(q, k, v, cu, kwargs.get("max_length_q"), scaling)[None], None


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                            max_len: Optional[int], scale: Optional[float], cu_k: Optional[torch.Tensor] = None,
                            max_k: Optional[int] = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch: q (T, Hq, D), k/v (S, Hkv, D), sequence i's queries
    at tokens [cu[i], cu[i+1]) and its keys at [cu_k[i], cu_k[i+1]) (cu_k None: the same as cu).  A sequence with
    more keys than queries (a chunk after its cached prefix) has its queries at the end of its keys: query j sees
    keys up to the one at its own position.  Returns (T, Hq, D).  torch_npu's fused attention on an NPU in 16-bit
    floats, the fused CUDA kernel where one runs (`fused_kernel`: ours in Triton or FlashAttention's varlen), else causal sdpa per sequence."""
    if cu_k is None:
        cu_k, max_k = cu, max_len
    if q.device.type == "npu" and fused_varlen_runs("npu", q.dtype, q.shape[-1]):
        from fully_async.device import npu_packed_causal_attention

        return npu_packed_causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu_k,
                                           q.shape[-1] ** -0.5 if scale is None else scale)
    kernel = fused_kernel(q)
    if kernel is not None:
        cu_q, cu_k = cu.to(torch.int32), cu_k.to(torch.int32)
        # no int() of a given length: under torch.compile it is a symbolic int, and int() would pin the compiled
        # layer to its value (a recompile for every micro-batch's longest sequence)
        max_q = max_len if max_len is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = max_k if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        if kernel == "triton":
            return triton_attention.packed_attention(q, k, v, cu_q, cu_k, max_q, max_k,
                                                     q.shape[-1] ** -0.5 if scale is None else scale)
        return flash_call(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, scale)
    bounds, key_bounds = cu.tolist(), cu_k.tolist()
    parts = [_causal_sdpa(q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1),
                          scale).transpose(0, 1)
             for a, b, c, d in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:])]
    return torch.cat(parts)


def register() -> None:
    """Make attn_implementation="varlen" known to transformers (idempotent; every trainer process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
