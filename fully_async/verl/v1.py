"""verl 0.9's V1 trainer keys (`trainer.use_v1`, `trainer.v1.*`) on this package's modes and placements (layer 1).

Why a pass of its own: one V1 key sets several of ours, and what it becomes depends on other keys of the same
command line (the trainer mode, data.train_batch_size, ppo_mini_batch_size), which the one-key rules of rules.py
cannot see.  It runs before them (compat.translate) and rewrites the V1 keys into ours; what it cannot honour is
refused here, naming what to use.  What verl 0.9.1 does, read from its code (verl/trainer/ppo/v1/):

* `trainer_mode=sync`: generate a batch, train it, push: our `mode=sync`.
* `trainer_mode=colocate_async` (trainer_colocate_async.py): rollout replicas on the trainer's GPUs; each step
  submits one train batch of prompts, `num_warmup_batches` batches are submitted ahead before the loop; once a
  train batch of groups is complete the unfinished requests are aborted, the replicas sleep, the trainer trains
  the batch (mini-batches of ppo_mini_batch_size), then pushes the weights and the aborted requests resume on them
  (partial rollout).  That is our `async_training.placement=colocated` (`rollout.n_gpus_per_node=0`), one weight
  push per step (`trigger_parameter_sync_step=1`), a step of train_batch_size groups (`require_batches =
  train_batch_size / ppo_mini_batch_size`), `partial_rollout=true`, and `num_warmup_batches` extra train batches
  admitted ahead of the current version (`staleness_threshold=num_warmup_batches`).
* `trainer_mode=separate_async` (trainer_separate_async.py): a standalone rollout pool
  (actor_rollout_ref.rollout.nnodes x n_gpus_per_node), `parameter_sync_step` local updates of ppo_mini_batch_size
  groups per step (verl asserts train_batch_size == parameter_sync_step x ppo_mini_batch_size) and one push per
  step: our split placement with `trigger_parameter_sync_step=parameter_sync_step`, `require_batches=1` and the
  same admission window; `hybrid_rollout.enable_switch=true` (idle trainer GPUs lent to generation, reclaimed for
  the next step) is our `placement=elastic`.
* `sampler.max_off_policy_threshold` T with `max_off_policy_strategy` drop (a finished group spanning more than T
  versions is dropped and a fresh prompt drawn) or wait (the trainer waits while an in-flight group has reached T
  versions): here nothing is dropped and no group's age is capped in versions; the bound is on admission.  T=1
  (either strategy: every trained group comes from one version) is our on-policy setting, `staleness_threshold=0
  partial_rollout=false`; T >= 2 is refused, naming the admission bound to use instead; null (no cap) is warned.
* A key of the colocate_async / separate_async section under another trainer_mode is warned (only that mode's
  trainer reads it); `trainer.v1.sync` and the sampler's custom-sampler / refill options are warned at verl's
  defaults (INERT) and refused otherwise.  classify_v1 says what each V1 key becomes, for docs/verl_compat.md.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional

from fully_async.core.config import ConfigError

logger = logging.getLogger(__name__)

MODES = ("sync", "colocate_async", "separate_async")
V1 = "trainer.v1."
# verl 0.9.1's defaults (verl/trainer/config/ppo_trainer.yaml) of the keys a V1 translation reads
VERL_DEFAULTS = {"data.train_batch_size": 1024, "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
                 "trainer.v1.colocate_async.num_warmup_batches": 1, "trainer.v1.separate_async.num_warmup_batches": 1,
                 "trainer.v1.separate_async.parameter_sync_step": 4,
                 "trainer.v1.separate_async.hybrid_rollout.enable_switch": False,
                 "trainer.v1.sampler.max_off_policy_threshold": 8, "trainer.v1.sampler.max_off_policy_strategy": "drop",
                 "actor_rollout_ref.hybrid_engine": True}
READ = ("trainer.use_v1", "model_engine", "trainer.v1.trainer_mode", *VERL_DEFAULTS)
AGE = ("here no group is dropped and no group's age is capped in versions: the staleness bound limits admission "
       "instead (async_training.staleness_threshold: extra prompts admitted per version, as a fraction of a "
       "version's; trainer.v1.*.num_warmup_batches maps onto it) and fully_async/staleness/max reports the age of "
       "trained groups; port with trainer.v1.sampler.max_off_policy_threshold=null (or 1: on-policy)")
RECLAIM = ("the lent engines are reclaimed as soon as a step's groups are queued (async_training.placement=elastic "
           "has no threshold to tune)")
ENGINES = {"megatron": "megatron", "dp": None}
NO_SAMPLER = "custom samplers and failed-group refill are not implemented: the rollouter draws prompts in data order"
# V1 keys accepted only at verl's default (warned there): key -> (why it has no effect, the refusal otherwise)
INERT = {"trainer.v1.sync": ("verl 0.9.1's sync trainer has no options", "verl 0.9.1's sync trainer has no options"),
         "trainer.v1.sampler.custom_sampler.path": ("verl's default sampler, as here", NO_SAMPLER),
         "trainer.v1.sampler.custom_sampler.name": ("verl's default sampler, as here", NO_SAMPLER),
         "trainer.v1.sampler.sampler_kwargs": ("verl's default sampler, as here", NO_SAMPLER),
         "trainer.v1.sampler.sync_refill_failed_groups": ("no refill of failed groups, verl's default", NO_SAMPLER)}


def is_v1_key(key: str) -> bool:
    return key.startswith(V1) or key in ("trainer.use_v1", "model_engine", "actor_rollout_ref.actor.model_engine")


def _parse(line: str) -> tuple[str, Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ov = OverridesParser.create().parse_overrides([line])[0]
    return ov.key_or_group, ov.value()


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"{value!r}: a positive integer")
    return value


def translate_v1(lines: list[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(overrides with the V1 keys rewritten into ours, warnings, (verl key, our key) pairs); ConfigError for a V1
    setting not honoured here.  Lines without a V1 key pass unchanged (and in order)."""
    parsed = []
    for line in lines:
        try:
            parsed.append((line, *_parse(line)))
        except Exception:            # noqa: BLE001 -- Hydra's own error comes later, naming the override
            parsed.append((line, None, None))
    given = {key.lstrip("+"): value for _, key, value in parsed if key is not None}
    if not any(key is not None and is_v1_key(key.lstrip("+")) for _, key, _ in parsed):
        return lines, [], []
    warnings: list[str] = []
    mapped: list[tuple[str, str]] = []
    ours: dict[str, Any] = {}

    def warn(key: str, why: str) -> None:
        msg = f"{key}={given[key]} is accepted but has no effect here: {why}"
        logger.warning("%s", msg)
        warnings.append(msg)

    def get(key: str) -> Any:
        return given.get(key, VERL_DEFAULTS.get(key))

    for key in ("model_engine", "actor_rollout_ref.actor.model_engine"):
        if key in given:
            engine = given[key]
            if engine not in ENGINES:
                raise ConfigError(key, f"{engine!r}: verl's {engine} engine is not implemented here; use dp (FSDP: "
                                  "actor_rollout_ref.actor.strategy=fsdp|fsdp2) or megatron")
            if ENGINES[engine]:
                ours["actor_rollout_ref.actor.strategy"] = ENGINES[engine]
                mapped.append((key, "actor_rollout_ref.actor.strategy"))
            else:
                warn(key, "verl's FSDP engine: actor_rollout_ref.actor.strategy (fsdp|fsdp2) picks it here")
    if "trainer.use_v1" in given:
        warn("trainer.use_v1", "one trainer implementation here; trainer.v1.trainer_mode (mapped onto mode and "
             "async_training.placement) picks the loop")
    mode = get_mode(given)
    if mode is not None:
        ours.update(_mode_keys(mode, given, get, warn, mapped))
    _off_policy(given, get, mode, ours, warn, mapped)
    for key in given:
        if key in INERT:
            if not _inert(key, given[key]):
                raise ConfigError(key, f"{given[key]!r}: {INERT[key][1]}")
            warn(key, INERT[key][0])
        elif key.startswith(V1) and key not in READ and not _hybrid_tuning(key):
            raise ConfigError(key, "a V1 trainer option with no counterpart here (custom samplers, failed-group "
                              "refill); docs/verl_compat.md lists the V1 keys that map")
        elif _hybrid_tuning(key):
            warn(key, RECLAIM)
        elif mode in (None, "sync") and key.startswith((V1 + "colocate_async.", V1 + "separate_async.")):
            section = key[len(V1):].split(".")[0]
            warn(key, f"read only with trainer.v1.trainer_mode={section} (this script's is {mode or 'sync'}, "
                 "verl's default)")
    out = [line for line, key, _ in parsed if key is None or not _consumed(key.lstrip("+"), mode)]
    out = [f"++{k}={_render(v)}" for k, v in ours.items()] + out
    return out, warnings, mapped


