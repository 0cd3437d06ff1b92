"""Driver-side view of a run (layer 7 helper): progress bar, console, TensorBoard and trackers, summary.

Actors only produce metric dicts; the driver drains them from every running actor (the trainer's or sync
worker's steps, the rollouter's validations) and writes every sink, so TensorBoard files land on the
machine the user launched from.

Output a person can read: the tqdm bar only on a terminal (and `trainer.progress_bar=true`); written to a
file or a pipe, the step lines are plain lines.  Every step line also goes to the log files of the
`fully_async` logger (Hydra's `main.log`), bar or not.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, TextIO

from fully_async.core.config import validation_only
from fully_async.core.plan import RunPlan
from fully_async.telemetry import generations
from fully_async.telemetry.metrics import WALL_TIME, MetricLogger, next_free

logger = logging.getLogger("fully_async")
BOUND_PAUSES = "fully_async/rollouter/bound_pauses"


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _file_handlers(log: logging.Logger) -> list[logging.Handler]:
    """The file handlers a record of `log` reaches (Hydra's main.log sits on the root logger)."""
    handlers: list[logging.Handler] = []
    current: Optional[logging.Logger] = log
    while current is not None:
        handlers += [h for h in current.handlers if isinstance(h, logging.FileHandler)]
        if not current.propagate:
            break
        current = current.parent
    return handlers


def log_to_files(line: str, log: logging.Logger = logger) -> None:
    """`line` into the log files only: the console got it already (from the bar or as a plain line)."""
    if not log.isEnabledFor(logging.INFO):
        return
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, line, None, None)
    for handler in _file_handlers(log):
        if record.levelno >= handler.level:
            handler.handle(record)


def hydra_log_dir() -> Optional[str]:
    """Hydra's run folder (main.log, failure_traceback.txt), when the run was started through Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return None


def fresh_tensorboard_dir(tb: str) -> Optional[str]:
    """None when `tb` holds no TensorBoard event file; else the first `<tb>_<k>` (k = 2, 3, ...) that holds none (a
    run's own folder beside the earlier run's: TensorBoard overlays the event files of one folder)."""
    def has_events(folder: str) -> bool:
        try:
            return any(name.startswith("events.out.tfevents") for name in os.listdir(folder))
        except OSError:
            return False

    return next_free(tb.rstrip(os.sep), has_events) if has_events(tb) else None


def open_metric_logger(cfg: Any, resuming: bool = False) -> MetricLogger:
    """The sinks of `trainer.logger`, started before Ray so that a tracker that cannot start (credentials, tracking
    URI, mode) fails the run before any actor exists; `resuming`: the file logger appends to the run's file."""
    from omegaconf import OmegaConf

    t = cfg.trainer
    return MetricLogger(list(t.logger), t.project_name, t.experiment_name,
                        config=OmegaConf.to_container(cfg, resolve=True), resuming=resuming)


