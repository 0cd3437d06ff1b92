#!/usr/bin/env bash
# GPU verification of the scale-out paths and the sync-vs-async comparison (issues #3, #6, #10).
#
#   bash scripts/gpu_verify.sh runs|megatron|packing      (on a 2x H100 machine, from the repo root)
#   bash scripts/gpu_verify.sh scaling|compare2|compare4  (engine pool, #10: on a 4-GPU machine)
#   bash scripts/gpu_verify.sh decode                     (#45: the decode step, this tree against OLD's; PART=profile
#                                                          its kernels and the attention settings; PART=mlp the
#                                                          decode MLP kernel's tiles; SLOTS="256 1024" the 3072-token
#                                                          run at each slot count, REPEATS=2 warm runs each, COLD=1
#                                                          each side from empty compile caches: 1 GPU)
#   bash scripts/gpu_verify.sh prefill                    (#45: the prefill, this tree against OLD's: 1,024-token
#                                                          prompts and an abort update's re-prefill burst: 1 GPU)
#   bash scripts/gpu_verify.sh attention                  (#45: the packed attention kernels alone -- FlashAttention
#                                                          varlen against cuDNN at the update's micro-batches, the
#                                                          prefill chunk's flash against sdpa -- after the packing
#                                                          GPU tests: 1 GPU)
#   bash scripts/gpu_verify.sh update                     (#45: the seed-003 step's update alone, with and without
#                                                          gradient checkpointing, its top kernels; SIDES="new old":
#                                                          against OLD's package in the same call: 1 GPU)
#   bash scripts/gpu_verify.sh engine                     (embedded engine vs generate(static), #11, its decode
#                                                          profile and abort re-prefill cost: 1 GPU)
#   bash scripts/gpu_verify.sh tests                      (the embedded engine's GPU tests only)
#   bash scripts/gpu_verify.sh mfu                        (#12: megatron vs torch parity, packed update MFU: 1 GPU)
#   bash scripts/gpu_verify.sh multijob                   (#15: two jobs share one GPU under the pool's leases; 1 GPU)
#   bash scripts/gpu_verify.sh memory                     (memory model vs measured peak, trainer + engine, #16: 1 GPU)
#   bash scripts/gpu_verify.sh colocated                  (colocated async vs sync, seed-003 shape, #27: 1 GPU)
#   bash scripts/gpu_verify.sh switch                     (#41: a turn switch of the embedded engine, VMM vs the old sleep: 1 GPU)
#   bash scripts/gpu_verify.sh elastic                    (elastic vs split async vs sync, #27: N=2 or 4 GPUs)
#   bash scripts/gpu_verify.sh seed                       (#28: sync vs split/elastic/colocated, seed-003 shape, N GPUs)
#   bash scripts/gpu_verify.sh features                   (#24/#26: Ulysses over NCCL, LoRA, reward model, NPU path: 2 GPUs)
#   bash scripts/gpu_verify.sh broadcast                  (#28: one weight broadcast to K engine replicas vs one: K+1 GPUs)
#   bash scripts/gpu_verify.sh critic                     (#24: a PPO step with a critic next to GRPO's: 1 GPU)
#   bash scripts/gpu_verify.sh megatron_critic            (#24: the megatron critic against the torch one, a PPO run: 1 GPU)
#   bash scripts/gpu_verify.sh vpp                        (#23: virtual pipeline stages, pp=2 x vpp=2 vs HF + a run: 2 GPUs)
#   bash scripts/gpu_verify.sh megatron_lora              (#23: megatron LoRA against the torch LoRA, a run + resume: 1 GPU;
#                                                          TP=2: 2 GPUs, a tp=2 run)
#
# Expects the offline bundle in .gpubundle/ (../shared/tools/offline_bundle.sh) plus the tiny task
# as jsonl in .gpubundle/data/.  Model: a Qwen2.5-0.5B-shaped Qwen2 with random weights and the
# 21-token tiny tokenizer (scripts/build_shaped_model.py): rewards stay ~0, only speed is meaningful.  VOCAB=real
# gives the model Qwen2.5's 151,936-row embedding (the output head a real checkpoint has; by default its rows are the
# tokenizer's, padded to 64: every measurement before 2026-12-01's eleventh session), VOCAB=<rows> any other.
# Writes results under $OUT (default /tmp/gpu_out).  GPUS (e.g. 2,3) moves megatron_lora, vpp and features onto other
# devices of the machine, so that two of them can run side by side (MASTER_PORT apart for vpp)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# the shaped model (SHAPE, OUT) every section measures, with VOCAB's embedding rows
shaped_model() { python3 scripts/build_shaped_model.py --shape "$1" --out "$2" --vocab "${VOCAB:-tokenizer}"; }
# installed once per machine (several of these scripts may run side by side on disjoint GPUS)
[ -f /tmp/site/.bundle_installed ] || { python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpubundle/*.whl \
    && tar xJf .gpubundle/ray.tar.xz -C /tmp/site && touch /tmp/site/.bundle_installed; }
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0
nvidia-smi -L
# these runs use the bundled task's settings (its preset, run/prepare.py BUNDLED_TASK_OVERRIDES, which the entry point
# applies only when no data.train_files is given) on their own copy of its data; their own overrides follow and win
mapfile -t PRESET < <(python3 -c "from fully_async.run.prepare import BUNDLED_TASK_OVERRIDES as o; print(*o, sep='\n')")
python3 -c "import ray, hydra, torch, transformers, tensorboard, tqdm; print('ray', ray.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
# the engine-pool benchmarks (#10): 0.5B-shaped model, bf16.  scaling: responses run to the max (random
# weights with the 21-token vocabulary stop at EOS only by chance: IGNORE_EOS=true makes them run to the max),
# BATCH prompts x 8 per step against NSEQS slots per engine, so one engine works in waves and K engines in 1/K of
# them; compare: the long-tail lognormal workload (benchmark.response_length).  free_cache_engine=false: memory is
# plentiful here, so sync's engines stay resident between generate phases (their decode graphs stay valid)
BATCH=${BATCH:-16}
POOL=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
      data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-256}
      actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16
      actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
      actor_rollout_ref.actor.ppo_mini_batch_size=$BATCH data.train_batch_size=$BATCH actor_rollout_ref.rollout.n=8
      actor_rollout_ref.rollout.max_num_seqs=${NSEQS:-128} benchmark.response_length=${LENGTHS:-lognormal}
      benchmark.ignore_eos=${IGNORE_EOS:-false} actor_rollout_ref.rollout.free_cache_engine=false
      trainer.total_training_steps=${STEPS:-8} trainer.progress_bar=false
      trainer.logger=[console,tensorboard] "trainer.default_local_dir=/tmp/ckpt")
case "${1:-runs}" in
memory)
  # the planner's memory model (#16): estimate vs measured peak of the trainer and the embedded engine, 0.5B-shaped
  # bf16 model on one GPU; every slot busy (32 prompts x 8 = max_num_seqs 256) and every response at the max length
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  MEM=(trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
       data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-512}
       actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16
       actor_rollout_ref.actor.ppo_mini_batch_size=32 data.train_batch_size=32 actor_rollout_ref.rollout.n=8
       actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=${MICRO:-16} actor_rollout_ref.rollout.max_num_seqs=256
       "trainer.default_local_dir=/tmp/ckpt")
  timeout 280 python3 scripts/check_memory_model.py --out "$OUT/memory_model.json" "${MEM[@]}" \
      actor_rollout_ref.model.enable_gradient_checkpointing=false 2>&1 | grep -v "it/s\]" | tail -6
  timeout 280 python3 scripts/check_memory_model.py --out "$OUT/memory_model_ckpt.json" "${MEM[@]}" \
      actor_rollout_ref.model.enable_gradient_checkpointing=true 2>&1 | grep -v "it/s\]" | tail -6
  ;;
tests)
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_engine_cuda.py \
      tests/gpu/test_device_ipc_cuda.py 2>&1 | tail -15
  ;;
switch)
  # what a turn switch costs the embedded engine and what it frees (#41): its memory at fixed addresses (CUDA VMM)
  # against the old sleep, 256 slots of the 0.5B shape with the responses kept in flight through the sleep (KV swap)
  shaped_model 0.5b /tmp/m05
  CUDA_VISIBLE_DEVICES=0 timeout ${LIMIT:-300} python3 scripts/bench_engine_switch.py --model /tmp/m05 --device cuda \
      --slots ${NSEQS:-256} --tokens ${TOKENS:-1024} --before ${BEFORE:-600} --out "$OUT/engine_switch.json" 2>&1 | tail -8
  ;;
colocated)
  # FCE: actor_rollout_ref.rollout.free_cache_engine (default true, verl's default; COLO_EXTRA may add
  # actor_rollout_ref.rollout.free_cache_engine_force=true, which frees the engine's memory at every turn)
  # colocated async against sync on ONE GPU (#27), the seed-003 shape: 0.5B-shaped bf16, 64 prompts x 8, lognormal
  # lengths up to MAXLEN (3072), EOS ignored, packed trainer with dynamic batch size, staleness 0.2, trigger 4, the
  # engine's slots as the run sizes them (max_num_seqs=null over the bundled preset's 128; NSEQS sets it);
  # both runs in this invocation, then compared from their logs (steady steps: the first, compiling, step excluded
  # by the comparison's own rules).  Activation recompute as a run with its own data leaves it: unset (the memory
  # model decides), not the bundled preset's false; CKPT=true|false sets it
  shaped_model 0.5b /tmp/m05
  SEED=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
        data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-3072}
        actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 actor_rollout_ref.actor.ppo_mini_batch_size=64
        data.train_batch_size=64 actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.max_num_seqs=${NSEQS:-null}
        benchmark.response_length=lognormal benchmark.ignore_eos=true actor_rollout_ref.rollout.free_cache_engine=${FCE:-true}
        async_training.staleness_threshold=${STALENESS:-0.2} async_training.trigger_parameter_sync_step=${TRIGGER:-4}
        trainer.resume_mode=disable trainer.progress_bar=false
        trainer.val_before_train=false trainer.test_freq=-1 trainer.logger=[console,tensorboard] trainer.timeline=true
        actor_rollout_ref.model.enable_gradient_checkpointing=${CKPT:-null} "trainer.default_local_dir=/tmp/ckpt")
  # RUNS: where the runs' logs go (default $OUT/runs); SKIP_SYNC=1 RUNS=<an earlier call's, same warm machine>
  # compares a new colocated variant (TAG names it, COLO_EXTRA its overrides, ALLOW_DIFF="--allow-diff KEY ..." the
  # keys they set) with that call's sync run
  # Steady steps: STEPS=13 WARMUP=4 TAIL=1 compares steps 5-12, two whole weight versions at TRIGGER=4 (the table's
  # "over the whole versions timed"); a window that cuts a version weighs its slow first step wrongly.
  # PROFILE_STEPS="[6]": both runs profile those trainer steps (global_profiler.tool=torch) into $OUT/profile_<run>/,
  # and the head of each step's ops.txt is printed (a profiled step runs slower: its time counts in the comparison)
  export CUDA_VISIBLE_DEVICES=0
  RUNS=${RUNS:-$OUT/runs}; COLO=$RUNS/colocated${TAG:+_$TAG}; mkdir -p "$RUNS"
  PROF_SYNC=(); PROF_COLO=(); PROF_DIFF=()
  if [ -n "${PROFILE_STEPS:-}" ]; then
    PROF_SYNC=(global_profiler.tool=torch "global_profiler.steps=$PROFILE_STEPS" "global_profiler.save_path=$OUT/profile_sync")
    PROF_COLO=(global_profiler.tool=torch "global_profiler.steps=$PROFILE_STEPS"
               "global_profiler.save_path=$OUT/profile_colocated${TAG:+_$TAG}")
    PROF_DIFF=(--allow-diff global_profiler.save_path)
  fi
  [ "${SKIP_SYNC:-0}" = 1 ] || TENSORBOARD_DIR=$RUNS/sync timeout ${RUN_LIMIT:-260} python3 -m fully_async.main \
      mode=sync "${SEED[@]}" trainer.total_training_steps=${SYNC_STEPS:-${STEPS:-8}} hydra.run.dir=/tmp/h_sync \
      "${PROF_SYNC[@]}" 2>&1 | tee "$RUNS/sync.log" | grep -v "it/s\]" | grep -E "^step|run finished|Error|error" | tail -12
  TENSORBOARD_DIR=$COLO timeout ${RUN_LIMIT:-260} python3 -m fully_async.main mode=async \
      async_training.placement=colocated rollout.n_gpus_per_node=0 "${SEED[@]}" trainer.total_training_steps=${STEPS:-8} \
      hydra.run.dir=/tmp/h_colo "${PROF_COLO[@]}" ${COLO_EXTRA:-} 2>&1 | tee "$RUNS/colocated${TAG:+_$TAG}.log" \
      | grep -v "it/s\]" | grep -E "^step|run finished|Error|error" | tail -12
  python3 scripts/compare_sync_async.py --from-logs $COLO $RUNS/sync --out $OUT/compare${TAG:+_$TAG} \
      --allow-diff async_training.placement --allow-diff trainer.total_training_steps \
      --allow-diff actor_rollout_ref.rollout.weight_sync "${PROF_DIFF[@]}" ${ALLOW_DIFF:-} --warmup-steps ${WARMUP:-1} \
      --tail-steps ${TAIL:-1} 2>&1 | tail -30
  for ops in "$OUT"/profile_*/step_*/ops.txt; do
    [ -f "$ops" ] && { echo "== $ops"; head -${PROFILE_ROWS:-16} "$ops" | cut -c1-160; }
  done
  # ALSO_FORCE=1: the same colocated run again with the engine's memory freed at every turn, against the same sync run
  if [ "${ALSO_FORCE:-0}" = 1 ]; then
    TENSORBOARD_DIR=$RUNS/colocated_force timeout ${RUN_LIMIT:-260} python3 -m fully_async.main mode=async \
        async_training.placement=colocated rollout.n_gpus_per_node=0 "${SEED[@]}" trainer.total_training_steps=${STEPS:-8} \
        hydra.run.dir=/tmp/h_colo_force actor_rollout_ref.rollout.free_cache_engine_force=true ${COLO_EXTRA:-} 2>&1 \
        | tee "$RUNS/colocated_force.log" | grep -v "it/s\]" | grep -E "^step|run finished|Error|error" | tail -12
    python3 scripts/compare_sync_async.py --from-logs $RUNS/colocated_force $RUNS/sync --out $OUT/compare_force \
        --allow-diff async_training.placement --allow-diff trainer.total_training_steps \
        --allow-diff actor_rollout_ref.rollout.weight_sync --allow-diff actor_rollout_ref.rollout.free_cache_engine_force \
        ${ALLOW_DIFF:-} --warmup-steps ${WARMUP:-1} --tail-steps ${TAIL:-1} 2>&1 | tail -30
  fi
  tar czf "$OUT/runs${TAG:+_$TAG}.tgz" -C "$RUNS" . 2>/dev/null
  ;;
elastic)
  # elastic trainer devices (#27 item 2) against split async and sync at equal devices (N, default 2), one
  # invocation: the split SPLIT (default 1 rollout device) for both async placements, the engine-pool workload above
  # (lognormal lengths, a rollout-bound pipeline, so the trainer waits and lends its engines).  The elastic run's
  # fully_async/elastic/* metrics (busy_ratio, trainer_idle_ratio against trainer/idle_ratio, parked, tokens) show
  # what the lent engines did
  shaped_model 0.5b /tmp/m05
  N=${DEVICES:-2}
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((N - 1)))
  timeout 560 python3 scripts/compare_sync_async.py --devices "$N" --placements split,elastic --split ${SPLIT:-1} \
      --threshold ${REWARD_THRESHOLD:-0.0} --out /tmp/pool/elastic$N "${POOL[@]}" \
      2>&1 | grep -v "it/s\]" | grep -E -v "^\[(async|sync|bench)\] " | tail -60
  cp /tmp/pool/elastic$N/placements.json "$OUT/elastic${N}_placements.json" 2>/dev/null
  for p in split elastic; do cp "/tmp/pool/elastic$N/$p/report.md" "$OUT/elastic${N}_$p.md" 2>/dev/null; done
  python3 - "/tmp/pool/elastic$N/runs/async_elastic" <<'PY' 2>&1 | tail -12
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0}); acc.Reload()
tags = acc.Tags()["scalars"]
for tag in sorted(t for t in tags if t.startswith("fully_async/elastic/") or t == "trainer/idle_ratio"):
    vals = [e.value for e in acc.Scalars(tag)][1:] or [0.0]   # steady steps: the first (compiling) one left out
    print(f"{tag:45s} mean {sum(vals) / len(vals):.4g}")
