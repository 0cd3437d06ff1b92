"""The memory model (fully_async/planner/memory_model.py) against the measured peak of one device, per role.

    python scripts/check_memory_model.py [--out mem.json] [--capacity-gib 80] [overrides...]

Same Hydra overrides as `python -m fully_async.main`; placement is ignored (one device, as bench_pipeline.py).
Engine: the configured engine generates two step batches (ppo_mini_batch_size x n responses; make it
max_num_seqs so every slot is used) with benchmark.ignore_eos=true and no synthetic lengths, so every response
runs to data.max_response_length.  Trainer: prepare_batch + train_step on those samples (micro-batches of
ppo_micro_batch_size_per_gpu rows, every row at the full length).  Each phase starts from an emptied cache with a
fresh peak window; measured = max allocated during the phase minus what was allocated when it started (the
torch allocator's view: the runtime's own context is not in it, so the estimate is compared without its
plan.context_gib term).  Example (the 0.5B-shaped model, one GPU; scripts/gpu_verify.sh memory):

    python scripts/build_shaped_model.py --shape 0.5b --out /tmp/m05
    python scripts/check_memory_model.py trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 \\
        actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16 ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
FORCED = ["benchmark.ignore_eos=true", "benchmark.response_length=none"]


def estimates(cfg, capacity_gib: float) -> dict:
    """Estimated bytes of each role (without the context term) and the shape used."""
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import GIB, engine_memory, trainer_memory

    with open(os.path.join(cfg.actor_rollout_ref.model.path, "config.json")) as fh:
        shape = Shape.of(json.load(fh))
    # the device's capacity decides what the trainer will do with an unset enable_gradient_checkpointing and
    # fsdp_config.reshard_after_forward, so the estimate is of the same configuration as the measurement
    trainer = trainer_memory(cfg, shape, 1, capacity_gib * GIB)
    engine = engine_memory(cfg, shape, capacity_gib * GIB)
    return {"params": shape.params(), "trainer": trainer.as_dict(), "engine": engine.as_dict()}


def measure(cfg) -> dict:
    """Peak allocated bytes of the engine phase and of the trainer phase on one device."""
    import torch

    from fully_async.compare.bench import _rollout_phase, _train_phase, one_device_config
    from fully_async.device import check_available, get_device
    from fully_async.run.prepare import prepare

    cfg = one_device_config(cfg)
    device = get_device(cfg.trainer.device)
    check_available(device)
    if not device.is_accelerator:
        raise SystemExit("check_memory_model.py measures device memory: use trainer.device=cuda or npu")
    device.set_device(0)
    prep = prepare(cfg)
    torch.manual_seed(cfg.trainer.seed)
    out = {}
    device.empty_cache()
    device.reset_peak_memory()
    base = device.memory_stats()["allocated_gib"]
    # two step batches: the trainer's second optimizer step runs with the AdamW states allocated (the steady peak)
    recorded, rollout = _rollout_phase(cfg, prep, device, 2, 0, None)
    out["engine"] = {"peak_gib": device.memory_stats()["max_allocated_gib"] - base, "timing": rollout}
    device.empty_cache()
    device.reset_peak_memory()
    base = device.memory_stats()["allocated_gib"]
    train = _train_phase(cfg, prep, device, recorded, 0)
    out["trainer"] = {"peak_gib": device.memory_stats()["max_allocated_gib"] - base, "timing": train}
    lengths = [s.num_tokens for g in recorded[0] for s in g]
    out["samples"], out["max_tokens_per_sample"] = len(lengths), max(lengths)
    return out


def main(argv: list[str] | None = None) -> int:
    from fully_async.core.config_checks import validate
    from fully_async.run.hydra_setup import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write estimate and measurement as JSON here")
    ap.add_argument("--capacity-gib", type=float, default=None,
                    help="device memory for the estimate (GiB; default: the device's own)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(list(args.overrides) + FORCED)
    validate(cfg)
    capacity_gib = args.capacity_gib
    if capacity_gib is None:
        from fully_async.device import get_device

        total = get_device(cfg.trainer.device).total_memory()
        capacity_gib = 80.0 if total is None else total / 2**30
    est = estimates(cfg, capacity_gib)
    meas = measure(cfg)
    rows = []
    for role in ("trainer", "engine"):
        e = est[role]["total_gib"] - est[role]["parts_gib"].get("context", 0.0)
        m = meas[role]["peak_gib"]
        rows.append({"role": role, "estimate_gib": e, "measured_peak_gib": m, "error": e / m - 1.0,
                     "parts_gib": est[role]["parts_gib"], "note": est[role]["note"]})
        print(f"{role:8} estimate {e:7.3f} GiB  measured peak {m:7.3f} GiB  ({100 * (e / m - 1):+.1f}%)  "
              f"[{', '.join(f'{k} {v:.3f}' for k, v in est[role]['parts_gib'].items())}]")
    print(f"{meas['samples']} samples of {meas['max_tokens_per_sample']} tokens; {est['params'] / 1e6:.1f}M parameters")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "measured": meas, "overrides": list(args.overrides) + FORCED}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
