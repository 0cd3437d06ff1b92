"""A randomly initialised Qwen2 of a real model's shape, with the bundled character tokenizer.

    python scripts/build_shaped_model.py --shape 0.5b --out /tmp/qwen2_0.5b_shaped

For throughput and scaling measurements where a real checkpoint is not available (offline GPU
machines): the layer sizes are Qwen2.5-0.5B's / ~3B's, the vocabulary is the tiny tokenizer's 21
tokens (the embedding padded to 64 rows), the weights are random, so rewards stay ~0 and only speed is meaningful.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import os

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from fully_async.core.config import asset_path

    tiny = asset_path("tiny_arithmetic/model")
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(args.seed)
    vocab = -(-len(tok) // 64) * 64  # padded like real checkpoints, so tensor parallelism can split it
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
