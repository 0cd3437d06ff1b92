#!/usr/bin/env bash
# Sync vs async on the bundled tiny arithmetic task, same config apart from `mode`, plus the
# rollout-only / train-only ceilings (--bench) for the pipeline efficiency.
#
#   bash recipes/tiny_arithmetic/compare.sh [key=value ...]
#   = python scripts/compare_sync_async.py --out compare_out/tiny_arithmetic --bench trainer.device=cpu [key=value ...]
#
# Hardware expected: one CPU machine with >= 2 otherwise idle cores (async: rollouter + trainer on
# one core each; sync: one worker with both cores).  Runs async, then sync (40 steps each), then
# the bench; writes report.md, table.json and PNG plots to compare_out/tiny_arithmetic and prints
# the side-by-side table.  Timings are only meaningful when nothing else loads the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
python scripts/compare_sync_async.py --out compare_out/tiny_arithmetic --bench trainer.device=cpu "$@"
