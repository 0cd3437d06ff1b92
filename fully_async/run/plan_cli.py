"""`python -m fully_async.plan [plan.key=value ...] [overrides]`: what a config needs and what it will do, before
any device is touched.

Same Hydra config and validation as `python -m fully_async.main`, then:
  1. memory per device of each role against the device's capacity (planner/memory_model.py); a role that does
     not fit makes the exit code 2;
  2. the device plan: which node and device holds which rollout replica and trainer rank;
  3. predicted tokens/s of sync (all devices), split async at every rollout/trainer split, elastic async (split
     with an engine on every trainer device) and colocated async (all devices), for each device count in
     plan.devices, by a discrete-event simulation (planner/pipeline_sim.py, colocated_sim.py) from stage costs
     measured by scripts/bench_pipeline.py or a run's logs (plan.stage_costs=...) or estimated from FLOPs and
     bandwidth;
  4. the recommended mode (the fastest whose memory fits: colocated and elastic put an engine next to a trainer
     rank, asleep while it trains, as sync does), each mode's predicted speedup over sync and every assumption.
`--json` prints the same as one JSON object.  Planner keys (plan_options.py): plan.devices=[8,32,128],
plan.stage_costs=bench.json, plan.response_lengths=lognormal|<histogram.json>|<run's TensorBoard dir>,
plan.device=ascend910b|h100|..., plan.device_memory_gib=..., plan.weight_sync_s=..., plan.sim_steps=16,
plan.batch_scaling=weak|fixed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from fully_async.core.config import ConfigError, num_seqs, uses_critic
from fully_async.planner.hardware import DEVICES, DeviceSpec, Shape, known_shape
from fully_async.planner.memory_model import (GIB, checkpoints_activations, co_tenant_need_gib, co_tenant_usable_gib,
                                             colocated_memory, engine_memory, trainer_dp, trainer_estimate_bytes,
                                             trainer_memory, verdict)
from fully_async.planner.sim_engine import data_parallel_speedup
from fully_async.run.plan_format import format_text
from fully_async.run.plan_options import PlanOptions, parse, split_overrides

DEFAULT_DEVICE = {"npu": "ascend910b", "cuda": "h100", "auto": "ascend910b"}
MAX_PLAN_LINES = 12
WARMUP_STEPS = 2          # simulated steps left out of the steady rate (the async pipeline fill)


# ----------------------------------------------------------------------------------- inputs
def model_shape(cfg: Any) -> tuple[Shape, str]:
    """The model's shape and where it came from: the local config.json, else the built-in table."""
    path = str(cfg.actor_rollout_ref.model.path)
    try:
        local = Shape.from_dir(path)
    except ValueError as exc:
        raise ConfigError("actor_rollout_ref.model.path", str(exc)) from exc
    if local is not None:
        return local, os.path.join(path, "config.json")
    known = known_shape(path)
    if known is None:
        from fully_async.planner.hardware import MODEL_SHAPES
        raise ConfigError("actor_rollout_ref.model.path", f"{path!r} has no config.json here and is not a built-in "
                          f"shape ({', '.join(MODEL_SHAPES)}, optionally with an org prefix and -Instruct)")
    name, shape = known
    return Shape.of(shape), f"built-in shape table: {name} (no local config.json; from the model's Hub config)"


def assumed_device(cfg: Any, opts: PlanOptions, detect: Optional[Any] = None) -> tuple[Optional[str], str]:
    """(the device table row the prediction prices, why that one).  plan.device wins; trainer.device=npu|cuda take
    their default row; trainer.device=auto resolves as a run would on this machine (`detect`: () -> npu|cuda|cpu,
    fully_async.device by default), and where it finds no accelerator the plan is for the package's first target,
    Ascend 910B, said so rather than assumed silently."""
    if opts.device:
        return opts.device, f"plan.device={opts.device}"
    asked = str(cfg.trainer.device)
    if asked != "auto":
        key = DEFAULT_DEVICE.get(asked)
        return key, (f"trainer.device={asked}: its default row ({key}); another card: plan.device="
                     f"{'|'.join(sorted(DEVICES))}" if key else f"trainer.device={asked}: no table row")
    if detect is None:
        def detect() -> str:
            from fully_async.device import get_device
            return get_device("auto").name
    found = detect()
    if found in DEFAULT_DEVICE and found != "auto":
        return DEFAULT_DEVICE[found], (f"trainer.device=auto is {found} on this machine: its default row "
                                       f"({DEFAULT_DEVICE[found]}); another card: plan.device=...")
    return DEFAULT_DEVICE["auto"], ("trainer.device=auto and this machine has no NPU or GPU: planning for an Ascend "
                                    "910B (ascend910b), the package's first target; name the cards you will run on "
                                    f"with plan.device={'|'.join(sorted(DEVICES))}")