def _inert(key: str, value: Any) -> bool:
    return value is False if key.endswith("refill_failed_groups") else value in (None, {})


def classify_v1(key: str) -> tuple[str, str]:
    """(status, note) of a V1 key for docs/verl_compat.md: mapped, warned or unknown (compat.classify's statuses)."""
    if key in INERT:
        return "warned", f"{INERT[key][0]}; other values are refused: {INERT[key][1]}"
    if key == "trainer.use_v1":
        return "warned", "one trainer implementation here; trainer.v1.trainer_mode picks the loop"
    if key == "trainer.v1.trainer_mode":
        return "mapped", ("sync is mode=sync; colocate_async is async_training.placement=colocated and "
                          "separate_async split (elastic with hybrid_rollout.enable_switch), with the step and "
                          "admission window of the section above")
    if key == "trainer.v1.sampler.max_off_policy_threshold":
        return "warned", ("a no-op with verl's default trainer_mode=sync, as here; with an async trainer_mode 1 is "
                          "staleness_threshold=0 partial_rollout=false, null is warned and >= 2 refused: " + AGE)
    if key == "trainer.v1.sampler.max_off_policy_strategy":
        return "warned", "read with max_off_policy_threshold (drop and wait alike at 1; verl asserts drop|wait)"
    if _hybrid_tuning(key):
        return "warned", RECLAIM
    targets = {"trainer.v1.colocate_async.num_warmup_batches": "async_training.staleness_threshold",
               "trainer.v1.separate_async.num_warmup_batches": "async_training.staleness_threshold",
               "trainer.v1.separate_async.parameter_sync_step": "async_training.trigger_parameter_sync_step",
               "trainer.v1.separate_async.hybrid_rollout.enable_switch": "async_training.placement (elastic)"}
    if key in targets:
        section = key[len(V1):].split(".")[0]
        return "mapped", (f"honoured as `{targets[key]}` with trainer_mode={section}; with another trainer_mode "
                          "a warning names it")
    if is_v1_key(key):
        return "refused", "a V1 trainer option with no counterpart here"
    return "unknown", ""


