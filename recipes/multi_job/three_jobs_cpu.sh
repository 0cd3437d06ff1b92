#!/usr/bin/env bash
# Three sync-mode GRPO jobs on the bundled tiny task share one 2-device pool (CPU; devices are logical):
# job_a leases device 0, job_b device 1, job_c both (all or nothing: it waits until both are free, and the
# requests behind it wait for it -- first come, first served, nobody starves).
#
#   bash recipes/multi_job/three_jobs_cpu.sh [key=value ...]      # outputs under $MULTI_JOB_OUT (default multi_job_out/three_jobs)
#
# Hardware expected: one CPU machine with >= 2 cores; 20 steps per job, one to two minutes.  The pool's timeline
# of all three jobs: $MULTI_JOB_OUT/pool/tiny_pool/timeline.json.  Timing against one after another:
#   python scripts/multi_job_compare.py --jobs 3 --devices 2 --job-devices '0;1;0,1' trainer.device=cpu trainer.total_training_steps=20
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mkdir -p "${MULTI_JOB_OUT:-multi_job_out/three_jobs}" && cd "${MULTI_JOB_OUT:-multi_job_out/three_jobs}" && pwd)
source recipes/multi_job/pool_head.sh
start_head 8
trap stop_head EXIT

COMMON=(mode=sync trainer.device=cpu trainer.total_training_steps=20 trainer.test_freq=10 trainer.progress_bar=false
        multi_job.pool=tiny_pool multi_job.devices=2 "multi_job.pool_dir=$OUT/pool")
declare -A DEVICES=([job_a]="[0]" [job_b]="[1]" [job_c]="[0,1]")
pids=(); seed=0
for job in job_a job_b job_c; do
  seed=$((seed + 1))   # different jobs: each its own data order and sampling seed
  TENSORBOARD_DIR="$OUT/$job/tensorboard" python -m fully_async.main "${COMMON[@]}" trainer.experiment_name=$job \
      data.seed=$seed trainer.seed=$seed \
      "multi_job.job_devices=${DEVICES[$job]}" "trainer.default_local_dir=$OUT/$job/checkpoints" \
      "hydra.run.dir=$OUT/$job/hydra" "$@" > "$OUT/$job.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
grep -h -E "run finished|validation reward" "$OUT"/job_*.log || true
echo "logs: $OUT/job_{a,b,c}.log; pool timeline: $OUT/pool/tiny_pool/timeline.json"
exit $status
