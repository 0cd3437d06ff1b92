"""A randomly initialised Qwen2 of a real model's shape, with the bundled character tokenizer.

    python scripts/build_shaped_model.py --shape 0.5b --out /tmp/qwen2_0.5b_shaped [--vocab real]

For throughput and scaling measurements where a real checkpoint is not available (offline GPU
machines): the layer sizes are Qwen2.5-0.5B's / ~3B's, the weights are random, so rewards stay ~0 and only speed is
meaningful.  The vocabulary (--vocab): `tokenizer` (the default, what every measurement before 2026-12-01's eleventh
session used) is the bundled tokenizer's 21 tokens, the embedding padded to 64 rows, so the output head costs next to
nothing; `real` is the real checkpoint's 151,936 rows (Qwen2.5's at every size here: at 0.5B the tied embedding is
136M of its 494M parameters, a decode step reads it whole and the update multiplies every token by it); an integer
sets the rows.  Ids past the tokenizer's are never produced by it; sampled, they decode to nothing.
"""
from __future__ import annotations

import argparse
import shutil
import sys

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008),
}
REAL_VOCAB = 151936   # Qwen2.5's embedding rows (0.5B, 1.5B and 3B alike)


def vocab_rows(vocab: str, tokenizer_size: int) -> int:
    """The embedding rows --vocab asks for: the tokenizer's padded to a multiple of 64 (as real checkpoints pad, so
    tensor parallelism can split it), Qwen2.5's, or a number of rows that holds the tokenizer."""
    if vocab == "tokenizer":
        return -(-tokenizer_size // 64) * 64
    if vocab == "real":
        return REAL_VOCAB
    try:
        rows = int(vocab)
    except ValueError:
        raise SystemExit(f"--vocab {vocab!r}: one of tokenizer, real or a number of rows") from None
    if rows < tokenizer_size:
        raise SystemExit(f"--vocab {rows}: fewer rows than the tokenizer's {tokenizer_size} tokens")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", default="tokenizer", help="tokenizer (default) | real (151,936 rows) | a number of rows")
    args = p.parse_args(argv)
    import os

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from fully_async.core.config import asset_path

    tiny = asset_path("tiny_arithmetic/model")
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(args.seed)
    vocab = vocab_rows(args.vocab, len(tok))
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                      rope_theta=1000000.0, **SHAPES[args.shape])
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out)
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(tiny, name), os.path.join(args.out, name))
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}-shaped Qwen2, {n / 1e6:.0f}M parameters (random init, {len(tok)} tokens, embedding "
          f"rows {vocab}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
