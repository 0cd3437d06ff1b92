"""Rollout-only and train-only tokens/s of one device: `python -m fully_async.compare.bench`
(fully_async/compare/bench.py), kept under this name for the commands that used it; the split chooser is the
planner's (fully_async/planner/search.py choose_split)."""
import sys

from fully_async.compare.bench import (_rollout_phase, _train_phase, format_table, main, measure,  # noqa: F401
                                       measure_config, one_device_config, run_tokens_per_s)
from fully_async.compare.stats import format_split  # noqa: F401
from fully_async.planner.search import async_ceiling, choose_split, sync_ceiling, train_capacity  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
