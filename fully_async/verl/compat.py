"""verl's config keys that are not in our schema (layer 1): each one is mapped, warned or refused.

A ported verl script passes `key=value` overrides for every key of verl's trainer configs
(docs/verl_config_keys.tsv lists those of verl 0.9.1 and b178a3cd).  Keys our schema has (same name, same meaning)
go to Hydra untouched.  Every other verl key is handled here, on the override list, before Hydra composes
the config, so `--cfg job`, `fully_async.doctor` and the run see the same config:

* mapped:  honoured under our name (`actor.optim.lr_decay_style` -> `actor.optim.lr_scheduler_type`);
* warned:  accepted with one warning saying why it has no effect here, then dropped;
* refused: a ConfigError naming the key and what to use instead (before Ray starts).

A rule may accept only some values (`rollout.data_parallel_size=1` is warned, 2 is refused), and a key
that neither the schema nor verl knows (`+trainer.typo=3`) is refused with the nearest valid names.
The rules themselves are the table in verl/rules.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

from fully_async.core.config import ConfigError, FullyAsyncConfig
from fully_async.verl.rules import (DEFAULT_DIFFERENCES, MAPPED, OPEN_DICTS, REFUSED, RULES, SCALAR_AS_LIST,
                                         VALUE_MAPS, WARNED, Rule)

logger = logging.getLogger(__name__)

HONOURED = "honoured"
__all__ = ["DEFAULT_DIFFERENCES", "HONOURED", "MAPPED", "REFUSED", "WARNED", "classify", "find_rule",
           "read_tsv", "read_versions", "render", "translate"]


def schema_keys() -> set[str]:
    """Every key of the schema: leaves and sections."""
    out: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.add(prefix + f.name)
            if dataclasses.is_dataclass(default):
                walk(type(default), prefix + f.name + ".")

    walk(FullyAsyncConfig, "")
    return out


_SCHEMA: Optional[set[str]] = None
_COMPILED: Optional[list[tuple["re.Pattern[str]", Rule]]] = None


def in_schema(key: str) -> bool:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = schema_keys()
    return key in _SCHEMA or any(key.startswith(d + ".") for d in OPEN_DICTS)


def find_rule(key: str) -> Optional[tuple[Rule, tuple[str, ...]]]:
    """The first rule matching `key` (and its wildcards' matches), or None."""
    global _COMPILED
    if _COMPILED is None:
        from fully_async.verl.rules_09 import RULES_09

        _COMPILED = [(r.regex(), r) for r in RULES + RULES_09]
    for rx, rule in _COMPILED:
        m = rx.match(key)
        if m:
            return rule, m.groups()
    return None


def render(value: Any) -> str:
    """A Python value as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r}")


@dataclass
class Translation:
    overrides: list[str]                       # what Hydra composes
    warnings: list[str]                        # one per warned key
    mapped: list[tuple[str, str]]              # (verl key, our key)


def _unknown(key: str) -> ConfigError:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = schema_keys()
    close = difflib.get_close_matches(key, sorted(_SCHEMA), n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(key, "not a key of fully_async's schema (fully_async/core/config.py) nor of verl's trainer "
                       f"configs (docs/verl_compat.md lists both){hint}")


def translate(overrides: list[str]) -> Translation:
    """Apply the rules to Hydra command-line overrides; raises ConfigError for a refused or unknown key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fully_async.verl.v1 import translate_v1

    parser = OverridesParser.create()
    overrides, warnings, mapped = translate_v1(overrides)
    out: list[str] = []
    engine_served: Optional[str] = None
    for line in overrides:
        ov = parser.parse_overrides([line])[0]
        key = ov.key_or_group
        if ov.is_hydra_override() or ov.package is not None or "/" in key or ov.is_delete():
            out.append(line)
            continue
        open_dict = any(key.startswith(d + ".") for d in OPEN_DICTS)
        found = find_rule(key) if open_dict or not in_schema(key) else None
        if found is None and open_dict:  # verl has some entries (no '+' needed there): add or override
            out.append("++" + line.lstrip("+"))
            continue
        if found is None and in_schema(key):
            served = VALUE_MAPS.get(key, {}).get(str(ov.value()))
            if served is not None:   # a verl value served here by another one (sglang -> vllm)
                engine_served = str(ov.value()) if key == "actor_rollout_ref.rollout.name" else engine_served
                msg = f"{key}={ov.value()} runs as {key}={served[0]}: {served[1]}"
                logger.warning("%s", msg)
                warnings.append(msg)
                line = f"{line.split('=', 1)[0]}={served[0]}"
            if key in SCALAR_AS_LIST and isinstance(ov.value(), str):
                line = f"{line.split('=', 1)[0]}=[{line.split('=', 1)[1]}]"
            if line.startswith("+") and not line.startswith("++"):
                line = "+" + line   # verl adds a key its YAML lacks (+algorithm.filter_groups.metric); ours has it
            out.append(line)
            continue
        if found is None:
            raise _unknown(key)
        rule, groups = found
        if ov.is_sweep_override():
            raise ConfigError(key, "a verl key outside our schema cannot be swept; sweep our key instead")
        value = ov.value()
        raw = line.split("=", 1)[1]
        if rule.status == REFUSED:
            raise ConfigError(key, f"{rule.note}")
        if rule.allowed is not None and not rule.allowed(value):
            raise ConfigError(key, f"{raw} is not supported here ({rule.note}): {rule.refusal}")
        if rule.status == WARNED or (value is None and rule.null_unset):
            msg = f"{key}={raw} is accepted but has no effect here: {rule.note}"
            logger.warning("%s", msg)
            warnings.append(msg)
            continue
        target = rule.target.format(*groups)  # type: ignore[union-attr]
        text = render(rule.convert(value)) if rule.convert else raw
        out.append(f"++{target}={text}")
        mapped.append((key, target))
        logger.info("verl key %s -> %s", key, target)
    _check_overlong_reference(mapped)
    if engine_served is not None:
        out = _drop_engine_ignored(out, engine_served, warnings)
    return Translation(out, warnings, mapped)


def _drop_engine_ignored(out: list[str], engine: str, warnings: list[str]) -> list[str]:
    """A script for an engine served here by vLLM (sglang, trtllm) may set enable_chunked_prefill, which that engine's
    verl server never reads: dropped (warned), so vLLM keeps chunked prefill on and max_num_batched_tokens below the
    longest sequence is not refused for a setting that meant nothing in verl."""
    key = "actor_rollout_ref.rollout.enable_chunked_prefill"
    kept = [line for line in out if line.lstrip("+").split("=", 1)[0] != key]
    if len(kept) < len(out):
        msg = (f"{key} is dropped: verl's {engine} server does not read it, and vLLM, which serves the rollout "
               "here, keeps chunked prefill on (without it a max_num_batched_tokens below the longest sequence is "
               "refused)")
        logger.warning("%s", msg)
        warnings.append(msg)
    return kept


def _check_overlong_reference(mapped: list[tuple[str, str]]) -> None:
    """verl's DAPO reward manager asserts reward_kwargs.max_resp_len is given with reward_kwargs.overlong_buffer_cfg
    (verl/experimental/reward_loop/reward_manager/dapo.py); refused here too, rather than falling back to
    data.max_response_length (which only verl's DAPO recipe, with reward_model.overlong_buffer.*, does)."""
    buffer = [k for k, _ in mapped if ".reward_kwargs.overlong_buffer_cfg." in k]
    if buffer and not any(k.endswith(".reward_kwargs.max_resp_len") for k, _ in mapped):
        prefix = buffer[0].split(".reward_kwargs.")[0]
        raise ConfigError(f"{prefix}.reward_kwargs.max_resp_len",
                          f"{buffer[0]} is set without {prefix}.reward_kwargs.max_resp_len, which verl's DAPO reward "
                          "manager asserts is given (the length the overlong penalty counts from); add it, e.g. "
                          "the data.max_response_length")


def classify(key: str) -> tuple[str, str]:
    """(status, note) of a verl key for the docs: honoured (our schema, same name), mapped (honoured under our
    name), warned, warned with some values refused, or refused."""
    from fully_async.verl.v1 import classify_v1, is_v1_key

    if is_v1_key(key):
        return classify_v1(key)
    open_dict = any(key.startswith(d + ".") for d in OPEN_DICTS)
    found = find_rule(key) if open_dict or not in_schema(key) else None
    if found is None:
        if any(key.startswith(d + ".") for d in OPEN_DICTS):
            return HONOURED, "an entry of an open dict of our schema, passed on as given"
        if in_schema(key):
            return HONOURED, "; ".join(n for n in (DEFAULT_DIFFERENCES.get(key, ""), _mode_note(key)) if n)
        return "unknown", ""
    rule, groups = found
    if rule.status == MAPPED:
        note = f"honoured as `{rule.target.format(*groups)}`" + (f": {rule.note}" if rule.note and not  # type: ignore
                                                                 rule.note.startswith("honoured as") else "")
        if rule.allowed is not None:
            note += f"; other values than {rule.allowed_doc} are refused ({rule.refusal})"
        return MAPPED, note
    if rule.status == WARNED and rule.allowed is not None:
        return WARNED, f"{rule.note}; values other than {rule.allowed_doc} are refused: {rule.refusal}"
    return rule.status, rule.note


def _mode_note(key: str) -> str:
    """Where a key acts, when only in some modes (core/mode_keys.py); elsewhere a warning names it."""
    from fully_async.core.mode_keys import MODE_ONLY

    rule = MODE_ONLY.get(key)
    if rule is None:
        return ""
    where = " and ".join({"sync": "mode=sync", "async": "mode=async", "pool": "a shared device pool"}[m]
                         for m in rule.acts_in)
    return f"acts in {where} only; in the other modes a warning names it ({rule.why})"


def read_tsv(path: str) -> list[tuple[str, str]]:
    """(key, default as JSON text) of every row of verl_config_keys.tsv."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or line.startswith("key\t") or not line.strip():
                continue
            key, default = line.rstrip("\n").split("\t")[:2]
            rows.append((key, default))
    return rows


def read_versions(path: str) -> dict[str, tuple[str, ...]]:
    """{key: the verl versions whose configs have it} (verl_config_keys.tsv's fourth column)."""
    out = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#") or line.startswith("key\t") or not line.strip():
                continue
            cells = line.rstrip("\n").split("\t")
            out[cells[0]] = tuple(cells[3].split(","))
    return out


def schema_default(key: str) -> Any:
    """Our schema's default of `key` (a leaf), interpolations left as written."""
    node: Any = FullyAsyncConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return dataclasses.asdict(node) if dataclasses.is_dataclass(node) else node
