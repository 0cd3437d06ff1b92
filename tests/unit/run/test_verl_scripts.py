"""Every verl example launch script (tests/fixtures/verl_scripts.tsv, extracted by scripts/extract_verl_scripts.py
from verl's examples, its fully-async and one-step-off recipes and the DAPO recipe at a pinned commit) ports by
changing the module name and the paths: its overrides translate, compose under its own --config-name and pass
validation, or the script is refused for one of the reasons docs/verl_compat.md lists ("verl's example scripts").
"""
import functools
import json
import logging
import os
import re

import pytest

from fully_async.core.config import ConfigError, asset_path
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
TABLE = os.path.join(ROOT, "tests", "fixtures", "verl_scripts.tsv")
DOC = os.path.join(ROOT, "docs", "verl_compat.md")
# what a port changes besides the module name: the paths (to ones that exist here) and the device
PATHS = {"data.train_files": asset_path("tiny_arithmetic/data/train.parquet"),
         "data.val_files": asset_path("tiny_arithmetic/data/val.parquet"),
         "actor_rollout_ref.model.path": asset_path("tiny_arithmetic/model"),
         "custom_reward_function.path": os.path.join(ROOT, "tests", "fixtures", "verl_reward_fn.py"),
         "reward.custom_reward_function.path": os.path.join(ROOT, "tests", "fixtures", "verl_reward_fn.py"),
         "data.custom_cls.path": os.path.join(ROOT, "tests", "fixtures", "verl_custom_rows.py")}
from fully_async.verl.compat import translate
from fully_async.verl.rules import SCRIPT_REFUSALS as REASONS


def rows(table=None):
    with open(table or TABLE) as f:
        for line in f:
            if line.startswith("#") or line.startswith("source\t"):
                continue
            source, path, module, name, overrides = line.rstrip("\n").split("\t")
            yield source, path, module, name, json.loads(overrides)


def ported(overrides):
    out = []
    for o in overrides:
        key = o.lstrip("+").split("=", 1)[0]
        if key in PATHS:
            o = f"{key}={PATHS[key]}"
        elif key in ("trainer.default_local_dir", "trainer.rollout_data_dir", "trainer.validation_data_dir"):
            continue
        elif key == "trainer.experiment_name" and "$(" in o:    # a name bash computes ($(basename ...)): free text
            continue
        out.append(o)
    return out + ["trainer.device=cuda"]       # verl's scripts are for GPUs (validation reads no device)


def reason_of(err):
    for reason, pattern in REASONS:
        if re.fullmatch(pattern, err.key or ""):
            return reason
    return None


