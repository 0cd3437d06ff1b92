"""End to end on Ray with the bundled tiny task: a few async steps, metrics, failures."""
import os

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars, read_wandb_offline

pytestmark = pytest.mark.integration

REQUIRED_METRICS = [
    "perf/throughput", "perf/time_per_step", "perf/total_num_tokens",
    "timing_s/gen", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/param_sync",
    "timing_s/step", "fully_async/count/staleness_samples", "fully_async/count/total_generated_samples",
    "fully_async/count/current_param_version", "trainer/idle_ratio", "fully_async/rollouter/idle_ratio",
    "fully_async/total_wait_time", "fully_async/count/stale_samples_processed",
    "fully_async/count/stale_trajectory_processed", "rollouter/idle_ratio", "rollouter/active_time",
    "rollouter/version_time", "rollouter/validate_time",
    "fully_async/partial/total_partial_num", "fully_async/partial/partial_ratio",
    "fully_async/partial/max_partial_span", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "actor/lr", "critic/score/mean", "response_length/mean", "response_length/max",
    "response_length/clip_ratio", "val-core/arithmetic/reward/mean@1",
]


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.fixture(scope="module")
def metrics_run(ray_session, tmp_path_factory):
    """One 4-step async run that every metrics test reads: TensorBoard, W&B offline, the dumps."""
    from fully_async.run.main import run_async

    tmp_path = tmp_path_factory.mktemp("metrics_run")
    env = {"TENSORBOARD_DIR": str(tmp_path / "tb"), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"),
           "VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl")}
    (tmp_path / "wandb").mkdir()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=4",
                           "trainer.test_freq=2", "actor_rollout_ref.actor.use_kl_loss=true",
                           "trainer.progress_bar=false", "actor_rollout_ref.rollout.n=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                           "trainer.logger=[console,tensorboard,wandb,file]",
                           "trainer.log_val_generations=2", f"trainer.validation_data_dir={tmp_path}/val_gen",
                           f"trainer.rollout_data_dir={tmp_path}/rollouts"])
        summary = run_async(cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return tmp_path, cfg, summary


def test_async_run_completes_and_writes_metrics(metrics_run):
    tmp_path, cfg, summary = metrics_run
    assert summary["steps"] == 4
    # every validation's responses (the bundled task's 128 validation prompts, val_kwargs.n=1) dumped, 2 shown
    tests_helpers.check_val_generations(str(tmp_path / "val_gen"), str(tmp_path / "tb"), [0, 2, 4], 128)
    tests_helpers.check_rollout_dump(str(tmp_path / "rollouts"), [1, 2, 3, 4], 8 * 4)   # every trained response
    scalars = read_scalars(str(tmp_path / "tb"))
    missing = [m for m in REQUIRED_METRICS + ["actor/kl_loss", "timing_s/ref"] if m not in scalars]
    assert not missing, f"missing metrics: {missing}"
    assert [s for s, _ in scalars["actor/pg_loss"]] == [1, 2, 3, 4]
    # validation before training (version 0), at version 2 (test_freq) and the final one
    val_steps = [s for s, _ in scalars["val-core/arithmetic/reward/mean@1"]]
    assert 0 in val_steps and 2 in val_steps and 4 in val_steps
    assert [v for _, v in scalars["fully_async/count/current_param_version"]] == [0, 1, 2, 3]
    assert all(0.0 <= v <= 1.0 for _, v in scalars["trainer/idle_ratio"] + scalars["rollouter/idle_ratio"])
    assert scalars["fully_async/total_wait_time"] == scalars["timing_s/gen"]
    # one per param version, logged at the trainer step that pushed the next one
    assert [s for s, _ in scalars["rollouter/version_time"]] == [1, 2, 3, 4]
    assert all(a <= v for (_, a), (_, v) in zip(scalars["rollouter/active_time"], scalars["rollouter/version_time"]))
    stale = [v for _, v in scalars["fully_async/count/stale_trajectory_processed"]]
    assert stale == sorted(stale) and stale[-1] <= 4 * 8 * 4  # cumulative, at most every trained response
    # the trained responses' lengths, as a histogram the planner and the benchmark workload read
    from fully_async.core.workload import load_histogram

    lengths, weights = load_histogram(str(tmp_path / "tb" / "response_lengths.json"))
    assert sum(weights) == len(summary["trained_sample_ids"]) == 4 * 8 * 4
    assert lengths == sorted(lengths) and 1 <= lengths[0] and lengths[-1] <= cfg.data.max_response_length


def test_the_file_logger_gets_the_tensorboard_scalars(metrics_run):
    """trainer.logger=[...,file] (verl's file logger, at VERL_FILE_LOGGER_PATH): a JSON line {"step", "data"} per
    logged step, holding every scalar TensorBoard got, at the same steps, with the same values."""
    import json

    tmp_path, _, _ = metrics_run
    tb = read_scalars(str(tmp_path / "tb"))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines and all(set(line) == {"step", "data"} for line in lines)
    got: dict = {}
    for line in lines:
        for key, value in line["data"].items():
            got.setdefault(key, []).append((line["step"], value))
    assert set(got) == set(tb)
    for key, points in tb.items():
        assert [s for s, _ in sorted(got[key])] == [s for s, _ in sorted(points)], key
        assert [v for _, v in sorted(got[key])] == pytest.approx([v for _, v in sorted(points)], rel=1e-6), key


def test_wandb_offline_gets_the_tensorboard_scalars(metrics_run):
    """trainer.logger=[console,tensorboard,wandb] with WANDB_MODE=offline: the W&B run file holds every scalar
    name TensorBoard got, at the same steps, with the same values."""
    pytest.importorskip("wandb")
    tmp_path, _, _ = metrics_run
    tb = read_scalars(str(tmp_path / "tb"))
    wb = read_wandb_offline(str(tmp_path / "wandb"))
    assert {"trainer/idle_ratio", "rollouter/idle_ratio", "val-core/arithmetic/reward/mean@1"} <= set(tb)
    # the validation generations (trainer.log_val_generations=2) are TensorBoard text and a W&B table
    table = {k for k in wb if k.startswith("val/generations/")}
    assert "val/generations/nrows" in table and set(wb) - table == set(tb)
    for key, points in tb.items():
        if key == "training/global_step":  # W&B's step axis: on every row it got, validation rows too
            assert {s for s, _ in points} <= {s for s, _ in wb[key]} and all(s == v for s, v in wb[key])
            continue
        assert [s for s, _ in sorted(wb[key])] == [s for s, _ in sorted(points)], key
        assert [v for _, v in sorted(wb[key])] == pytest.approx([v for _, v in sorted(points)], rel=1e-6), key


def test_collective_weight_sync_and_fsdp2_trainer_on_gloo(ray_session, tmp_path, monkeypatch):
    """2 FSDP2 trainer ranks + the engine, weights broadcast over a stateless gloo group."""
    from fully_async.run.main import run_async

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=3",
                       "actor_rollout_ref.rollout.weight_sync=collective", "actor_rollout_ref.actor.strategy=fsdp2",
                       "trainer.n_gpus_per_node=2", "trainer.progress_bar=false", "trainer.val_before_train=false",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    summary = run_async(cfg)
    assert summary["steps"] == 3
    scalars = read_scalars(str(tmp_path / "tb"))
    assert len(scalars["perf/param_sync_buckets"]) == 3 and all(v > 0 for _, v in scalars["perf/param_sync_gbps"])
    assert [v for _, v in scalars["fully_async/count/current_param_version"]] == [0, 1, 2]


def test_strict_on_policy_samples_are_fresh(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run_async

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.total_training_steps=3",
                       "async_training.staleness_threshold=0",
                       "async_training.trigger_parameter_sync_step=1", "async_training.partial_rollout=false",
                       "trainer.val_before_train=false", "data.val_files=null", "trainer.progress_bar=false",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4"])
    run_async(cfg)
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [v for _, v in scalars["fully_async/staleness/max"]] == [0, 0, 0]
    assert [v for _, v in scalars["fully_async/partial/total_partial_num"]] == [0, 0, 0]


SCORE_HEADER = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                "    if solution_str.strip() != str(ground_truth):\n")


def run_with_reward(tmp_path, monkeypatch, source: str, *overrides: str) -> tuple[str, str]:
    """A 3-step default run (in this process, on the module's Ray) scoring with the custom reward function `source`
    (written to a file): (its path, the error the run failed with, as the driver reports it)."""
    from fully_async.cluster.ray_utils import RunFailed
    from fully_async.run.main import run

    path = tmp_path / "reward_fn.py"
    path.write_text(source)
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    with pytest.raises(RunFailed) as err:
        run(load_config([f"custom_reward_function.path={path}", *overrides, "trainer.total_training_steps=3",
                         "trainer.val_before_train=false", "trainer.progress_bar=false",
                         f"trainer.default_local_dir={tmp_path}/ckpt"]))
    return str(path), str(err.value)


def test_failing_rollouter_fails_the_run_with_its_error(ray_session, tmp_path, monkeypatch):
    # correct answers score (so the driver's probe passes); the first wrong answer blows up in the rollouter
    bad, out = run_with_reward(tmp_path, monkeypatch, SCORE_HEADER + "        raise ValueError('reward exploded on "
                                                                    "purpose')\n    return 1.0\n")
    # the user's error, where it was raised (file and line), reaches the driver
    assert "rollouter failed: RewardError: reward function compute_score" in out
    assert "raised ValueError: reward exploded on purpose" in out and f"{bad}:3 (in compute_score)" in out


def test_hanging_reward_fails_the_run_within_its_timeout(ray_session, tmp_path, monkeypatch):
    # correct answers score at once (so the driver's probe passes); the first wrong answer hangs in the rollouter
    slow, out = run_with_reward(tmp_path, monkeypatch, SCORE_HEADER + "        __import__('time').sleep(600)\n"
                                                                     "    return 1.0\n", "reward_model.timeout_s=3")
    assert f"rollouter failed: RewardError: reward function {slow}:compute_score did not return within " \
           "reward_model.timeout_s=3s on sample e0-p" in out, out[-3000:]
    assert "(prompt index " in out