PY
  ;;
seed)
  # the multi-GPU comparison (#28) at the seed-003 shape: N GPUs (DEVICES, default 2), 64 x N prompts x 8 per step (the
  # batch grows with the devices), lognormal lengths up to 3072, EOS ignored, packed trainer with dynamic batch size,
  # staleness 0.2, trigger 4, 256 slots per engine; sync against each async placement in PLACEMENTS (default
  # split,elastic,colocated) at the split SPLIT (default 1 rollout device), one invocation.  A second call on the
  # same warm machine may add placements against the first call's sync run: SYNC_LOG=/tmp/pool/seed$N/runs/sync
  # POVR: overrides of one placement's run only, P:KEY=VALUE separated by spaces (compare_sync_async.py
  # --placement-override), e.g. POVR="colocated:actor_rollout_ref.rollout.weight_sync=device_ipc"
  # SHAPE (default 0.5b; 1.5b: Qwen2.5-1.5B's shape) picks the model; TAG names the run directory
  MODEL=/tmp/m_${SHAPE:-0.5b}
  shaped_model ${SHAPE:-0.5b} $MODEL
  N=${DEVICES:-2}
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((N - 1)))
  B=$((64 * N))
  SEEDN=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=$MODEL data.train_files=.gpubundle/data/train.jsonl
         data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-3072}
         actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
         actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
         actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 actor_rollout_ref.actor.ppo_mini_batch_size=$B
         data.train_batch_size=$B actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.max_num_seqs=${NSEQS:-256}
         benchmark.response_length=lognormal benchmark.ignore_eos=true actor_rollout_ref.rollout.free_cache_engine=false
         async_training.staleness_threshold=${STALENESS:-0.2} async_training.trigger_parameter_sync_step=${TRIGGER:-4}
         trainer.total_training_steps=${STEPS:-6} trainer.progress_bar=false trainer.val_before_train=false
         trainer.test_freq=-1 trainer.logger=[console,tensorboard] "trainer.default_local_dir=/tmp/ckpt" ${EXTRA:-})
  D=/tmp/pool/seed$N${TAG:+_$TAG}
  # a machine lent again may still hold an earlier call's runs: start clean unless the sync run to reuse is in there
  case "${SYNC_LOG:-}" in "$D"/*) ;; *) rm -rf "$D" ;; esac
  # LIMIT (default: what is left of 560 s since this script started) leaves the device call's 600 s room for the
  # copies below, which a call killed at its own limit never reaches; the whole output is also kept in $OUT as printed
  timeout ${LIMIT:-$((560 - SECONDS))} python3 scripts/compare_sync_async.py --devices "$N" --placements ${PLACEMENTS:-split,elastic,colocated} \
      $([ "${PLACEMENTS:-split}" = colocated ] || echo --split ${SPLIT:-1}) \
      $(for o in ${POVR:-}; do echo --placement-override "$o"; done) --threshold 0.0 --warmup-steps ${WARMUP:-1} --out $D ${SYNC_LOG:+--sync-log $SYNC_LOG} \
      "${SEEDN[@]}" 2>&1 | grep -v "it/s\]" | tee "$OUT/seed${N}${TAG:+_$TAG}.log" \
      | grep -E -v "^\[(async|sync|bench)[a-z_]*\] " | tail -50
  cp $D/placements.json "$OUT/seed${N}${TAG:+_$TAG}_placements.json" 2>/dev/null
  tar czf "$OUT/seed${N}${TAG:+_$TAG}_runs.tgz" -C $D runs logs 2>/dev/null
  grep -h -E "Error|Traceback" $D/logs/*.log 2>/dev/null | head -10
  ;;
features)
  # #24 and #26 on GPUs: Ulysses sequence parallelism over NCCL against one GPU (float32 parity, bf16 FlashAttention
  # varlen) and in a 2-GPU sync run; LoRA (async) and a reward model (sync) runs on the bundled task; the NPU path
  # (the tests' stand-in over CUDA) against the CUDA path, packed; device-IPC tests on 2 GPUs.  Learning runs print
  # their first and last validation reward.  Every part writes its log under $OUT as it goes (a call that runs out
  # of time keeps what finished) and has its own limit; ONLY (space-separated: tests lora ulysses rm npu) picks parts
  export CUDA_VISIBLE_DEVICES=${GPUS:-0,1}
  want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
  TINY=("${PRESET[@]}" trainer.device=cuda data.train_files=.gpubundle/data/train.jsonl
        data.val_files=.gpubundle/data/val.jsonl trainer.progress_bar=false trainer.resume_mode=disable
        trainer.logger=[console,tensorboard] "trainer.default_local_dir=/tmp/ckpt" trainer.total_training_steps=${STEPS:-40})
  val() { python3 -c "import sys; sys.path.insert(0, 'tests'); from tests_helpers import first_and_last_val as f; \
print('$1: val reward first/last', f(sys.argv[1]))" "/tmp/runs/$1" 2>&1 | tail -1 | tee -a "$OUT/features.txt"; }
  want tests && timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ulysses_cuda.py \
      tests/gpu/test_device_ipc_cuda.py > "$OUT/features_tests.log" 2>&1; grep -E "passed|failed" "$OUT/features_tests.log"
  if want lora; then
    TENSORBOARD_DIR=/tmp/runs/lora_async timeout 150 python3 -m fully_async.main mode=async "${TINY[@]}" \
        actor_rollout_ref.model.lora_rank=16 actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=3e-3 \
        trainer.save_freq=40 hydra.run.dir=/tmp/h_lora > "$OUT/features_lora.log" 2>&1; val lora_async
  fi
  if want ulysses; then
    TENSORBOARD_DIR=/tmp/runs/ulysses_sync timeout 200 python3 -m fully_async.main mode=sync "${TINY[@]}" \
        trainer.n_gpus_per_node=2 actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.model.use_remove_padding=true \
        actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 actor_rollout_ref.actor.dtype=bfloat16 \
        hydra.run.dir=/tmp/h_sp > "$OUT/features_ulysses.log" 2>&1; val ulysses_sync
  fi
  if want rm; then
    python3 -c "import sys, pathlib; sys.path[:0] = ['tests', 'tests/unit/train']; from test_reward_model import \
make_reward_model as m; m(pathlib.Path('/tmp/rm'), kind='token', bias=0.375)"
    TENSORBOARD_DIR=/tmp/runs/reward_model timeout 150 python3 -m fully_async.main mode=sync "${TINY[@]}" \
        trainer.total_training_steps=4 reward_model.enable=true reward_model.model.path=/tmp/rm hydra.run.dir=/tmp/h_rm \
        > "$OUT/features_rm.log" 2>&1; grep -E "^step|run finished|Error" "$OUT/features_rm.log" | tail -6
  fi
  if want npu; then   # float32 (fsdp on one device is torch), bf16 (one-rank fsdp2 over hccl), megatron in bf16
    BF16=(actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16)
    for variant in float32 bf16 megatron_bf16; do
      case $variant in float32) V=(actor_rollout_ref.model.use_remove_padding=true) ;;
        bf16) V=(actor_rollout_ref.model.use_remove_padding=true "${BF16[@]}") ;;
        megatron_bf16) V=(actor_rollout_ref.actor.strategy=megatron "${BF16[@]}") ;; esac
      rm -rf /tmp/npu_vs_*
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*} timeout 240 python3 scripts/npu_on_cuda_check.py --steps 4 \
          --out "$OUT/npu_vs_cuda_$variant.json" "${V[@]}" > "$OUT/features_npu_$variant.log" 2>&1
      echo "npu vs cuda, $variant: $(grep -m1 '"ok"' "$OUT/features_npu_$variant.log")" | tee -a "$OUT/features.txt"
      cat /tmp/npu_vs_*/npu/hydra/failure_traceback.txt > "$OUT/npu_run_traceback_$variant.txt" 2>/dev/null
    done
  fi
  tar czf "$OUT/features_runs.tgz" -C /tmp runs 2>/dev/null
  ;;
