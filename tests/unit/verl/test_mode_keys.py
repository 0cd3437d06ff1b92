"""No key documented as honoured does nothing in some mode without a word: every verl key docs/verl_compat.md calls
honoured (or mapped), set away from its default in sync mode, in async mode and on a shared device pool, either acts
there (core/mode_keys.py: it is not a key of another mode only), or is named by a warning, or is refused."""
import ast
import logging
import os

import pytest

from fully_async.core.config import ConfigError, FullyAsyncConfig
from fully_async.core.config_checks import validate
from fully_async.core.mode_keys import ASYNC, MODE_ONLY, SYNC, _get, acts
from fully_async.run.hydra_setup import load_config
from fully_async.verl.compat import HONOURED, MAPPED, classify, find_rule, read_tsv
from fully_async.verl.v1 import is_v1_key

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
ROWS = read_tsv(os.path.join(ROOT, "docs", "verl_config_keys.tsv"))
POOL = ["multi_job.pool=p", "multi_job.ray_address=h:1", "multi_job.devices=8"]
# name -> (mode, on a shared pool, overrides)
MODES = {"sync": (SYNC, False, ["mode=sync"]), "async": (ASYNC, False, ["mode=async"]),
         "sync on a pool": (SYNC, True, ["mode=sync", *POOL]), "async on a pool": (ASYNC, True, ["mode=async", *POOL])}


def honoured_targets() -> dict[str, str]:
    """verl key -> the schema key it sets, for every key the docs call honoured or mapped."""
    out = {}
    for key, _ in ROWS:
        status, _ = classify(key)
        if status == HONOURED:
            out[key] = key
        elif status == MAPPED and not is_v1_key(key):   # V1 keys choose the mode themselves (test_verl_v1.py)
            rule, groups = find_rule(key)
            out[key] = rule.target.format(*groups)
    return out


def probe(target: str):
    """A value other than the schema default."""
    default = _get(FullyAsyncConfig(), target)
    if isinstance(default, bool):
        return not default
    if default is None:
        return 2
    if isinstance(default, float):
        return 0.5 if default != 0.5 else 0.25
    if isinstance(default, int):
        return default * 2 if default > 0 else 2
    raise AssertionError(f"no probe value for {target} (default {default!r})")


def outcome(verl_key: str, target: str, mode: str, caplog) -> str:
    """'refused', 'warned' (a warning names the key) or 'silent'."""
    caplog.clear()
    value = probe(target)
    line = f"{verl_key}={str(value).lower() if isinstance(value, bool) else value}"
    with caplog.at_level(logging.WARNING):
        try:
            validate(load_config([*MODES[mode][2], line]))
        except ConfigError:
            return "refused"
    named = [r for r in caplog.records if verl_key in r.getMessage() or target in r.getMessage()]
    return "warned" if named else "silent"


CASES = [(verl, target, mode) for verl, target in sorted(honoured_targets().items()) if target in MODE_ONLY
         for mode in MODES if not acts(MODE_ONLY[target], *MODES[mode][:2])]


def test_the_walk_covers_the_mode_only_keys():
    covered = {t for _, t, _ in CASES}
    # every mode-only key that verl also has is walked (ours alone, e.g. rollout.weight_sync, are not in the table)
    assert {"async_training.staleness_threshold", "rollout.test_freq", "data.train_batch_size",
            "actor_rollout_ref.actor.fsdp_config.param_offload",
            "actor_rollout_ref.rollout.free_cache_engine"} <= covered
    assert len(CASES) >= 20


@pytest.mark.parametrize("verl_key, target, mode", CASES)
def test_a_key_of_other_modes_is_named_or_refused(verl_key, target, mode, caplog):
    got = outcome(verl_key, target, mode, caplog)
    assert got in ("warned", "refused"), f"{verl_key} set in {mode} mode does nothing and says nothing"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_key_that_acts_is_not_named(mode, caplog):
    """Where a mode-only key acts, no 'has no effect' warning names it."""
    for verl_key, target in honoured_targets().items():
        rule = MODE_ONLY.get(target)
        if rule is None or not acts(rule, *MODES[mode][:2]) or rule.checked_elsewhere:
            continue
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            try:
                validate(load_config([*MODES[mode][2], f"{verl_key}={probe(target)}"]))
            except ConfigError:
                continue
        assert not [r for r in caplog.records if "has no effect" in r.getMessage()
                    and r.getMessage().startswith(target + "=")]


# files whose reads of the config act in one mode only (the loops and what only they use)
ASYNC_ONLY = ("actors/rollouter.py", "actors/trainer.py", "actors/queue.py", "core/staleness.py",
              "rollout/scheduler.py", "weight_sync/collective.py", "weight_sync/object_store.py")
SYNC_ONLY = ("actors/sync_loop.py", "weight_sync/local.py")
# files that read keys to check, plan, document or translate them, not to act on them
NOT_ACTING = ("core/config.py", "core/config_checks.py", "core/mode_keys.py", "planner/", "run/plan_cli.py",
              "run/doctor.py", "verl/", "run/prepare.py")


def attribute_readers() -> dict[str, set[str]]:
    """attribute name -> the package files (relative) that read `<something>.<name>`."""
    out: dict[str, set[str]] = {}
    pkg = os.path.join(ROOT, "fully_async")
    for folder, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, pkg)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Attribute):
                        out.setdefault(node.attr, set()).add(rel)
    return out


def test_keys_read_only_by_one_modes_code_are_in_the_table():
    """Derived from the code: a documented-honoured key whose field name is read only by files of one mode's loop
    acts in that mode only, so it must be in MODE_ONLY (and is then named in the others)."""
    readers = attribute_readers()
    missing = []
    for target in set(honoured_targets().values()):
        files = {f for f in readers.get(target.rsplit(".", 1)[1], set()) if not f.startswith(NOT_ACTING)}
        for only, mode in ((ASYNC_ONLY, ASYNC), (SYNC_ONLY, SYNC)):
            if files and files <= set(only) and (target not in MODE_ONLY or MODE_ONLY[target].acts_in[0] != mode):
                missing.append((target, mode, sorted(files)))
    assert not missing, missing
