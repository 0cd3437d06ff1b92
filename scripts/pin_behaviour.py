"""Write (or check) the pinned behaviour of the bundled CPU task: what a refactoring must not change.

Runs mode=sync and mode=async (on-policy bound: staleness_threshold=0, so the async pipeline is deterministic),
and mode=sync on two data-parallel CPU trainer ranks, for a few steps with the default seed, in-process on Ray, and records per mode the trained sample ids in training
order and, per step, the mean score, policy loss, gradient norm, entropy and mean response length.  The pin lives in
tests/fixtures/behaviour_pin.json; tests/integration/test_behaviour_pin.py compares a fresh run with it.

    python scripts/pin_behaviour.py --write    # after a deliberate change of behaviour: re-pin (say why in the commit)
    python scripts/pin_behaviour.py            # print the fresh record and whether it matches the pin
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = os.path.join(REPO, "tests", "fixtures", "behaviour_pin.json")
STEPS = 3
TAGS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")
OVERRIDES = [f"trainer.total_training_steps={STEPS}", "trainer.resume_mode=disable", "trainer.progress_bar=false",
             "trainer.val_before_train=false", "trainer.test_freq=-1", "async_training.staleness_threshold=0",
             "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


# name -> (mode, extra overrides): one device per mode, and sync on two data-parallel trainer ranks (fsdp2 over gloo)
RUNS = {"sync": ("sync", []), "async": ("async", []),
        "sync_dp2": ("sync", ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=fsdp2"])}


def record(name: str, workdir: str) -> dict:
    """One run of RUNS[name]; its trained sample ids and per-step scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fully_async.run.hydra_setup import load_config
    from fully_async.run.main import run

    mode, extra = RUNS[name]
    tb = os.path.join(workdir, f"tb_{name}")
    os.environ["TENSORBOARD_DIR"] = tb
    cfg = load_config([f"mode={mode}", *OVERRIDES, *extra, f"trainer.default_local_dir={workdir}/ckpt_{name}"])
    summary = run(cfg)
    acc = EventAccumulator(tb, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {str(e.step): e.value for e in acc.Scalars(tag)} for tag in TAGS}
    return {"trained_sample_ids": summary["trained_sample_ids"], "scalars": scalars}


def compare(got: dict, pinned: dict, rel: float = 1e-5, floor: float = 1e-6) -> list[str]:
    """Differences between a fresh record and the pin (empty: the same behaviour): each scalar within `rel` of the
    pinned value or `floor` of it.  The floor is for values that are zero up to float32 rounding, which differs
    between CPUs: GRPO's pg_loss over group-normalised advantages (1e-9 to 1e-7 here, a different sign on another
    machine, while every other scalar agreed within 5e-7 of itself); a changed loss moves it by far more."""
    out = []
    for mode in pinned:
        g, p = got[mode], pinned[mode]
        if g["trained_sample_ids"] != p["trained_sample_ids"]:
            out.append(f"{mode}: trained sample ids differ: {g['trained_sample_ids'][:8]}... vs "
                       f"{p['trained_sample_ids'][:8]}...")
        for tag, steps in p["scalars"].items():
            for step, want in steps.items():
                have = g["scalars"].get(tag, {}).get(step)
                if have is None or abs(have - want) > rel * abs(want) + floor:
                    out.append(f"{mode}: {tag} at step {step}: {have} vs pinned {want}")
    return out


def fresh() -> dict:
    """Every run of RUNS, on the Ray this process has up (a test's), else on a local one started for them."""
    import ray

    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        with tempfile.TemporaryDirectory() as workdir:
            return {name: record(name, workdir) for name in RUNS}
    finally:
        if own:
            ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="write the fresh record as the pin")
    args = ap.parse_args()
    got = fresh()
    if args.write:
        with open(PIN, "w") as fh:
            json.dump(got, fh, indent=1, sort_keys=True)
        print(f"pinned {PIN}")
        return
    diffs = compare(got, json.load(open(PIN))) if os.path.exists(PIN) else ["no pin yet"]
    print(json.dumps(got, indent=1, sort_keys=True))
    print("\n".join(diffs) if diffs else "matches the pin")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