broadcast)
  # #28: one collective weight broadcast from the trainer's rank 0 to K engine replicas, each on a GPU of its own,
  # against one replica, 0.5B and 3B shapes (bf16); K from REPLICAS (default 1 .. GPUs - 1); every receiver's weights
  # are checked against the sender's after the updates
  N=$(nvidia-smi -L | wc -l)
  timeout ${LIMIT:-300} python3 scripts/bench_weight_sync.py --shapes ${SHAPES:-0.5b 3b} --device cuda --repeats 5 \
      --replicas ${REPLICAS:-$(seq -s' ' 1 $((N - 1)))} --timeout 90 --out "$OUT/weight_sync_replicas.json" 2>&1 | grep -v "^\[20" | tail -20
  ;;
critic)
  # #24: a PPO step with a critic (adv_estimator=gae, n=1) next to GRPO's (n=8) on the 0.5B shape, one GPU, sync, the
  # same responses per step (64 prompts x 8 for GRPO, 512 prompts x 1 for PPO) and lengths (lognormal, max 1024, EOS
  # ignored); prints each run's per-step timings (old log-prob, values, critic update, actor update, step)
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  C=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
     data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-1024}
     actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
     actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
     actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768 actor_rollout_ref.rollout.max_num_seqs=256
     benchmark.response_length=lognormal benchmark.ignore_eos=true trainer.total_training_steps=${STEPS:-4}
     trainer.val_before_train=false trainer.test_freq=-1 trainer.logger=[console,tensorboard] trainer.resume_mode=disable
     "trainer.default_local_dir=/tmp/ckpt")
  TENSORBOARD_DIR=/tmp/runs/grpo timeout 250 python3 -m fully_async.main mode=sync "${C[@]}" data.train_batch_size=64 \
      actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.rollout.n=8 hydra.run.dir=/tmp/h_grpo \
      > "$OUT/critic_grpo.log" 2>&1
  TENSORBOARD_DIR=/tmp/runs/gae timeout 250 python3 -m fully_async.main mode=sync "${C[@]}" data.train_batch_size=512 \
      actor_rollout_ref.actor.ppo_mini_batch_size=512 actor_rollout_ref.rollout.n=1 algorithm.adv_estimator=gae \
      critic.optim.lr=1e-5 critic.use_dynamic_bsz=true critic.ppo_max_token_len_per_gpu=32768 hydra.run.dir=/tmp/h_gae \
      > "$OUT/critic_gae.log" 2>&1
  for r in grpo gae; do python3 - "/tmp/runs/$r" "$r" <<'PY' 2>&1 | tee -a "$OUT/critic.txt"
