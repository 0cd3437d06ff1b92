"""The built-in comparison of sync and async mode (layer 8: above run/, whose config loading and checks it uses;
nothing in the package imports it): `python -m fully_async.compare` runs the same workload in both modes on equal
devices (or reads two saved runs) and writes one report with both modes, its plots and, with repeats, the mean and
spread of every row.

  runs.py        one logged run (TensorBoard scalars, config.json, summary.json) and the config diff rules
  stats.py       per-run numbers, the side-by-side table and its text forms
  plots.py       the PNGs (matplotlib: the `plots` extra)
  report.py      report.md and the repeat summary (median, spread, warnings)
  repeats.py     the one report of repeated comparisons (mean ± std per row, error-bar plot)
  placements.py  several async placements against one sync run, with the planner's simulation of each
  simulate.py    the planner's simulation of a logged run (scripts/sim_check.py is its command line)
  bench.py       rollout-only and train-only tokens/s of one device (python -m fully_async.compare.bench)
  driver.py      which runs with which overrides, each a subprocess; the comparison of two run dirs
  __main__.py    the command line
The split of an async run's devices is chosen by the planner (planner/search.py choose_split).
"""
