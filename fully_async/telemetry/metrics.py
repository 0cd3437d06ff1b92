"""Metric computation and sinks (layer 1): console line, TensorBoard, and the trackers of tracking.py (W&B, SwanLab,
MLflow).  Names follow verl."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional, Sequence

from fully_async.core import safe_write
from fully_async.core.types import Sample, SampleGroup

logger = logging.getLogger(__name__)


def batch_metrics(samples: Sequence[Sample], trainer_version: int, max_response_length: int,
                  max_prompt_length: Optional[int] = None) -> dict[str, float]:
    """Reward, length, partial-rollout and staleness statistics of one training batch."""
    n = len(samples)
    rewards = [s.reward for s in samples]
    resp = [len(s.response_ids) for s in samples]
    prompt = [len(s.prompt_ids) for s in samples]
    # interrupted and resumed, or (keep mode) continued across a weight update without interruption
    partial = [s for s in samples if s.num_interruptions > 0 or len(set(s.versions)) > 1]
    stale = [trainer_version - s.param_version_start for s in samples]
    m = {
        "critic/score/mean": sum(rewards) / n,
        "critic/score/max": max(rewards),
        "critic/score/min": min(rewards),
        "response_length/mean": sum(resp) / n,
        "response_length/max": max(resp),
        "response_length/min": min(resp),
        "response_length/clip_ratio": sum(r >= max_response_length for r in resp) / n,
        "prompt_length/mean": sum(prompt) / n,
        "prompt_length/max": max(prompt),
        "prompt_length/min": min(prompt),
        "fully_async/partial/total_partial_num": len(partial),
        "fully_async/partial/partial_ratio": len(partial) / n,
        "fully_async/partial/max_partial_span": max((s.param_version_end - s.param_version_start for s in samples),
                                                   default=0),
        "fully_async/staleness/mean": sum(stale) / n,
        "fully_async/staleness/max": max(stale),
        "perf/total_num_tokens": sum(prompt) + sum(resp),
    }
    turns = [s.verl_num_turns for s in samples if s.num_turns]   # multi-turn only
    if turns:
        m.update({"num_turns/min": min(turns), "num_turns/max": max(turns), "num_turns/mean": sum(turns) / len(turns)})
    if max_prompt_length:
        m["prompt_length/clip_ratio"] = sum(p >= max_prompt_length for p in prompt) / n
    extra_keys = {k for s in samples for k, v in s.reward_extra.items() if isinstance(v, (int, float))}
    for key in sorted(extra_keys):
        vals = [float(s.reward_extra[key]) for s in samples if key in s.reward_extra]
        m[f"reward_extra/{key}/mean"] = sum(vals) / len(vals)
    return m


class StaleCounter:
    """verl's cumulative `fully_async/count/stale_samples_processed` (prompt groups) and
    `fully_async/count/stale_trajectory_processed` (responses) trained so far by this process: a response is stale
    when the trainer's param version is ahead of the one that finished it (`param_version_end`), a group when
    it is ahead of the one that finished its last response (verl stamps a group at its completion)."""

    def __init__(self) -> None:
        self.samples = 0
        self.trajectories = 0

    def add(self, groups: Sequence[SampleGroup], trainer_version: int) -> dict[str, float]:
        for group in groups:
            ends = [s.param_version_end for s in group.samples]
            self.samples += int(bool(ends) and trainer_version - max(ends) >= 1)
            self.trajectories += sum(trainer_version - end >= 1 for end in ends)
        return {"fully_async/count/stale_samples_processed": self.samples,
                "fully_async/count/stale_trajectory_processed": self.trajectories}


def rollouter_version_metrics(version_s: float, idle_s: float) -> dict[str, float]:
    """verl's rollouter metrics of one param version: `rollouter/version_time` (seconds the version lasted on the
    rollouter), `rollouter/active_time` (seconds of it the rollouter had something to generate) and
    `rollouter/idle_ratio` (1 - active/version)."""
    if version_s <= 0:
        return {}
    active = min(version_s, max(0.0, version_s - idle_s))
    return {"rollouter/version_time": version_s, "rollouter/active_time": active,
            "rollouter/idle_ratio": 1.0 - active / version_s}


CONSOLE_KEYS = (("critic/score/mean", "reward"), ("val-core", "val"), ("actor/pg_loss", "pg_loss"),
                ("actor/grad_norm", "gnorm"), ("critic/vf_loss", "vf_loss"), ("response_length/mean", "resp_len"),
                ("fully_async/staleness/mean", "stale"), ("perf/throughput", "tok/s/dev"),
                ("trainer/idle_ratio", "t_idle"), ("fully_async/rollouter/idle_ratio", "r_idle"),
                ("timing_s/step", "step_s"))


def engine_metrics(current: Sequence[dict], previous: Optional[Sequence[dict]], window_s: float) -> dict[str, float]:
    """`fully_async/rollouter/num_engines` and, per rollout engine i, its slots (`engine_<i>/slots`: max_num_seqs as
    resolved), the tokens it generated and the fraction of the window it had work (`engine_<i>/{tokens,busy_ratio}`),
    the engine's own milliseconds
    per iteration (`engine_<i>/ms_per_step`; from it, the pool's and Ray's overhead) and the sequences an iteration
    decoded on average (`engine_<i>/seqs_per_step`: the tokens over the iterations) and, where the engine counts
    them, the tokens those sequences had cached (`engine_<i>/kv_tokens_per_step`: what its attention read); the
    planner splits a measured step into its fixed, per-sequence and per-cached-token parts with them.  From the
    pool's cumulative `engine_stats()` now and at the start of the window (None: since the start)."""
    m: dict[str, float] = {"fully_async/rollouter/num_engines": float(len(current))}
    for i, cur in enumerate(current):
        prev = previous[i] if previous and i < len(previous) else {"tokens": 0, "busy_s": 0.0}
        m[f"fully_async/rollouter/engine_{i}/tokens"] = float(cur["tokens"] - prev["tokens"])
        if cur.get("slots"):   # max_num_seqs as the run resolved it (null: sized by the memory model at start-up)
            m[f"fully_async/rollouter/engine_{i}/slots"] = float(cur["slots"])
        if window_s > 0:
            m[f"fully_async/rollouter/engine_{i}/busy_ratio"] = min(1.0, max(0.0, (cur["busy_s"] - prev["busy_s"])
                                                                            / window_s))
        iterations = cur.get("iterations", 0) - prev.get("iterations", 0)
        if iterations > 0:   # the engine's own time per iteration (one decode step), without pool/Ray overhead
            m[f"fully_async/rollouter/engine_{i}/ms_per_step"] = \
                1e3 * (cur.get("engine_s", 0.0) - prev.get("engine_s", 0.0)) / iterations
            m[f"fully_async/rollouter/engine_{i}/seqs_per_step"] = (cur["tokens"] - prev["tokens"]) / iterations
            if cur.get("kv_tokens"):   # engines that count what their steps' sequences had cached (the embedded one)
                m[f"fully_async/rollouter/engine_{i}/kv_tokens_per_step"] = \
                    (cur["kv_tokens"] - prev.get("kv_tokens", 0)) / iterations
    return m


