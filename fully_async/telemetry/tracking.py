"""Experiment trackers (layer 1): Weights & Biases, SwanLab and MLflow sinks for `trainer.logger`.

Each is started the way verl's `verl/utils/tracking.py` starts it, so a verl user's environment carries over:
project = `trainer.project_name`, run name = `trainer.experiment_name`, the resolved config logged with the run,
and the same environment variables (WANDB_API_KEY / WANDB_ENTITY / WANDB_MODE / WANDB_DIR; SWANLAB_API_KEY /
SWANLAB_MODE / SWANLAB_LOG_DIR; MLFLOW_TRACKING_URI / MLFLOW_RUN_ID).  The packages are optional extras
(`pip install 'fully_async[wandb]'`, `[swanlab]`, `[mlflow]`), imported only when their logger is configured;
`check_installed` names a missing one before Ray starts.

Every sink receives the same metric dicts as TensorBoard, at the same steps.  Two differences follow from the
services themselves: W&B drops a step lower than one it already has, and the driver can receive a validation
(from the rollouter) after a later trainer step, so W&B plots against `training/global_step` (its
`define_metric`) instead of its own step counter; MLflow refuses `@` in a key, so `mean@1` is logged as
`mean_at_1` (verl renames it the same way: `mlflow_key`).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
from typing import Any, Optional, Protocol, Sequence

from fully_async.core import safe_write
from fully_async.core.config import ConfigError

logger = logging.getLogger(__name__)

# logger name -> the module it imports; each is also the name of the pip extra that installs it
TRACKER_MODULES = {"wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
WANDB_STEP_KEY = "training/global_step"
MLFLOW_DEFAULT_URI = "sqlite:////tmp/mlruns.db"  # verl's default when MLFLOW_TRACKING_URI is unset


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """trainer.log_val_generations: (input, output, score) of a validation, under val/generations."""
        ...

    def close(self, failed: bool = False) -> None: ...


def check_installed(backends: Sequence[str]) -> None:
    """A ConfigError naming the logger and the extra to install, for each configured tracker whose package is
    absent (called before Ray starts)."""
    missing = [name for name in backends
               if name in TRACKER_MODULES and importlib.util.find_spec(TRACKER_MODULES[name]) is None]
    if missing:
        fixes = "; ".join(f"{name} needs the {TRACKER_MODULES[name]} package, which is not installed: "
                          f"pip install 'fully_async[{name}]'" for name in missing)
        raise ConfigError("trainer.logger", f"{fixes} (or drop {', '.join(missing)} from trainer.logger)")


class TrackerStartError(RuntimeError):
    """A configured tracker could not start (credentials, mode, tracking URI)."""


START_HINTS = {
    "wandb": "set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to write the run locally",
    "swanlab": "set SWANLAB_API_KEY, or SWANLAB_MODE=local / offline to write the run locally",
    "mlflow": "check MLFLOW_TRACKING_URI (a server, a database such as sqlite:////tmp/mlruns.db, or a file: store "
              "with MLFLOW_ALLOW_FILE_STORE=true)",
}


def open_tracker(name: str, project: str, experiment: str, config: Optional[dict]) -> Tracker:
    """Start the tracker `name`; a failure is a TrackerStartError naming the logger and what to set."""
    trackers = {"wandb": WandbTracker, "swanlab": SwanlabTracker, "mlflow": MlflowTracker}
    if name not in trackers:
        raise ValueError(f"trainer.logger={name!r} is not a tracker; trackers: {sorted(trackers)}")
    try:
        return trackers[name](project, experiment, config)
    except Exception as exc:  # noqa: BLE001 - each service raises its own types
        raise TrackerStartError(f"trainer.logger={name}: {name} did not start ({type(exc).__name__}: "
                                f"{str(exc).strip()[:500]}); {START_HINTS[name]}") from exc


class WandbTracker:
    """W&B; offline with WANDB_MODE=offline (files under WANDB_DIR, `wandb sync` uploads them later)."""

    def __init__(self, project: str, experiment: str, config: Optional[dict]):
        import wandb

        self.run = wandb.init(project=project, name=experiment, entity=os.environ.get("WANDB_ENTITY"),
                              config=config)
        self.run.define_metric(WANDB_STEP_KEY)
        self.run.define_metric("*", step_metric=WANDB_STEP_KEY)  # out-of-order steps are kept (see module doc)
        self.generations: Any = None   # the validation generations' table so far (log_generations)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, WANDB_STEP_KEY: step})

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """One table row per validation, as verl's: step, then input_i / output_i / score_i of each sample (the
        table is logged whole each time: W&B keeps the last one logged under a key)."""
        import wandb

        columns = ["step"] + [f"{c}_{i}" for i in range(1, len(samples) + 1) for c in ("input", "output", "score")]
        if self.generations is None or list(self.generations.columns) != columns:
            self.generations = wandb.Table(columns=columns)
        table = wandb.Table(columns=columns, data=list(self.generations.data))
        table.add_data(step, *[field for sample in samples for field in sample])
        self.run.log({"val/generations": table, WANDB_STEP_KEY: step})
        self.generations = table

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        wandb.teardown()   # the process-wide settings (WANDB_DIR, mode) are read again by the next run's init


class SwanlabTracker:
    """SwanLab; SWANLAB_MODE=local or offline writes under SWANLAB_LOG_DIR (default ./swanlog) without an account.
    verl's SWANLAB_MODE=cloud is SwanLab's `online` (the default)."""

    def __init__(self, project: str, experiment: str, config: Optional[dict]):
        import swanlab

        api_key = os.environ.get("SWANLAB_API_KEY")
        if api_key:
            swanlab.login(api_key=api_key)  # as verl: overwrites an earlier login
        mode = os.environ.get("SWANLAB_MODE", "online")
        self.run = swanlab.init(project=project, name=experiment, config={"FRAMEWORK": "fully_async", **(config or {})},
                                log_dir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"),
                                mode="online" if mode == "cloud" else mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """A table (step, input, output, score) per validation, as verl's."""
        import swanlab

        table = swanlab.echarts.Table()
        table.add(headers=["step", "input", "output", "score"], rows=[[step, *sample] for sample in samples])
        self.run.log({"val/generations": table}, step=step)

    def close(self, failed: bool = False) -> None:
        if failed:
            self.run.finish(state="crashed", error="the run failed (see its log)")
        else:
            self.run.finish()


