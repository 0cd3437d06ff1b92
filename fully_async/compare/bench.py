"""Ceilings of the async pipeline (layer 8, the comparison's bench): rollout-only and train-only throughput of ONE
device each.

An async run splits N devices into r rollout devices and N - r trainer devices, so its tokens/s can
at best reach the slower of the two stages run alone.  This script measures both stages for a
config, in-process and without Ray, under the conditions one device gets: the configured device
(placement forced to one device per stage; strategy fsdp2 runs as torch, the same backend without a
process group), and on CPU one thread (a CPU "device" is one core; `torch.set_num_threads(1)`).

  rollout-only: the configured engine generates `rollout.n` responses for each prompt of a
                step's batch (train prompts, in order), the responses are scored; no training.
  train-only:   the configured backend runs `prepare_batch` + `train_step` on exactly the samples
                recorded in the rollout phase; no generation.

A `benchmark.response_length` workload (fully_async/core/workload.py) applies here as in the runs, so the
ceilings are measured on the same response lengths.  Tokens are counted as in
`perf/total_num_tokens`: prompt + response tokens of the samples.  A first warm-up batch (not
timed) absorbs one-off costs (kernel selection, allocator growth).

Model of N devices (R = rollout-only, T = train-only tokens/s of one device, e = data-parallel
scaling efficiency of a trainer kept per doubling of its devices, 1.0 = linear; rollout replicas do not communicate):
  train capacity of k devices   k x T x e^log2(k)  (2 devices: 2 T e, 4: 4 T e^2; as the planner prices them)
  async, r rollout + k trainer  min(r x R, train capacity(k))              (the stages overlap)
  sync on N devices             1 / (1 / (N x R) + 1 / train capacity(N))  (generate and train alternate)
`planner.search.choose_split` picks the r of 1..N-1 with the highest async ceiling (ties: fewer rollout devices).

  python -m fully_async.compare.bench [--batches 3] [--out bench.json] [--async-log TB_DIR] [overrides...]

With `--async-log` (the TensorBoard dir of an async run of the same config) it also reports the
pipeline efficiency = async tokens/s / ceiling of that run's split, where async tokens/s =
sum(perf/total_num_tokens) / sum(timing_s/step).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


from fully_async.compare.stats import format_split
from fully_async.planner.search import async_ceiling, choose_split

def _prompts_per_batch(cfg: Any) -> int:
    """Prompt groups one trainer step consumes (sync: data.train_batch_size; the run's plan)."""
    from fully_async.core.plan import RunPlan
    return RunPlan.of(cfg).groups_per_step


def _num_tokens(samples: list) -> int:
    return sum(s.num_tokens for s in samples)


def _stage(tokens: int, samples: int, seconds: float) -> dict:
    return {"tokens": tokens, "samples": samples, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "samples_per_s": samples / seconds if seconds > 0 else float("nan")}


def _rollout_phase(cfg: Any, prep: Any, device: Any, batches: int, warmup: int,
                   lengths: Any = None) -> tuple[list[list], dict]:
    """Generate and score `warmup + batches` step batches; returns the groups of each batch and the timing."""
    from fully_async.actors.actor_setup import build_tokenizer
    from fully_async.rollout.engines import build_engine
    from fully_async.rollout.generation import group_pendings, run_to_completion, score_samples
    from fully_async.rewards import build_reward_manager
    from fully_async.core.types import SamplingParams

    tokenizer = build_tokenizer(cfg)
    reward = build_reward_manager(cfg)
    engine = build_engine(prep.cfg, device, prep.eos_token_ids, prep.pad_token_id)   # its engine slots sized
    r = cfg.actor_rollout_ref.rollout
    params = SamplingParams(r.temperature, r.top_p, r.top_k, cfg.data.max_response_length)
    per_batch = _prompts_per_batch(cfg)
    recorded, tokens, samples, seconds = [], 0, 0, 0.0
    for b in range(warmup + batches):
        records = [prep.train[(b * per_batch + i) % len(prep.train)] for i in range(per_batch)]
        groups = [(rec, group_pendings(f"b{b}-p{i}", rec, r.n, params, lengths)) for i, rec in enumerate(records)]
        device.synchronize()
        t = time.perf_counter()
        run_to_completion(engine, [p for _, ps in groups for p in ps])
        batch = []
        for rec, ps in groups:
            group = [p.to_sample() for p in ps]
            score_samples(tokenizer, reward, rec, group)
            batch.append(group)
        device.synchronize()
        if b >= warmup:
            seconds += time.perf_counter() - t
            flat = [s for g in batch for s in g]
            tokens += _num_tokens(flat)
            samples += len(flat)
        recorded.append(batch)
    del engine
    device.empty_cache()
    return recorded, _stage(tokens, samples, seconds)


def _train_phase(cfg: Any, prep: Any, device: Any, recorded: list[list], warmup: int) -> dict:
    """prepare_batch + train_step on each recorded batch (the first `warmup` untimed)."""
    from fully_async.train.backends import build_backend
    from fully_async.core.batch import build_batch
    from fully_async.train.ppo_update import ppo_update
    from fully_async.train.train_step import prepare_batch

    actor = cfg.actor_rollout_ref.actor
    mini = actor.ppo_mini_batch_size
    backend = build_backend(cfg, device, len(recorded) * math.ceil(_prompts_per_batch(cfg) / mini) * actor.ppo_epochs)
    tokens, samples, seconds = 0, 0, 0.0
    for b, groups in enumerate(recorded):
        flat = [s for g in groups for s in g]
        device.synchronize()
        t = time.perf_counter()
        batch = build_batch(flat, prep.pad_token_id)
        prepare_batch(backend, cfg, batch, {})
        ppo_update(backend, cfg, batch, num_mini_batches=max(1, math.ceil(len(groups) / mini)))
        device.synchronize()
        if b >= warmup:
            seconds += time.perf_counter() - t
            tokens += _num_tokens(flat)
            samples += len(flat)
    del backend
    device.empty_cache()
    return _stage(tokens, samples, seconds)


PER_DEVICE = ("rollout/train tokens_per_s are of ONE device each (R and T); r rollout devices give r x R, k trainer "
              "devices k x T (x dp efficiency when k > 1); min_tokens_per_s is the async ceiling of a 1+1 split")


def one_device_config(cfg: Any) -> Any:
    """A copy of `cfg` placed on one device per stage (what the bench measures; see the module docstring)."""
    cfg = copy.deepcopy(cfg)
    cfg.trainer.nnodes = cfg.trainer.n_gpus_per_node = 1
    cfg.rollout.nnodes = cfg.rollout.n_gpus_per_node = 1
    if cfg.actor_rollout_ref.actor.strategy == "fsdp2":
        cfg.actor_rollout_ref.actor.strategy = "torch"
    return cfg


def measure_config(cfg: Any, batches: int = 3, warmup: int = 1) -> dict:
    """Rollout-only and train-only throughput of one device each for `cfg` (an OmegaConf config as
    load_config returns; its placement is ignored)."""
    import torch

    from fully_async.device import check_available, describe_hardware, get_device
    from fully_async.run.prepare import prepare
    from fully_async.core.workload import LengthProfile, workload_report

    if batches < 1:
        raise ValueError(f"--batches {batches} must be >= 1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = one_device_config(cfg)
    lengths = LengthProfile.from_config(cfg)
    prep = prepare(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    threads_before = torch.get_num_threads()
    try:
        if device.is_accelerator:
            device.set_device(0)
        else:
            torch.set_num_threads(1)  # what one async actor gets: Ray assigns it one core
        torch.manual_seed(cfg.trainer.seed)
        recorded, rollout = _rollout_phase(cfg, prep, device, batches, warmup, lengths)
        train = _train_phase(cfg, prep, device, recorded, warmup)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    ceiling = min(rollout["tokens_per_s"], train["tokens_per_s"])
    return {"device": device.name, "hardware": describe_hardware(device), "threads": threads if not
            device.is_accelerator else None, "batches": batches, "warmup": warmup,
            "prompts_per_batch": _prompts_per_batch(cfg), "n": cfg.actor_rollout_ref.rollout.n,
            "max_num_seqs": prep.cfg.actor_rollout_ref.rollout.max_num_seqs, "rollout": rollout, "train": train,
            "min_tokens_per_s": ceiling,
            "bottleneck": "rollout" if rollout["tokens_per_s"] <= train["tokens_per_s"] else "train",
            "per_device": PER_DEVICE, "workload": workload_report(cfg)}


def measure(overrides: list[str], batches: int = 3, warmup: int = 1) -> dict:
    """Same Hydra overrides as `python -m fully_async.main`; see the module docstring."""
    from fully_async.run.hydra_setup import load_config

    return measure_config(load_config(list(overrides)), batches, warmup)


def run_tokens_per_s(log_dir: str) -> tuple[float, dict]:
    """sum(perf/total_num_tokens) / sum(timing_s/step) of a run's TensorBoard dir, and its devices."""
    from fully_async.compare.runs import read_run
    from fully_async.compare.stats import tokens_per_s

    run = read_run(log_dir)
    return tokens_per_s(run), run.devices()


def format_table(result: dict, async_tokens_per_s: float | None = None, async_ceiling_tps: float | None = None) -> str:
    rows = [("stage", "tokens", "samples", "seconds", "tokens/s", "samples/s")]
    for stage in ("rollout", "train"):
        s = result[stage]
        rows.append((f"{stage}-only", str(s["tokens"]), str(s["samples"]), f"{s['seconds']:.3f}",
                     f"{s['tokens_per_s']:.1f}", f"{s['samples_per_s']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"hardware: {result['hardware']}; device {result['device']}"
             + (f", {result['threads']} thread(s)" if result["threads"] else "")
             + f"; {result['batches']} timed batch(es) of {result['prompts_per_batch']} prompts x n={result['n']}; "
             "one device per stage"]
    if result.get("workload"):
        lines.append(result["workload"]["description"])
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"min(rollout-only, train-only) = {result['min_tokens_per_s']:.1f} tokens/s per device pair "
                 f"(bottleneck: {result['bottleneck']})")
    if async_tokens_per_s is not None:
        ceiling = async_ceiling_tps or result["min_tokens_per_s"]
        lines.append(f"async run: {async_tokens_per_s:.1f} tokens/s / ceiling {ceiling:.1f} -> pipeline efficiency "
                     f"{async_tokens_per_s / ceiling:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=3, help="timed step batches per stage (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up batches (default 1)")
    ap.add_argument("--out", help="write the numbers as JSON to this file")
    ap.add_argument("--async-log", help="TensorBoard dir of an async run of this config: report pipeline efficiency")
    ap.add_argument("--devices", type=int, help="also print the predicted ceilings of every async split of N devices")
    ap.add_argument("--dp-efficiency", type=float, default=1.0,
                    help="data-parallel scaling efficiency of a trainer, kept per doubling of its devices, in (0, 1] "
                         "(default 1.0)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m fully_async.main")
    args = ap.parse_intermixed_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:  # bad flags fail before the measurement
        choose_split(args.devices if args.devices is not None else 2, 1.0, 1.0, args.dp_efficiency)
    except ValueError as exc:
        ap.error(str(exc))
    result = measure(args.overrides, args.batches, args.warmup)
    result["overrides"] = list(args.overrides)
    R, T = result["rollout"]["tokens_per_s"], result["train"]["tokens_per_s"]
    async_tps = ceiling = None
    if args.async_log:
        async_tps, dev = run_tokens_per_s(args.async_log)
        ceiling = async_ceiling(dev["rollout"], dev["trainer"], R, T, args.dp_efficiency)
        result.update(async_tokens_per_s=async_tps, async_devices=dev, async_ceiling_tokens_per_s=ceiling,
                      pipeline_efficiency=async_tps / ceiling)
    print(format_table(result, async_tps, ceiling))
    if args.devices is not None:
        result["split"] = choose_split(args.devices, R, T, args.dp_efficiency)
        print("\n".join(format_split(result["split"])))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
