"""The embedded engine's decode forward for llama-family decoders (Llama, Qwen2/2.5, Qwen3, Mistral), written as
two functions per layer that torch.compile can fuse.

Why: a captured decode step of transformers' modules is ~40 small kernels per layer (RMSNorm alone is seven,
rotary embeddings ten), and at decode batch sizes each costs more than its arithmetic: on one H100 the 0.5B
shape spends ~3.4 ms per step whether 64 or 256 sequences decode.  Here each layer is
    attn_in  : the previous layer's MLP residual -> RMSNorm -> q/k/v projections (-> Qwen3's q/k RMSNorm) ->
               rotary embedding (with split-KV attention: inside its kernel)
    (eager)  : write the new key/value into the slot cache in place, then grouped-query attention over each
               row's cached positions: decode_attention.py's split-KV kernel, which reads each row's own length
               (CUDA), or SDPA over the span bucket under a mask (elsewhere, or split_kv=False)
    attn_out : o projection + residual -> RMSNorm -> SwiGLU MLP (its residual added by the next attn_in, or the
               final norm, in the same kernel as that RMSNorm); with fused_mlp (CUDA, where the split-KV attention
               runs) the decode step's MLP is attn_mid (o projection + residual -> RMSNorm), then the gate/up
               projection and SwiGLU as one Triton kernel (decode_mlp.py), then the down projection
The projections that read the same input run as one matrix product each: q/k/v and gate/up
(`fuse_projections` lays each group's weights out side by side in one tensor, the modules' parameters views of it,
so weight updates, sleeps at fixed addresses and transformers' own prefill keep working on the same storage; at
the 0.5B shape on 1x H200 that is 72 fewer kernels per decode step).
`attn_in`/`attn_out` take the layer's weights as arguments, so one compiled program serves every layer (a
compile per function, not per layer: seconds at start-up, cached on disk by inductor between runs), with
dynamic batch and span sizes.  Uncompiled (cpu, npu, or no compile backend) the same functions run eagerly and
compute what transformers computes, op for op.

`unsupported_reason(model)` says why a model cannot take this path (the engine then runs transformers' own
modules); the math follows transformers' modeling_{llama,qwen2,qwen3,mistral}.py.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported_reason(model: Any) -> Optional[str]:
    """None when `model` (an AutoModelForCausalLM) is a llama-family decoder this module reproduces exactly."""
    c = model.config
    if c.model_type not in FAMILIES:
        return f"model_type {c.model_type!r} is not one of {FAMILIES}"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"hidden_act {c.hidden_act!r} (only silu)"
    base = model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the decoder has no {name!r}"
    layer = base.layers[0]
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
        if not hasattr(layer, name):
            return f"a decoder layer has no {name!r}"
    for group in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                  (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
        for name in group[1]:
            if not isinstance(getattr(group[0], name, None), torch.nn.Linear):
                return f"a decoder layer's {name!r} is not a torch.nn.Linear"
    for group in projection_groups(layer):
        if len({lin.bias is None for lin in group}) > 1:
            return "a projection group (q/k/v or gate/up) mixes layers with and without bias"
    if getattr(c, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm/Qwen2RMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def projection_groups(layer: Any) -> list[list[Any]]:
    """The linear layers of a decoder layer that read the same input: q/k/v, then gate/up."""
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]]


def side_by_side(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """One tensor over `tensors` when they lie back to back in one storage (rows of a concatenation), else None."""
    first = tensors[0]
    off = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.shape[1:] != first.shape[1:] or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != off):
            return None
        off += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def fuse_projections(model: Any) -> int:
    """Lay out the weights (and biases) of each projection group (`projection_groups`) back to back in one tensor
    and make the modules' parameters views of it; groups already laid out so are left alone, as are groups whose
    members differ in bias.  Returns the groups moved.  Transient memory: one group's weights."""
    moved = 0
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            for group in projection_groups(layer):
                for attr in ("weight", "bias"):
                    params = [getattr(lin, attr, None) for lin in group]
                    if any(p is None for p in params) or side_by_side(params) is not None:
                        continue
                    whole = torch.cat([p.data for p in params])
                    start = 0
                    for p in params:
                        p.data = whole[start:start + p.shape[0]]
                        start += p.shape[0]
                    moved += 1
    return moved


