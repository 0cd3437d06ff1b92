"""Build the bundled default task: a tiny Qwen2 "warm-started" policy for 2-number addition.

Outputs (default ``fully_async/assets/tiny_arithmetic/``):
  model/  Qwen2ForCausalLM (float32 safetensors, head_dim 32 so vLLM's CPU attention accepts it) plus a
          character-level tokenizer (byte-level BPE alphabet, no merges) with EOS ``<eos>`` and PAD ``<pad>``.
          Its chat template concatenates the message contents, so a prompt is exactly ``"12+7="``.
  data/   ``train.parquet`` / ``val.parquet`` in verl format (data_source "arithmetic"); the expected response
          is the decimal sum followed by EOS, e.g. ``"19<eos>"``.

Why the SFT mixture: the RL demo must show validation reward (greedy, exact match) rising from <= 0.4 to
>= 0.8 within minutes on CPU.  A model that already adds correctly leaves nothing to learn, and one that cannot
add learns too slowly.  So the warm start is trained on a mixture of targets: the correct sum with probability
``P_CORRECT`` and a systematic wrong answer (sum + 1) otherwise (expected cross-entropy over both targets,
response tokens only).  The model then knows addition but prefers the "+1" answer: greedy decoding is mostly
wrong, while sampling at temperature 1 finds the right sum about ``P_CORRECT`` of the time.  RL only has to
flip one prompt-independent preference, which generalises across prompts, so the reward curve rises quickly
and reliably.

Deterministic: fixed seeds, one CPU thread, deterministic torch algorithms.  Takes ~2-3 min on one core.
Usage: python scripts/build_tiny_model.py [--out DIR] [--seed N]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "fully_async" / "assets" / "tiny_arithmetic"
MAX_OPERAND = 49          # operands 0..49 -> 2500 distinct problems
N_VAL, N_TRAIN = 128, 1024
P_CORRECT = 0.3           # SFT mixture weight of the correct sum; the rest goes to sum + 1
SFT_STEPS, SFT_BATCH, SFT_LR = 900, 128, 3e-3  # SFT_BATCH problems x 2 targets per step
CHARS = "0123456789+-*/=() \n"
SPECIALS = ["<pad>", "<eos>"]  # ids 0 and 1
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map used by the ByteLevel pre-tokenizer (space -> 'Ġ')."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    b2u = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in CHARS:
        vocab[b2u[ord(c)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token=None,
                                   unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=64)


def make_problems(seed: int) -> tuple[list, list, list]:
    """Disjoint val / train problem sets; SFT uses every problem that is not in val."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[:N_VAL], pairs[N_VAL:N_VAL + N_TRAIN], pairs[N_VAL:]


def write_parquet(path: Path, pairs: list, split: str) -> None:
    rows = [{"data_source": "arithmetic",
             "prompt": [{"role": "user", "content": f"{a}+{b}="}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": split, "index": i}} for i, (a, b) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def encode_batch(tok, prompts: list[str], responses: list[str]):
    """Right-padded ids, loss mask over response tokens (response + EOS)."""
    p_ids = [tok.encode(p) for p in prompts]
    r_ids = [tok.encode(r) + [tok.eos_token_id] for r in responses]
    width = max(len(p) + len(r) for p, r in zip(p_ids, r_ids))
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.float)
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p):len(p) + len(r)] = 1.0
    return ids, mask


def seq_logprob(model, ids, mask):
    """Sum of log-probs of the masked tokens per row (causal LM shift)."""
    logits = model(input_ids=ids).logits  # right padding only: causal attention never sees it
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * mask[:, 1:]).sum(-1)


def sft(model, tok, pairs: list, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.98), weight_decay=0.01)
    prompts = [f"{a}+{b}=" for a, b in pairs]
    good = encode_batch(tok, prompts, [str(a + b) for a, b in pairs])
    bad = encode_batch(tok, prompts, [str(a + b + 1) for a, b in pairs])
    model.train()
    t0 = time.time()
    for step in range(SFT_STEPS):
        lr = SFT_LR * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / SFT_STEPS))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randperm(len(pairs), generator=g)[:SFT_BATCH]
        # expected cross-entropy under the target mixture (no sampling noise)
        loss = -(P_CORRECT * seq_logprob(model, good[0][idx], good[1][idx])
                 + (1 - P_CORRECT) * seq_logprob(model, bad[0][idx], bad[1][idx])).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == SFT_STEPS - 1:
            print(f"  sft step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  {time.time() - t0:.0f}s", flush=True)
    model.eval()