class RunLogger:
    def __init__(self, cfg: Any, total_steps: int, sources: list[Any], hardware: str = "",
                 stream: Optional[TextIO] = None, sink: Optional[MetricLogger] = None,
                 names: Optional[list[str]] = None, resumed_at: Optional[int] = None):
        from tqdm import tqdm

        from fully_async.cluster.ray_utils import Calls

        t = cfg.trainer
        self.sources = sources  # actor handles with pop_metrics() -> [(step, metrics)]
        self.names = names or [f"source{i}" for i in range(len(sources))]
        self.calls = Calls()  # an actor that does not answer is asked again only once it has
        self.stream = stream if stream is not None else sys.stdout
        self.total_steps = total_steps
        # the checkpoint's step a resumed run continues from (check_resume_state): told, not guessed from the first
        # step logged, which can be the checkpoint's own (a colocated rollouter's metrics of the resumed version)
        self.resumed_at = resumed_at
        # a bar redraws itself with \r: only where a person watches a terminal
        self.interactive = bool(t.progress_bar) and is_tty(self.stream)
        self.bar = tqdm(total=total_steps, desc="steps", dynamic_ncols=True, disable=not self.interactive,
                        file=self.stream)
        self.sink = sink if sink is not None else open_metric_logger(cfg)
        self.sink.write_line = self.write_line
        self.mode = cfg.mode
        self.val_only = validation_only(cfg)
        self.hardware = hardware
        self.checkpoint_root, self.save_freq = str(t.default_local_dir), int(t.save_freq)
        plan = RunPlan.of(cfg)
        self.devices = {"trainer": plan.trainer_devices, "rollout": plan.rollout_devices, "total": plan.total_devices,
                        "device": t.device}
        self.val_history: list[tuple[int, dict]] = []
        self.history: list[tuple[int, dict]] = []
        self.show_generations = int(t.log_val_generations)   # telemetry/generations.py
        self.dump_dir = t.validation_data_dir
        self.rollout_dir = t.rollout_data_dir

    def write_line(self, line: str) -> None:
        """A step line: above the bar on a terminal, a plain line otherwise; and into main.log."""
        if self.interactive:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
        log_to_files(line)

    def drain(self, wait_s: float = 0.1, deadline_s: Optional[float] = None) -> None:
        """Log what every source's outbox holds; a source that does not answer within `wait_s` is skipped this
        time (its outbox waits for the next drain), or, with `deadline_s` (the last drain of a run), waited on
        that long and then named (Unresponsive).  A last drain that finds an earlier call outstanding asks once
        more after its answer: that call may have popped the outbox before the source's last metrics (the final
        validation a driver then runs again when it does not see it)."""
        for name, source in zip(self.names, self.sources):
            key, start = f"{name}.pop_metrics", source.pop_metrics.remote
            if deadline_s is not None:
                stale = key in self.calls.pending
                batch = self.calls.get(key, start, deadline_s)
                if stale:
                    batch = list(batch) + list(self.calls.get(key, start, deadline_s))
            else:
                done, batch = self.calls.poll(key, start, wait_s)
                if not done:
                    continue
            for step, metrics in batch:
                self._log(step, metrics)

    def has_val_at(self, step: int) -> bool:
        return any(s == step for s, _ in self.val_history)

    def log_val(self, metrics: dict, step: int) -> None:
        self._log(step, metrics)

    def _log(self, step: int, metrics: dict) -> None:
        wall_time = metrics.get(WALL_TIME)
        if wall_time is not None:   # the step's own end (MetricsOutbox._emit), not this drain's time
            metrics = {k: v for k, v in metrics.items() if k != WALL_TIME}
        rows = {k: metrics[k] for k in (generations.VAL_GENERATIONS, generations.ROLLOUT_GENERATIONS) if k in metrics}
        if rows:   # responses riding with the metrics: written / shown, never logged as scalars
            metrics = {k: v for k, v in metrics.items() if k not in rows}
            if generations.VAL_GENERATIONS in rows:
                self._generations(step, rows[generations.VAL_GENERATIONS])
            if generations.ROLLOUT_GENERATIONS in rows and self.rollout_dir:
                generations.dump(self.rollout_dir, step, rows[generations.ROLLOUT_GENERATIONS])
        if any(k.startswith("val-core/") for k in metrics):
            self.val_history.append((step, metrics))
        else:
            self.history.append((step, metrics))
            self.bar.update(step - self.bar.n)
        if wall_time is None:
            self.sink.log(metrics, step)
        else:
            self.sink.log(metrics, step, wall_time=wall_time)

    def _generations(self, step: int, rows: list[dict]) -> None:
        """A validation's responses: every one into trainer.validation_data_dir, trainer.log_val_generations of them
        to the sinks that show text."""
        if self.dump_dir:
            path = generations.dump(self.dump_dir, step, rows)
            logger.info("validation generations of step %d: %s (%d responses)", step, path, len(rows))
        if self.show_generations > 0:
            self.sink.log_generations(generations.pick(rows, self.show_generations), step)

    @staticmethod
    def _val_mean(metrics: dict) -> float:
        vals = [v for k, v in metrics.items() if k.startswith("val-core/")]
        return sum(vals) / len(vals)

    def _checkpoints(self) -> str:
        """Where the run's checkpoints went, or why there are none (verl's default save_freq=-1 keeps none)."""
        from fully_async.core.checkpoint import LATEST

        try:
            with open(os.path.join(self.checkpoint_root, LATEST)) as fh:
                latest = fh.read().strip()
        except OSError:
            latest = ""
        if latest:
            return f"{self.checkpoint_root} (latest global_step_{latest})"
        if self.save_freq <= 0:
            return f"none saved: save_freq={self.save_freq}; set trainer.save_freq to keep the weights"
        return f"none saved yet in {self.checkpoint_root} (trainer.save_freq={self.save_freq})"

    def finish(self, wall_s: float) -> dict:
        """The summary (logged and summary.json).  A resumed run (its first step is not 1) says "resumed at step
        N", a stopped one (Ctrl-C / SIGTERM: its last step is short of the total) "stopped at step N"; only a
        run that went from step 0 to the end compares the validation reward before and after."""
        self.bar.close()
        steps = [s for s, _ in self.history]
        last = max(steps + [self.resumed_at or 0])   # a resumed run that trained nothing stands at its checkpoint
        if self.resumed_at:
            resumed_at: Optional[int] = self.resumed_at
        else:   # not told (a caller without a checkpoint at hand): the step before the first one logged
            resumed_at = min(steps) - 1 if steps and min(steps) > 1 and self.resumed_at is None else None
        stopped_at = last if last < self.total_steps else None
        summary: dict[str, Any] = {"wall_s": wall_s, "steps": last, "mode": self.mode, "hardware": self.hardware,
                                   "devices": self.devices}
        if resumed_at is not None:
            summary["resumed_at_step"] = resumed_at
        if stopped_at is not None:
            summary["stopped_at_step"] = stopped_at
        if self.val_history:
            self.val_history.sort(key=lambda item: item[0])  # several sources: in step order
            first_step, first = self.val_history[0]
            if resumed_at is None and first_step == 0 and stopped_at is None and len(self.val_history) > 1:
                summary["val_before"] = self._val_mean(first)
                summary["val_after"] = self._val_mean(self.val_history[-1][1])
            summary["val_last_step"] = self.val_history[-1][0]
            summary["val_last"] = self._val_mean(self.val_history[-1][1])
        for key in ("perf/throughput", "trainer/idle_ratio", "fully_async/rollouter/idle_ratio"):
            vals = [m[key] for _, m in self.history if key in m]
            if vals:
                summary[key] = sum(vals) / len(vals)
        if self.val_only:
            summary["val_only"] = True
            lines = [f"trainer.val_only: validated the weights of step {last} in {wall_s:.1f}s; nothing was trained"]
        elif stopped_at is not None:
            lines = [f"run stopped at step {stopped_at} (of {self.total_steps}) after {wall_s:.1f}s"]
        else:
            lines = [f"run finished in {wall_s:.1f}s after {last} steps"]
        if resumed_at is not None:
            lines.append(f"resumed at step {resumed_at}: {last - resumed_at} steps in this run")
        if "val_before" in summary:
            lines.append(f"validation reward: before {summary['val_before']:.3f} -> after {summary['val_after']:.3f}")
        elif "val_last" in summary:
            lines.append(f"validation reward at step {summary['val_last_step']}: {summary['val_last']:.3f}")
        lines += [f"mean {k}: {summary[k]:.4g}" for k in summary if "/" in k]
        pauses = [m[BOUND_PAUSES] for _, m in self.history if BOUND_PAUSES in m]
        if pauses:   # cumulative; each version's own line is at debug level
            summary["rollouter_bound_pauses"] = int(max(pauses))
            lines.append(f"rollouter: paused at the staleness bound {summary['rollouter_bound_pauses']} time(s), each "
                         "until the trainer's next weight update (async mode's normal flow control)")
        lines.append(f"checkpoints: {self._checkpoints()}")
        if self.sink.log_dir:
            lines.append(f"TensorBoard: {self.sink.log_dir}")
        logs = hydra_log_dir()
        if logs:
            lines.append(f"logs: {logs} (main.log)")
        for line in lines:
            logger.info(line)
        self.sink.write_json("summary.json", summary)
        self.sink.close()
        return summary