def rollouter_window_metrics(current: dict, previous: dict) -> dict[str, float]:
    """The rollouter's metrics over one trainer step, from its cumulative counters at the end of the window
    (`current`) and at its start (`previous`; {} for the first window, which has no idle ratio): the sample
    counts, the fraction of the window it had nothing to generate (`fully_async/rollouter/idle_ratio`), and
    the per-engine metrics of `engine_metrics`.  No counters yet ({}): no metrics."""
    if not current:
        return {}
    m = {"fully_async/count/total_generated_samples": current["generated_samples"],
         "fully_async/count/staleness_samples": current["staleness_samples"],
         "fully_async/rollouter/bound_pauses": current["bound_pauses"]}
    if "filtered_groups" in current:   # dynamic sampling (algorithm.filter_groups): dropped in the window, in all
        m["train/num_filtered_groups"] = current["filtered_groups"] - previous.get("filtered_groups", 0)
        m["fully_async/count/filtered_groups"] = current["filtered_groups"]
    wall = current["wall_s"] - previous.get("wall_s", 0.0)
    if previous and wall > 0:
        m["fully_async/rollouter/idle_ratio"] = min(1.0, (current["idle_s"] - previous["idle_s"]) / wall)
    if "engines" in current:
        m.update(engine_metrics(current["engines"], previous.get("engines"), wall))
    return m


def console_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key == "val-core":
            vals = [v for k, v in metrics.items() if k.startswith("val-core/")]
            if vals:
                parts.append(f"{short} {sum(vals) / len(vals):.3f}")
        elif key in metrics:
            parts.append(f"{short} {metrics[key]:.4g}")
    return " | ".join(parts)


# the wall time an actor produced a step's metrics (actor_setup.MetricsOutbox._emit), riding with them to the driver:
# TensorBoard's event time for them, so a plot against time puts each step at its own end, not at the driver's drain
WALL_TIME = "_wall_time"


def tensorboard_dir(project: str, experiment: str) -> str:
    return os.environ.get("TENSORBOARD_DIR") or os.path.join("tensorboard_log", project, experiment)


def next_free(base: str, used: Any, suffix: str = "") -> str:
    """`base + suffix`, or where `used` says it holds an earlier run's output, the first `<base>_<k><suffix>`
    (k = 2, 3, ...) that does not: a run's own TensorBoard folder or metrics file beside an earlier run's."""
    if not used(base + suffix):
        return base + suffix
    k = 2
    while used(f"{base}_{k}{suffix}"):
        k += 1
    return f"{base}_{k}{suffix}"


