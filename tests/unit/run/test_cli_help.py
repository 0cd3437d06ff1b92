"""`python -m fully_async.main --help` prints our own usage (hydra.help.template), not Hydra's dump of the preset:
it names the other commands, and every key it names exists in the composed config (async and sync)."""
import re

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fully_async.run.hydra_setup import CONFIG_DIR, register


@pytest.fixture(scope="module", params=["fully_async_ppo_trainer", "ppo_trainer"])
def composed(request):
    register()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=request.param, return_hydra_config=True)


def test_help_names_the_other_commands_and_not_the_config_dump(composed):
    text = composed.hydra.help.template
    for needle in ("python -m fully_async.plan", "python -m fully_async.doctor", "mode=sync",
                   "--config-name=ppo_trainer", "--cfg job", "trainer.save_freq", "docs/"):
        assert needle in text, needle
    assert "$CONFIG" not in text and "$FLAGS_HELP" not in text    # no 300-line preset, no completion scripts
    assert len(text.splitlines()) <= 40
    assert max(len(line) for line in text.splitlines()) <= 120


def test_every_key_the_help_names_exists(composed):
    text = composed.hydra.help.template
    keys = set(re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)=", text))
    assert len(keys) >= 15, keys
    cfg = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
    missing = [k for k in keys if OmegaConf.select(cfg, k, default="<missing>") == "<missing>"]
    assert not missing, missing
