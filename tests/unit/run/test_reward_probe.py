"""The start-up reward probe is bounded by reward_model.probe_timeout_s and says what it waits for (issue 42): a reward
function that hangs at start-up -- at its import or on its first call -- is on the console within seconds (its
file:name) and fails naming the function and the key, instead of blocking for verl's 300 s."""
import logging
import time

import pytest

from fully_async.core.config import ConfigError
from fully_async.core.types import PromptRecord
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import probe_rewards
from fully_async.run.reward_probe import KEY, bounded_probe

HANGS_ON_CALL = '''\
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)
    return 1.0
'''
HANGS_AT_IMPORT = '''\
import time

time.sleep(60)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''
GOOD = '''\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


def probe(tmp_path, text, name):
    path = tmp_path / name
    path.write_text(text)
    # timeout_s=null: the call runs in the driver itself, where only the probe's own bound can stop it
    cfg = load_config([f"custom_reward_function.path={path}", "reward_model.timeout_s=null",
                       "reward_model.probe_timeout_s=1"])
    rec = PromptRecord(index=3, prompt_ids=[1], data_source="arithmetic", ground_truth="4")
    probe_rewards(cfg, [rec])
    return str(path)


def test_a_reward_function_that_hangs_on_its_first_call_fails_naming_it_and_the_key(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        probe(tmp_path, HANGS_ON_CALL, "hangs_on_call.py")
    elapsed = time.monotonic() - start
    path = str(tmp_path / "hangs_on_call.py")
    msg = str(err.value)
    assert msg.startswith(f"config error at '{KEY}': the reward function {path}:compute_score did not return within "
                          "1s at start-up (scoring data_source 'arithmetic', row 3"), msg
    assert elapsed < 4, elapsed
    assert f"reward probe: calling {path}:compute_score once per data_source before the run (each step bounded by " \
           f"{KEY}=1s)" in caplog.text


def test_a_reward_file_that_hangs_at_its_import_fails_naming_the_import(tmp_path):
    with pytest.raises(ConfigError, match=r"did not return within 1s at start-up \(importing .*hangs_at_import.py:"
                                          r"compute_score\)"):
        probe(tmp_path, HANGS_AT_IMPORT, "hangs_at_import.py")


def test_a_good_reward_function_passes_the_probe(tmp_path):
    probe(tmp_path, GOOD, "good.py")


def test_the_probe_says_it_is_still_waiting_and_kills_what_it_gave_up_on(caplog):
    killed = []

    def slow(watch):
        watch.on_timeout = lambda: killed.append(True)
        watch.stage("scoring data_source 'x', row 0")
        time.sleep(3)

    caplog.set_level(logging.INFO)
    with pytest.raises(ConfigError, match=r"within 0.8s at start-up \(scoring data_source 'x', row 0\)"):
        bounded_probe(slow, "f.py:score", 0.8, log_every_s=0.3)
    assert killed == [True]
    assert "reward probe: still waiting for f.py:score after 0s (scoring data_source 'x', row 0;" in caplog.text


def test_the_probe_raises_the_functions_own_error_and_refuses_a_bad_bound():
    def broken(watch):
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        bounded_probe(broken, "f.py:score", 5)
    with pytest.raises(ConfigError, match=r"reward_model.probe_timeout_s.*must be a positive number"):
        bounded_probe(broken, "f.py:score", float("nan"))
