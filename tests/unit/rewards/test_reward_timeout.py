"""reward_model.timeout_s: a custom reward function runs in a worker process and one that hangs fails with a
RewardError naming the function (file:name), the sample and the limit, within about the limit; the built-in rules
start no process."""
import multiprocessing
import time

import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.rewards import RewardError, RewardManager, build_reward_manager, load_custom_score
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import prepare

REWARD = '''\
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if {hang_when}:
        time.sleep(120)
    if solution_str == "crash":
        return 1.0 / 0.0  # line 8
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
'''


def reward_file(tmp_path, hang_when="solution_str == 'hang'"):
    path = tmp_path / "slow_reward.py"
    path.write_text(REWARD.format(hang_when=hang_when))
    return str(path)


def pooled(path, timeout_s):
    return RewardManager(load_custom_score(path, "compute_score"), max_response_length=8,
                         source=(path, "compute_score"), timeout_s=timeout_s)


def test_a_hanging_custom_reward_fails_naming_function_sample_and_limit(tmp_path):
    path = reward_file(tmp_path)
    manager = pooled(path, 2.0)
    try:
        assert manager.score("arithmetic", "3", "3", None, 1) == (1.0, {})  # in the worker
        start = time.perf_counter()
        with pytest.raises(RewardError) as err:
            manager.score("arithmetic", "hang", "3", None, 1, sample="sample e0-p7-s1 (prompt index 7)")
        elapsed = time.perf_counter() - start
        msg = str(err.value)
        assert f"reward function {path}:compute_score" in msg
        assert "sample e0-p7-s1 (prompt index 7)" in msg and "solution_str='hang'" in msg
        assert "reward_model.timeout_s=2s" in msg
        assert 2.0 <= elapsed < 6.0  # killed at the limit, not after the function's 120 s
        assert manager.score("arithmetic", "3", "3", None, 1) == (1.0, {})  # a fresh worker serves the next call
    finally:
        manager.close()


def test_a_crash_in_the_worker_keeps_the_file_line_and_traceback(tmp_path):
    path = reward_file(tmp_path)
    manager = pooled(path, 30.0)
    try:
        with pytest.raises(RewardError) as err:
            manager.score("arithmetic", "crash", "3", None, 1)
    finally:
        manager.close()
    msg = str(err.value)
    assert f"raised ZeroDivisionError: float division by zero at {path}:8 (in compute_score)" in msg
    assert f'File "{path}", line 8, in compute_score' in msg and "manager.py" not in msg
    assert err.value.user_exception == "ZeroDivisionError: float division by zero"


def test_builtin_rules_start_no_process_and_null_means_in_process(tmp_path):
    cfg = load_config([])
    assert cfg.reward_model.timeout_s == 300.0  # the default applies to custom functions only
    manager = build_reward_manager(cfg)
    before = multiprocessing.active_children()
    assert manager.pool is None and manager.score("arithmetic", "3", "3", None, 1)[0] == 1.0
    assert multiprocessing.active_children() == before
    path = reward_file(tmp_path)
    in_process = build_reward_manager(load_config([f"custom_reward_function.path={path}",
                                                   "reward_model.timeout_s=null"]))
    assert in_process.pool is None and in_process.score("arithmetic", "3", "3", None, 1)[0] == 1.0
    assert build_reward_manager(load_config([f"custom_reward_function.path={path}"])).pool is not None


def test_negative_timeout_is_refused():
    with pytest.raises(ConfigError) as err:
        validate(load_config(["reward_model.timeout_s=-1"]))
    assert err.value.key == "reward_model.timeout_s"


def test_a_reward_that_hangs_on_the_probe_fails_before_ray(tmp_path):
    path = reward_file(tmp_path, hang_when="True")
    start = time.perf_counter()
    with pytest.raises(RewardError) as err:
        prepare(load_config([f"custom_reward_function.path={path}", "reward_model.timeout_s=1"]))
    msg = str(err.value)
    assert f"{path}:compute_score did not return within reward_model.timeout_s=1s" in msg
    assert "the pre-run probe (row " in msg
    assert time.perf_counter() - start < 60


def test_starting_the_worker_does_not_count_against_the_call_limit(tmp_path, monkeypatch):
    import fully_async.rewards.manager as manager_mod

    path = tmp_path / "slow_import.py"
    path.write_text("import time\n\ntime.sleep(2)  # a heavy import\n\n\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0\n")
    manager = pooled(str(path), 1.0)
    try:
        assert manager.score("arithmetic", "3", "3", None, 1) == (1.0, {})  # 2 s to start, then well within 1 s
    finally:
        manager.close()
    monkeypatch.setattr(manager_mod, "WORKER_START_S", 0.5)
    manager = pooled(str(path), 1.0)
    try:
        with pytest.raises(RewardError, match=r"its scoring process did not start and import .*slow_import.py "
                                              r"within 0.5s \(before scoring sample s1"):
            manager.score("arithmetic", "3", "3", None, 1, sample="sample s1")
    finally:
        manager.close()