def device_spec(cfg: Any, opts: PlanOptions, key: Optional[str] = None) -> DeviceSpec:
    key = key or opts.device or DEFAULT_DEVICE.get(str(cfg.trainer.device))
    if key is None:
        if None in (opts.device_memory_gib, opts.device_tflops, opts.device_hbm_gbs):
            raise ConfigError("plan.device", f"trainer.device={cfg.trainer.device}: name a device row "
                              f"({', '.join(sorted(DEVICES))}) or give plan.device_memory_gib, plan.device_tflops "
                              "and plan.device_hbm_gbs")
        base = DeviceSpec("custom device", 0.0, 0.0, 0.0, 10.0)
    else:
        base = DEVICES[key]
    return DeviceSpec(base.name if not any(v is not None for v in (opts.device_memory_gib, opts.device_tflops,
                                                                     opts.device_hbm_gbs, opts.device_link_gbs))
                      else f"{base.name} (overridden)",
                      opts.device_memory_gib or base.memory_gib, opts.device_tflops or base.tflops,
                      opts.device_hbm_gbs or base.hbm_gbs, opts.device_link_gbs or base.link_gbs)


def length_profile(cfg: Any, opts: PlanOptions) -> tuple[Any, str]:
    """(sample id -> length, description) of the response-length distribution the prediction assumes."""
    from omegaconf import OmegaConf

    from fully_async.core.workload import LengthProfile

    choice = opts.response_lengths
    if os.path.isdir(choice):   # a run's TensorBoard dir: the lengths its trained responses had (launcher.py)
        from fully_async.core.workload import RESPONSE_LENGTHS

        if not os.path.isfile(os.path.join(choice, RESPONSE_LENGTHS)):
            raise ConfigError("plan.response_lengths", f"{choice} has no {RESPONSE_LENGTHS} (a run writes it into "
                              "its TensorBoard dir when it finishes)")
        choice = os.path.join(choice, RESPONSE_LENGTHS)
    bench_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if choice == "config":
        if str(cfg.benchmark.response_length) == "none":
            bench_cfg.benchmark.response_length = "lognormal"
            label = "assumed (benchmark.response_length=none): the long-tail workload's "
        else:
            label = "the config's benchmark.response_length: "
    elif choice == "lognormal" or choice.endswith(".json"):
        bench_cfg.benchmark.response_length = choice
        label = ""
    else:
        raise ConfigError("plan.response_lengths", f"{choice!r}: expected config, lognormal, a .json length "
                          "histogram ({\"lengths\": [...], \"weights\": [...]}) or a run's TensorBoard dir")
    try:
        profile = LengthProfile.from_config(bench_cfg)
    except ConfigError as exc:
        raise ConfigError("plan.response_lengths", str(exc)) from exc
    return profile.target, label + profile.describe()