def outcome(name, overrides):
    """'ok' or the refusal reason (None: refused for a reason not listed)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    try:
        cfg = load_config(ported(overrides), config_name=name)
        validate(cfg)
        return "ok", ""
    except ConfigError as err:
        return reason_of(err), str(err)
    except MissingConfigException as err:
        return reason_of(ConfigError("--config-name", str(err))), str(err)
    except OverrideParseException as err:
        return reason_of(ConfigError("hydra-grammar", str(err))), str(err)
    except ConfigCompositionException as err:
        return reason_of(ConfigError("hydra-compose", str(err))), str(err)


@functools.lru_cache(maxsize=None)
def table_outcomes(table=None):
    """{path: (reason, message, translated with warnings)} of every script of `table` (b178a3cd's by default),
    composed once per session: test_verl_scripts_0_9 counts over the same results."""
    logging.disable(logging.WARNING)
    try:
        out = {}
        for _, path, _, name, overrides in rows(table):
            reason, msg = outcome(name, overrides)
            out[path] = (reason, msg, reason == "ok" and bool(translate(ported(overrides)).warnings))
        return out
    finally:
        logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def outcomes():
    return {path: (reason, msg) for path, (reason, msg, _) in table_outcomes().items()}


def test_the_table_is_verls_scripts_at_the_pinned_commit():
    head = open(TABLE).read().splitlines()[:3]
    assert "volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7" in head[1]
    sources = [r[0] for r in rows()]
    assert (len(sources), sources.count("verl"), sources.count("recipe")) == (122, 98, 24)


def test_every_script_translates_or_is_refused_for_a_documented_reason(outcomes):
    unexplained = {p: msg for p, (reason, msg) in outcomes.items() if reason is None}
    assert not unexplained, unexplained
    doc = open(DOC).read()
    for reason, _ in REASONS:
        assert f"- {reason}" in doc, reason


# The model families a run refuses when the model loads, whatever the script's other keys: vision-language models
# anywhere (run/prepare.py check_causal_lm: text-only causal LMs), and under megatron every family but dense
# Qwen2/Qwen3/Llama (train/backends/hf_megatron.py SUPPORTED_MODEL_TYPES); told from the script's model path, else
# its file name (a path given by a shell variable)
VISION_LANGUAGE = re.compile(r"-VL-|_vl[-_]|MiniCPM-o|minicpmo|GLM-4\.\dV", re.I)
NOT_DENSE = re.compile(r"A3B|A22B|A2\.7B|moe|Moonlight|GLM-4\.5-Air|glm_air|DeepSeek-V3|dsv3|dspk|gpt-?oss|Next", re.I)
# verl's own scripts that verl itself cannot run as written
BROKEN_IN_VERL = ("an override Hydra cannot parse (in verl too)", "config missing from verl itself",
                  "rollout-correction keys verl itself no longer has (a recipe older than its rollout_correction API)")


def model_family(path, name, overrides):
    model = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("actor_rollout_ref.model.path=")),
                 "")
    model = model or os.path.basename(path)
    megatron = "megatron" in name or "actor_rollout_ref.actor.strategy=megatron" in overrides
    if VISION_LANGUAGE.search(model):
        return "vision-language"
    if megatron and NOT_DENSE.search(model):
        return "mixture-of-experts under megatron"
    return None


def refusal_classes(outcomes):
    """Each refused script's class: a model family the run refuses anyway, a critic under megatron (the algorithms
    issue), a script verl itself cannot run, or a feature not implemented here."""
    classes = {}
    for _, path, _, name, overrides in rows():
        reason = outcomes[path][0]
        if reason == "ok":
            continue
        family = model_family(path, name, overrides)
        classes[path] = (family or ("critic" if reason.startswith("gae") else
                                    "broken in verl" if reason in BROKEN_IN_VERL else "not implemented"))
    return classes


def test_the_count_in_the_porting_page_is_the_tables(outcomes):
    ok = sum(reason == "ok" for reason, _ in outcomes.values())
    readme = open(os.path.join(ROOT, "docs", "porting.md")).read()
    assert f"{ok} of {len(outcomes)} of verl's example scripts" in readme, ok
    assert ok >= 5
    counts = {}
    for cls in refusal_classes(outcomes).values():
        counts[cls] = counts.get(cls, 0) + 1
    families = counts.get("vision-language", 0) + counts.get("mixture-of-experts under megatron", 0)
    told = (f"{families} for a model family the run refuses when the model loads ({counts.get('vision-language', 0)} "
            f"vision-language, {counts.get('mixture-of-experts under megatron', 0)} mixture-of-experts under megatron)"
            f", {counts.get('critic', 0)} for a critic under megatron, {counts.get('broken in verl', 0)} that verl "
            f"itself cannot run as written, and {counts.get('not implemented', 0)} for a feature not implemented")
    assert told in " ".join(readme.split()), told


def test_what_is_refused_for_a_feature_not_implemented_is_named(outcomes):
    """The scripts refused neither for their model family, a critic under megatron nor verl's own errors: the
    features they need, kept explicit so a change of this list is seen."""
    left = sorted(os.path.basename(p) for p, cls in refusal_classes(outcomes).items() if cls == "not implemented")
    assert left == [], left