def mode_reading(key: str) -> Optional[str]:
    """The trainer_mode whose section holds `key` (None for keys read in every mode)."""
    section = key[len(V1):].split(".")[0] if key.startswith(V1) else ""
    return section if section in MODES[1:] else None


def get_mode(given: dict[str, Any]) -> Optional[str]:
    mode = given.get("trainer.v1.trainer_mode")
    if mode is None:
        return None
    if mode not in MODES:
        raise ConfigError("trainer.v1.trainer_mode", f"{mode!r} is not one of {list(MODES)} (verl 0.9.1's modes)")
    return mode


def _hybrid_tuning(key: str) -> bool:
    return key.startswith("trainer.v1.separate_async.hybrid_rollout.") and not key.endswith(".enable_switch")


def _consumed(key: str, mode: Optional[str]) -> bool:
    """A key the V1 pass replaced by ours (data.train_batch_size only where it became require_batches)."""
    if key == "data.train_batch_size":
        return mode in ("colocate_async", "separate_async")
    return is_v1_key(key)


def _mode_keys(mode: str, given: dict[str, Any], get: Any, warn: Any, mapped: list) -> dict[str, Any]:
    key = "trainer.v1.trainer_mode"
    if mode == "sync":
        mapped.append((key, "mode"))
        return {"mode": "sync"}
    batch = _positive_int("data.train_batch_size", get("data.train_batch_size"))
    mini = _positive_int("actor_rollout_ref.actor.ppo_mini_batch_size",
                         get("actor_rollout_ref.actor.ppo_mini_batch_size"))
    section = V1 + mode + "."
    warmup = get(section + "num_warmup_batches")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not math.isfinite(warmup) or warmup < 0:
        raise ConfigError(section + "num_warmup_batches", f"{warmup!r}: a number >= 0 (train batches submitted ahead)")
    other = V1 + ("separate_async." if mode == "colocate_async" else "colocate_async.")
    for k in given:
        if k.startswith(other) and not _hybrid_tuning(k):
            warn(k, f"read only with trainer.v1.trainer_mode={other[len(V1):-1]} (this script's is {mode})")
    keys: dict[str, Any] = {"mode": "async", "async_training.staleness_threshold": float(warmup),
                            "async_training.partial_rollout": True}
    if mode == "colocate_async":
        if batch % mini:
            raise ConfigError("data.train_batch_size", f"{batch} is not a multiple of "
                              f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}: a colocate_async step trains "
                              "train_batch_size groups in mini-batches (async_training.require_batches here)")
        keys.update({"async_training.placement": "colocated", "rollout.n_gpus_per_node": 0,
                     "async_training.trigger_parameter_sync_step": 1, "async_training.require_batches": batch // mini})
    else:
        sync_step = _positive_int(section + "parameter_sync_step", get(section + "parameter_sync_step"))
        if batch != sync_step * mini:
            raise ConfigError("data.train_batch_size", f"{batch} != {section}parameter_sync_step x "
                              f"ppo_mini_batch_size = {sync_step} x {mini} (verl's separate_async asserts it)")
        elastic = bool(get(section + "hybrid_rollout.enable_switch")) and bool(get("actor_rollout_ref.hybrid_engine"))
        keys.update({"async_training.placement": "elastic" if elastic else "split",
                     "async_training.trigger_parameter_sync_step": sync_step, "async_training.require_batches": 1})
        if section + "parameter_sync_step" in given:
            mapped.append((section + "parameter_sync_step", "async_training.trigger_parameter_sync_step"))
        if section + "hybrid_rollout.enable_switch" in given:
            mapped.append((section + "hybrid_rollout.enable_switch", "async_training.placement"))
    mapped += [(key, "mode"), (key, "async_training.placement"), ("data.train_batch_size",
                                                                   "async_training.require_batches")]
    if section + "num_warmup_batches" in given:
        mapped.append((section + "num_warmup_batches", "async_training.staleness_threshold"))
    return keys


def _off_policy(given: dict[str, Any], get: Any, mode: Optional[str], ours: dict[str, Any], warn: Any,
                mapped: list) -> None:
    t_key, s_key = "trainer.v1.sampler.max_off_policy_threshold", "trainer.v1.sampler.max_off_policy_strategy"
    strategy = get(s_key)
    if strategy not in ("drop", "wait"):
        raise ConfigError(s_key, f"{strategy!r} is not one of ['drop', 'wait'] (verl asserts it)")
    if t_key not in given:
        if s_key in given:
            warn(s_key, "read with trainer.v1.sampler.max_off_policy_threshold, which this script does not set")
        return
    threshold = given[t_key]
    if threshold is None:
        warn(t_key, "no cap on the versions a group spans, as here (the staleness bound limits admission only)")
        if s_key in given:
            warn(s_key, "read only with a max_off_policy_threshold")
        return
    _positive_int(t_key, threshold)
    if mode in (None, "sync"):
        warn(t_key, "verl's sync trainer is on-policy, so the threshold is a no-op there, as here")
        if s_key in given:
            warn(s_key, "a no-op for the sync trainer")
        return
    if threshold > 1:
        what = "drops finished groups" if strategy == "drop" else "waits for in-flight groups"
        raise ConfigError(t_key, f"{threshold} with max_off_policy_strategy={strategy} (verl {what} older than "
                          f"{threshold} versions): {AGE}")
    ours.update({"async_training.staleness_threshold": 0.0, "async_training.partial_rollout": False})
    mapped.append((t_key, "async_training.staleness_threshold"))
    if given.get(V1 + mode + ".num_warmup_batches", 0):
        warn(V1 + mode + ".num_warmup_batches", "max_off_policy_threshold=1 trains only groups generated on one "
             "version (async_training.staleness_threshold=0), so no batch is admitted ahead")


def _render(value: Any) -> str:
    from fully_async.verl.compat import render

    return render(value)