import sys
sys.path.insert(0, "tests")
from tests_helpers import read_scalars
sc = read_scalars(sys.argv[1])
tags = ["timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/values", "timing_s/update_critic",
        "timing_s/update_actor", "perf/total_num_tokens"]
print(sys.argv[2], {t: [round(v, 3) for _, v in sc[t]] for t in tags if t in sc})
PY
  done
  tar czf "$OUT/critic_runs.tgz" -C /tmp/runs grpo gae 2>/dev/null
  ;;
megatron_critic)
  # #24: PPO's critic on strategy=megatron against the torch critic (values, update, checkpoint: tests/gpu), then a
  # sync PPO run (gae) with the megatron actor and critic on the bundled task, its first and last validation reward
  export CUDA_VISIBLE_DEVICES=0
  timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_megatron_critic.py 2>&1 | tail -15
  TENSORBOARD_DIR=/tmp/runs/megatron_gae timeout ${RUN_LIMIT:-200} python3 -m fully_async.main \
      --config-name=ppo_megatron_trainer "${PRESET[@]}" trainer.device=cuda data.train_files=.gpubundle/data/train.jsonl \
      data.val_files=.gpubundle/data/val.jsonl algorithm.adv_estimator=gae critic.optim.lr=1e-4 \
      trainer.total_training_steps=${STEPS:-30} trainer.resume_mode=disable trainer.save_freq=${SAVE_FREQ:-15} \
      trainer.progress_bar=false trainer.logger=[console,tensorboard] "trainer.default_local_dir=/tmp/ckpt_mg" \
      hydra.run.dir=/tmp/h_mg > "$OUT/megatron_gae.log" 2>&1
  grep -E "^step|run finished|Error|error" "$OUT/megatron_gae.log" | tail -8
  python3 -c "import sys; sys.path.insert(0, 'tests'); from tests_helpers import first_and_last_val as f, read_scalars as r; \
s = r('/tmp/runs/megatron_gae'); print('val reward first/last', f('/tmp/runs/megatron_gae')); \
print({k: [round(v, 4) for _, v in s[k]][::6] for k in ('critic/vf_loss', 'critic/vf_explained_var', 'critic/grad_norm') if k in s})"
  cat /tmp/h_mg/failure_traceback.txt 2>/dev/null | tail -30
  ;;
