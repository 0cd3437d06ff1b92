#!/usr/bin/env bash
# Two async GRPO jobs and one sync job on the bundled tiny task share one 2-device pool (CPU; devices are logical).
#
#   bash recipes/multi_job/async_jobs_cpu.sh [key=value ...]      # outputs under $MULTI_JOB_OUT (default multi_job_out/async_jobs)
#
# async_a: trainer on pool device 0, rollout on device 1 (the default layout: rollout after the trainer).
# async_b: crossed, trainer on device 1, rollout on device 0 -- each device then carries one job's trainer and the
#          other's rollout, so one job's rollouter generates while the other's trainer waits for samples.
# sync_c:  both devices per phase (rollout, then train with the weight update).
# Each async side holds its lease while nobody else wants its devices and gives it back when someone does (the
# rollouter after multi_job.min_slice_s of generating, its partial responses parked); weight updates that reach a
# rollouter without its lease are loaded when it next wakes its engines.  One timeline of all jobs:
# $MULTI_JOB_OUT/pool/tiny_pool/timeline.json (ui.perfetto.dev).  Hardware expected: one CPU machine with >= 2 cores;
# 20 steps per job, about two minutes.  Extra arguments are Hydra overrides for every job.  Each job's time next to
# the same async jobs one after another:
#   python scripts/multi_job_compare.py --mode async --jobs 2 --devices 2 --job-devices '0;1' --rollout-devices '1;0' \
#       trainer.device=cpu trainer.total_training_steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mkdir -p "${MULTI_JOB_OUT:-multi_job_out/async_jobs}" && cd "${MULTI_JOB_OUT:-multi_job_out/async_jobs}" && pwd)
source recipes/multi_job/pool_head.sh   # start_head / stop_head: a private Ray head unless RAY_ADDRESS is set
start_head 8
trap stop_head EXIT

COMMON=(trainer.device=cpu trainer.total_training_steps=20 trainer.test_freq=10 trainer.progress_bar=false
        multi_job.pool=tiny_pool multi_job.devices=2 "multi_job.pool_dir=$OUT/pool")
declare -A LAYOUT=([async_a]="mode=async multi_job.job_devices=[0] multi_job.rollout_devices=[1]"
                   [async_b]="mode=async multi_job.job_devices=[1] multi_job.rollout_devices=[0]"
                   [sync_c]="mode=sync")
pids=(); seed=0
for job in async_a async_b sync_c; do
  seed=$((seed + 1))   # different jobs: each its own data order and sampling seed
  # shellcheck disable=SC2086  # the layout is several overrides
  TENSORBOARD_DIR="$OUT/$job/tensorboard" python -m fully_async.main "${COMMON[@]}" ${LAYOUT[$job]} \
      trainer.experiment_name=$job data.seed=$seed trainer.seed=$seed \
      "trainer.default_local_dir=$OUT/$job/checkpoints" "hydra.run.dir=$OUT/$job/hydra" "$@" > "$OUT/$job.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
grep -h -E "run finished|validation reward" "$OUT"/*.log || true
echo "logs: $OUT/{async_a,async_b,sync_c}.log; pool timeline: $OUT/pool/tiny_pool/timeline.json"
exit $status
