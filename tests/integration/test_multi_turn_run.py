"""Multi-turn tool rollouts end to end (actor_rollout_ref.rollout.multi_turn.*, verl's tool agent loop): a policy
that calls a calculator tool (tests/fakes.ToolScriptEngine) on a chat model, verl's tool YAML, a custom reward that
reads verl's num_turns; async (with partial rollouts cutting turns and tool steps) and sync; every trained response
carries its tool answer outside the loss; the checkpoint resumes."""
import json
import os

import pytest

from chat_helpers import build_chat_model
from fully_async.run.hydra_setup import load_config
import tests_helpers
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_session():
    yield from tests_helpers.ray_session(num_cpus=3, PYTHONPATH=TESTS)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    import pandas as pd

    root = tmp_path_factory.mktemp("calc_task")
    model = build_chat_model(str(root / "model"))
    rows = [{"prompt": [{"role": "user", "content": f"what is {a}+{b}?"}], "data_source": "calc",
             "reward_model": {"ground_truth": str(a + b), "style": "rule"}, "extra_info": {"index": i}}
            for i, (a, b) in enumerate((a, b) for a in range(8) for b in range(8))]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:4]).to_parquet(root / "val.parquet")
    tools = root / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "fakes:CalcTool", "config": {}, "tool_schema": {
        "type": "function", "function": {"name": "calc", "description": "adds two integers", "parameters": {
            "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}}]}))
    return root, model, str(tools)


def overrides(root, model, tools, tmp_path, mode, steps):
    return [f"mode={mode}", f"actor_rollout_ref.model.path={model}", f"data.train_files={root}/train.parquet",
            f"data.val_files={root}/val.parquet", "data.max_prompt_length=400", "data.max_response_length=120",
            "actor_rollout_ref.rollout.name=fakes:ToolScriptEngine", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            "custom_reward_function.path=" + os.path.join(TESTS, "fakes.py"), "custom_reward_function.name=calc_reward",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.progress_bar=false",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=2",
            f"trainer.default_local_dir={tmp_path}/ck", "actor_rollout_ref.rollout.dtype=float32"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tool_calls_run_end_to_end_with_their_answers_outside_the_loss(ray_session, task, tmp_path, monkeypatch,
                                                                      mode):
    from fully_async.run.main import run

    root, model, tools = task
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(load_config(overrides(root, model, tools, tmp_path, mode, 4)))
    assert summary["steps"] == 4
    scalars = read_scalars(str(tmp_path / "tb"))
    # every response called the tool once and answered with its result: reward 1, verl's num_turns 4
    assert [v for _, v in scalars["critic/score/mean"]] == [1.0] * 4
    assert [v for _, v in scalars["num_turns/mean"]] == [4.0] * 4
    assert all(v == 1.0 for _, v in scalars["val-core/calc/reward/mean@1"])
    # resume from the step-4 checkpoint: two steps more, the same behaviour
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb2"))
    summary = run(load_config(overrides(root, model, tools, tmp_path, mode, 6)))
    assert summary["steps"] == 6
    assert [v for _, v in read_scalars(str(tmp_path / "tb2"))["critic/score/mean"]] == [1.0] * 2
