"""Parity check of the Megatron-core backend against the Hugging Face model on one GPU/NPU.

    python3 scripts/gpu_megatron_check.py [--out DIR] [--dtypes bfloat16 float32] [--batch 8] [--seq 512]
    torchrun --nproc_per_node 2 scripts/gpu_megatron_check.py --tp 2 --dtypes float32     # tp / pp / dp

No Ray and no Hydra: the config is `fully_async.core.config.FullyAsyncConfig` through OmegaConf.structured,
and torch.distributed is initialised here (world size 1 on 127.0.0.1, or torchrun's RANK/WORLD_SIZE;
the device's comm backend).  With several ranks every rank also runs the HF reference on its device.
A randomly initialised Qwen2 of the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings, init std --init-std) is written to a temp folder and
loaded by TorchBackend (HF) and MegatronBackend (GPTModel, tp 1).  Checks, per dtype:
  log-probs        megatron vs HF on the same right-padded batch (all real tokens, t >= 1)
  train_step       one PPO step from the same weights: pg_loss / grad_norm of both backends, timings
  sync             named_parameters_for_sync() == the HF weights (before training), and after training
                   the synced weights loaded into HF reproduce megatron's log-probs
  offload/onload   device memory freed, log-probs unchanged afterwards
  save/load        a checkpoint restores the log-probs of the moment it was written
Prints a table and writes megatron_check.json to --out (default: $OUT, else the current folder).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fully_async.core.batch import TrainBatch  # noqa: E402
from fully_async.device import get_device  # noqa: E402

SHAPE_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)


def make_config(model_dir: str, dtype: str, device_name: str, extra: dict | None = None, tp: int = 1, pp: int = 1):
    from omegaconf import OmegaConf

    from fully_async.core.config import FullyAsyncConfig

    cfg = OmegaConf.structured(FullyAsyncConfig)
    if "megatron" not in cfg.actor_rollout_ref.actor:    # until config.py carries actor.megatron: untyped copy
        cfg = OmegaConf.create(OmegaConf.to_container(cfg))
        cfg.actor_rollout_ref.actor.megatron = dict(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=1,
            sequence_parallel=False, use_distributed_optimizer=False, override_transformer_config={})
    actor = cfg.actor_rollout_ref.actor
    actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size = tp, pp
    cfg.actor_rollout_ref.model.path = model_dir
    cfg.trainer.device = device_name
    actor.dtype = dtype
    actor.optim.lr = 1e-5
    actor.optim.lr_warmup_steps = 0
    actor.ppo_micro_batch_size_per_gpu = 4
    actor.entropy_coeff = 0.0
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4
    cfg.actor_rollout_ref.rollout.temperature = 1.0
    for key, value in (extra or {}).items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def build_model(path: str, shape: dict, dtype: torch.dtype, seed: int = 0, init_std: float = 0.1) -> None:
    """Random Qwen2; init_std 0.1 gives peaked next-token distributions (log-prob std ~1-3), so a layout
    error cannot hide in near-uniform log-probs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**shape, initializer_range=init_std, rms_norm_eps=1e-6, rope_theta=1e6)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():   # q/k/v biases and norm weights start constant: give them values
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path)


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    ids = torch.zeros(batch, seq, dtype=torch.long)
    attn = torch.zeros(batch, seq, dtype=torch.long)
    resp = torch.zeros(batch, seq)
    prompt = min(64, seq // 4)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        attn[i, :n] = 1
        resp[i, prompt:n] = 1.0
    adv = torch.randn(batch, 1, generator=g) * resp
    return TrainBatch(ids, attn, resp, torch.zeros(batch, seq), torch.zeros(batch), [str(i // 2) for i in range(batch)],
                      advantages=adv)


def hf_log_probs(model_dir: str, batch: TrainBatch, device, dtype: torch.dtype = torch.float32,
                 state: dict | None = None) -> torch.Tensor:
    """(B, L) log-probs of a plain HF model of `model_dir` in `dtype` (its weights replaced by `state` when given):
    float32 is the yardstick for bf16 errors; with `state`, synced weights read by HF (the trainer's own HF model
    may be an fsdp2 module of DTensors)."""
    from transformers import AutoModelForCausalLM

    from fully_async.train.backends.torch_backend import token_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    model.to(device.torch_device())
    with torch.no_grad():
        logp, _ = token_log_probs(model.eval(), batch.to(device.torch_device()), temperature=1.0)
    del model
    device.empty_cache()
    return logp.float().cpu()


def diff_stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b).abs()[mask]
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "ref_std": float(b[mask].std())}


def timed(device, fn):
    device.synchronize()
    t = time.perf_counter()
    out = fn()
    device.synchronize()
    return out, time.perf_counter() - t


def summed_over_ranks(backend):
    """The HF reference with several ranks in bf16 is fsdp2 over all of them (strategy fsdp on a bf16 trainer), so
    each rank's forward_backward runs and reports only its data-parallel shard; the trainer group sums those
    additive metrics over the ranks (train/group.py), here an all_reduce does.  Float32 (strategy torch) and
    megatron (its metrics are summed over its dp shards inside) are left as they are."""
    import torch.distributed as dist

    if backend.data_parallel_size == 1:
        return backend
    shard_step = backend.forward_backward

    def forward_backward(mini):
        stats = shard_step(mini)
        keys = sorted(stats)
        total = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=backend.torch_device)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    backend.forward_backward = forward_backward
    return backend