@torch.no_grad()
def generate(model, tok, prompts: list[str], n: int, temperature: float, gen: torch.Generator,
             max_new: int = 5) -> list[str]:
    """Decode `n` responses per prompt (greedy when temperature == 0); prompts are bucketed by length."""
    out: list[list[str]] = [[] for _ in prompts]
    enc = [tok.encode(p) for p in prompts]
    for length in sorted({len(e) for e in enc}):
        rows = [i for i, e in enumerate(enc) if len(e) == length]
        ids = torch.tensor([enc[i] for i in rows]).repeat_interleave(n, 0)
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
            done |= nxt == tok.eos_token_id
            if done.all():
                break
        for j, row in enumerate(ids[:, length:].tolist()):
            text = tok.decode([t for t in row if t not in (tok.pad_token_id,)], skip_special_tokens=False)
            ended = "<eos>" in text
            out[rows[j // n]].append(text.split("<eos>")[0] if ended else text + "<noeos>")
    return out


def evaluate(model, tok, pairs: list, seed: int, n_samples: int = 8) -> dict:
    prompts = [f"{a}+{b}=" for a, b in pairs]
    g = torch.Generator().manual_seed(seed)
    greedy = generate(model, tok, prompts, 1, 0.0, g)
    sampled = generate(model, tok, prompts, n_samples, 1.0, g)
    ok = sum(r[0] == str(a + b) for r, (a, b) in zip(greedy, pairs)) / len(pairs)
    tot = len(pairs) * n_samples
    s_ok = sum(x == str(a + b) for r, (a, b) in zip(sampled, pairs) for x in r) / tot
    s_p1 = sum(x == str(a + b + 1) for r, (a, b) in zip(sampled, pairs) for x in r) / tot
    g_p1 = sum(r[0] == str(a + b + 1) for r, (a, b) in zip(greedy, pairs)) / len(pairs)
    return {"greedy_acc": ok, "greedy_plus1": g_p1, "sampled_acc": s_ok, "sampled_plus1": s_p1,
            "sampled_junk": 1 - s_ok - s_p1}


def check_tokenizer(tok, model_dir: Path) -> None:
    loaded = AutoTokenizer.from_pretrained(model_dir)
    for text in ["12+7=19", "0+0=0", "49+49=98", "1 + 2 =\n3", "(3*4)-5/6"]:
        ids = tok.encode(text)
        assert loaded.encode(text) == ids, (text, ids, loaded.encode(text))
        assert tok.decode(ids) == text and loaded.decode(ids) == text, text
        assert tok.eos_token_id not in ids and tok.pad_token_id not in ids
    chat = loaded.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == "12+7=", repr(chat)
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == (1, 0, None)
    assert len(loaded) == len(tok), (len(loaded), len(tok))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()

    model_dir, data_dir = args.out / "model", args.out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    val, train, sft_pairs = make_problems(args.seed)
    write_parquet(data_dir / "train.parquet", train, "train")
    write_parquet(data_dir / "val.parquet", val, "test")

    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        attention_dropout=0.0, initializer_range=0.02, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32")
    model = Qwen2ForCausalLM(config).float()
    print(f"params: {sum(p.numel() for p in model.parameters()):,}  sft problems: {len(sft_pairs)}", flush=True)
    sft(model, tok, sft_pairs, args.seed)

    # eos/pad only: no sampling defaults that vLLM would pick up as request defaults
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    check_tokenizer(tok, model_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    metrics = evaluate(reloaded, tok, val, args.seed + 1)
    print("val metrics (8 samples/prompt at T=1):", {k: round(v, 3) for k, v in metrics.items()})
    print(f"prompt format 'a+b=' -> response '<sum><eos>'; eos id {tok.eos_token_id}, pad id {tok.pad_token_id},"
          f" vocab {len(tok)}; built in {time.time() - t0:.0f}s")
    for path in sorted(p for p in args.out.rglob("*") if p.is_file()):
        print(f"  {path.stat().st_size:>10,}  {path.relative_to(args.out)}")


if __name__ == "__main__":
    main()
