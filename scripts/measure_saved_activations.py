"""Bytes a Qwen2 decoder layer keeps for backward, eager against torch.compile (inductor), per token.

    python scripts/measure_saved_activations.py [--out saved.json] [--rows 2] [--seq 128] [--dtype bfloat16]

Why: the memory model (fully_async/planner/memory_model.py) counts what one layer saves; on CUDA the trainer compiles
each decoder layer (train/backends/torch_backend.compile_decoder_layers, actor.use_torch_compile) and inductor's
min-cut partitioner saves less than eager PyTorch (it recomputes the SwiGLU activation, norms and casts in backward).
Inductor runs on CPU too and partitions the same way, so this runs anywhere.

How: a Qwen2ForCausalLM of the 0.5B layer shape (tiny vocabulary) with 1 and with 3 layers, compiled per layer as
the trainer does, runs forward under torch.autograd.graph.saved_tensors_hooks; the pack hook records each saved
tensor's storage once (by data pointer), parameters excluded.  Half the 3-layer minus 1-layer difference is one
layer's share (embedding, final norm, head and the rotary tables cancel).  Inputs as torch_backend.token_log_probs
passes them without use_remove_padding: attention_mask and position_ids; `padded` right-pads the rows so that
transformers keeps the mask (then sdpa gets a mask and grouped kv heads are repeated to the query heads first,
as on CUDA with real batches) -- with an all-ones mask transformers drops it and sdpa repeats nothing.  A second
shape with head_dim 128 (query width 1792 != hidden 896) separates the hidden-sized from the query-sized tensors.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter


def saved_bytes(layers: int, compiled: bool, padded: bool, rows: int, seq: int, dtype: str, head_dim: int
                ) -> tuple[int, Counter]:
    """(saved bytes, Counter of (per-token elements, dtype) -> count) of one forward over rows x seq tokens."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=896, num_hidden_layers=layers, num_attention_heads=14,
                      num_key_value_heads=2, intermediate_size=4864, head_dim=head_dim, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.train()
    if compiled:  # as compile_decoder_layers
        for layer in model.model.layers:
            layer.compile(backend="inductor", dynamic=None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 64, (rows, seq))
    mask = torch.ones(rows, seq, dtype=torch.long)
    if padded:
        mask[0, seq - seq // 4:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = rows * seq

    def forward(record: dict) -> None:
        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                record[st.data_ptr()] = (st.nbytes(), str(t.dtype).replace("torch.", ""))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)

    forward({})          # the compiling pass; the measured one reuses its program (same sizes)
    seen: dict = {}
    forward(seen)
    kinds = Counter((nbytes // tokens // torch.empty((), dtype=getattr(torch, dt)).element_size(), dt)
                    for nbytes, dt in seen.values())
    return sum(nbytes for nbytes, _ in seen.values()), kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the table as JSON here")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    tokens = args.rows * args.seq
    rows = []
    print(f"{args.rows} x {args.seq} tokens, {args.dtype}; bytes per token and layer (3 layers - 1 layer) / 2")
    for head_dim in (64, 128):
        for padded in (False, True):
            for compiled in (False, True):
                one, k1 = saved_bytes(1, compiled, padded, args.rows, args.seq, args.dtype, head_dim)
                three, k3 = saved_bytes(3, compiled, padded, args.rows, args.seq, args.dtype, head_dim)
                per_layer = (three - one) / 2 / tokens
                # per-token element counts of one layer's saved tensors (the 3-layer run's extra two layers)
                kinds = {f"{elems}x{dt}": (k3[(elems, dt)] - k1.get((elems, dt), 0)) / 2
                         for elems, dt in sorted(k3) if k3[(elems, dt)] != k1.get((elems, dt), 0)}
                rows.append({"head_dim": head_dim, "q": 14 * head_dim, "kv": 2 * head_dim, "padded": padded,
                             "compiled": compiled, "bytes_per_token_layer": per_layer, "tensors": kinds})
                print(f"head_dim {head_dim:3} (q {14 * head_dim:4}, kv {2 * head_dim:3})  "
                      f"mask {'padded ' if padded else 'all-one'}  {'compiled' if compiled else 'eager   '}  "
                      f"{per_layer:9.1f}  [{', '.join(f'{n:g} x {k}' for k, n in kinds.items())}]", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "tokens": tokens, "dtype": args.dtype, "hidden": 896, "intermediate": 4864},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
