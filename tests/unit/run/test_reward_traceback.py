"""A custom reward function that raises: the driver's output names the function, its file and the line where it
raised, with the function's own traceback (our frames trimmed) -- at the pre-run probe and inside the rollouter."""
import os
import subprocess
import sys

import pytest

from fully_async.rewards import RewardError, RewardManager, load_custom_score

REWARD = '''\
def _parse(text):
    return int(text)  # line 2: raises on a non-number


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if {condition}:
        return float(_parse("not a number"))  # line 7
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
'''


def write_reward(tmp_path, condition):
    f = tmp_path / "my_reward.py"
    f.write_text(REWARD.format(condition=condition))
    return str(f)


def test_manager_error_names_function_file_line_and_keeps_user_frames(tmp_path):
    path = write_reward(tmp_path, "solution_str == 'boom'")
    manager = RewardManager(load_custom_score(path, "compute_score"), max_response_length=8)
    assert manager.score("arithmetic", "3", "3", None, 1)[0] == 1.0
    with pytest.raises(RewardError) as err:
        manager.score("arithmetic", "boom", "3", None, 1)
    msg = str(err.value)
    assert "reward function compute_score" in msg and f"({path})" in msg
    assert f"at {path}:2 (in _parse)" in msg and "ValueError: invalid literal for int()" in msg
    assert f'File "{path}", line 7, in compute_score' in msg and f'File "{path}", line 2, in _parse' in msg
    assert "solution_str='boom'" in msg
    assert "manager.py" not in msg  # our own frames are trimmed


def start_main(tmp_path, *overrides):
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    return subprocess.Popen([sys.executable, "-m", "fully_async.main", f"hydra.run.dir={tmp_path}/run",
                             "trainer.progress_bar=false", "trainer.logger=[console]", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


@pytest.fixture(scope="module")
def driver_runs(tmp_path_factory):
    """The two driver runs (a crash at the pre-run probe; a crash inside the rollouter), started side by side:
    {name: (folder, reward file, returncode, stdout + stderr)}."""
    probe = tmp_path_factory.mktemp("probe")
    f = probe / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    x = 1\n"
                 "    raise KeyError(solution_str)  # line 3\n")
    inside = tmp_path_factory.mktemp("rollouter")
    # the probe scores the ground truth as the response (passes); the first wrong response raises
    path = write_reward(inside, "solution_str.strip() != str(ground_truth).strip()")
    procs = {"probe": (probe, str(f), start_main(probe, f"custom_reward_function.path={f}")),
             "rollouter": (inside, path, start_main(inside, f"custom_reward_function.path={path}",
                                                    "trainer.total_training_steps=2",
                                                    "trainer.val_before_train=false"))}
    out = {}
    for name, (folder, reward, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (folder, reward, proc.returncode, stdout + stderr)
    return out


def test_probe_crash_names_file_and_line(driver_runs):
    tmp_path, f, returncode, out = driver_runs["probe"]
    assert returncode == 1, out
    assert f"at {f}:3 (in compute_score)" in out and f'File "{f}", line 3, in compute_score' in out
    assert "probed before the run" in out
    assert "Started a local Ray instance" not in out
    log = (tmp_path / "run" / "main.log").read_text()
    assert f"at {f}:3 (in compute_score)" in log


def test_crash_inside_the_rollouter_reaches_the_driver_with_the_traceback(driver_runs):
    tmp_path, path, returncode, out = driver_runs["rollouter"]
    assert returncode == 1, out[-3000:]
    assert "rollouter failed: RewardError" in out, out[-3000:]
    assert f"at {path}:2 (in _parse)" in out and f'File "{path}", line 7, in compute_score' in out
    log = (tmp_path / "run" / "main.log").read_text()
    assert f"at {path}:2 (in _parse)" in log