megatron_lora)
  # #23: LoRA on strategy=megatron against the torch LoRA (tests/gpu), then a sync GRPO run with megatron LoRA on the
  # bundled task (TP megatron tensor-parallel ranks, default 1), saved at step 15 and 30 and resumed for 2 more steps
  N=${TP:-1}
  export CUDA_VISIBLE_DEVICES=${GPUS:-$(seq -s, 0 $((N - 1)))}
  [ "$N" = 1 ] && timeout ${TESTS_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -W ignore tests/gpu/test_megatron_lora_cuda.py \
      > "$OUT/megatron_lora_tests.log" 2>&1; grep -E "^E |passed|failed" "$OUT/megatron_lora_tests.log" | head -30
  [ "${ONLY:-}" = tests ] && exit 0
  LORA_RUN=(--config-name=ppo_megatron_trainer "${PRESET[@]}" trainer.device=cuda data.train_files=.gpubundle/data/train.jsonl
            data.val_files=.gpubundle/data/val.jsonl actor_rollout_ref.model.lora_rank=16 actor_rollout_ref.actor.optim.lr=3e-3
            trainer.n_gpus_per_node=$N actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$N trainer.save_freq=15
            trainer.progress_bar=false trainer.logger=[console,tensorboard] "trainer.default_local_dir=/tmp/ckpt_lora$N"
            hydra.run.dir=/tmp/h_lora$N)
  TENSORBOARD_DIR=/tmp/runs/megatron_lora$N timeout ${RUN_LIMIT:-200} python3 -m fully_async.main "${LORA_RUN[@]}" \
      trainer.total_training_steps=${STEPS:-30} trainer.resume_mode=disable > "$OUT/megatron_lora$N.log" 2>&1
  grep -E "^step|run finished|Error|error" "$OUT/megatron_lora$N.log" | tail -6
  python3 -c "import sys; sys.path.insert(0, 'tests'); from tests_helpers import first_and_last_val as f; \
print('val reward first/last', f('/tmp/runs/megatron_lora$N'))"
  ls /tmp/ckpt_lora$N/*/actor/lora_adapter 2>&1 | tail -3
  TENSORBOARD_DIR=/tmp/runs/megatron_lora${N}_resumed timeout 150 python3 -m fully_async.main "${LORA_RUN[@]}" \
      trainer.total_training_steps=$(( ${STEPS:-30} + 2 )) trainer.resume_mode=auto > "$OUT/megatron_lora${N}_resume.log" 2>&1
  grep -E "resum|^step|run finished|Error|error" "$OUT/megatron_lora${N}_resume.log" | tail -5
  cat /tmp/h_lora$N/failure_traceback.txt 2>/dev/null | tail -30
  ;;
restructure)
  # after the loops were restructured (#22): every GPU test (engine, megatron parity with the one PPO update, packing,
  # host offload), then one sync run on GPU 0 (engines and trainer taking turns on their own device) whose losses
  # and rewards go to $OUT
  shaped_model 0.5b /tmp/m05
  CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -25
  CUDA_VISIBLE_DEVICES=0 TENSORBOARD_DIR=$OUT/runs/sync timeout 200 python3 -m fully_async.main mode=sync "${POOL[@]}" \
      trainer.total_training_steps=4 trainer.resume_mode=disable hydra.run.dir=/tmp/h_sync 2>&1 | grep -v "it/s\]" | tail -12
  ;;
engine)
  # the embedded engine (#11): GPU correctness (graphs and eager), the engine against generate(static) in one
  # invocation, then the pipeline's rollout-only ceiling at the same concurrency (BATCH x 8 = NSEQS sequences)
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_engine_cuda.py 2>&1 | tail -8
  timeout 300 python3 scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 \
      --engines ${ENGINES:-hf,hf_sdpa,hf_modules} --baselines generate_static --concurrency 64 256 --new-tokens 256 \
      --repeats 2 --out "$OUT/bench_engines.json" 2>&1 | grep -v "it/s\]" | tail -12
  # long spans (#27): the split-KV attention (hf) against the masked SDPA over the span bucket (hf_sdpa)
  timeout 240 python3 scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 --engines hf,hf_sdpa \
      --baselines "" --concurrency 256 --new-tokens 3072 --repeats 1 --no-updates \
      --out "$OUT/bench_engines_3072.json" 2>&1 | grep -v "it/s\]" | tail -4
  timeout 200 python3 scripts/bench_pipeline.py --batches 2 --out "$OUT/bench_pipeline.json" "${POOL[@]}" \
      2>&1 | grep -v "it/s\]" | tail -8
  # where a decode step goes (device- or host-bound, which kernels), and an abort update's re-prefill burst under
  # each prefill budget (docs/measurements/engine_profile_h200/, engine_prefill_h200/)
  timeout 150 python3 scripts/profile_engine_step.py --model /tmp/m05 --device cuda --dtype bfloat16 \
      --concurrency 64 256 --warm 200 1500 --out "$OUT/profile_engine_step.json" 2>&1 | grep -E "^c=|wrote"
  timeout 200 python3 scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 --engines hf \
      --baselines "" --repeats 1 --concurrency 256 --new-tokens 3072 --no-updates --resume-budgets 0 8192 32768 \
      --resume-after-steps 1200 --out "$OUT/resume_burst.json" 2>&1 | grep -E "resume_burst" | cut -c1-200
  ;;
decode)
  # #45: the decode step against its floor.  This tree's engine and OLD's (a package tree, default .gpubundle/old/:
  # `git archive <commit> fully_async | tar x -C .gpubundle/old`) in one invocation, 256 x 3072 and 64 / 256 x 256,
  # after the engine's GPU tests (SIDES=new: this tree only); PART=profile: where the step goes now; PART=attn: the
  # attention kernel alone at 256 and 1,024 rows (bench_decode_attention.py); PART=mlp: the tiles of the decode MLP kernel (bench_decode_mlp.py); PART="bench
  # profile": both.  COLD=1: each side compiles from empty Triton/inductor caches (start-up compared fairly); TESTS=0
  # skips the GPU tests
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  BENCH=(scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 --engines hf --baselines "" --no-updates)
  if [[ " ${PART:-bench} " == *" bench "* ]]; then
    [ "${TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_engine_cuda.py 2>&1 | tail -4
    for side in ${SIDES:-new old}; do
      PP=$PYTHONPATH; [ $side = old ] && PP=/tmp/site:$PWD/${OLD:-.gpubundle/old}
      [ "${COLD:-0}" = 1 ] && export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
      PYTHONPATH=$PP timeout $((150 * $(wc -w <<< "${SLOTS:-256}") * ${REPEATS:-1})) python3 "${BENCH[@]}" \
          --concurrency ${SLOTS:-256} --new-tokens 3072 --repeats ${REPEATS:-1} --out "$OUT/${side}_3072.json" 2>&1 \
          | grep -v "it/s\]" | tail -4
      PYTHONPATH=$PP timeout 120 python3 "${BENCH[@]}" --concurrency 64 256 --new-tokens 256 --repeats 2 \
          --out "$OUT/${side}_256.json" 2>&1 | grep -v "it/s\]" | tail -3
    done
  fi
  if [[ " ${PART:-bench} " == *" mlp "* ]]; then
    timeout 200 python3 scripts/bench_decode_mlp.py --out "$OUT/decode_mlp.json" 2>&1 | grep -E "^rows|wrote"
  fi
  if [[ " ${PART:-bench} " == *" profile "* ]]; then
    timeout 150 python3 scripts/profile_engine_step.py --model /tmp/m05 --device cuda --dtype bfloat16 \
        --concurrency 64 256 --warm 200 1500 --out "$OUT/profile_engine_step.json" 2>&1 | grep -E "^c=|wrote"
  fi
  if [[ " ${PART:-bench} " == *" attn "* ]]; then   # the attention alone: chunks decided per call against one unit a program
    timeout 300 python3 scripts/bench_decode_attention.py --rows 256 1024 --out "$OUT/decode_attention.json" 2>&1 \
        | grep -v "it/s\]" | grep -E "split_kv" | cut -c1-160
  fi
  ;;
prefill)
  # #45 item 2: the engine's prefill, this tree's against OLD's (default .gpubundle/old/) in one invocation, after
  # the engine's GPU tests: 1,024-token prompts with 256 new tokens at 64 / 256 sequences, 12,288-token prompts (over
  # the budget: this tree splits them into chunks, OLD prefills each alone) at 16, both under the run's default
  # 8,192-token budget, and the re-prefill burst of an abort update (256 x 3072 lognormal, resumed after 1,200 steps)
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  BENCH=(scripts/bench_engines.py --model /tmp/m05 --device cuda --dtype bfloat16 --engines hf --baselines "" --no-updates)
  # CASES: which of p1024 p12k burst (default all three); TESTS=0 skips the GPU tests
  CASES=" ${CASES:-p1024 p12k burst} "
  [ "${TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hf_engine_cuda.py 2>&1 | tail -4
  for side in ${SIDES:-new old}; do
    PP=$PYTHONPATH; [ $side = old ] && PP=/tmp/site:$PWD/${OLD:-.gpubundle/old}
    [[ $CASES == *" p1024 "* ]] && PYTHONPATH=$PP timeout 120 python3 "${BENCH[@]}" --concurrency 64 256 \
        --prompt-len 1024 --new-tokens 256 --repeats 2 --max-num-batched-tokens 8192 --out "$OUT/${side}_p1024.json" \
        2>&1 | grep -v "it/s\]" | tail -3
    [[ $CASES == *" p12k "* ]] && PYTHONPATH=$PP timeout 120 python3 "${BENCH[@]}" --concurrency 16 --prompt-len 12288 \
        --new-tokens 128 --repeats 2 --max-num-batched-tokens 8192 --out "$OUT/${side}_p12k.json" 2>&1 \
        | grep -v "it/s\]" | tail -3
    [[ $CASES == *" burst "* ]] && PYTHONPATH=$PP timeout 150 python3 "${BENCH[@]}" --concurrency 256 --new-tokens 3072 \
        --repeats 1 --resume-budgets 8192 0 --resume-after-steps 1200 --out "$OUT/${side}_burst.json" 2>&1 \
        | grep -v "it/s\]" | tail -3
  done
  ;;
attention)
  # #45: the packed attention kernels alone (scripts/bench_varlen_attention.py: the seed-003 update's micro-batches,
  # forward and backward, FlashAttention varlen against cuDNN; the prefill chunk's flash against sdpa), after the
  # packing GPU tests (the flash path with more keys than queries against sdpa aligned to the bottom right)
  # KERNELS: which (default flash, triton and cudnn); SWEEP=1 tries the Triton kernels' block settings first
  export CUDA_VISIBLE_DEVICES=0
  python3 -c "import inspect, torch, triton; from torch.nn.attention.varlen import varlen_attn as f; \
print('torch', torch.__version__, 'triton', triton.__version__, 'varlen_attn', inspect.signature(f))"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_packing_cuda.py 2>&1 | tail -4
  timeout ${LIMIT:-240} python3 scripts/bench_varlen_attention.py ${SWEEP:+--sweep} --kernels ${KERNELS:-flash triton cudnn} \
      --out "$OUT/varlen_attention.json" 2>&1 | grep -v "^sweep.*failed" | tail -${TAIL_LINES:-16}
  ;;
update)
  # #45: the seed-003 step's update alone (512 responses, the workload's lognormal lengths up to 3072, 32768 tokens a
  # micro-batch, packed, compiled layers), without and with gradient checkpointing, and where its kernels' time goes
  # SIDES="new old": this tree's update, then OLD's (a package tree with its scripts, default .gpubundle/old/), in
  # one call (PROFILE= leaves the kernel profile out); SIDES="new each": this tree, then this tree with the one-rank
  # fsdp2 reducing and gathering every micro-batch (--reduce-every-micro-batch, resharded: as before 953cd9e);
  # "keep": this tree with fsdp_config.reshard_after_forward=false (the gathered weights kept across micro-batches,
  # what an unset key does on one device since 2026-11-30's sixth session); "reshard": with it true (each layer
  # re-gathered in every backward and micro-batch, verl's default over several ranks); "torch": this tree's plain
  # backend (bf16 parameters).
  # The bench builds the run's backend (verl's fsdp: on one bf16 device a one-rank fsdp2); STRATEGY=torch: the plain
  # backend, bf16 parameters (what the update rows before 2026-11-30's fifth session measured)
  shaped_model 0.5b /tmp/m05
  export CUDA_VISIBLE_DEVICES=0
  # PACKED="flash triton": this tree's update once per packed attention kernel (FULLY_ASYNC_PACKED_ATTENTION)
  for side in ${SIDES:-new}; do
    for kernel in ${PACKED:-auto}; do
      PP=$PYTHONPATH; ROOT=.; [ $side = old ] && { ROOT=${OLD:-.gpubundle/old}; PP=/tmp/site:$PWD/$ROOT; }
      SIDE_ARGS=(); [ $side = each ] && SIDE_ARGS=(--reduce-every-micro-batch
                                                  --set actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true)
      [ $side = keep ] && SIDE_ARGS=(--set actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false)
      [ $side = reshard ] && SIDE_ARGS=(--set actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true)
      [ $side = torch ] && SIDE_ARGS=(--strategy torch)
      [ $side != old ] && [ $side != torch ] && SIDE_ARGS+=(--strategy "${STRATEGY:-fsdp}")
      FULLY_ASYNC_PACKED_ATTENTION=$kernel PYTHONPATH=$PP timeout ${LIMIT:-420} python3 $ROOT/scripts/bench_packing.py \
          --model /tmp/m05 --device cuda --rows 512 --n 8 --max-prompt 16 --max-response 3072 --lengths workload \
          --max-tokens 32768 --variants ${VARIANTS:-packed:varlen/compiled packed:varlen/compiled/ckpt} ${PROFILE---profile} \
          "${SIDE_ARGS[@]}" \
          --warmup 1 --iters ${ITERS:-2} --out "$OUT/update${SIDES:+_$side}${PACKED:+_$kernel}.json" 2>&1 \
          | tee "$OUT/update${SIDES:+_$side}${PACKED:+_$kernel}.log" | grep -v "it/s\]" | grep -vi "warn" | tail -${TAIL_LINES:-40}
    done
  done
  ;;
scaling)
  shaped_model 0.5b /tmp/m05
  timeout 560 python3 scripts/bench_rollout_scaling.py --devices ${DEVICES:-1 2 4} --out /tmp/pool/scaling "${POOL[@]}" \
      2>&1 | grep -v "it/s\]" | grep -E "^\[|^ |devices|hardware|workload|Error|error" | tail -40
  cp /tmp/pool/scaling/rollout_scaling.json "$OUT/" 2>/dev/null
  ;;
compare2|compare4)
  shaped_model 0.5b /tmp/m05
  N=${1#compare}
  [ "$N" = 2 ] && export CUDA_VISIBLE_DEVICES=0,1
  timeout 560 python3 scripts/compare_sync_async.py --devices "$N" --threshold ${REWARD_THRESHOLD:-0.0} --bench-batches 2 ${SPLIT:+--split $SPLIT} \
      ${BENCH_JSON:+--bench-json $BENCH_JSON} ${SYNC_LOG:+--sync-log $SYNC_LOG} --out /tmp/pool/compare$N${SPLIT:+_split$SPLIT} "${POOL[@]}" \
      2>&1 | grep -v "it/s\]" | grep -E -v "^\[(async|sync|bench)\] " | tail -60
  D=/tmp/pool/compare$N${SPLIT:+_split$SPLIT}
  cp "$D/report.md" "$OUT/report$N${SPLIT:+_split$SPLIT}.md"; cp "$D/table.json" "$OUT/table$N${SPLIT:+_split$SPLIT}.json"
  cp "$D/bench.json" "$OUT/bench$N.json" 2>/dev/null
  ;;
runs)
  shaped_model 0.5b /tmp/m05
  COMMON=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
          data.val_files=null data.max_prompt_length=16 data.max_response_length=256
          actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.dtype=bfloat16
          actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
          actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.ppo_mini_batch_size=16
          data.train_batch_size=16 trainer.total_training_steps=${STEPS:-15} trainer.resume_mode=disable
          trainer.progress_bar=false trainer.timeline=true "trainer.default_local_dir=/tmp/ckpt")
  TENSORBOARD_DIR=$OUT/runs/async timeout 240 python3 -m fully_async.main mode=async "${COMMON[@]}" \
      hydra.run.dir=/tmp/h_async 2>&1 | grep -v "it/s\]" | tail -25
  TENSORBOARD_DIR=$OUT/runs/sync timeout 240 python3 -m fully_async.main mode=sync trainer.n_gpus_per_node=2 \
      "${COMMON[@]}" hydra.run.dir=/tmp/h_sync 2>&1 | grep -v "it/s\]" | tail -25
  timeout 150 python3 scripts/bench_weight_sync.py --shapes 0.5b 3b --device cuda --out "$OUT/weight_sync.json" 2>&1 | tail -8
  tar czf "$OUT/runs.tgz" -C "$OUT" runs
  ;;
vpp)
  # #23: virtual pipeline stages (megatron's interleaved schedule) on 2 GPUs: pp=2 x vpp=2 against the HF model
  # (gpu_megatron_check.py: log-probs, one PPO step, synced weights, offload, save/load; a batch of CHECK_BATCH rows,
  # 8 by default: two micro-batches of 4 and their own lengths), then a short sync run with vpp on the 0.5B shape
  export CUDA_VISIBLE_DEVICES=${GPUS:-0,1}
  timeout ${CHECK_LIMIT:-240} torchrun --nproc_per_node 2 --master_port ${MASTER_PORT:-29500} scripts/gpu_megatron_check.py --pp 2 --vpp 2 \
      --dtypes ${DTYPES:-float32 bfloat16} --batch ${CHECK_BATCH:-8} --seq 256 --out "$OUT" > "$OUT/vpp_check.log" 2>&1
  grep -v -i "warn" "$OUT/vpp_check.log" | grep -E "^\[rank[0-9]\]: [A-Za-z.]*(Error|Exception)|^[{|]|^(check|logp|vs |pg_|grad|fwd|tokens|sync|offload|save|peak)" | tail -30
  shaped_model 0.5b /tmp/m05
  TENSORBOARD_DIR=/tmp/runs/vpp_sync timeout ${RUN_LIMIT:-200} python3 -m fully_async.main --config-name=ppo_megatron_trainer \
      "${POOL[@]}" trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 \
      actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2 actor_rollout_ref.actor.use_kl_loss=true \
      trainer.total_training_steps=${STEPS:-4} trainer.resume_mode=disable trainer.save_freq=${STEPS:-4} \
      hydra.run.dir=/tmp/h_vpp > "$OUT/vpp_sync.log" 2>&1
  grep -E "^step|run finished|Error|error" "$OUT/vpp_sync.log" | tail -8
  cat /tmp/h_vpp/failure_traceback.txt 2>/dev/null | tail -30
  ;;
megatron)
  shaped_model 0.5b /tmp/m05
  M=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
     data.val_files=null data.max_prompt_length=16 data.max_response_length=128
     actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
     actor_rollout_ref.actor.ppo_mini_batch_size=16 data.train_batch_size=16 trainer.total_training_steps=${STEPS:-6}
     trainer.resume_mode=disable trainer.progress_bar=false "trainer.default_local_dir=/tmp/ckpt")
  [ "${SKIP_ASYNC:-0}" = 1 ] || TENSORBOARD_DIR=$OUT/megatron_async timeout 200 python3 -m fully_async.main --config-name=fully_async_ppo_megatron_trainer mode=async "${M[@]}" \
      hydra.run.dir=/tmp/h_ma 2>&1 | grep -v "it/s\]" | tail -12
  TENSORBOARD_DIR=$OUT/megatron_sync_tp2 timeout 200 python3 -m fully_async.main --config-name=fully_async_ppo_megatron_trainer mode=sync \
      trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "${M[@]}" hydra.run.dir=/tmp/h_ms 2>&1 \
      | grep -v "it/s\]" | tail -12
  ;;
mfu)
  # #12: megatron and torch give the same loss on one batch; the packed PPO update's MFU with the fused lm_head
  # (default) against the unfused head and the padded baseline, same batch, same process
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_megatron_parity.py 2>&1 | tail -6
  timeout 300 python3 scripts/bench_packing.py --shape 0.5b --device cuda \
      --variants ${VARIANTS:-packed:varlen packed:varlen/unfused packed:varlen/compiled packed:varlen/unfused/compiled padded} --out "$OUT/packing_mfu.json" 2>&1 | tail -8
  ;;
multijob)
  # several jobs on one device pool (#15): JOBS (default 2) sync-mode jobs with the 0.5B-shaped model share the
  # first DEVICES GPUs (default 1: both on GPU 0) under the pool's leases -- each job's engine and trainer are on
  # the GPU only while it holds the lease -- then the same jobs one after another, each alone.  Prints per job the
  # end-to-end time both ways and, per phase, what an offload frees and an onload brings back (allocated and
  # reserved GiB before -> after, seconds); writes $OUT/multi_job.json and the pool's Perfetto timeline.
  # 2 GPUs: DEVICES=2 JOBS=3 JOB_DEVICES='0;1;0' (a job per GPU, the third shares GPU 0 with the first), or
  # DEVICES=2 EXTRA="trainer.n_gpus_per_node=2 actor_rollout_ref.actor.strategy=fsdp2" (each job on both GPUs);
  # async jobs, crossed (each GPU carries one job's trainer and the other's rollout):
  # MODE=async DEVICES=2 JOB_DEVICES='0;1' ROLLOUT_DEVICES='1;0'
  # (the sequential baseline runs each async job alone on both GPUs: trainer on one, rollout on the other)
  shaped_model 0.5b /tmp/m05
  MJ=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
      data.val_files=null data.max_prompt_length=16 data.max_response_length=${MAXLEN:-256}
      actor_rollout_ref.actor.dtype=bfloat16 actor_rollout_ref.rollout.dtype=bfloat16
      actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
      actor_rollout_ref.actor.ppo_mini_batch_size=$BATCH data.train_batch_size=$BATCH actor_rollout_ref.rollout.n=8
      actor_rollout_ref.rollout.max_num_seqs=${NSEQS:-128} benchmark.response_length=${LENGTHS:-lognormal}
      trainer.total_training_steps=${STEPS:-8} trainer.logger=[console,tensorboard])
  rm -rf /tmp/multijob
  timeout ${LIMIT:-580} python3 scripts/multi_job_compare.py --mode ${MODE:-sync} --jobs ${JOBS:-2} \
      --devices ${DEVICES:-1} --out /tmp/multijob ${JOB_DEVICES:+--job-devices "$JOB_DEVICES"} \
      ${ROLLOUT_DEVICES:+--rollout-devices "$ROLLOUT_DEVICES"} "${MJ[@]}" ${EXTRA:-} 2>&1 | grep -v "it/s\]" | tail -40
  cp /tmp/multijob/multi_job.json "$OUT/multi_job_${TAG:-run}.json" 2>/dev/null
  cp /tmp/multijob/shared/pool/compare_pool/timeline.json "$OUT/multi_job_${TAG:-run}_timeline.json" 2>/dev/null
  grep -h -E "Error|error|Traceback" /tmp/multijob/*/job*.log | head -20
  ;;
packing)
  # remove-padding: parity (float32, then bfloat16) and trainer throughput on one GPU, then end to end on two
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/bench_packing.py --shape 0.5b --device cuda --dtype float32 \
      --rows 16 --max-tokens 8192 --warmup 0 --iters 1 --out "$OUT/packing_parity_fp32.json" 2>&1 | tail -5
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/bench_packing.py --shape 0.5b --device cuda \
      --variants padded/plain padded packed:varlen/plain packed:varlen packed:sdpa \
      --out "$OUT/packing_0.5b.json" 2>&1 | tail -7
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/bench_packing.py --shape 0.5b --device cuda --grad-ckpt \
      --rows 128 --max-tokens 32768 --variants padded packed:varlen --out "$OUT/packing_0.5b_ckpt.json" 2>&1 | tail -4
  shaped_model 0.5b /tmp/m05
  P=("${PRESET[@]}" trainer.device=cuda actor_rollout_ref.model.path=/tmp/m05 data.train_files=.gpubundle/data/train.jsonl
     data.val_files=null data.max_prompt_length=16 data.max_response_length=256
     actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.dtype=bfloat16
     actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.optim.lr=1e-6
     actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.actor.use_dynamic_bsz=true
     actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 actor_rollout_ref.actor.ppo_mini_batch_size=16
     data.train_batch_size=16 trainer.total_training_steps=${STEPS:-5} trainer.resume_mode=disable
     trainer.progress_bar=false "trainer.default_local_dir=/tmp/ckpt")
  TENSORBOARD_DIR=$OUT/packed_sync timeout 200 python3 -m fully_async.main mode=sync trainer.n_gpus_per_node=2 "${P[@]}" \
      hydra.run.dir=/tmp/h_ps 2>&1 | grep -v "it/s\]" | tail -10
  ;;
esac
ls -la "$OUT"
