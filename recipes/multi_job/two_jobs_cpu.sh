#!/usr/bin/env bash
# Two independent sync-mode GRPO jobs on the bundled tiny task share one 2-device pool (CPU; devices are logical).
#
#   bash recipes/multi_job/two_jobs_cpu.sh [key=value ...]        # outputs under $MULTI_JOB_OUT (default multi_job_out/two_jobs)
#
# What it does: starts a private Ray head (or joins $RAY_ADDRESS), launches both jobs as ordinary
# `python -m fully_async.main` processes with the same multi_job.pool, waits for both, stops the head it started.
# Each job leases the whole pool per phase (rollout incl. the weight update, then train), so they take turns;
# every job has its own run folder, TensorBoard run and log.  The pool writes one timeline of all jobs:
# $MULTI_JOB_OUT/pool/tiny_pool/timeline.json (open in ui.perfetto.dev: a process per job, a track per device).
# Hardware expected: one CPU machine with >= 2 cores; 20 steps per job, about a minute.  Extra arguments are Hydra
# overrides for both jobs.  Each job's time next to the same jobs run one after another:
#   python scripts/multi_job_compare.py --jobs 2 --devices 2 trainer.device=cpu trainer.total_training_steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mkdir -p "${MULTI_JOB_OUT:-multi_job_out/two_jobs}" && cd "${MULTI_JOB_OUT:-multi_job_out/two_jobs}" && pwd)
source recipes/multi_job/pool_head.sh   # start_head / stop_head: a private Ray head unless RAY_ADDRESS is set
start_head 6
trap stop_head EXIT

COMMON=(mode=sync trainer.device=cpu trainer.total_training_steps=20 trainer.test_freq=10 trainer.progress_bar=false
        multi_job.pool=tiny_pool multi_job.devices=2 "multi_job.pool_dir=$OUT/pool")
pids=(); seed=0
for job in job_a job_b; do
  seed=$((seed + 1))   # different jobs: each its own data order and sampling seed
  TENSORBOARD_DIR="$OUT/$job/tensorboard" python -m fully_async.main "${COMMON[@]}" trainer.experiment_name=$job \
      data.seed=$seed trainer.seed=$seed \
      "trainer.default_local_dir=$OUT/$job/checkpoints" "hydra.run.dir=$OUT/$job/hydra" "$@" > "$OUT/$job.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
grep -h -E "run finished|validation reward" "$OUT"/job_*.log || true
echo "logs: $OUT/job_a.log $OUT/job_b.log; pool timeline: $OUT/pool/tiny_pool/timeline.json"
exit $status
