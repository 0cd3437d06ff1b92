"""Driver-side view of a run (layer 5 helper): progress bar, console, TensorBoard, summary.

Actors only produce metric dicts; the driver drains them from every running actor (the trainer's or sync
worker's steps, the rollouter's validations) and writes every sink, so TensorBoard files land on the
machine the user launched from.
"""
from __future__ import annotations

import logging
from typing import Any

from fully_async.core.plan import RunPlan
from fully_async.core.metrics import MetricLogger

logger = logging.getLogger("fully_async")


class RunLogger:
    def __init__(self, cfg: Any, total_steps: int, sources: list[Any], hardware: str = ""):
        from omegaconf import OmegaConf
        from tqdm import tqdm

        t = cfg.trainer
        self.sources = sources  # actor handles with pop_metrics() -> [(step, metrics)]
        self.bar = tqdm(total=total_steps, desc="steps", dynamic_ncols=True, disable=not t.progress_bar)
        self.sink = MetricLogger(list(t.logger), t.project_name, t.experiment_name,
                                 config=OmegaConf.to_container(cfg, resolve=True), write_line=self.bar.write)
        self.mode = cfg.mode
        self.hardware = hardware
        plan = RunPlan.of(cfg)
        self.devices = {"trainer": plan.trainer_devices, "rollout": plan.rollout_devices, "total": plan.total_devices,
                        "device": t.device}
        self.val_history: list[tuple[int, dict]] = []
        self.history: list[tuple[int, dict]] = []

    def drain(self) -> None:
        import ray

        for batch in ray.get([source.pop_metrics.remote() for source in self.sources]):
            for step, metrics in batch:
                self._log(step, metrics)

    def has_val_at(self, step: int) -> bool:
        return any(s == step for s, _ in self.val_history)

    def log_val(self, metrics: dict, step: int) -> None:
        self._log(step, metrics)

    def _log(self, step: int, metrics: dict) -> None:
        if any(k.startswith("val-core/") for k in metrics):
            self.val_history.append((step, metrics))
        else:
            self.history.append((step, metrics))
            self.bar.update(step - self.bar.n)
        self.sink.log(metrics, step)

    @staticmethod
    def _val_mean(metrics: dict) -> float:
        vals = [v for k, v in metrics.items() if k.startswith("val-core/")]
        return sum(vals) / len(vals)

    def finish(self, wall_s: float) -> dict:
        self.bar.close()
        summary: dict[str, Any] = {"wall_s": wall_s, "steps": self.history[-1][0] if self.history else 0,
                                   "mode": self.mode, "hardware": self.hardware, "devices": self.devices}
        if self.val_history:
            self.val_history.sort(key=lambda item: item[0])  # several sources: in step order
            summary["val_before"] = self._val_mean(self.val_history[0][1])
            summary["val_after"] = self._val_mean(self.val_history[-1][1])
        for key in ("perf/throughput", "fully_async/trainer/idle_ratio", "fully_async/rollouter/idle_ratio"):
            vals = [m[key] for _, m in self.history if key in m]
            if vals:
                summary[key] = sum(vals) / len(vals)
        lines = [f"run finished in {wall_s:.1f}s after {summary['steps']} steps"]
        if "val_before" in summary:
            lines.append(f"validation reward: before {summary['val_before']:.3f} -> after {summary['val_after']:.3f}")
        lines += [f"mean {k}: {summary[k]:.4g}" for k in summary if "/" in k]
        if self.sink.log_dir:
            lines.append(f"TensorBoard: {self.sink.log_dir}")
        for line in lines:
            logger.info(line)
        self.sink.write_json("summary.json", summary)
        self.sink.close()
        return summary