def check_dtype(dtype_name: str, args, device, workdir: str) -> dict:
    import torch.distributed as dist

    from fully_async.train.backends.megatron_backend import MegatronBackend
    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.train.ppo_update import ppo_update
    from fully_async.device import parse_dtype

    rank0 = dist.get_rank() == 0
    dtype = parse_dtype(dtype_name)
    model_dir = os.path.join(workdir, f"qwen2_{dtype_name}")
    if rank0:
        build_model(model_dir, SHAPE_05B, dtype, init_std=args.init_std)
    dist.barrier()
    cfg = make_config(model_dir, dtype_name, device.name, tp=args.tp, pp=args.pp,
                      extra={"actor_rollout_ref.actor.megatron.use_distributed_optimizer": args.distributed_optimizer,
                             "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": args.vpp})
    batch = make_batch(args.batch, args.seq, SHAPE_05B["vocab_size"])
    valid = batch.attention_mask.bool().clone()
    valid[:, 0] = False
    res: dict = {"dtype": dtype_name, "init_std": args.init_std, "tp": args.tp, "pp": args.pp, "vpp": args.vpp,
                 "world": dist.get_world_size(), "distributed_optimizer": args.distributed_optimizer, "batch": args.batch, "seq": args.seq, "tokens": int(batch.attention_mask.sum())}

    hf = summed_over_ranks(TorchBackend(cfg, device, total_optimizer_steps=10))
    mg = MegatronBackend(cfg, device, total_optimizer_steps=10)
    from safetensors.torch import load_file
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    synced = mg.named_parameters_for_sync()       # collective; the full dict on rank 0 only
    res["sync_equal_before_training"] = not rank0 or sorted(synced) == sorted(original) and all(
        torch.equal(synced[k], original[k]) for k in original)

    lp_hf, t_hf = timed(device, lambda: hf.compute_log_probs(batch))
    lp_mg, t_mg = timed(device, lambda: mg.compute_log_probs(batch))
    res["logp"] = diff_stats(lp_mg, lp_hf, valid) | {"hf_s": t_hf, "megatron_s": t_mg}
    if dtype != torch.float32:   # how far each bf16 implementation is from the float32 model
        truth = hf_log_probs(model_dir, batch, device)
        res["logp_vs_fp32"] = {"hf": diff_stats(lp_hf, truth, valid), "megatron": diff_stats(lp_mg, truth, valid)}

    batch.old_log_probs = lp_hf
    m_hf, t_hf = timed(device, lambda: ppo_update(hf, cfg, batch, num_mini_batches=1))
    m_mg, t_mg = timed(device, lambda: ppo_update(mg, cfg, batch, num_mini_batches=1))
    res["step1"] = {"hf": m_hf, "megatron": m_mg, "hf_s": t_hf, "megatron_s": t_mg}
    _, t_hf = timed(device, lambda: ppo_update(hf, cfg, batch, num_mini_batches=1))   # warm timings
    m2, t_mg = timed(device, lambda: ppo_update(mg, cfg, batch, num_mini_batches=1))
    res["step2"] = {"hf_s": t_hf, "megatron_s": t_mg, "hf_tok_s": res["tokens"] / t_hf,
                    "megatron_tok_s": res["tokens"] / t_mg, "megatron_loss_finite": all(
                        torch.isfinite(torch.tensor(v)) for v in m2.values())}

    after = mg.named_parameters_for_sync()
    lp_mg2 = mg.compute_log_probs(batch)
    if rank0:
        res["weights_changed_max_abs"] = max(float((after[k].float() - original[k].float()).abs().max())
                                             for k in original)
        res["synced_into_hf_logp"] = diff_stats(lp_mg2, hf_log_probs(model_dir, batch, device, dtype, after), valid)

    before = device.memory_stats()["allocated_gib"]
    mg.offload()
    freed = before - device.memory_stats()["allocated_gib"]
    mg.onload()
    res["offload"] = {"freed_gib": freed, "logp_equal_after_onload": bool(torch.equal(mg.compute_log_probs(batch), lp_mg2))}

    ckpt = os.path.join(workdir, f"ckpt_{dtype_name}")
    mg.save(ckpt)
    ppo_update(mg, cfg, batch, num_mini_batches=1)
    mg.load(ckpt)
    res["save_load_logp_max_abs"] = float((mg.compute_log_probs(batch) - lp_mg2).abs()[valid].max())
    res["peak_gib"] = device.memory_stats()["max_allocated_gib"]
    hf = mg = None   # free both models (a `del` would leave the timed lambdas' names unbound)
    device.empty_cache()
    return res


