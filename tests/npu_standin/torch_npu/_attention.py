"""`torch_npu.npu_fusion_attention` over torch's scaled-dot-product attention (per sequence for the TND layout)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from torch_npu import _standin

_SEEN: set = set()
_CAUSAL_MODES = (2, 3)   # 2: top-left aligned causal, 3: down-right aligned (transformers' default)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mode: int) -> torch.Tensor:
    """(N, S, D) per head; GQA when k/v have fewer heads."""
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None
    if causal and lq != lk:
        offset = lk - lq if mode == 3 else 0
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=k.shape[-3] != q.shape[-3])


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: Any = None, padding_mask: Any = None,
                         atten_mask: Optional[torch.Tensor] = None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = 2147483647, next_tockens: int = 2147483647, inner_precise: int = 0,
                         prefix: Any = None, actual_seq_qlen: Optional[Sequence[int]] = None,
                         actual_seq_kvlen: Optional[Sequence[int]] = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False) -> tuple:
    """What the package and transformers call: BSND / BNSD / BSH / TND layouts, no dropout, the causal sparse
    modes (2, 3) or no mask.  Returns torch_npu's 7-tuple (attention_out first; the softmax statistics empty)."""
    if keep_prob != 1.0 or pse is not None or padding_mask is not None:
        raise NotImplementedError("NPU stand-in: npu_fusion_attention without dropout, pse or padding_mask only")
    if atten_mask is not None and sparse_mode not in _CAUSAL_MODES:
        raise NotImplementedError(f"NPU stand-in: atten_mask with sparse_mode={sparse_mode}")
    causal = atten_mask is not None
    if (input_layout, causal) not in _SEEN:
        _SEEN.add((input_layout, causal))
        _standin.log("npu_fusion_attention", layout=input_layout, causal=causal, sparse_mode=sparse_mode)
    if input_layout == "TND":
        out = _tnd(query, key, value, causal, scale, sparse_mode, actual_seq_qlen, actual_seq_kvlen)
    elif input_layout in ("BSND", "BNSD", "BSH"):
        out = _batched(query, key, value, head_num, input_layout, causal, scale, sparse_mode)
    else:
        raise NotImplementedError(f"NPU stand-in: input_layout={input_layout!r}")
    empty = torch.empty(0, device=query.device)
    return out, empty, empty, empty, 0, 0, 0


def _batched(q, k, v, head_num, layout, causal, scale, mode):
    if layout == "BSH":
        b, s, h = q.shape
        q, k, v = (t.view(b, t.shape[1], -1, h // head_num) for t in (q, k, v))
    if layout in ("BSND", "BSH"):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))          # -> B N S D
    out = _sdpa(q, k, v, causal, scale, mode)
    if layout == "BNSD":
        return out
    out = out.transpose(1, 2)
    return out.reshape(out.shape[0], out.shape[1], -1) if layout == "BSH" else out


def _tnd(q, k, v, causal, scale, mode, qlen, kvlen):
    """T N D with cumulative end offsets per sequence (actual_seq_qlen / actual_seq_kvlen, torch_npu's TND)."""
    if qlen is None or kvlen is None or len(qlen) != len(kvlen):
        raise ValueError("TND layout needs actual_seq_qlen and actual_seq_kvlen of equal length")
    outs, q0, k0 = [], 0, 0
    for q1, k1 in zip(qlen, kvlen):
        qs, ks, vs = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))    # N S D
        outs.append(_sdpa(qs, ks, vs, causal, scale, mode).transpose(0, 1))
        q0, k0 = q1, k1
    return torch.cat(outs, dim=0)