def jsonl_path(project: str, experiment: str, resuming: bool) -> str:
    """verl's file logger's path: $VERL_FILE_LOGGER_PATH, else $VERL_FILE_LOGGER_ROOT (default the working folder)
    /<project_name>/<experiment_name>.jsonl.  A new run (not resuming) whose file holds an earlier run's lines
    writes the next free `<name>_<k>.jsonl` instead (as its TensorBoard folder: verl would truncate the file); a
    resumed run appends to it."""
    path = os.environ.get("VERL_FILE_LOGGER_PATH") or os.path.join(
        os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", ".")), project, f"{experiment}.jsonl")

    def used(p: str) -> bool:
        return os.path.isfile(p) and os.path.getsize(p) > 0

    if resuming:
        return path
    stem, ext = os.path.splitext(path)
    fresh = next_free(stem, used, ext)
    if fresh != path:
        logger.info("%s holds an earlier run's metrics: this run writes to %s (a resumed run appends)", path, fresh)
    return fresh


def _finite_or_none(value: Any) -> Optional[float]:
    value = float(value)
    return value if math.isfinite(value) else None


class JsonlFile:
    """trainer.logger `file` (verl's FileLogger): one JSON line {"step": N, "data": {name: value}} per logged step,
    written unbuffered (a crash keeps every step logged before it); a value that is not finite is written null, as
    verl's orjson writes it.  Validation generations are not written (verl's does not write them either)."""

    def __init__(self, project: str, experiment: str, resuming: bool = False):
        self.path = jsonl_path(project, experiment, resuming)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.fp = open(self.path, "ab", buffering=0)
        logger.info("file logger: %s", os.path.abspath(self.path))

    def log(self, metrics: dict[str, float], step: int) -> None:
        data = {k: _finite_or_none(v) for k, v in metrics.items()}
        self.fp.write(json.dumps({"step": step, "data": data}).encode() + b"\n")

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        return None

    def close(self, failed: bool = False) -> None:
        self.fp.close()


class MetricLogger:
    """Fans step metrics out to the configured sinks (trainer.logger): the console line, TensorBoard, verl's JSON-lines
    file and the experiment trackers of tracking.py (wandb, swanlab, mlflow), each receiving the same names at the
    same steps."""

    def __init__(self, backends: Sequence[str], project: str, experiment: str, config: Optional[dict] = None,
                 write_line: Any = None, resuming: bool = False):
        from fully_async.telemetry.tracking import TRACKER_MODULES, open_tracker

        self.console = "console" in backends
        self.write_line = write_line or (lambda line: logger.info(line))
        self.writer = None
        self.log_dir = ""
        self.trackers: list[Any] = []
        self.closed = False
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir = tensorboard_dir(project, experiment)
            self.writer = SummaryWriter(self.log_dir)
            if config is not None:  # the resolved config travels with the curves (compare_sync_async diffs it)
                self.write_json("config.json", config)
                self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")
        try:
            if "file" in backends:
                self.trackers.append(JsonlFile(project, experiment, resuming))
            for name in backends:
                if name in TRACKER_MODULES:
                    self.trackers.append(open_tracker(name, project, experiment, config))
        except BaseException:
            self.close(failed=True)  # the trackers already started end as failed runs
            raise

    def log(self, metrics: dict[str, float], step: int, wall_time: Optional[float] = None) -> None:
        """`wall_time`: when the step's metrics were produced (TensorBoard's event time; now when None)."""
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step, walltime=wall_time)
            self.writer.flush()
        for tracker in self.trackers:
            tracker.log(metrics, step)
        if self.console:
            line = console_line(step, metrics)
            if line != f"step {step}":   # metrics with nothing for the console (per-version ones): no line
                self.write_line(line)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """trainer.log_val_generations: a validation's (input, output, score) samples to the sinks that show text
        (telemetry/generations.py); the console line shows none."""
        from fully_async.telemetry.generations import VAL_GENERATIONS, markdown

        if self.writer is not None:
            self.writer.add_text(VAL_GENERATIONS, markdown(samples, step), step)
            self.writer.flush()
        for tracker in self.trackers:
            tracker.log_generations(samples, step)

    def write_json(self, name: str, data: dict) -> None:
        """A side file in the TensorBoard run directory (no-op without TensorBoard)."""
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            safe_write.write_json(os.path.join(self.log_dir, name), data, indent=1, default=str)

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink (once; `failed`: the trackers mark the run failed/crashed)."""
        if self.closed:
            return
        self.closed = True
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # noqa: BLE001 - one tracker failing to close must not hide the others
                logger.warning("closing the %s logger failed: %s", type(tracker).__name__, exc)
