"""The entry point passes its command line through the verl-compat rules before Hydra composes it, so
`--cfg job` prints what the run gets and a refused key fails before anything starts."""
import subprocess
import sys

import yaml

from fully_async.run.hydra_setup import rewrite_argv


def main(*args):
    return subprocess.run([sys.executable, "-m", "fully_async.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_cfg_job_shows_the_translated_config_and_one_warning_per_verl_key():
    r = main("--cfg", "job", "actor_rollout_ref.hybrid_engine=False", "data.return_raw_chat=True",
             "actor_rollout_ref.actor.optim.lr_decay_style=cosine", "+reward_model.reward_kwargs.max_resp_len=6")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert "hybrid_engine" not in cfg["actor_rollout_ref"] and "return_raw_chat" not in cfg["data"]
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr_scheduler_type"] == "cosine"
    assert cfg["reward_model"]["overlong_buffer"]["max_resp_len"] == 6
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 8          # the bundled task's preset
    assert r.stderr.count("actor_rollout_ref.hybrid_engine=False is accepted but has no effect here") == 1
    assert r.stderr.count("data.return_raw_chat=True is accepted but has no effect here") == 1


def test_a_typo_fails_naming_the_key_before_hydra():
    r = main("--cfg", "job", "+trainer.typo=3")
    assert r.returncode == 1
    assert "config error at 'trainer.typo': not a key of fully_async's schema" in r.stderr
    assert "Traceback" not in r.stderr


def test_rewrite_argv_keeps_hydra_flags_and_drops_the_preset_for_a_users_config_path():
    argv = ["prog", "--config-path", "/tmp/mine", "--config-name", "x", "actor_rollout_ref.hybrid_engine=False",
            "trainer.device=cpu"]
    assert rewrite_argv(argv) == ["prog", "--config-path", "/tmp/mine", "--config-name", "x", "trainer.device=cpu"]
    out = rewrite_argv(["prog", "-m", "trainer.device=cpu"])
    assert out[:2] == ["prog", "-m"] and "actor_rollout_ref.rollout.n=8" in out and out[-1] == "trainer.device=cpu"
