"""trainer.log_val_generations and trainer.validation_data_dir (telemetry/generations.py): verl's choice of the samples
shown, its JSONL dump, the sinks that show text (TensorBoard, W&B, SwanLab, MLflow), the driver's routing and the
config checks."""
import json
import logging
import os

import numpy as np
import pytest

from fully_async.core.config import ConfigError, typed_config
from fully_async.core.config_checks import validate
from fully_async.core.types import PromptRecord, Sample
from fully_async.rollout.generation import validation_metrics
from fully_async.run.hydra_setup import load_config
from fully_async.telemetry import generations
from fully_async.telemetry.metrics import MetricLogger
from tests_helpers import read_texts


def rows(n=6):
    return [{"input": f"prompt {i % 3}", "output": f"answer {i}", "gts": str(i), "score": float(i)} for i in range(n)]


def test_the_samples_shown_are_verls_choice_whatever_order_they_came_in():
    # verl's _maybe_log_val_generations, step by step
    samples = sorted(((r["input"], r["output"], r["score"]) for r in rows()), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    assert generations.pick(rows(), 3) == samples[:3]
    distinct = [dict(r, input=f"prompt {i}") for i, r in enumerate(rows())]   # equal inputs keep their order
    assert generations.pick(distinct[::-1], 3) == generations.pick(distinct, 3)
    assert len(generations.pick(rows(), 100)) == 6


def test_the_dump_is_verls_jsonl_with_the_step(tmp_path):
    data = rows(2)
    data[0]["gts"] = np.array([1, 2])          # a parquet ground truth
    data[1]["acc"] = True                      # a reward function's extra field
    path = generations.dump(str(tmp_path / "val"), 7, data)
    assert path == str(tmp_path / "val" / "7.jsonl") and os.listdir(tmp_path / "val") == ["7.jsonl"]
    got = [json.loads(line) for line in open(path)]
    assert got[0] == {"input": "prompt 0", "output": "answer 0", "gts": [1, 2], "score": 0.0, "step": 7}
    assert got[1]["acc"] is True and got[1]["step"] == 7


def test_validation_rows_carry_the_reward_extras_without_overriding_the_score():
    rec = PromptRecord(0, [1, 2], "arithmetic", "3")
    s = Sample("u", "s", [1, 2], [3], [0.0], [0], reward=1.0, reward_extra={"acc": 1.0, "score": 5.0})
    metrics = validation_metrics([(rec, [s])], 1, 0.5, [("1+2=", "3", "3")])
    assert metrics[generations.VAL_GENERATIONS] == [{"input": "1+2=", "output": "3", "gts": "3", "score": 1.0,
                                                     "acc": 1.0}]
    assert generations.VAL_GENERATIONS not in validation_metrics([(rec, [s])], 1, 0.5)


def test_trained_rows_decode_each_response_with_its_prompts_ground_truth():
    class Tok:
        calls = 0

        def decode(self, ids, skip_special_tokens):
            assert skip_special_tokens
            Tok.calls += 1
            return " ".join(map(str, ids))

    s = Sample("u", "s", [1, 2], [3, 4], [0.0, 0.0], [0, 0], reward=0.5, reward_extra={"acc": 0.0},
               ground_truth="7")
    assert generations.trained_rows(Tok(), [s]) == [{"input": "1 2", "output": "3 4", "gts": "7", "score": 0.5,
                                                    "acc": 0.0}]
    Tok.calls = 0
    other = Sample("u", "s2", [1, 2], [5], [0.0], [0], reward=1.0, ground_truth="7")   # the same prompt's group
    rows = generations.trained_rows(Tok(), [s, other])
    assert [r["output"] for r in rows] == ["3 4", "5"] and rows[1]["input"] == "1 2"
    assert Tok.calls == 3                   # the prompt once, each response once


def test_tensorboard_shows_the_samples_as_text(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    sink = MetricLogger(["tensorboard"], "p", "e")
    sink.log_generations(generations.pick(rows(), 2), 3)
    sink.close()
    [(step, text)] = read_texts(str(tmp_path / "tb"))["val/generations"]
    assert step == 3 and text.startswith("**Generation Results - Step 3**") and text.count("### Sample ") == 2


@pytest.mark.parametrize("tracker", ["wandb", "swanlab", "mlflow"])
def test_each_tracker_gets_the_samples(tmp_path, monkeypatch, tracker):
    pytest.importorskip(tracker)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "swanlog"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    sink = MetricLogger([tracker], "p", "e")
    for step in (0, 2):
        sink.log_generations(generations.pick(rows(), 2), step)
    sink.close()
    if tracker == "mlflow":
        arts = sorted(p.name for p in tmp_path.glob("mlruns/*/*/artifacts/*.json"))
        assert arts == ["val_step0.json", "val_step2.json"]
        got = json.loads(next(tmp_path.glob("mlruns/*/*/artifacts/val_step2.json")).read_text())
        assert got == [{"input": i, "output": o, "score": s} for i, o, s in generations.pick(rows(), 2)]
    elif tracker == "wandb":   # one table, a row per validation: the second logging holds both rows
        tables = [json.loads(t.read_text())
                  for t in tmp_path.glob("wandb/offline-run-*/files/media/table/val/generations_*.table.json")]
        assert sorted(len(t["data"]) for t in tables) == [1, 2]
        last = max(tables, key=lambda t: len(t["data"]))
        assert last["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
        assert [row[0] for row in last["data"]] == [0, 2]
    else:
        files = list(tmp_path.glob("swanlog/run-*/run-*.swanlab"))
        assert len(files) == 1 and b"val/generations" in files[0].read_bytes()


class FakeSink:
    def __init__(self):
        self.logged, self.shown = [], []
        self.write_line = None

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def log_generations(self, samples, step):
        self.shown.append((step, samples))


def test_the_driver_dumps_every_row_shows_n_and_logs_the_scalars_without_them(tmp_path):
    from fully_async.run.run_logging import RunLogger

    cfg = load_config(["trainer.log_val_generations=2", f"trainer.validation_data_dir={tmp_path}/val",
                       "trainer.progress_bar=false"])
    sink = FakeSink()
    run_log = RunLogger(cfg, 4, [], sink=sink)
    metrics = {"val-core/arithmetic/reward/mean@1": 0.5, generations.VAL_GENERATIONS: rows()}
    run_log.log_val(metrics, 4)
    assert sink.logged == [(4, {"val-core/arithmetic/reward/mean@1": 0.5})]
    assert sink.shown == [(4, generations.pick(rows(), 2))]
    assert len(open(tmp_path / "val" / "4.jsonl").readlines()) == 6
    assert run_log.has_val_at(4)
    # a trained step's rows: dumped only with trainer.rollout_data_dir, never logged as scalars
    run_log.log_val({"actor/pg_loss": 0.1, generations.ROLLOUT_GENERATIONS: rows(3)}, 5)
    assert sink.logged[-1] == (5, {"actor/pg_loss": 0.1}) and not (tmp_path / "rollouts").exists()
    run_log.rollout_dir = str(tmp_path / "rollouts")
    run_log.log_val({"actor/pg_loss": 0.2, generations.ROLLOUT_GENERATIONS: rows(3)}, 6)
    assert len(open(tmp_path / "rollouts" / "6.jsonl").readlines()) == 3


def test_the_settings_are_checked_before_the_run(tmp_path, caplog):
    with pytest.raises(ConfigError, match="trainer.log_val_generations"):
        validate(typed_config(load_config(["trainer.log_val_generations=-1"])))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.validation_data_dir.*is not a directory"):
        validate(typed_config(load_config([f"trainer.validation_data_dir={tmp_path}/file"])))
    with pytest.raises(ConfigError, match=r"trainer.rollout_data_dir.*is not a directory"):
        validate(typed_config(load_config([f"trainer.rollout_data_dir={tmp_path}/file"])))
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"trainer.validation_data_dir.*not writable"):
            validate(typed_config(load_config([f"trainer.validation_data_dir={locked}/val"])))
    validate(typed_config(load_config([f"trainer.validation_data_dir={tmp_path}/new/val"])))
    assert not (tmp_path / "new").exists()        # checked, not created, before the run
    with caplog.at_level(logging.WARNING):
        validate(typed_config(load_config(["trainer.log_val_generations=3", "trainer.logger=[console]"])))
    assert "trainer.log_val_generations=3 has no effect: none of trainer.logger=['console']" in caplog.text