def attn_in(x: torch.Tensor, delta: Optional[torch.Tensor], cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
            ln: torch.Tensor, wqkv: torch.Tensor, bqkv: Optional[torch.Tensor], q_norm: Optional[torch.Tensor],
            k_norm: Optional[torch.Tensor], eps: float, heads: int, kv_heads: int, head_dim: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream x (B, 1, hidden) plus the previous layer's MLP output `delta` (None at the first layer) ->
    query (B, heads, 1, D), key and value (B, kv_heads, 1, D), rotary applied, and the residual stream; wqkv/bqkv:
    the q, k and v projections' weights (biases) back to back.  cos None: query (B, 1, heads, D) and key and
    value (B, 1, kv_heads, D), views of the projection's output, not rotated (the split-KV kernel rotates them)."""
    batch = x.shape[0]
    if delta is not None:
        x = x + delta
    h = _rms(x, ln, eps)
    q, k, v = F.linear(h, wqkv, bqkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.reshape(batch, 1, heads, head_dim)
    k = k.reshape(batch, 1, kv_heads, head_dim)
    v = v.reshape(batch, 1, kv_heads, head_dim)
    if q_norm is not None:
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    if cos is None:
        return q, k, v, x
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                  # (B, 1, D) -> (B, 1, 1, D)
    return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), x


def attn_out(x: torch.Tensor, attn: torch.Tensor, wo: torch.Tensor, bo: Optional[torch.Tensor], ln: torch.Tensor,
             wgu: torch.Tensor, bgu: Optional[torch.Tensor], wd: torch.Tensor, bd: Optional[torch.Tensor],
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, mlp): the residual stream after attention, x + o(attn), and the MLP's output SwiGLU(RMSNorm(h)), which
    the next attn_in (or final_norm) adds to h; wgu/bgu: the gate and up projections' weights (biases) back to
    back."""
    h, normed = attn_mid(x, attn, wo, bo, ln, eps)
    gate, up = F.linear(normed, wgu, bgu).chunk(2, dim=-1)
    return h, F.linear(F.silu(gate) * up, wd, bd)


def attn_mid(x: torch.Tensor, attn: torch.Tensor, wo: torch.Tensor, bo: Optional[torch.Tensor], ln: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_out's first half: (h, RMSNorm(h)) with h = x + o(attn); the MLP then runs as decode_mlp's gate/up +
    SwiGLU kernel and the down projection."""
    h = x + F.linear(attn, wo, bo)
    return h, _rms(h, ln, eps)


def final_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x + delta, weight, eps)


_COMPILED: dict[str, tuple[Callable, ...]] = {}


def _compiled(backend: str) -> tuple[Callable, ...]:
    """One compiled program per function per process, shared by every layer and every engine (dynamic sizes)."""
    if backend not in _COMPILED:
        _COMPILED[backend] = tuple(torch.compile(f, backend=backend, dynamic=True)
                                   for f in (attn_in, attn_out, final_norm, attn_mid))
    return _COMPILED[backend]


def _bias(linear: torch.nn.Module) -> Optional[torch.Tensor]:
    return getattr(linear, "bias", None)


