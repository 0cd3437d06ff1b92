"""Rollout on every device, end to end on Ray with the bundled tiny task (CPU: a "device" is one core).

sync mode with 2 trainer ranks runs 2 engines (one per rank); async mode with 2 rollout devices runs 2
engine replicas; the per-engine metrics prove every engine generated, and both runs learn the task."""
import json
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration

LEARN = ["trainer.total_training_steps=24", "trainer.test_freq=-1", "trainer.progress_bar=false"]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def check_two_engines_learned(scalars: dict, steps: int) -> None:
    assert [v for _, v in scalars["fully_async/rollouter/num_engines"]] == [2] * steps
    for i in (0, 1):
        tokens = [v for _, v in scalars[f"fully_async/rollouter/engine_{i}/tokens"]]
        assert sum(tokens) > 0, f"engine {i} never generated"
        busy = [v for _, v in scalars[f"fully_async/rollouter/engine_{i}/busy_ratio"]]
        assert all(0.0 <= b <= 1.0 for b in busy) and max(busy) > 0
    val = [v for _, v in sorted(scalars["val-core/arithmetic/reward/mean@1"])]
    assert val[0] < 0.2 and val[-1] > 0.6, val   # greedy validation reward before -> after


def test_sync_mode_generates_on_every_trainer_device(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run_sync

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config(["mode=sync", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.n_gpus_per_node=2",
                       "actor_rollout_ref.actor.strategy=fsdp2", "trainer.log_val_generations=2",
                       f"trainer.validation_data_dir={tmp_path}/val_gen", f"trainer.rollout_data_dir={tmp_path}/roll",
                       *LEARN])
    summary = run_sync(cfg)
    assert summary["steps"] == 24
    tests_helpers.check_val_generations(str(tmp_path / "val_gen"), str(tmp_path / "tb"), [0, 24], 128)
    tests_helpers.check_rollout_dump(str(tmp_path / "roll"), range(1, 25), 16 * 8)
    scalars = read_scalars(str(tmp_path / "tb"))
    check_two_engines_learned(scalars, 24)
    # every step, both engines generated their share of the batch (16 prompts x n=8 over 2 engines)
    for i in (0, 1):
        assert all(v > 0 for _, v in scalars[f"fully_async/rollouter/engine_{i}/tokens"])


def test_async_mode_runs_one_replica_per_rollout_device(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run_async

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "rollout.n_gpus_per_node=2",
                       "trainer.timeline=true", *LEARN])
    summary = run_async(cfg)
    assert summary["steps"] == 24
    scalars = read_scalars(str(tmp_path / "tb"))
    check_two_engines_learned(scalars, 24)
    with open(os.path.join(str(tmp_path / "tb"), "timeline.json")) as fh:
        trace = json.load(fh)["traceEvents"]
    tracks = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert {"engine_0", "engine_1", "rollouter", "trainer"} <= tracks


def test_placement_that_cannot_fit_fails_at_once_naming_the_need(ray_session):
    import time

    from fully_async.device import CPU
    from fully_async.placement.groups import make_placement_group
    from fully_async.cluster.ray_utils import RunFailed

    start = time.monotonic()
    with pytest.raises(RunFailed, match=r"could not place 5 rollout engine replica\(s\).*'CPU': 5.*has \{'CPU': 3"):
        make_placement_group(CPU, 5, 1, "5 rollout engine replica(s)")
    assert time.monotonic() - start < 10
