"""The experiment trackers of trainer.logger (wandb, swanlab, mlflow) receive the same scalar names, at the same
steps, as TensorBoard; each is read back from what it wrote offline (W&B's offline run file, SwanLab's local
record file, MLflow's file-store metrics folder).  A tracker whose package is missing is named with its pip extra
before Ray starts."""
import importlib.util

import pytest

from fully_async.core.config import ConfigError
from fully_async.telemetry.metrics import MetricLogger
from fully_async.telemetry.tracking import TrackerStartError, check_installed, flat_params, mlflow_key
from fully_async.device import get_device
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import prepare
from tests_helpers import read_mlflow_file_store, read_scalars, read_swanlab, read_wandb_offline

CONFIG = {"trainer": {"project_name": "p", "logger": ["console", "tensorboard"]}, "data": {"max_response_length": 8}}


def step_metrics(step: int) -> dict:
    """A step's metric names as both modes log them, with the sync loop's per-phase memory metrics."""
    memory = {f"memory/{phase}/{key}": value for phase in ("generate", "update_actor")
              for key, value in get_device("cpu").memory_stats().items()}
    return {"critic/score/mean": 0.1 * step, "actor/pg_loss": -0.5 / step, "perf/throughput": 1000.0 + step,
            "perf/max_memory_allocated_gb": 1.5, "timing_s/step": 0.25, "trainer/idle_ratio": 0.3,
            "rollouter/idle_ratio": 0.1, "fully_async/count/stale_samples_processed": 2 * step,
            "training/global_step": step, **memory}


def log_a_run(sink: MetricLogger) -> dict[int, dict]:
    """Validation at step 0, three steps, a validation at step 2 that reaches the driver after step 3 (as a
    rollouter's can), and the final one."""
    val = lambda v: {"val-core/arithmetic/reward/mean@1": v, "val-aux/response_length/mean": 3.0}  # noqa: E731
    logged = [(0, val(0.1)), (1, step_metrics(1)), (2, step_metrics(2)), (3, step_metrics(3)), (2, val(0.5)),
              (3, val(0.9))]
    for step, metrics in logged:
        sink.log(metrics, step)
    sink.close()
    return logged


def expected(logged, rename=lambda k: k):
    out: dict = {}
    for step, metrics in logged:
        for key, value in metrics.items():
            out.setdefault(rename(key), []).append((step, pytest.approx(value)))
    return {k: sorted(v, key=lambda sv: sv[0]) for k, v in out.items()}


def by_step(scalars):
    return {k: sorted(v, key=lambda sv: sv[0]) for k, v in scalars.items()}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "swanlog"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return tmp_path


@pytest.mark.parametrize("tracker", ["wandb", "swanlab", "mlflow"])
def test_tracker_gets_the_tensorboard_scalars(dirs, tracker):
    pytest.importorskip(tracker)
    sink = MetricLogger(["console", "tensorboard", tracker], "p", "e", config=CONFIG, write_line=lambda line: None)
    logged = log_a_run(sink)
    tb = by_step(read_scalars(str(dirs / "tb")))
    assert tb == expected(logged)
    assert {"memory/generate/host_rss_gib", "perf/max_memory_allocated_gb", "trainer/idle_ratio"} <= set(tb)
    if tracker == "wandb":
        got = read_wandb_offline(str(dirs / "wandb"))
        # W&B's step axis is training/global_step, so every row carries it (validation rows too)
        assert by_step(got) == {**expected(logged), "training/global_step": sorted((s, s) for s, _ in logged)}
    elif tracker == "swanlab":
        assert by_step(read_swanlab(str(dirs / "swanlog"))) == expected(logged)
    else:
        got = by_step(read_mlflow_file_store(str(dirs / "mlruns")))
        assert got == expected(logged, rename=mlflow_key)
        assert "val-core/arithmetic/reward/mean_at_1" in got  # `@` is the one character MLflow refuses here


def test_mlflow_logs_the_config_as_verl_flattens_it(dirs):
    pytest.importorskip("mlflow")
    MetricLogger(["mlflow"], "p", "e", config=CONFIG).close()
    params = list((dirs / "mlruns").glob("*/*/params"))
    assert len(params) == 1
    assert (params[0] / "trainer" / "logger" / "list_len").read_text() == "2"
    assert (params[0] / "trainer" / "logger" / "1").read_text() == "tensorboard"
    assert flat_params(CONFIG)["data/max_response_length"] == 8


def test_a_missing_tracker_package_names_the_logger_and_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    check_installed(["console", "tensorboard"])  # not trackers: nothing to install
    with pytest.raises(ConfigError) as err:
        check_installed(["console", "swanlab"])
    assert err.value.key == "trainer.logger"
    msg = str(err.value)
    assert "swanlab needs the swanlab package" in msg and "pip install 'fully_async[swanlab]'" in msg
    with pytest.raises(ConfigError, match=r"fully_async\[swanlab\]"):  # the run stops in prepare, before Ray
        prepare(load_config(["trainer.logger=[console,swanlab]"]))


def test_a_tracker_that_cannot_start_names_the_logger_and_what_to_set(dirs, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(TrackerStartError) as err:
        MetricLogger(["console", "tensorboard", "mlflow"], "p", "e", config=CONFIG)
    assert "trainer.logger=mlflow: mlflow did not start" in str(err.value)
    assert "check MLFLOW_TRACKING_URI" in str(err.value)