class FusedDecoder:
    """Decode forward of one token per row over a slot cache, reading the model's own parameters (so in-place
    weight updates apply, and a model moved by sleep/wake is read at its new place)."""

    def __init__(self, model: Any, compile_backend: Optional[str] = None, split_kv: bool = False,
                 fused_mlp: bool = False):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode: {reason}")
        self.model, self.base = model, model.get_decoder()
        c = model.config
        self.eps = float(c.rms_norm_eps)
        attn = self.base.layers[0].self_attn
        self.head_dim = int(getattr(attn, "head_dim", c.hidden_size // c.num_attention_heads))
        self.heads = int(c.num_attention_heads)
        self.kv_heads = int(getattr(c, "num_key_value_heads", None) or self.heads)
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.compiled = compile_backend is not None
        self.split_kv = split_kv
        self._in, self._out, self._norm, self._mid = (_compiled(compile_backend) if self.compiled
                                                      else (attn_in, attn_out, final_norm, attn_mid))
        self.fused_mlp = fused_mlp
        self.bind()

    def bind(self) -> None:
        """Read the layers' weights where they are now, each projection group as one tensor (`fuse_projections`
        first lays out any group that is not back to back: after a sleep that moved the weights one by one)."""
        fuse_projections(self.model)
        self.layers = []
        for layer in self.base.layers:
            a, m = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            qkv, gate_up = (self._joined(group) for group in projection_groups(layer))
            self.layers.append((
                (layer.input_layernorm.weight, *qkv, q_norm.weight if q_norm is not None else None,
                 k_norm.weight if k_norm is not None else None),
                (a.o_proj.weight, _bias(a.o_proj), layer.post_attention_layernorm.weight, *gate_up,
                 m.down_proj.weight, _bias(m.down_proj))))

    @staticmethod
    def _joined(group: list[Any]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias or None) of a projection group, each one tensor over the members' back-to-back storage."""
        weight = side_by_side([lin.weight for lin in group])
        biases = [_bias(lin) for lin in group]
        bias = None if all(b is None for b in biases) else side_by_side(biases)
        if weight is None or (bias is None and any(b is not None for b in biases)):
            raise RuntimeError("fused decode: a projection group's weights are not back to back "
                               "(fuse_projections(model) lays them out)")
        return weight, bias

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cu: torch.Tensor,
                max_len: int, keys: list[torch.Tensor], values: list[torch.Tensor], prefix: int = 0) -> torch.Tensor:
        """Packed prefill: ids (T,) hold the joining sequences back to back, sequence i at tokens [cu[i], cu[i+1]),
        token t at position positions[t] of slot slots[t].  Each token is a row of the same per-layer functions
        the decode step runs (norms, projections and rotary fused where compiled; matrix products at T rows); its
        key/value is written into its slot, and attention is causal within each sequence (FlashAttention's
        varlen kernel where it runs, core/varlen_attention.py).  No padding: the work is the real tokens.
        `prefix` > 0: one sequence, the next chunk of a longer request whose first `prefix` positions its slot already
        holds; its tokens also attend to those (causal, aligned to the bottom right).
        Returns the final hidden states (after the last norm) at each sequence's last token, (N, hidden)."""
        from fully_async.core.varlen_attention import packed_causal_attention

        tokens = ids.shape[0]
        span = prefix + tokens
        cu_k = torch.tensor([0, span], dtype=torch.int32, device=ids.device) if prefix else None
        x = self.base.embed_tokens(ids[:, None])                                   # (T, 1, hidden)
        cos, sin = self.base.rotary_emb(x, positions[:, None])
        delta = None
        for (w_in, w_out), k_buf, v_buf in zip(self.layers, keys, values):
            q, k, v, x = self._in(x, delta, cos, sin, *w_in, self.eps, self.heads, self.kv_heads, self.head_dim)
            k, v = k[:, :, 0], v[:, :, 0]                                          # (T, kv_heads, D)
            k_buf[slots, :, positions] = k
            v_buf[slots, :, positions] = v
            if prefix:   # the chunk's queries over its slot's keys: the cached prefix and the chunk itself
                k, v = k_buf[slots[0], :, :span].transpose(0, 1), v_buf[slots[0], :, :span].transpose(0, 1)
            out = packed_causal_attention(q[:, :, 0], k, v, cu, max_len, self.scaling, cu_k, span)
            x, delta = self._out(x, out.reshape(tokens, 1, self.heads * self.head_dim), *w_out, self.eps)
        last = cu[1:].long() - 1
        return self._norm(x[last, 0], delta[last, 0], self.base.norm.weight, self.eps)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor],
                 keys: list[torch.Tensor], values: list[torch.Tensor], span: int) -> torch.Tensor:
        """ids (B, 1) at `positions` (B,): write each row's key/value at its position in slot row i of every
        layer's cache, attend over columns [0, span) under the additive `mask` (B, 1, 1, span) -- with split_kv,
        over columns [0, min(position + 1, span)) of each row, and `mask` is not used (None); returns the final
        hidden states (B, hidden) after the model's last norm."""
        batch = ids.shape[0]
        if self.split_kv:
            from fully_async.rollout.engines.decode_attention import split_kv_decode_attention

            lengths = positions + 1
        elif mask.device.type == "npu" and mask.dtype != torch.bool:
            mask = mask == 0     # NPU's fused SDPA takes a boolean "may attend" mask
        x = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(x, positions.unsqueeze(1))
        rows = torch.arange(batch, device=ids.device)
        groups = self.heads // self.kv_heads
        delta = None
        mlp = self._mlp_for(batch)
        for (w_in, w_out), k_buf, v_buf in zip(self.layers, keys, values):
            if self.split_kv:   # rotates the query and key and writes the new key/value at each row's position itself
                q, k, v, x = self._in(x, delta, None, None, *w_in, self.eps, self.heads, self.kv_heads,
                                      self.head_dim)
                out = split_kv_decode_attention(q.view(batch, self.kv_heads, groups, self.head_dim), k_buf, v_buf,
                                                lengths, span, self.scaling, k[:, 0], v[:, 0], cos[:, 0], sin[:, 0])
            else:
                q, k, v, x = self._in(x, delta, cos, sin, *w_in, self.eps, self.heads, self.kv_heads, self.head_dim)
                q = q.reshape(batch, self.kv_heads, groups, self.head_dim)
                k_buf[rows, :, positions] = k[:, :, 0]
                v_buf[rows, :, positions] = v[:, :, 0]
                out = F.scaled_dot_product_attention(q, k_buf[:batch, :, :span], v_buf[:batch, :, :span],
                                                     attn_mask=mask, scale=self.scaling)
            x, delta = mlp(x, out.reshape(batch, 1, self.heads * self.head_dim), *w_out, self.eps)
        return self._norm(x[:, 0], delta[:, 0], self.base.norm.weight, self.eps)

    def _mlp_for(self, batch: int) -> Callable:
        """attn_out, or -- with fused_mlp and a tile for this batch (decode_mlp.TILES) -- attn_mid, then the gate/up
        projection and SwiGLU in one kernel, then the down projection."""
        tile = None
        if self.fused_mlp:
            from fully_async.rollout.engines.decode_mlp import swiglu_matmul, tile_for
            tile = tile_for(batch)
        if tile is None:
            return self._out

        def mlp(x, attn, wo, bo, ln, wgu, bgu, wd, bd, eps):
            h, normed = self._mid(x, attn, wo, bo, ln, eps)
            return h, F.linear(swiglu_matmul(normed, wgu, bgu, tile), wd, bd)
        return mlp
