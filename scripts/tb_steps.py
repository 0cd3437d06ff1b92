"""Print chosen per-step scalars of TensorBoard run dirs side by side (a quick look at a GPU run's steps).

    python scripts/tb_steps.py RUN_DIR [RUN_DIR ...] [--tags timing_s/step,timing_s/gen,...]
"""
import argparse
import sys

DEFAULT_TAGS = ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/param_sync",
                "fully_async/rollouter/engine_0/ms_per_step", "fully_async/rollouter/kept_in_flight",
                "fully_async/partial/total_partial_num", "fully_async/rollouter/bound_pauses",
                "fully_async/staleness/mean", "perf/total_num_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--tags", default=",".join(DEFAULT_TAGS))
    args = ap.parse_args()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in args.runs:
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        have = set(acc.Tags()["scalars"])
        print(f"== {run}")
        for tag in args.tags.split(","):
            if tag in have:
                print(f"  {tag:45s} " + " ".join(f"{e.value:9.4g}" for e in acc.Scalars(tag)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
