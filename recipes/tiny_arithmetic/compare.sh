#!/usr/bin/env bash
# Sync vs async on the bundled tiny arithmetic task at equal total devices (2 cores: async 1 rollout +
# 1 trainer core vs sync on 2 cores with 2 engines and FSDP2), same config apart from `mode` and the
# placement keys, plus the rollout-only / train-only ceilings (--bench) for the split and the efficiency.
#
#   bash recipes/tiny_arithmetic/compare.sh [key=value ...]
#   = python scripts/compare_sync_async.py --out compare_out/tiny_arithmetic --bench trainer.device=cpu [key=value ...]
#
# Hardware expected: one CPU machine with >= 2 otherwise idle cores.  Runs the bench, then async, then
# sync (40 steps each); writes report.md, table.json and PNG plots to compare_out/tiny_arithmetic and prints
# the side-by-side table.  Timings are only meaningful when nothing else loads the machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
python scripts/compare_sync_async.py --out compare_out/tiny_arithmetic --bench trainer.device=cpu "$@"
