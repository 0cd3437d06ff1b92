"""One run of a comparison as it was logged: its TensorBoard scalars, `config.json` and `summary.json` (layer 8).

Everything a comparison reports is computed from what a run wrote into its TensorBoard directory (scalars, the
event wall times, `config.json`, `summary.json`), so a comparison can be redone from saved logs.  Each step's
scalars carry the wall time the step ended in its own actor (the driver writes them later, with that time).

Fair comparison: equal total devices.  Two runs whose configs differ only in PLACEMENT_KEYS (and `mode`) are
compared when both use the same number of devices; any other difference is refused (`config_diff`, `check_diff`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


VAL_PREFIX = "val-core/"
MODES = ("async", "sync")
# what may differ between the two runs of an equal-devices comparison (the comparison sets them per mode)
PLACEMENT_KEYS = ("trainer.n_gpus_per_node", "rollout.n_gpus_per_node", "actor_rollout_ref.actor.strategy",
                  "async_training.placement")


OLD_TAGS = {"trainer/idle_ratio": "fully_async/trainer/idle_ratio"}  # verl's name -> ours before we took verl's


@dataclass
class Run:
    log_dir: str
    scalars: dict[str, list[tuple[int, float, float]]]   # tag -> [(step, wall_time, value)] in write order
    first_wall: float                                    # wall_time of the first event in the dir
    config: dict
    summary: dict = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return str(self.config.get("mode", self.summary.get("mode", "?")))

    def series(self, tag: str) -> list[tuple[int, float, float]]:
        if tag not in self.scalars and tag in OLD_TAGS:  # a run logged before the tag took verl's name
            return self.scalars.get(OLD_TAGS[tag], [])
        return self.scalars.get(tag, [])

    def values(self, tag: str) -> list[float]:
        return [v for _, _, v in self.series(tag)]

    def after(self, warmup_steps: int, tail_steps: int = 0) -> "Run":
        """This run without the points of its first `warmup_steps` trainer steps (compiles, first allocations) and of
        its last `tail_steps` (the end of the run: the rollouter has admitted the run's last prompts, so the last
        step waits for its own slowest responses, once per run): the steady steps both modes' throughput is read from
        when --warmup-steps / --tail-steps are given."""
        if warmup_steps <= 0 and tail_steps <= 0:
            return self
        steps = ([s for s, _, _ in self.series("timing_s/step")]
                 or [s for pts in self.scalars.values() for s, _, _ in pts])
        first, last = min(steps, default=0), max(steps, default=0)
        kept = {tag: [p for p in pts if first + warmup_steps <= p[0] <= last - tail_steps]
                for tag, pts in self.scalars.items()}
        return Run(self.log_dir, kept, self.first_wall, self.config, self.summary)

    def devices(self) -> dict:
        if "devices" in self.summary:
            out = dict(self.summary["devices"])
        else:
            t, r = self.config["trainer"], self.config["rollout"]
            n_train = t["nnodes"] * t["n_gpus_per_node"]
            n_roll = r["nnodes"] * r["n_gpus_per_node"] if self.mode == "async" else 0
            out = {"trainer": n_train, "rollout": n_roll, "total": n_train + n_roll, "device": t["device"]}
        if out.get("device") == "auto":   # print what it resolved to, from the run's hardware line
            hw = str(self.summary.get("hardware", ""))
            out["device"] = ("cpu" if hw.startswith("CPU") else "npu" if "Ascend" in hw else
                             "cuda" if hw and hw[0].isdigit() else "auto")
        return out

    @property
    def strategy(self) -> str:
        """The trainer backend the run used (verl's `fsdp` resolved as config.actor_strategy resolves it)."""
        return resolved_strategy(self.config)


def resolved_strategy(config: dict) -> str:
    """actor.strategy of a saved config.json, verl's `fsdp` resolved as the trainer resolves it
    (config.fsdp_backend): fsdp2 on several trainer devices, and on one a one-rank fsdp2 in bf16/fp16 or plain
    torch in float32, so runs that trained alike compare alike."""
    from fully_async.core.config import ActorConfig, fsdp_backend

    actor = config.get("actor_rollout_ref", {}).get("actor", {})
    strategy = str(actor.get("strategy", "?"))
    if strategy != "fsdp":
        return strategy
    t = config.get("trainer", {})
    return fsdp_backend(t.get("nnodes", 1) * t.get("n_gpus_per_node", 1), str(actor.get("dtype", ActorConfig.dtype)))


class CompareError(RuntimeError):
    """A run dir that cannot be compared (missing files, missing scalars)."""


def _read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def read_run(log_dir: str) -> Run:
    """All scalars of one TensorBoard run dir plus its config.json and (when present) summary.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config_path = os.path.join(log_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CompareError(f"{log_dir}: no config.json (not a fully_async TensorBoard run dir; "
                           "was trainer.logger missing 'tensorboard'?)")
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    if not scalars.get("timing_s/step"):
        raise CompareError(f"{log_dir}: no timing_s/step scalars (the run logged no training step)")
    try:
        first = acc.FirstEventTimestamp()
    except ValueError:
        first = min(w for s in scalars.values() for _, w, _ in s)
    summary_path = os.path.join(log_dir, "summary.json")
    summary = _read_json(summary_path) if os.path.isfile(summary_path) else {}
    return Run(log_dir, scalars, first, _read_json(config_path), summary)




# ----------------------------------------------------------------------------------- config diff
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


# where a run writes, not what it trains: the default experiment name carries the mode (tiny_arithmetic_${mode})
OUTPUT_KEYS = ("trainer.experiment_name", "trainer.default_local_dir")


def config_diff(a: dict, b: dict, ignore: tuple[str, ...] = ("mode",) + OUTPUT_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for every dotted key whose values differ, except `ignore` (the mode and the
    output locations) and the keys a sync run does not read (async_only_keys: the bundled preset sets them for
    async mode only)."""
    ignore = tuple(ignore) + tuple(sorted(async_only_keys()))
    fa, fb = flatten(a), flatten(b)
    for flat, config in ((fa, a), (fb, b)):
        if "actor_rollout_ref.actor.strategy" in flat:
            flat["actor_rollout_ref.actor.strategy"] = resolved_strategy(config)
    missing = object()
    diff = []
    for key in sorted(set(fa) | set(fb)):
        if key in ignore:
            continue
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if va != vb:
            diff.append((key, "<absent>" if va is missing else va, "<absent>" if vb is missing else vb))
    return diff


def check_diff(diff: list[tuple[str, Any, Any]], allow_diff: tuple[str, ...],
               totals: dict[str, int]) -> tuple[list, bool]:
    """(differences that block the comparison, fair).  fair: equal total devices; then the PLACEMENT_KEYS
    may differ too.  With unequal totals a placement difference blocks (it is not a fair split either)."""
    fair = totals["async"] == totals["sync"]
    allowed = set(allow_diff) | (set(PLACEMENT_KEYS) if fair else set())
    return [d for d in diff if d[0] not in allowed], fair


def async_only_keys() -> set[str]:
    """Keys a sync run does not read (core/mode_keys.py: the staleness knobs, the rollout devices, ...): an async and
    a sync run may differ in them and still run the same workload."""
    from fully_async.core.mode_keys import MODE_ONLY, SYNC

    return {key for key, only in MODE_ONLY.items() if SYNC not in only.acts_in}


def workload_of(config: dict) -> Optional[dict]:
    """workload_report() of a run's config: its benchmark.response_length profile and benchmark.ignore_eos
    (None when neither applies)."""
    from omegaconf import OmegaConf

    from fully_async.core.config import ConfigError
    from fully_async.core.workload import workload_report

    bench = config.get("benchmark", {})
    if str(bench.get("response_length", "none")) == "none" and not bench.get("ignore_eos"):
        return None
    try:
        return workload_report(OmegaConf.create(config))
    except ConfigError as exc:  # e.g. a histogram file that moved since the run
        kind = bench.get("response_length")
        return {"kind": kind, "description": f"synthetic response lengths: {kind} (cannot describe: {exc})"}



def placement_of(config: dict) -> str:
    """sync | split | colocated | elastic (async_training.placement of an async run)."""
    if config.get("mode") == "sync":
        return "sync"
    return str(config.get("async_training", {}).get("placement", "split"))