def pin_local_rank() -> None:
    """Show each torchrun rank only its own device (before anything touches the device runtime): the backends address
    device 0 of their process, as the package's pinned actors see it."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return
    for var in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        shown = os.environ.get(var)
        os.environ[var] = shown.split(",")[int(local)] if shown else local
    os.environ["LOCAL_RANK"] = "0"   # of the devices this process sees


def print_table(results: list[dict]) -> None:
    rows = [("check", *[r["dtype"] for r in results])]
    def add(name, fn):
        rows.append((name, *[fn(r) for r in results]))
    add("logp max |diff| (all tokens)", lambda r: f"{r['logp']['max_abs']:.4f}")
    add("logp mean |diff|", lambda r: f"{r['logp']['mean_abs']:.5f}")
    add("logp std (HF)", lambda r: f"{r['logp']['ref_std']:.3f}")
    add("vs fp32 max|diff| hf / megatron", lambda r: "-" if "logp_vs_fp32" not in r else
        f"{r['logp_vs_fp32']['hf']['max_abs']:.4f} / {r['logp_vs_fp32']['megatron']['max_abs']:.4f}")
    add("vs fp32 mean|diff| hf / megatron", lambda r: "-" if "logp_vs_fp32" not in r else
        f"{r['logp_vs_fp32']['hf']['mean_abs']:.5f} / {r['logp_vs_fp32']['megatron']['mean_abs']:.5f}")
    add("pg_loss hf / megatron", lambda r: f"{r['step1']['hf']['actor/pg_loss']:.4f} / {r['step1']['megatron']['actor/pg_loss']:.4f}")
    add("grad_norm hf / megatron", lambda r: f"{r['step1']['hf']['actor/grad_norm']:.3f} / {r['step1']['megatron']['actor/grad_norm']:.3f}")
    add("fwd+bwd+step s hf / megatron", lambda r: f"{r['step2']['hf_s']:.3f} / {r['step2']['megatron_s']:.3f}")
    add("tokens/s hf / megatron", lambda r: f"{r['step2']['hf_tok_s']:.0f} / {r['step2']['megatron_tok_s']:.0f}")
    add("sync == HF before training", lambda r: str(r["sync_equal_before_training"]))
    add("synced->HF logp max |diff|", lambda r: f"{r['synced_into_hf_logp']['max_abs']:.4f}")
    add("offload freed GiB / logp same", lambda r: f"{r['offload']['freed_gib']:.2f} / {r['offload']['logp_equal_after_onload']}")
    add("save/load logp max |diff|", lambda r: f"{r['save_load_logp_max_abs']:.2e}")
    add("peak GiB", lambda r: f"{r['peak_gib']:.1f}")
    width = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, width)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="weight init std; 24 random layers at 0.1 are chaotic in bf16 (HF's own bf16 is off by ~2 nats)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size (world = tp x pp x dp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    parser.add_argument("--vpp", type=int, default=None, help="virtual_pipeline_model_parallel_size (model chunks)")
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()
    pin_local_rank()
    device = get_device("auto")
    if not device.is_accelerator:
        sys.exit("gpu_megatron_check needs a CUDA or NPU device (megatron-core does not run forward on CPU)")
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group(device.comm_backend, rank=rank, world_size=world)
    from importlib.metadata import version

    from fully_async.train.backends.megatron_backend import _import_megatron
    from fully_async.device import describe_hardware

    _import_megatron(device)   # MindSpeed first on npu
    header = {"hardware": describe_hardware(device), "torch": torch.__version__,
              "megatron_core": version("megatron-core")}
    holder = [tempfile.mkdtemp(prefix="megatron_check_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)      # one shared folder (single host) for model and checkpoints
    if rank == 0:
        print(header)
    results = []
    for d in args.dtypes:   # each dtype's numbers printed as it finishes (a later failure keeps them)
        results.append(check_dtype(d, args, device, holder[0]))
        if rank == 0:
            print(json.dumps(results[-1], default=str))
    if dist.get_rank() == 0:
        print_table(results)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        name = ("megatron_check.json" if world == 1 else
                f"megatron_check_tp{args.tp}_pp{args.pp}{f'_vpp{args.vpp}' if args.vpp else ''}_w{world}.json")
        with open(os.path.join(args.out, name), "w") as fh:
            json.dump({**header, "results": results}, fh, indent=1, default=str)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
