"""Rule-based scores, custom reward functions and the reward managers (fully_async.rewards)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from fully_async.core.config import CustomRewardConfig, DataConfig, OverlongBufferConfig, RewardModelConfig
from fully_async.rewards import (RewardError, RewardManager, build_reward_manager, default_compute_score,
                                 load_custom_score)


# ----------------------------------------------------------------------------------- built-in scores
def test_arithmetic_exact_match():
    assert default_compute_score("arithmetic", " 42\n", 42) == 1.0
    assert default_compute_score("arithmetic", "42", "42") == 1.0
    assert default_compute_score("arithmetic", "42.", "42") == 0.0
    assert default_compute_score("arithmetic", "the answer is 42", "42") == 0.0


def test_unknown_data_source():
    with pytest.raises(NotImplementedError) as e:
        default_compute_score("my/dataset", "x", "y")
    msg = str(e.value)
    assert "'my/dataset'" in msg and "openai/gsm8k" in msg and "custom_reward_function.path" in msg


# ----------------------------------------------------------------------------------- custom functions
def write(tmp_path, body, name="reward.py"):
    p = tmp_path / name
    p.write_text(body)
    return str(p)


def test_load_custom_score_ok(tmp_path):
    path = write(tmp_path, "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return float(len(solution_str))\n")
    fn = load_custom_score(path, "my_score")
    assert fn(data_source="x", solution_str="abc", ground_truth=None, extra_info=None) == 3.0


def test_load_custom_score_file_with_dataclass(tmp_path):
    path = write(tmp_path, "from __future__ import annotations\nfrom dataclasses import dataclass\n"
                           "@dataclass\nclass Parsed:\n    value: int\n"
                           "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return float(Parsed(int(solution_str)).value == ground_truth)\n", name="dc.py")
    fn = load_custom_score(path, "compute_score")
    assert fn(data_source="x", solution_str="4", ground_truth=4) == 1.0
    assert fn(data_source="x", solution_str="5", ground_truth=4) == 0.0


def test_load_custom_score_missing_file(tmp_path):
    with pytest.raises(RewardError, match=r"nope\.py.*file not found"):
        load_custom_score(str(tmp_path / "nope.py"), "compute_score")


def test_load_custom_score_import_error(tmp_path):
    path = write(tmp_path, "import not_a_real_module_xyz\n")
    with pytest.raises(RewardError) as e:
        load_custom_score(path, "compute_score")
    assert "reward.py" in str(e.value) and "not_a_real_module_xyz" in str(e.value)
    assert "ModuleNotFoundError" in str(e.value)


def test_load_custom_score_missing_name_lists_functions(tmp_path):
    path = write(tmp_path, "import os\nLIMIT = 3\ndef score_a(**kw):\n    return 0\n"
                           "def score_b(**kw):\n    return 1\nclass Helper:\n    pass\n")
    with pytest.raises(RewardError) as e:
        load_custom_score(path, "compute_score")
    msg = str(e.value)
    assert "'compute_score'" in msg and "reward.py" in msg and "['score_a', 'score_b']" in msg


def manager(fn, **kw):
    kw.setdefault("max_response_length", 20)
    return RewardManager(fn, **kw)


def test_manager_float_and_bool_and_numpy():
    assert manager(lambda **kw: 1).score("a", "x", "y", None, 3) == (1.0, {})
    assert manager(lambda **kw: True).score("a", "x", "y", None, 3) == (1.0, {})
    assert manager(lambda **kw: np.float32(0.25)).score("a", "x", "y", None, 3) == (0.25, {})


def test_manager_passes_keyword_arguments():
    seen = {}

    def fn(data_source, solution_str, ground_truth, extra_info):
        seen.update(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                    extra_info=extra_info)
        return 0.5

    assert manager(fn).score("openai/gsm8k", "resp", "7", {"k": 1}, 4) == (0.5, {})
    assert seen == {"data_source": "openai/gsm8k", "solution_str": "resp", "ground_truth": "7", "extra_info": {"k": 1}}


def test_manager_dict_result(tmp_path):
    path = write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return {'score': 0.5, 'acc': True, 'pred': 'x', 'len': 3}\n")
    score, extra = manager(load_custom_score(path, "compute_score")).score("a", "x", "y", None, 3)
    assert score == 0.5
    assert extra == {"acc": 1.0, "len": 3.0}


def test_manager_rejects_string_result(tmp_path):
    path = write(tmp_path, "def compute_score(**kw):\n    return 'yes'\n")
    with pytest.raises(RewardError) as e:
        manager(load_custom_score(path, "compute_score")).score("a", "x", "y", None, 3)
    assert "compute_score" in str(e.value) and "'yes'" in str(e.value)


def test_manager_rejects_nan_and_inf():
    def nan_score(**kw):
        return float("nan")

    with pytest.raises(RewardError, match=r"nan_score returned the value nan"):
        manager(nan_score).score("a", "x", "y", None, 3)
    with pytest.raises(RewardError, match="inf"):
        manager(lambda **kw: {"score": math.inf}).score("a", "x", "y", None, 3)
    with pytest.raises(RewardError, match=r"without 'score': keys \['acc'\]"):
        manager(lambda **kw: {"acc": 1.0}).score("a", "x", "y", None, 3)
    with pytest.raises(RewardError, match="None"):
        manager(lambda **kw: None).score("a", "x", "y", None, 3)


# ----------------------------------------------------------------------------------- dapo overlong buffer
def dapo(factor=1.0, log=True, enable=True):
    buf = OverlongBufferConfig(enable=enable, len=4, penalty_factor=factor, log=log)
    return manager(lambda **kw: 1.0, reward_manager="dapo", max_response_length=20, overlong_buffer=buf)


@pytest.mark.parametrize("length,penalty", [(10, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0)])
def test_dapo_overlong_penalty_exact(length, penalty):
    score, extra = dapo().score("a", "x", "y", None, length)
    assert score == pytest.approx(1.0 + penalty)
    assert extra["overlong_reward"] == pytest.approx(penalty)
    assert extra["overlong"] is (penalty < 0)


def test_dapo_penalty_factor_and_no_log():
    score, extra = dapo(factor=2.0, log=False).score("a", "x", "y", None, 18)
    assert score == pytest.approx(0.0)  # 1.0 + (-0.5 * 2.0)
    assert extra == {}


def test_dapo_disabled_and_naive_ignore_length():
    assert dapo(enable=False).score("a", "x", "y", None, 20) == (1.0, {})
    buf = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True)
    naive = manager(lambda **kw: 1.0, reward_manager="naive", overlong_buffer=buf)
    assert naive.score("a", "x", "y", None, 20) == (1.0, {})


def test_unknown_reward_manager():
    with pytest.raises(ValueError, match=r"reward_model.reward_manager='batch'.*naive\|dapo\|prime"):
        manager(lambda **kw: 1.0, reward_manager="batch")


# ----------------------------------------------------------------------------------- build_reward_manager
def cfg(path=None, name="compute_score", reward_manager="naive", buf=None):
    return SimpleNamespace(custom_reward_function=CustomRewardConfig(path=path, name=name),
                           reward_model=RewardModelConfig(reward_manager=reward_manager,
                                                          overlong_buffer=buf or OverlongBufferConfig()),
                           data=DataConfig(max_response_length=20))


def test_build_default_and_custom(tmp_path):
    rm = build_reward_manager(cfg())
    assert rm.compute_score is default_compute_score
    assert rm.score("openai/gsm8k", "#### 3", "3", None, 5) == (1.0, {})
    assert rm.score("math_dapo", "Answer: 3", "3", None, 5) == (1.0, {"acc": 1.0})  # DAPO's acc is kept
    path = write(tmp_path, "def mine(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.75\n")
    buf = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=False)
    rm = build_reward_manager(cfg(path=path, name="mine", reward_manager="dapo", buf=buf))
    assert rm.score("anything", "x", None, None, 18) == (pytest.approx(0.25), {})


def test_build_unknown_reward_manager():
    with pytest.raises(ValueError, match="reward_model.reward_manager"):
        build_reward_manager(cfg(reward_manager="batch"))


def test_dapo_max_resp_len_is_the_penalty_reference_as_in_verl():
    """verl's DAPO: expected_len = max_resp_len - len (reward_kwargs.max_resp_len), not the response limit."""
    buf = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0, log=True, max_resp_len=12)
    rm = build_reward_manager(cfg(reward_manager="dapo", buf=buf, path=None))
    assert rm.overlong_penalty(8) == 0.0 and rm.overlong_penalty(10) == pytest.approx(-0.5)  # (10 - 8) / 4
    assert rm.overlong_penalty(12) == pytest.approx(-1.0)


def test_custom_reward_kwargs_reach_the_function_over_the_calls_own(tmp_path):
    """verl's +custom_reward_function.reward_kwargs.<name>: merged over the call's keyword arguments."""
    path = write(tmp_path, "def mine(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
                           "    return scale * (solution_str == ground_truth)\n")
    config = cfg(path=path, name="mine")
    config.custom_reward_function.reward_kwargs = {"scale": 3.0}
    rm = build_reward_manager(config)
    assert rm.score("x", "7", "7", None, 1) == (3.0, {})
    config.custom_reward_function.reward_kwargs = {"extra_info": {"from": "kwargs"}}
    seen = write(tmp_path, "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return float(extra_info == {'from': 'kwargs'})\n", name="seen.py")
    config.custom_reward_function.path, config.custom_reward_function.name = seen, "f"
    assert build_reward_manager(config).score("x", "1", "1", {"from": "call"}, 1) == (1.0, {})
