"""DAPO's dynamic sampling end to end on the bundled tiny task, in both modes: groups whose responses all score
the same are dropped, more prompts are generated, and every prompt the run consumed is trained exactly once (all
its n responses) or counted as filtered -- across a checkpoint and resume too.  verl's rollout correction runs in
the same runs (its decoupled mode in async, its bypass mode in sync) and logs its metrics every step."""
import collections

import pytest

from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration

PROMPTS, N = 24, 2
# the parity of the response's length, with DAPO's `acc`: about half the groups of 2 agree and are dropped
REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    acc = sum(map(ord, solution_str)) % 2 == 0\n"
          "    return {'score': float(acc), 'acc': acc}\n")


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3)


def config(tmp_path, mode, *extra):
    path = tmp_path / "reward_fn.py"
    path.write_text(REWARD)
    return load_config([f"mode={mode}", f"custom_reward_function.path={path}", f"rollout.total_rollout_steps={PROMPTS}",
                        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                        "algorithm.filter_groups.max_num_gen_batches=20", f"actor_rollout_ref.rollout.n={N}",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                        "trainer.val_before_train=false", "data.val_files=null", "trainer.progress_bar=false",
                        f"trainer.default_local_dir={tmp_path}/ckpt", "data.max_response_length=8", *extra])


def check_accounting(summary):
    """Each consumed prompt trained once with all its responses, or filtered; together: the PROMPTS drawn."""
    trained = collections.Counter(i.rsplit("-s", 1)[0] for i in summary["trained_sample_ids"])
    filtered = summary["filtered_group_uids"]
    assert len(set(summary["trained_sample_ids"])) == len(summary["trained_sample_ids"])
    assert set(trained.values()) == {N}
    assert len(filtered) == len(set(filtered)) and not set(filtered) & set(trained)
    consumed = set(trained) | set(filtered)                   # PROMPTS of epoch 0, in the data's shuffled order
    assert len(consumed) == PROMPTS and all(uid.startswith("e0-p") for uid in consumed)
    assert filtered and trained                               # the run exercised both
    return trained, filtered


# verl's rollout correction rides along: decoupled token weights + rejection (async), bypass-mode rejection (sync)
RC = "algorithm.rollout_correction."
CORRECTION = {"async": [f"{RC}rollout_is=token", f"{RC}rollout_rs=seq_max_k3", f"{RC}rollout_rs_threshold=0.5"],
              "sync": [f"{RC}bypass_mode=true", f"{RC}rollout_rs=token_k1", f"{RC}rollout_rs_threshold=1.5"]}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_consumed_prompt_is_trained_once_or_filtered(ray_session, tmp_path, monkeypatch, mode):
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(config(tmp_path, mode, *CORRECTION[mode]))
    trained, filtered = check_accounting(summary)
    scalars = read_scalars(str(tmp_path / "tb"))
    steps = [s for s, _ in scalars["actor/pg_loss"]]
    assert [s for s, _ in scalars["rollout_corr/rollout_rs_masked_fraction"]] == steps
    assert ("rollout_corr/rollout_is_mean" in scalars) == (mode == "async")
    per_step = [v for _, v in scalars["train/num_filtered_groups"]]
    assert sum(per_step) == len(filtered) or mode == "async"   # async: the rollouter's windows, the last may lag
    assert scalars["fully_async/count/filtered_groups"][-1][1] <= len(filtered)
    if mode == "sync":   # every full step trained train_batch_size kept groups, drawn in rounds
        assert all(v >= 1 for _, v in scalars["train/num_gen_batches"])
        assert summary["steps"] == -(-len(trained) // 4)


def test_filtered_groups_are_counted_across_a_checkpoint_and_resume(ray_session, tmp_path, monkeypatch):
    from fully_async.run.main import run

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    first = run(config(tmp_path, "async", "trainer.total_training_steps=2", "trainer.save_freq=1",
                       "async_training.trigger_parameter_sync_step=1"))
    assert first["steps"] == 2 and first["filtered_group_uids"]
    second = run(config(tmp_path, "async", "trainer.save_freq=1", "async_training.trigger_parameter_sync_step=1"))
    check_accounting(second)
    assert set(first["filtered_group_uids"]) <= set(second["filtered_group_uids"])