_MLFLOW_INVALID = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """The name MLflow stores `key` under, as verl's adapter writes it: `@` -> `_at_`, runs of `/` -> one,
    any other character MLflow refuses -> `_`."""
    return _MLFLOW_INVALID.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def flat_params(config: Any, prefix: str = "") -> dict[str, Any]:
    """The config as MLflow params, as verl flattens it: nested keys joined by `/`, a list as its `list_len`
    and one entry per index."""
    if isinstance(config, dict):
        items = list(config.items())
    elif isinstance(config, (list, tuple)):
        items = [("list_len", len(config))] + [(str(i), v) for i, v in enumerate(config)]
    else:
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flat_params(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


class MlflowTracker:
    """MLflow: an experiment named `project_name`, a run named `experiment_name` (or the run MLFLOW_RUN_ID, as
    Azure ML / Databricks set it).  MLFLOW_TRACKING_URI: a server (http://...), a database (verl's default
    sqlite:////tmp/mlruns.db) or a file store (file:/path; MLflow 3 wants MLFLOW_ALLOW_FILE_STORE=true)."""

    def __init__(self, project: str, experiment: str, config: Optional[dict]):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", MLFLOW_DEFAULT_URI))
        run_id = os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            self.run = mlflow.start_run(run_id=run_id)
        else:
            exp = mlflow.set_experiment(project)
            self.run = mlflow.start_run(experiment_id=exp.experiment_id, run_name=experiment)
        if config:
            mlflow.log_params(flat_params(config))
        self._renamed: set[str] = set()

    def log(self, metrics: dict[str, float], step: int) -> None:
        out = {}
        for key, value in metrics.items():
            name = mlflow_key(key)
            if name != key and key not in self._renamed:
                self._renamed.add(key)
                logger.info("mlflow: metric %s is logged as %s (characters MLflow refuses)", key, name)
            out[name] = value
        self.mlflow.log_metrics(out, step=step)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """The artifact val_step<step>.json: [{input, output, score}, ...], as verl's."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"val_step{step}.json")
            safe_write.write_json(path, [{"input": i, "output": o, "score": s} for i, o, s in samples],
                                  fsync=False, ensure_ascii=False)
            self.mlflow.log_artifact(path)

    def close(self, failed: bool = False) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")