def engine_stays_resident(cfg: Any, shape: Shape, spec: DeviceSpec) -> tuple[bool, str]:
    """Does the engine keep its memory through the trainer's turns (no weights to the host and back at a switch)?
    free_cache_engine=false: yes; true: where the engine's first switch would find that both fit
    (device_memory/policy.py): the trainer's estimated peak, 20% over, and the engine within the device less its
    margin; never with the force key, a pool or an offloading trainer."""
    from fully_async.device_memory.policy import PRIVATE_POOL_MARK, engine_memory_mode

    mode, why = engine_memory_mode(cfg)
    capacity = spec.memory_gib * GIB
    mj = cfg.multi_job
    if (mode == "free" and cfg.mode == "sync" and mj.pool is not None and PRIVATE_POOL_MARK not in mj.pool
            and mj.co_tenancy and not cfg.actor_rollout_ref.rollout.free_cache_engine_force):
        # co-tenancy (placement/leases.py): a lease granted on the job's declared need switches nothing
        need = co_tenant_need_gib(cfg, shape, trainer_dp(cfg), capacity)
        room = co_tenant_usable_gib(spec.memory_gib)
        jobs = max(0, int(room // need)) if need > 0 else 0
        return jobs >= 1, (f"multi_job.pool with co-tenancy: this job declares {need:.1f} GiB (memory model, 20% "
                           f"over) of the {room:.0f} GiB the pool shares of {spec.memory_gib:.0f}: "
                           + (f"{jobs} such job(s) hold the device at once, nothing switching (a job that does not "
                              "fit beside them makes each switch free the engine)" if jobs else
                              "it does not fit even alone, so it takes the device alone and frees at each switch"))
    if mode != "auto":
        return mode == "keep", why
    # as the engine's first switch judges it (device_memory/policy.py): the trainer's estimated peak, 20% over, beside
    # the resident engine within the device less its margin
    trainer, engine = trainer_estimate_bytes(cfg, shape, capacity), engine_memory(cfg, shape, capacity).total
    room = co_tenant_usable_gib(spec.memory_gib)
    fits = (trainer + engine) / GIB <= room
    return fits, (f"free_cache_engine=true: the trainer's estimated peak {trainer / GIB:.1f} GiB (20% over) + engine "
                  f"{engine / GIB:.1f} GiB {'within' if fits else 'over'} the {room:.0f} GiB of {spec.memory_gib:.0f} "
                  f"the device leaves beside its margin: the engine "
                  f"{'stays resident' if fits else 'frees its memory at each switch'}")


def stage_costs(cfg: Any, opts: PlanOptions, shape: Shape, spec: DeviceSpec, mean_response: float) -> tuple:
    """(StageCosts, derivation dict, prompt length)."""
    from dataclasses import replace

    from fully_async.planner.stage_costs import estimate, from_bench

    actor = cfg.actor_rollout_ref.actor
    mp = actor.megatron.tensor_model_parallel_size * actor.megatron.pipeline_model_parallel_size \
        if actor.strategy == "megatron" else 1
    extra = int(bool(actor.use_kl_loss)) + int(not cfg.async_training.use_rollout_log_probs)
    if uses_critic(cfg):   # its values forward, its update (3 forwards' worth) and its recompute (checkpointing)
        extra += 4 + int(bool(cfg.critic.model.enable_gradient_checkpointing))
    prompt = opts.prompt_length or max(1, cfg.data.max_prompt_length // 2)
    rollout = cfg.actor_rollout_ref.rollout
    off = actor.fsdp_config
    resident, resident_why = engine_stays_resident(cfg, shape, spec)
    host = (0.0 if resident else 2.0 * shape.params() / rollout.tensor_model_parallel_size) + \
        (4.0 * shape.params() / mp if off.param_offload else 0.0) + (8.0 * shape.params() / mp if off.optimizer_offload
                                                                     else 0.0)
    # colocated async: a freeing switch also swaps the KV of the responses in flight to the host and back (the
    # embedded engine, rollout/engines/engine_memory.py KvSwap), every slot taken at the mean context in flight;
    # priced for colocated async only (colocated_sim.py): sync switches with nothing in flight
    swap = 0.0
    from fully_async.placement import placement_of

    if not resident and placement_of(cfg).holds_through_turns and rollout.name == "hf":
        swap = num_seqs(rollout) * (prompt + mean_response / 2) * shape.kv_bytes_per_token(2)
    est = estimate(shape, spec, rollout_tp=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, train_mp=mp,
                   checkpointing=checkpoints_activations(cfg, shape, trainer_dp(cfg), spec.memory_gib * GIB),
                   extra_forwards=extra, host_bytes=host, swap_bytes=swap,
                   assumptions=opts.estimate_assumptions(embedded=rollout.name == "hf"))
    derived: dict[str, Any] = {"estimate": est.as_dict(), "host_bytes_per_sync_step": host,
                               "kv_swap_bytes_per_switch": swap, "engine_resident": resident_why}
    if opts.stage_costs is None:
        costs = est
    elif os.path.isdir(opts.stage_costs):
        costs, run_prompt, run_trainer = run_stage_costs(opts.stage_costs, est, prompt + mean_response / 2)
        # the run's per-device-token cost holds its own data-parallel efficiency: one device's is that scaled by the
        # efficiency assumed at the run's device count, so the run's own device count is predicted as measured
        run_devices = max(run_trainer, 1)
        costs = replace(costs, dp_efficiency=opts.dp_efficiency, train_token_s=costs.train_token_s
                        * data_parallel_speedup(run_devices, opts.dp_efficiency) / run_devices)
        derived["measured"] = {"run": opts.stage_costs, "mode": costs.source}
        if opts.prompt_length is None and run_prompt:
            prompt = max(1, round(run_prompt))
        # a run measures one side of the weight update: the other mode's comes from the estimate
        derived["weight_sync"] = "measured" if costs.weight_sync_s else "estimated"
        derived["sync_step"] = "measured" if costs.sync_step_s else "estimated"
        costs = replace(costs, weight_sync_s=costs.weight_sync_s or est.weight_sync_s,
                        sync_step_s=costs.sync_step_s or est.sync_step_s)
    else:
        try:
            with open(opts.stage_costs) as fh:
                bench = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError("plan.stage_costs", f"cannot read {opts.stage_costs}: {exc}") from exc
        fraction = opts.decode_seq_fraction if opts.decode_seq_fraction is not None else \
            (0.0 if bench.get("device") != "cpu" else 1.0)
        try:
            costs, measured = from_bench(bench, fraction, est.weight_sync_s, est.sync_step_s, opts.dp_efficiency,
                                         cfg.data.max_response_length, source=f"measured: {opts.stage_costs}")
        except ValueError as exc:
            raise ConfigError("plan.stage_costs", str(exc)) from exc
        costs = replace(costs, prefill_token_s=0.0)
        derived["measured"] = dict(measured, decode_seq_fraction=fraction, hardware=bench.get("hardware"))
        if opts.prompt_length is None:
            prompt = max(1, round(measured["prompt_tokens_per_sample"]))
    if opts.weight_sync_s is not None:
        costs = replace(costs, weight_sync_s=opts.weight_sync_s)
    if opts.sync_step_s is not None:
        costs = replace(costs, sync_step_s=opts.sync_step_s)
    return costs, derived, prompt


def run_stage_costs(log_dir: str, est: Any = None, mean_context: float = 0.0) -> tuple[Any, float, int]:
    """StageCosts measured by a run (its TensorBoard dir: scalars and config.json), its mean prompt length and its
    trainer devices; with `est` (the estimate's StageCosts) its decode step is split by the estimate's costs per
    sequence and cached token (a sequence at `mean_context` where the run did not log its cache:
    stage_costs.from_run_scalars), and a split or elastic run, which has no turn switch to measure, takes the
    estimate's (colocated async's: a sync run measures it by its on/offload, a colocated run's are in its trainer
    time)."""
    from fully_async.planner.stage_costs import aligned_scalars, from_run_scalars

    config_path = os.path.join(log_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError("plan.stage_costs", f"{log_dir}: no config.json (expected a bench_pipeline.py JSON file or "
                          "the TensorBoard dir of a fully_async run)")
    with open(config_path) as fh:
        run_cfg = json.load(fh)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    trainer = run_cfg["trainer"]["nnodes"] * run_cfg["trainer"]["n_gpus_per_node"]
    placement = run_cfg.get("async_training", {}).get("placement", "split")
    try:
        costs = from_run_scalars(aligned_scalars(series), run_cfg.get("mode", "async"), trainer,
                                 source=f"measured: run logs {log_dir} ({run_cfg.get('mode')} mode)",
                                 placement=placement, seq_cost_s=est.decode_seq_s if est is not None else None,
                                 kv_cost_s=est.decode_kv_token_s if est is not None else 0.0,
                                 mean_context=mean_context)
    except ValueError as exc:
        raise ConfigError("plan.stage_costs", str(exc)) from exc
    if est is not None and run_cfg.get("mode", "async") == "async" and placement != "colocated":
        from dataclasses import replace

        costs = replace(costs, turn_switch_s=est.turn_switch_s)
    prompts = [v for _, v in series.get("prompt_length/mean", [])]
    return costs, (sum(prompts) / len(prompts) if prompts else 0.0), trainer


# ----------------------------------------------------------------------------------- sections
def memory_section(cfg: Any, shape: Shape, spec: DeviceSpec, opts: PlanOptions) -> dict:
    trainer_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    capacity = spec.memory_gib * GIB
    context = opts.context_gib * GIB
    trainer = trainer_memory(cfg, shape, trainer_dp(cfg), capacity)
    engine = engine_memory(cfg, shape, capacity)
    roles = [colocated_memory(cfg, trainer, engine)] if cfg.mode == "sync" else [trainer, engine]
    rows = []
    for role in roles:
        role.parts["context"] = context
        rows.append(dict(role.as_dict(), verdict=verdict(role.total, capacity, opts.warn_fraction)))
    if cfg.mode == "async":  # what the same devices would need as the sync loop (informational, not a verdict)
        n = trainer_devices + cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
        sync_trainer = trainer_memory(cfg, shape, trainer_dp(cfg, n), capacity)
        sync_engine = engine_memory(cfg, shape, capacity)
        sync_engine.parts["weights"] *= cfg.actor_rollout_ref.rollout.tensor_model_parallel_size  # sync: rollout tp 1
        role = colocated_memory(cfg, sync_trainer, sync_engine)
        role.role = f"if sync or colocated async on all {n} devices"
        role.parts["context"] = context
        sync_row = dict(role.as_dict(), verdict=verdict(role.total, capacity, opts.warn_fraction))
        # elastic: each trainer device (as configured) also hosts an engine, asleep while the trainer trains
        role = colocated_memory(cfg, trainer, engine)
        role.role = f"if elastic (an engine on each of the {trainer_devices} trainer devices)"
        role.parts["context"] = context
        elastic_row = dict(role.as_dict(), verdict=verdict(role.total, capacity, opts.warn_fraction))
    else:
        sync_row, elastic_row = None, None
    kv_needed = getattr(engine, "kv_needed", None)
    if kv_needed is not None and cfg.mode == "async" and kv_needed > engine.parts["kv_cache"]:
        rows[-1]["verdict"] = "tight" if rows[-1]["verdict"] == "fits" else rows[-1]["verdict"]
        rows[-1]["note"] += (f"; only {engine.parts['kv_cache'] / GIB:.2f} GiB left for it: vLLM will run fewer "
                             "sequences at once (raise gpu_memory_utilization or rollout tensor parallelism)")
    fits = all(r["verdict"] != "does not fit" for r in rows)
    colocated_fits = (sync_row or rows[0])["verdict"] != "does not fit"
    # which modes fit these devices (the recommendation's filter): sync and colocated async hold the same per
    # device; elastic a trainer rank of the async split plus an engine (a sync config: as colocated)
    mode_fits = {"sync": colocated_fits, "colocated": colocated_fits,
                 "elastic": (elastic_row or rows[0])["verdict"] != "does not fit",
                 "split": fits if cfg.mode == "async" else True}
    # which async placements the run would take with this engine and trainer (the recommendation's other filter)
    from fully_async.core.placement_checks import placement_refusal

    refusals = {m: placement_refusal(cfg, m) for m in ("colocated", "elastic")}
    # the row of a trainer device as configured: sync and split their own; colocated and elastic with an engine beside
    configured = {"colocated": sync_row, "elastic": elastic_row}.get(
        cfg.async_training.placement if cfg.mode == "async" else "sync") or rows[0]
    return {"device": spec.name, "capacity_gib": spec.memory_gib, "params": shape.params(), "roles": rows,
            "fits": fits, "sync_alternative": sync_row, "elastic_alternative": elastic_row, "mode_fits": mode_fits,
            "mode_refusals": {m: why for m, why in refusals.items() if why}, "configured": configured,
            "checkpointing_not_needed": checkpointing_not_needed(cfg, shape, spec, opts)}


# the update of the seed-003 step (0.5B-shaped Qwen2, 512 responses, ~515k tokens) on 1x H200, with and without
# gradient checkpointing (docs/measurements/engine_decode_h200/update_seed003.json)
CHECKPOINTING_MEASURED = "the seed-003 step's update on 1x H200: 4.00 s with it, 3.06 s without"


def checkpointing_not_needed(cfg: Any, shape: Shape, spec: DeviceSpec, opts: PlanOptions) -> Optional[dict]:
    """With actor_rollout_ref.model.enable_gradient_checkpointing=true: when a trainer device of the configured mode
    and placement (memory_section's `configured` row) still fits without it, by the memory model, its peak without
    it and what recomputing costs; else None.  The run's results do not depend on it."""
    import copy

    if cfg.actor_rollout_ref.model.enable_gradient_checkpointing is not True:   # false, or unset: decided by memory
        return None
    off = copy.deepcopy(cfg)
    off.actor_rollout_ref.model.enable_gradient_checkpointing = False
    row = memory_section(off, shape, spec, opts)["configured"]
    if row["verdict"] != "fits":
        return None
    return {"without_gib": row["total_gib"], "capacity_gib": spec.memory_gib, "role": row["role"],
            "measured": CHECKPOINTING_MEASURED}


def _ranges(items: list[int]) -> str:
    return f"{items[0]}" if len(items) == 1 else f"{items[0]}-{items[-1]}"


def device_plan(cfg: Any) -> list[str]:
    """Which node/device holds which trainer rank and rollout replica (placement.py packs each pool)."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    t_nodes, t_per = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
    lines = []
    if actor.strategy == "megatron":
        tp, pp = actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size
        dp = t_nodes * t_per // (tp * pp)
        lines.append(f"trainer: {t_nodes} node(s) x {t_per} = {t_nodes * t_per} ranks, megatron tp={tp} pp={pp} "
                     f"dp={dp} (rank = tp_rank + tp x (dp_rank + dp x pp_rank))")
        for p in range(pp):
            for d in range(dp):
                ranks = [t + tp * (d + dp * p) for t in range(tp)]
                lines.append(f"  node {ranks[0] // t_per} devices {_ranges([r % t_per for r in ranks])}: ranks "
                             f"{_ranges(ranks)} = pp stage {p}, dp replica {d}, tp 0-{tp - 1}")
    else:
        lines.append(f"trainer: {t_nodes} node(s) x {t_per} = {t_nodes * t_per} data-parallel rank(s), "
                     f"strategy {actor.strategy}")
        for node in range(t_nodes):
            lines.append(f"  node {node} devices 0-{t_per - 1}: ranks {node * t_per}-{node * t_per + t_per - 1}")
    if cfg.mode == "sync":
        lines.append("rollout: colocated, one engine per trainer rank on that rank's device (generate, then train)")
        return _clip(lines)
    if cfg.async_training.placement == "colocated":
        lines.append("rollout: colocated async, one engine per trainer rank on that rank's device (the engines "
                     "generate while the trainer waits, over-provisioned under the staleness bound)")
        return _clip(lines)
    r_nodes, r_per, tp = cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, rollout.tensor_model_parallel_size
    lines.append(f"rollout: {r_nodes} node(s) x {r_per} = {r_nodes * r_per} devices, {r_nodes * r_per // tp} "
                 f"replica(s) of tp={tp} ({rollout.name}, max_num_seqs={num_seqs(rollout)} each)")
    for node in range(r_nodes):
        reps = list(range(node * (r_per // tp), (node + 1) * (r_per // tp)))
        lines.append(f"  node {node} devices 0-{r_per - 1}: replicas {_ranges(reps)}")
    lines.append("(each pool is PACKed by Ray: the rollout and trainer pools share a node when it has room)")
    return _clip(lines)


def _clip(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_PLAN_LINES:
        return lines
    return lines[:MAX_PLAN_LINES - 1] + [f"  ... ({len(lines) - MAX_PLAN_LINES + 1} more lines in --json)"]


def throughput_section(cfg: Any, opts: PlanOptions, shape: Shape, spec: DeviceSpec) -> dict:
    from fully_async.planner.search import PipelineShape, plan_devices
    from fully_async.planner.stage_costs import expected_mean

    length, length_desc = length_profile(cfg, opts)
    pshape = PipelineShape.of(cfg)
    costs, derived, prompt = stage_costs(cfg, opts, shape, spec, expected_mean(length, pshape.n, 64))
    devices = opts.devices or [pshape.config_devices]
    results = [plan_devices(n, pshape, costs, length, prompt, opts.sim_steps, opts.batch_scaling, WARMUP_STEPS)
               for n in devices]
    assumptions = [
        f"stage costs: {costs.source}",
        f"response lengths: {length_desc}",
        f"prompt tokens per sample: {prompt}",
        f"decode step = {costs.decode_step_s * 1e3:.3f} ms + {costs.decode_seq_s * 1e6:.3f} us x sequences in flight"
        f" + {costs.decode_kv_token_s * 1e9:.3f} ns x tokens they have cached;"
        f" prefill {costs.prefill_token_s * 1e6:.3f} us/token; train {costs.train_token_s * 1e6:.3f} us/token on one "
        f"device (+{costs.train_step_s:.3f} s/step), data-parallel efficiency {costs.dp_efficiency:g}",
        f"async weight update {costs.weight_sync_s:.3f} s (both sides stall)" + (
            " (plan.weight_sync_s)" if opts.weight_sync_s is not None else " (measured by the run)"
            if derived.get("weight_sync") == "measured" else " (estimated: bf16 weights over the device link)") + (
            f", then the engines' load {costs.weight_load_s:.3f} s (the trainer goes on; measured by the run)"
            if costs.weight_load_s else ""),
        f"sync per-step switch {costs.sync_step_s:.3f} s" + (
            " (plan.sync_step_s)" if opts.sync_step_s is not None else " (measured by the run)"
            if derived.get("sync_step") == "measured" else f" (estimated: local reload + "
            f"{derived['host_bytes_per_sync_step'] / 1e9:.1f} GB to the host and back: offloads, and the engine's "
            f"weights unless it stays resident; {derived['engine_resident']})") + (
            f"; colocated async swaps {derived['kv_swap_bytes_per_switch'] / 1e9:.1f} GB of KV of the responses in "
            f"flight to the host and back at each switch besides ({costs.swap_s:.3f} s)"
            if costs.swap_s else "") + f"; colocated async's turn switch {costs.turn_switch_s:.3f} s (without the "
        "weight load: it loads at an update)",
        f"staleness_threshold={pshape.staleness_threshold:g}, trigger_parameter_sync_step={pshape.trigger}, "
        f"partial_rollout={pshape.partial_rollout}, max_num_seqs={pshape.max_num_seqs} per replica",
        f"batch at other device counts: {opts.batch_scaling} (config: {pshape.async_groups} groups/step async, "
        f"{pshape.sync_groups} sync, on {pshape.config_devices} devices); {opts.sim_steps} steps simulated, "
        f"ranked by the steady rate (the first {WARMUP_STEPS} steps, the pipeline fill, left out)",
    ]
    if opts.stage_costs is None:
        efficiencies = opts.estimate_assumptions(embedded=cfg.actor_rollout_ref.rollout.name == "hf")
        assumptions.append("estimate efficiencies: " + ", ".join(f"{k}={v:g}" for k, v in efficiencies.items()))
    return {"costs": costs.as_dict(), "derived": derived, "prompt_length": prompt, "results": results,
            "assumptions": assumptions}


def validate_for_plan(cfg: Any) -> list[str]:
    """The run's validation (config.validate), except for what a plan does not need on this machine: a model
    path naming a built-in shape (sized from the shape table) and data files not found here (the run will
    need them; returned as warnings).  Every other ConfigError stops the plan as it would stop the run."""
    from fully_async.core import config_checks as config_mod

    path = str(cfg.actor_rollout_ref.model.path)
    builtin = not os.path.isfile(os.path.join(path, "config.json")) and known_shape(path) is not None
    warnings = []
    for check in config_mod.SECTION_CHECKS + config_mod.CROSS_SECTION_CHECKS:
        if builtin and check is config_mod._check_model:
            continue
        try:
            check(cfg)
        except ConfigError as exc:
            if exc.key in ("data.train_files", "data.val_files") and "file not found" in str(exc):
                warnings.append(f"{exc} (not needed to plan; the run needs it)")
                continue
            raise
    return warnings


def size_engine_slots(cfg: Any, shape: Shape, spec: DeviceSpec) -> Optional[dict]:
    """actor_rollout_ref.rollout.max_num_seqs=null: the slots a run would give each engine on `spec`'s devices
    (memory_model.engine_slots, as run/prepare.py sizes them), written into `cfg` for the rest of the plan; None
    where the key is set."""
    r = cfg.actor_rollout_ref.rollout
    if r.max_num_seqs is not None:
        return None
    from fully_async.planner.memory_model import engine_slots

    slots, why = engine_slots(cfg, shape, spec.memory_gib * GIB)
    r.max_num_seqs = slots
    return {"max_num_seqs": slots, "why": why}


def build_report(overrides: list[str], config_name: str = "fully_async_ppo_trainer") -> dict:
    from fully_async.run.hydra_setup import load_config

    plan_args, hydra_args = split_overrides(overrides)
    opts = parse(plan_args)
    cfg = load_config(hydra_args, config_name=config_name)
    warnings = validate_for_plan(cfg)
    shape, source = model_shape(cfg)
    key, why = assumed_device(cfg, opts)
    spec = device_spec(cfg, opts, key)
    slots = size_engine_slots(cfg, shape, spec)
    from fully_async.core.plan import RunPlan

    return {"mode": cfg.mode, "warnings": warnings, "config_devices": RunPlan.of(cfg).total_devices,
            "hardware": {"device": spec.name, "why": why}, **({"engine_slots": slots} if slots else {}),
            "model": {"source": source, "params": shape.params(), "shape": vars(shape)},
            "memory": memory_section(cfg, shape, spec, opts), "device_plan": device_plan(cfg),
            "throughput": throughput_section(cfg, opts, shape, spec)}


USAGE = """Memory per device, the device plan and the predicted tokens/s of sync, split, elastic and colocated async
for a config, before any device is used (the same keys as python -m fully_async.main).  Exit 2 when a role does
not fit in device memory.

Planner keys (plan.KEY=VALUE; the rest are the run's own keys):
  plan.devices=[8,32,128]           device counts to predict for (default: the config's)
  plan.device=ascend910b|h100|...   the cards priced (default: from trainer.device; said in the output)
  plan.stage_costs=FILE_OR_DIR      measured costs: a bench JSON (python -m fully_async.compare.bench --out) or a
                                    run's TensorBoard dir (default: estimated from FLOPs and bandwidth)
  plan.response_lengths=config|lognormal|HISTOGRAM.json|RUN_DIR    plan.sim_steps=16
  plan.batch_scaling=weak|fixed     plan.weight_sync_s=S  plan.sync_step_s=S  plan.dp_efficiency=0.9
  every key:
    {keys}

Other commands:
  python -m fully_async.main ...           train (async; mode=sync for verl's main_ppo loop)
  python -m fully_async.compare ...        measure sync against async on this machine's devices
  python -m fully_async.doctor ...         check data, model, reward and device before a run
Manual: docs/planner.md"""


def usage() -> str:
    from dataclasses import fields

    import textwrap

    keys = textwrap.fill(" ".join(f"plan.{f.name}" for f in fields(PlanOptions)), 112, subsequent_indent=" " * 4)
    return USAGE.format(keys=keys)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fully_async.plan", description=usage(),
                                 usage="%(prog)s [plan.KEY=VALUE ...] [KEY=VALUE ...] [--json] [--config-name NAME]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ap.add_argument("--config-name", default="fully_async_ppo_trainer",
                    help="Hydra config in hydra_configs/ (as for python -m fully_async.main --config-name=...)")
    ap.add_argument("overrides", nargs="*", help="plan.* keys and Hydra overrides, as for python -m fully_async.main")
    args = ap.parse_args(argv)
    from fully_async.run.hydra_setup import user_errors

    try:
        report = build_report(args.overrides, args.config_name)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1, default=str) if args.json else format_text(report))
    return 0 if report["memory"]["fits"] else 2
