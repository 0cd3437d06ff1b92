"""Stage costs for the pipeline simulation: measured (a bench_pipeline.py JSON) or estimated (layer 1).

Measured.  bench_pipeline.py times one device generating `batches` step batches (prompts_per_batch x n
responses, sample ids b<k>-p<i>-s<j>, k from `warmup`) and one device training on them.  The response
lengths of those batches are known exactly when the bench ran a synthetic workload (its JSON records the
profile; ignore_eos without a profile means every response ran to max_response_length), so the engine's
decode steps S and response tokens Y of the timed batches are recomputed here, and the rollout seconds W
are split into a per-step and a per-sequence part by `decode_seq_fraction` f (the share of W that grows with
the number of sequences in flight):  decode_step_s = (1 - f) W / S,  decode_seq_s = f W / Y.  f = 0 (the
default on accelerators) is what was measured on an H100 for the embedded engine: the same 17.5-18.8 ms per
step at 64 and at 256 sequences (per-step overhead bound).  train_token_s = train seconds / trained tokens.

Measured from a run's logs (`from_run_scalars`: a TensorBoard dir of one run, either mode, its own devices):
  decode_step_s   mean of fully_async/rollouter/engine_<k>/ms_per_step over steps and engines; where the run also
                  logged engine_<k>/seqs_per_step (the sequences a step decoded on average, b) and the estimate's
                  costs are given (`seq_cost_s`: a sequence's matrix products; `kv_cost_s`: a cached token's keys
                  and values, read), the mean step m is split into its fixed part and what its batch costs: with
                  engine_<k>/kv_tokens_per_step logged (the tokens a step's sequences had cached, c) decode_seq_s
                  = seq_cost_s x f and decode_kv_token_s = kv_cost_s x f, without it decode_seq_s = (seq_cost_s +
                  kv_cost_s x mean_context) x f, and decode_step_s = m - (those x b and c), where f = 1 unless the
                  estimate's variable part exceeds m (then f scales it to m): the step the run measured at its own
                  batch, priced at other batches and contexts by what a sequence and a cached token cost (a sync
                  run's tail decodes few sequences, colocated async keeps every slot full with the long ones in
                  flight: 1.7 against ~4 ms a step at the seed-003 shape on 1x H200)
  train_token_s   async: sum(timing_s/step - timing_s/gen - timing_s/param_sync) x trainer devices / tokens (the
                  trainer's busy time outside the weight push; timing_s/gen is its wait for groups); sync:
                  sum(timing_s/step - timing_s/gen - switch) x devices / tokens
  weight_sync_s   async: mean timing_s/param_sync over the steps that pushed (the trainer's push; the engines load
                  meanwhile), colocated: plus the mean timing_s/param_sync/load (the engines load on the same devices)
  weight_load_s   split / elastic async whose push returns before the engines load (the object store: the run logs
                  timing_s/param_sync/wait, the next push's wait for that load): mean timing_s/param_sync/load, the
                  engines' load after the push (a collective push waits for it: inside timing_s/param_sync)
  sync_step_s     sync: mean(timing_s/param_sync + onload + offload + reward)
  turn_switch_s   sync: mean(timing_s/onload + offload + reward) (colocated async's turn switch and scoring: it
                  loads weights only at an update); a colocated run's own switches stay in its trainer busy time
Compiling steps are left out (`steady_steps`): a run's first steps compile (the trainer's layers, the engine's
decode graphs) and cost several times a steady one -- averaged in, a max-1024 run on 1x H200 read train 51.5
us/token against 19.9 steady.  By default a step is left out when its trainer busy seconds per token exceed
OUTLIER_RATIO (1.5) x their median over the run, and an engine's ms-per-step value when it exceeds 1.5 x that
engine's median (so a later recompile is left out too, while a step that is long only because it trained more
tokens is not: the rule is per token); `skip_steps=k` leaves out the first k steps (and values) instead, and
`outlier_ratio=None` keeps every step (scripts/sim_check.py, which checks a run's whole average).  At least one
step is always kept.

Estimated (no measurement).  From the model's shape and the device's data-sheet numbers:
  decode step     weights / (tp x HBM bandwidth x bw_eff) + launch overhead, plus per sequence 2 x matmul params /
                  (tp x peak x mfu), plus per token its sequences have cached its keys and values / (tp x HBM
                  bandwidth x bw_eff) (the simulation counts the cached tokens as they grow)
  prefill token   2 x matmul params / (tp x peak x mfu)
  train token     (6 + 2 x forward passes outside the update) x matmul params / (peak x mfu)
                  (+2 with gradient checkpointing; a reference forward with use_kl_loss, an old-policy forward
                  without use_rollout_log_probs), divided by tp x pp for megatron
  weight sync     bf16 weights / link bandwidth (async); sync's per-step switch: the local reload at HBM speed plus
                  what crosses to the host and back each step (engine weights with free_cache_engine, the
                  trainer's offloaded state) at host_gbs; colocated async's turn switch: that crossing only (the
                  estimate prices no scoring)
The efficiencies are assumptions printed with every prediction (ESTIMATE_ASSUMPTIONS) and overridable.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from fully_async.planner.hardware import DeviceSpec, Shape
from fully_async.planner.sim_engine import StageCosts, Workload, _group, generate_time
from fully_async.core.config import VERL_MAX_NUM_SEQS
from fully_async.core.workload import LengthProfile

ESTIMATE_ASSUMPTIONS = {
    "train_mfu": 0.35,        # model FLOPs utilisation of the update, by this count (6 x matmul params a token):
    #                           0.40 for the 0.5B shape's packed, compiled update alone on one H200, 0.35-0.39 inside
    #                           its colocated and sync runs (2026-11-30); 0.20 on one H100 before packing
    "decode_mfu": 0.5,        # of the decode matmuls once batches are large
    "prefill_mfu": 0.5,
    "bw_eff": 0.7,            # achieved fraction of HBM bandwidth in decode
    "launch_s": 0.004,        # per decode step: kernel launches, scheduling, sampling, host sync (engines not
    #                           measured here: vLLM, vLLM-Ascend; the embedded engine's eager-era H100 figure)
    "embedded_launch_s": 0.0007,  # the embedded engine's graph-captured step beyond its reads and products (1x H200:
    #                           0.77 ms at 64 x 216, 0.65 at 256 x 1516; engine_decode_h200/profile_step2.json)
    "link_eff": 0.5,          # achieved fraction of link bandwidth in the weight broadcast
    "dp_efficiency": 0.9,     # data-parallel scaling kept per doubling of trainer devices (data_parallel_speedup)
    "host_gbs": 25.0,         # device <-> host copies (engine sleep/wake, trainer offload), GB/s each way
}


def _override(bench: dict, key: str) -> Optional[str]:
    for item in bench.get("overrides") or []:
        if item.startswith(key + "="):
            return item.split("=", 1)[1]
    return None


def bench_lengths(bench: dict, fallback_max_len: int) -> tuple[Any, int]:
    """(sample id -> length, max_response_length) of the workload a bench_pipeline JSON recorded."""
    wl = bench.get("workload")
    max_len = int(_override(bench, "data.max_response_length") or (wl or {}).get("max_response_length")
                  or fallback_max_len)
    if not wl:
        raise ValueError("plan.stage_costs: the bench JSON records no synthetic workload (benchmark.response_length"
                         " / benchmark.ignore_eos), so the response lengths it timed are unknown; rerun "
                         "bench_pipeline.py with benchmark.response_length=lognormal benchmark.ignore_eos=true")
    if wl["kind"] == "lognormal":
        profile = LengthProfile.lognormal(int(wl["max_response_length"]), float(wl["median_ratio"]),
                                          float(wl["sigma"]), int(wl["seed"]))
        return profile.target, int(wl["max_response_length"])
    if wl["kind"] == "none" and wl.get("ignore_eos"):
        return (lambda _sid: max_len), max_len
    if wl.get("path"):
        profile = LengthProfile.histogram(wl["path"], int(wl["max_response_length"]), int(wl["seed"]))
        return profile.target, int(wl["max_response_length"])
    raise ValueError(f"plan.stage_costs: bench workload {wl.get('kind')!r} without ignore_eos: the lengths the "
                     "model produced were not recorded; rerun with benchmark.ignore_eos=true")


def from_bench(bench: dict, decode_seq_fraction: float = 0.0, weight_sync_s: float = 0.0,
               sync_step_s: float = 0.0, dp_efficiency: float = 1.0, fallback_max_len: int = 512,
               source: str = "bench") -> tuple[StageCosts, dict]:
    """StageCosts of one device from a bench_pipeline.py JSON, and what was derived (module docstring)."""
    if not 0.0 <= decode_seq_fraction <= 1.0:
        raise ValueError(f"plan.decode_seq_fraction={decode_seq_fraction} must be in [0, 1]")
    for key in ("rollout", "train", "prompts_per_batch", "n", "batches"):
        if key not in bench:
            raise ValueError(f"plan.stage_costs: {source} is not a bench_pipeline.py JSON (no {key!r})")
    length, _ = bench_lengths(bench, fallback_max_len)
    slots = int(bench.get("max_num_seqs") or _override(bench, "actor_rollout_ref.rollout.max_num_seqs")
                or VERL_MAX_NUM_SEQS)   # the engine's slots (older JSONs: the override, else verl's default)
    n, per = int(bench["n"]), int(bench["prompts_per_batch"])
    warmup = int(bench.get("warmup", 1))
    unit = StageCosts(decode_step_s=1.0, train_token_s=0.0)
    steps, resp = 0.0, 0
    for b in range(warmup, warmup + int(bench["batches"])):
        groups = []
        for i in range(per):
            _, seqs = _group(Workload(n, 0, lambda sid, b=b: length(sid.replace("e0-", f"b{b}-", 1))), i)
            groups.append(seqs)
        s, tok = generate_time(groups, unit, slots)
        steps, resp = steps + s, resp + tok
    roll, train = bench["rollout"], bench["train"]
    samples = int(roll["samples"])
    prompt_len = max(0.0, (roll["tokens"] - resp) / samples)
    seconds = float(roll["seconds"])
    costs = StageCosts(decode_step_s=(1 - decode_seq_fraction) * seconds / steps,
                       decode_seq_s=decode_seq_fraction * seconds / resp,
                       train_token_s=float(train["seconds"]) / float(train["tokens"]),
                       weight_sync_s=weight_sync_s, sync_step_s=sync_step_s, dp_efficiency=dp_efficiency,
                       source=source)
    derived = {"decode_steps": steps, "response_tokens": resp, "prompt_tokens_per_sample": prompt_len,
               "max_num_seqs": slots, "rollout_seconds": seconds, "train_tokens": train["tokens"],
               "train_seconds": train["seconds"]}
    return costs, derived


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


OUTLIER_RATIO = 1.5


def steady_steps(values: list[float], skip_steps: Optional[int] = None,
                 outlier_ratio: Optional[float] = OUTLIER_RATIO) -> list[int]:
    """Indices of the values to keep (module docstring): all but the first `skip_steps` when given, else those
    at most outlier_ratio x the median (every one with outlier_ratio=None); never none."""
    n = len(values)
    if skip_steps is not None:
        return list(range(min(max(0, skip_steps), n - 1), n)) if n else []
    if outlier_ratio is None or not n:
        return list(range(n))
    median = sorted(values)[n // 2] if n % 2 else sum(sorted(values)[n // 2 - 1:n // 2 + 1]) / 2
    kept = [i for i, v in enumerate(values) if v <= outlier_ratio * median]
    return kept or list(range(n))


def aligned_scalars(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[float]]:
    """Tag -> one value per trainer step (the steps timing_s/step was logged at), 0.0 where the tag was not logged:
    a weight push is logged only at the steps that push (every trigger_parameter_sync_step-th), so its values must
    not be paired with the first steps of the run."""
    steps = [s for s, _ in series.get("timing_s/step", [])]
    out = {}
    for tag, points in series.items():
        at = dict(points)
        out[tag] = [at.get(s, 0.0) for s in steps]
    return out


def trainer_busy(scalars: dict[str, list[float]], mode: str) -> tuple[list[float], list[float]]:
    """Per step of a run's logged scalars (aligned_scalars): the trainer's seconds (the step minus generating and the
    side costs) and the side costs (async: the weight push; sync: the push, on/offload and scoring)."""
    steps, gens = scalars.get("timing_s/step", []), scalars.get("timing_s/gen", [])

    def col(tag: str) -> list[float]:
        return scalars.get(tag) or [0.0] * len(steps)
    if mode == "async":
        side = list(col("timing_s/param_sync"))     # the weight push
    else:
        side = [p + a + b + c for p, a, b, c in zip(col("timing_s/param_sync"), col("timing_s/onload"),
                                                    col("timing_s/offload"), col("timing_s/reward"))]
    return [s - g - w for s, g, w in zip(steps, gens or [0.0] * len(steps), side)], side


def from_run_scalars(scalars: dict[str, list[float]], mode: str, trainer_devices: int, source: str = "run logs",
                     skip_steps: Optional[int] = None,
                     outlier_ratio: Optional[float] = OUTLIER_RATIO, placement: str = "split",
                     seq_cost_s: Optional[float] = None, kv_cost_s: float = 0.0,
                     mean_context: float = 0.0) -> StageCosts:
    """StageCosts of one run from its logged scalars (tag -> one value per step: aligned_scalars), its compiling
    steps left out (module docstring; the source names the steps left out); `seq_cost_s` / `kv_cost_s`: what one
    sequence / one cached token adds to a decode step, to split the measured step where the run logged its batch
    (and its cached tokens; without those a sequence is priced at `mean_context` cached tokens: module docstring)."""
    # per engine, the steps it logged a decode step at: (ms, sequences, cached tokens) of each, None where not logged
    logged = [[(ms, batch[i] if batch else None, cached[i] if cached else None)
               for i, ms in enumerate(values) if ms > 0]
              for tag, values in sorted(scalars.items())
              if tag.startswith("fully_async/rollouter/engine_") and tag.endswith("/ms_per_step")
              for batch, cached in [(scalars.get(tag.removesuffix("/ms_per_step") + "/seqs_per_step"),
                                     scalars.get(tag.removesuffix("/ms_per_step") + "/kv_tokens_per_step"))]]
    engines = [[ms for ms, _, _ in e] for e in logged]
    steps = scalars.get("timing_s/step", [])
    step_tokens = scalars.get("perf/total_num_tokens", [])
    if not any(engines) or not steps or not sum(step_tokens):
        raise ValueError(f"{source}: needs fully_async/rollouter/engine_<k>/ms_per_step, timing_s/step and "
                         "perf/total_num_tokens scalars (a fully_async run with trainer.logger including tensorboard)")
    kept = [e[i] for e, ms in zip(logged, engines) for i in steady_steps(ms, skip_steps, outlier_ratio)]
    decode_step_s, decode_seq_s, decode_kv_s = _mean([ms for ms, _, _ in kept]) / 1e3, 0.0, 0.0
    if seq_cost_s is not None and all(batch is not None for _, batch, _ in kept):
        seqs = _mean([batch for _, batch, _ in kept])
        with_cache = kv_cost_s > 0 and all(cached is not None for _, _, cached in kept)
        cached = _mean([c for _, _, c in kept]) if with_cache else 0.0
        per_seq = seq_cost_s if with_cache else seq_cost_s + kv_cost_s * mean_context
        variable = per_seq * seqs + kv_cost_s * cached
        if variable > 0:
            share = min(1.0, decode_step_s / variable)   # the estimate above the step measured: all of it variable
            decode_seq_s, decode_kv_s = per_seq * share, (kv_cost_s * share if with_cache else 0.0)
            decode_step_s -= variable * share
            source += f" (decode step split at its mean {seqs:.0f} sequences" + \
                (f" and {cached:.0f} cached tokens)" if with_cache else ")")

    def col(tag: str) -> list[float]:
        return scalars.get(tag) or [0.0] * len(steps)
    busy, side = trainer_busy(scalars, mode)
    n = min(len(busy), len(step_tokens))
    kept = steady_steps([busy[i] / step_tokens[i] if step_tokens[i] else 0.0 for i in range(n)], skip_steps,
                        outlier_ratio)
    dropped = [i + 1 for i in range(n) if i not in kept]
    if dropped:
        source += f" (steps {', '.join(map(str, dropped))} of {n} left out: compiling)"
    tokens = sum(step_tokens[i] for i in kept)
    train_token_s = sum(busy[i] for i in kept) * trainer_devices / tokens
    side_s = _mean([side[i] for i in kept])
    if mode == "async":
        # per weight update (the steps that pushed); colocated also waits for the engines' load on the same devices
        pushes = [side[i] for i in kept if side[i] > 0]
        update_s = _mean(pushes) if pushes else 0.0
        loads = [v for v in col("timing_s/param_sync/load") if v > 0]
        load_s = _mean(loads) if loads else 0.0
        if placement == "colocated":
            update_s, load_s = update_s + load_s, 0.0
        elif not scalars.get("timing_s/param_sync/wait"):
            load_s = 0.0   # a push that waits for the engines' load (collective): inside timing_s/param_sync
        return StageCosts(decode_step_s=decode_step_s, decode_seq_s=decode_seq_s, decode_kv_token_s=decode_kv_s,
                          train_token_s=train_token_s, weight_sync_s=update_s, weight_load_s=load_s, source=source)
    switches = [a + b + c for a, b, c in zip(col("timing_s/onload"), col("timing_s/offload"), col("timing_s/reward"))]
    return StageCosts(decode_step_s=decode_step_s, decode_seq_s=decode_seq_s, decode_kv_token_s=decode_kv_s,
                      train_token_s=train_token_s, sync_step_s=side_s,
                      turn_switch_s=_mean([switches[i] for i in kept if i < len(switches)]), source=source)


def estimate(shape: Shape, spec: DeviceSpec, *, rollout_tp: int = 1, train_mp: int = 1,
             checkpointing: bool = False, extra_forwards: int = 0, host_bytes: float = 0.0, swap_bytes: float = 0.0,
             assumptions: Optional[dict] = None) -> StageCosts:
    """StageCosts from FLOPs and bandwidth (module docstring); `assumptions` overrides ESTIMATE_ASSUMPTIONS."""
    a = dict(ESTIMATE_ASSUMPTIONS, **(assumptions or {}))   # launch_s: the engine's (plan_options picks it)
    peak, bw = spec.tflops * 1e12, spec.hbm_gbs * 1e9
    mm = shape.matmul_params()
    weights = 2.0 * shape.params()
    train_flops = (6 + 2 * extra_forwards + (2 if checkpointing else 0)) * mm
    return StageCosts(
        decode_step_s=weights / (rollout_tp * bw * a["bw_eff"]) + a["launch_s"],
        decode_seq_s=2 * mm / (rollout_tp * peak * a["decode_mfu"]),
        decode_kv_token_s=shape.kv_bytes_per_token(2) / (rollout_tp * bw * a["bw_eff"]),
        prefill_token_s=2 * mm / (rollout_tp * peak * a["prefill_mfu"]),
        train_token_s=train_flops / (train_mp * peak * a["train_mfu"]),
        weight_sync_s=weights / (spec.link_gbs * 1e9 * a["link_eff"]),
        sync_step_s=weights / (bw * a["bw_eff"]) + 2 * host_bytes / (a["host_gbs"] * 1e9),
        turn_switch_s=2 * host_bytes / (a["host_gbs"] * 1e9),
        swap_s=2 * swap_bytes / (a["host_gbs"] * 1e9),
        dp_efficiency=a["dp_efficiency"],
        source=f"estimated from FLOPs and bandwidth of {spec.name}")


def decode_floor_s(shape: Shape, hbm_gbs: float, seqs: int, mean_context: float, dtype_bytes: int = 2) -> float:
    """The least time one decode step of `seqs` sequences can take on a device of `hbm_gbs`: every weight a token
    goes through (the layers and the lm_head) and each sequence's keys and values over `mean_context` positions read
    once from device memory, at the full bandwidth, with nothing else (no launch, no arithmetic bound)."""
    read = dtype_bytes * shape.matmul_params() + seqs * shape.kv_bytes_per_token(dtype_bytes) * mean_context
    return read / (hbm_gbs * 1e9)


def expected_mean(length: Any, n: int, groups: int = 256) -> float:
    """Mean response length of the first `groups` groups (the simulator's own draws)."""
    total = sum(length(f"e0-p{i}-s{j}") for i in range(groups) for j in range(n))
    return total / (groups * n) if groups * n else math.nan
