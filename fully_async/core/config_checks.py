"""The one validation pass over the config (layer 0) that runs before Ray starts and before any data or model is
read: what types cannot express (ranges, choices, cross-field rules), raising `ConfigError` naming the key and the
valid values.  One function per section of the schema (`core/config.py`), then the checks that relate sections;
`validate_with_data` adds the ones that need the dataset's size."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import typing
from typing import Any

from fully_async.core.config import (POLICY_LOSS_MODES, ATTN_IMPLEMENTATIONS, DEVICES, DTYPES, KL_TYPES,
                                     LOGGERS, LOSS_AGG_MODES, LR_SCHEDULER_TYPES, MODES, PROFILER_CONTENTS,
                                     PROFILER_TOOLS, PROFILER_TOOLS_WARNED, RESUME_STATE_KEYS,
                                     REWARD_MANAGERS, ROLLOUT_NAMES, STRATEGIES, TRUNCATIONS, ConfigError, as_file_list,
                                     overlong_reference_length)
from fully_async.core.rollout_checks import check_multi_turn, check_prefill_budget, check_quantization
from fully_async.core.algorithm_checks import (_at_least, _choice, check_algorithm, check_filter_groups,
                                               check_grpo_group, check_reward_model, check_rollout_correction)
from fully_async.core.plan import RunPlan
from fully_async.core.placement_checks import (check_multi_job, check_placement, check_rollout_devices,
                                               check_rollout_layout, device_ipc_applies)
from fully_async.core.lora_targets import LORA_A_INITS, TargetError, megatron_targets

logger = logging.getLogger(__name__)


def validate(cfg: Any) -> None:
    """Checks that need no data and no model; raises ConfigError naming the key.  Each section is checked by its
    own function, then the checks that relate sections (each a small named function).  NaN and inf first: every
    range check below compares, and a comparison with NaN is false."""
    check_finite(cfg)
    for check in SECTION_CHECKS + CROSS_SECTION_CHECKS:
        check(cfg)


# ------------------------------------------------------------------ finite numbers, by a walk over the schema
def _numbers(schema: type, node: Any, prefix: str) -> typing.Iterator[tuple[str, Any]]:
    """(key, value) of every number under `node`: the schema's fields (`FullyAsyncConfig` and its sections), and
    whatever a free-form field (a dict or a list: override_config, engine kwargs) holds."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        value = node.get(f.name) if isinstance(node, dict) else getattr(node, f.name, None)
        sub = next((t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)),
                   None)
        if sub is not None and value is not None:
            yield from _numbers(sub, value, key + ".")
        else:
            yield from _loose_numbers(value, key)


def _loose_numbers(value: Any, key: str) -> typing.Iterator[tuple[str, Any]]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield key, value
    elif hasattr(value, "items"):
        for k, v in value.items():
            yield from _loose_numbers(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        for i, v in enumerate(value):
            yield from _loose_numbers(v, f"{key}[{i}]")


def check_finite(cfg: Any) -> None:
    """Every number of the config is finite: NaN passes every range check (a comparison with NaN is false) and
    inf turns a timeout or a bound off; both fail late, inside an actor, without the key.  ConfigError names the
    first key that is not."""
    from fully_async.core.config import FullyAsyncConfig

    for key, value in _numbers(FullyAsyncConfig, cfg, ""):
        if not math.isfinite(value):
            raise ConfigError(key, f"{value!r} is not a finite number (NaN and inf are refused; give a number, or "
                              "null where the key allows it)")


# ------------------------------------------------------------------ keys the chosen mode does not read
def inert_overrides(cfg: Any, overrides: list[str]) -> list[str]:
    """The command-line keys (`key=value`, `+key=value`) that do nothing with this config: `async_training.*` in
    sync mode, `actor_rollout_ref.actor.megatron.*` unless strategy=megatron, `critic.*` without a critic.  Each is
    logged as a warning naming the key and why; returned for callers that report them (the doctor)."""
    rules = []
    if cfg.mode == "sync":
        rules.append(("async_training.", "mode=sync runs the colocated synchronous loop: async_training.* is read "
                                         "only in async mode"))
    if cfg.actor_rollout_ref.actor.strategy != "megatron":
        rules.append(("actor_rollout_ref.actor.megatron.",
                      f"actor_rollout_ref.actor.strategy={cfg.actor_rollout_ref.actor.strategy}: the megatron "
                      "layout is read only with strategy=megatron"))
    rules += _inert_policy_loss_keys(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
    from fully_async.core.config import uses_critic

    if not uses_critic(cfg):
        rules.append(("critic.", f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains no critic: "
                                 "critic.* is read only with adv_estimator=gae or critic.enable=true"))
    found = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        for prefix, why in rules:
            if key.startswith(prefix):
                found.append(f"{key} has no effect: {why}")
                logger.warning("%s", found[-1])
    return found


# the parameters only some policy_loss.loss_modes read (algorithms/policy_losses.py): key prefix -> those modes
_POLICY_LOSS_KEYS = {"actor_rollout_ref.actor.clip_ratio_c": ("vanilla", "dppo_tv", "dppo_kl"),
                     "actor_rollout_ref.actor.policy_loss.clip_cov_": ("clip_cov",),
                     "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": ("kl_cov",),
                     "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": ("kl_cov",),
                     "actor_rollout_ref.actor.tau_": ("sapo",),
                     "actor_rollout_ref.actor.policy_loss.dro_beta": ("dro",)}


def _inert_policy_loss_keys(loss_mode: str) -> list[tuple[str, str]]:
    return [(prefix, f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: it is read only by loss_mode="
                     f"{'/'.join(modes)}")
            for prefix, modes in _POLICY_LOSS_KEYS.items() if loss_mode not in modes]


# ------------------------------------------------------------------ one function per section
def _check_mode(cfg: Any) -> None:
    _choice("mode", cfg.mode, MODES)


def _check_trainer(cfg: Any) -> None:
    t = cfg.trainer
    _choice("trainer.device", t.device, DEVICES)
    for name in t.logger:
        _choice("trainer.logger", name, LOGGERS)
    _choice("trainer.resume_mode", t.resume_mode, ("auto", "disable", "resume_path"))
    if t.resume_mode == "resume_path":
        path = t.resume_from_path
        if not path or not os.path.isfile(os.path.join(path, "trainer_state.json")):
            raise ConfigError("trainer.resume_from_path", f"{path!r} is not a checkpoint folder (global_step_<v> "
                              "with trainer_state.json) as trainer.resume_mode=resume_path requires")
    unknown = [k for k in t.resume_allow_config_change if k not in RESUME_STATE_KEYS]
    if unknown:
        raise ConfigError("trainer.resume_allow_config_change", f"{unknown} are not keys checked on resume; those "
                          f"are {list(RESUME_STATE_KEYS)} (other keys may change freely)")
    if t.max_ckpt_to_keep is not None:
        _at_least("trainer.max_ckpt_to_keep", t.max_ckpt_to_keep, 1)
    _at_least("trainer.progress_timeout_s", t.progress_timeout_s, 0.0, strict=True)
    _at_least("trainer.max_bad_steps", t.max_bad_steps, 1)
    if t.device_peak_tflops is not None:
        _at_least("trainer.device_peak_tflops", t.device_peak_tflops, 0.0, strict=True)
    for key in ("nnodes", "n_gpus_per_node", "total_epochs"):
        _at_least(f"trainer.{key}", getattr(t, key), 1)
    if t.total_training_steps is not None:
        _at_least("trainer.total_training_steps", t.total_training_steps, 1)
    _check_val_generations(cfg)
    if t.val_only and not t.val_before_train:
        logger.warning("trainer.val_only=true has no effect: it ends the run after the validation before training, "
                       "and trainer.val_before_train=false skips that validation (verl's rule): the run trains")
    elif t.val_only and not cfg.data.val_files:
        raise ConfigError("trainer.val_only", "a validation-only run needs validation data: data.val_files is not set")


def _check_writable_dir(key: str, path: Any) -> None:
    """`path` (unset: nothing to check) is a directory this user can create or write; not created here."""
    if not path:
        return
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(key, f"{path} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{path} cannot be written: {parent} is not writable by this user")


def _check_profiler(cfg: Any) -> None:
    """global_profiler (verl's keys): the trainer device's own profiler around the listed steps.  verl's tools that
    need its launcher (nsys: workers started under Nsight; torch_memory) are warned, nothing profiled; a step list
    without a tool, or a tool without steps, profiles nothing, as in verl, and is named."""
    gp = cfg.global_profiler
    if gp.tool in PROFILER_TOOLS_WARNED:
        logger.warning("global_profiler.tool=%s has no effect here: nothing is profiled (global_profiler.tool=torch "
                       "profiles the trainer's steps with the device's own profiler, torch_npu's on an NPU)", gp.tool)
        return
    if gp.tool is not None:
        _choice("global_profiler.tool", gp.tool, PROFILER_TOOLS + PROFILER_TOOLS_WARNED)
    steps = list(gp.steps or [])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
        raise ConfigError("global_profiler.steps", f"{steps!r}: the trainer's global steps to profile, integers from "
                          "1 (the first step)")
    total = cfg.trainer.total_training_steps
    if gp.tool is None and steps:
        logger.warning("global_profiler.steps=%s has no effect: global_profiler.tool is null (torch or npu "
                       "profiles them)", steps)
    elif gp.tool is not None and not steps:
        logger.warning("global_profiler.tool=%s has no effect: global_profiler.steps lists no step", gp.tool)
    elif gp.tool is not None and total is not None and max(steps) > total:
        logger.warning("global_profiler.steps=%s: steps after trainer.total_training_steps=%d never run", steps, total)
    if gp.tool is not None and steps:
        _check_writable_dir("global_profiler.save_path", gp.save_path)
    valid = PROFILER_CONTENTS.get(gp.tool or "torch", ())
    for item in gp.contents or ():
        if item not in valid:
            raise ConfigError("global_profiler.contents", f"{item!r} is not one of {list(valid)} (the "
                              f"{gp.tool or 'torch'} profiler's contents, as verl's tool_config.{gp.tool or 'torch'}"
                              ".contents)")


TEXT_SINKS = ("tensorboard", "wandb", "swanlab", "mlflow")   # the trainer.logger sinks that show generations


def _check_val_generations(cfg: Any) -> None:
    """trainer.log_val_generations / validation_data_dir / rollout_data_dir (telemetry/generations.py): a count of
    at least 0; directories this user can create or write; each named when nothing would show or need it."""
    t = cfg.trainer
    _at_least("trainer.log_val_generations", t.log_val_generations, 0)
    if t.log_val_generations and not any(name in TEXT_SINKS for name in t.logger):
        logger.warning("trainer.log_val_generations=%s has no effect: none of trainer.logger=%s shows generations "
                       "(%s do)", t.log_val_generations, list(t.logger), ", ".join(TEXT_SINKS))
    for key in ("validation_data_dir", "rollout_data_dir"):
        _check_writable_dir(f"trainer.{key}", getattr(t, key))
    if (t.log_val_generations or t.validation_data_dir) and not cfg.data.val_files:
        logger.warning("trainer.log_val_generations / trainer.validation_data_dir have no effect: data.val_files is "
                       "not set, so nothing is validated")


def _check_data(cfg: Any) -> None:
    data = cfg.data
    _choice("data.truncation", data.truncation, TRUNCATIONS)
    _at_least("data.max_prompt_length", data.max_prompt_length, 1)
    _at_least("data.max_response_length", data.max_response_length, 1)
    train_files = as_file_list(data.train_files)
    if not train_files:
        raise ConfigError("data.train_files", "no training file given")
    from fully_async.core.data import path_problem

    custom = data.custom_cls
    if custom.path or custom.name:
        if not (custom.path and custom.name):
            raise ConfigError("data.custom_cls", f"path={custom.path!r} and name={custom.name!r}: both are needed (a "
                              "python file and the callable in it that makes the rows)")
        if not os.path.isfile(custom.path):
            raise ConfigError("data.custom_cls.path", f"file not found: {custom.path}")
        return   # the files are the callable's to read (verl's custom classes take dataset folders too)
    for key, files in (("data.train_files", train_files), ("data.val_files", as_file_list(data.val_files))):
        for path in files:
            if not os.path.lexists(path):
                raise ConfigError(key, f"file not found: {path}")
            problem = path_problem(path)
            if problem:
                raise ConfigError(key, problem)
            if not path.endswith((".parquet", ".jsonl", ".json")):
                raise ConfigError(key, f"{path}: expected a .parquet or .jsonl file")


def _check_model(cfg: Any) -> None:
    model_path = cfg.actor_rollout_ref.model.path
    if not os.path.isdir(model_path) or not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ConfigError("actor_rollout_ref.model.path",
                          f"{model_path!r} is not a local Hugging Face model folder (no config.json); "
                          "download the model first (this package never fetches weights at run time)")
    model = cfg.actor_rollout_ref.model
    _at_least("actor_rollout_ref.model.lora_rank", model.lora_rank, 0)
    if model.lora_rank:
        _at_least("actor_rollout_ref.model.lora_alpha", model.lora_alpha, 0.0, strict=True)
    if model.lora_A_init_method is not None:
        _choice("actor_rollout_ref.model.lora_A_init_method", model.lora_A_init_method, LORA_A_INITS)
    if model.lora_rank and cfg.actor_rollout_ref.actor.strategy == "megatron":
        try:
            megatron_targets(model.target_modules, model.exclude_modules)
        except TargetError as exc:
            raise ConfigError(f"actor_rollout_ref.model.{exc.key}", exc.message) from None


def _check_actor(cfg: Any) -> None:
    actor = cfg.actor_rollout_ref.actor
    _choice("actor_rollout_ref.actor.strategy", actor.strategy, STRATEGIES)
    _choice("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    _choice("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, KL_TYPES)
    _choice("actor_rollout_ref.actor.dtype", actor.dtype, DTYPES)
    _at_least("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size, 1)
    _at_least("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs, 1)
    _check_optim("actor_rollout_ref.actor.optim", actor.optim)
    _at_least("actor_rollout_ref.actor.grad_clip", actor.grad_clip, 0.0, strict=True)
    _at_least("actor_rollout_ref.actor.clip_ratio_c", actor.clip_ratio_c, 1.0, strict=True)
    _check_policy_loss(actor)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        if value is not None:
            _at_least(f"actor_rollout_ref.actor.{key}", value, 0.0, strict=True)
    if actor.loss_scale_factor is not None:
        _at_least("actor_rollout_ref.actor.loss_scale_factor", actor.loss_scale_factor, 0, strict=True)
    if actor.ppo_micro_batch_size_per_gpu is not None:  # larger than a mini-batch just means one micro-batch
        _at_least("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu, 1)


def _check_policy_loss(actor: Any) -> None:
    """actor.policy_loss.* and SAPO's temperatures (algorithms/policy_losses.py)."""
    pl, key = actor.policy_loss, "actor_rollout_ref.actor.policy_loss"
    _choice(f"{key}.loss_mode", pl.loss_mode, POLICY_LOSS_MODES)
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        if not 0.0 < getattr(pl, name) <= 1.0:
            raise ConfigError(f"{key}.{name}", f"{getattr(pl, name)!r} must be in (0, 1] (a fraction of the tokens)")
    if pl.clip_cov_lb >= pl.clip_cov_ub:
        raise ConfigError(f"{key}.clip_cov_lb", f"{pl.clip_cov_lb!r} must be below clip_cov_ub={pl.clip_cov_ub!r}")
    _at_least(f"{key}.ppo_kl_coef", pl.ppo_kl_coef, 0.0)
    if pl.loss_mode == "dro" and (pl.dro_beta is None or not pl.dro_beta > 0):
        raise ConfigError(f"{key}.dro_beta", f"{pl.dro_beta!r}: loss_mode=dro needs a positive coefficient of its "
                          "quadratic log-ratio penalty (verl has no default), e.g. dro_beta=0.1")
    _at_least("actor_rollout_ref.actor.tau_pos", actor.tau_pos, 0.0, strict=True)
    _at_least("actor_rollout_ref.actor.tau_neg", actor.tau_neg, 0.0, strict=True)


def _check_optim(prefix: str, optim: Any) -> None:
    """An optimizer section (the actor's, the critic's): lr, schedule type, cosine floor and cycles."""
    _at_least(f"{prefix}.lr", optim.lr, 0.0)
    _choice(f"{prefix}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULER_TYPES)
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"{prefix}.min_lr_ratio", f"{optim.min_lr_ratio!r} must be in [0, 1] (a fraction of "
                          "optim.lr)")
    _at_least(f"{prefix}.num_cycles", optim.num_cycles, 0.0, strict=True)


def _check_critic(cfg: Any) -> None:
    """The critic section, read only when a critic is trained (uses_critic); algorithm.gamma / lam, and
    trainer.critic_warmup, whose meaning needs a critic."""
    from fully_async.core.config import uses_critic

    alg, critic = cfg.algorithm, cfg.critic
    if alg.adv_estimator == "gae" and critic.enable is False:
        raise ConfigError("critic.enable", "false, but algorithm.adv_estimator=gae needs a value model: set "
                          "critic.enable=true (or null) or use algorithm.adv_estimator=grpo")
    if not 0.0 <= alg.lam <= 1.0:
        raise ConfigError("algorithm.lam", f"{alg.lam!r} must be in [0, 1]")
    _at_least("trainer.critic_warmup", cfg.trainer.critic_warmup, 0)
    if not uses_critic(cfg):
        if cfg.trainer.critic_warmup > 0:
            raise ConfigError("trainer.critic_warmup", "there is no critic to warm up (algorithm.adv_estimator="
                              f"{alg.adv_estimator}, critic.enable={critic.enable}); use 0")
        return
    megatron = cfg.actor_rollout_ref.actor.strategy == "megatron"
    if megatron != (critic.strategy == "megatron"):
        actor = cfg.actor_rollout_ref.actor.strategy
        raise ConfigError("critic.strategy", f"{critic.strategy!r} with actor_rollout_ref.actor.strategy={actor}: the "
                          "critic is built by the actor's backend, so both are megatron or neither is (set "
                          f"critic.strategy={'megatron' if megatron else 'fsdp'})")
    _choice("critic.strategy", critic.strategy, ("fsdp", "torch", "fsdp2", "megatron"))
    _check_optim("critic.optim", critic.optim)
    _choice("critic.loss_agg_mode", critic.loss_agg_mode, LOSS_AGG_MODES)
    _at_least("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size, 1)
    _at_least("critic.ppo_epochs", critic.ppo_epochs, 1)
    _at_least("critic.cliprange_value", critic.cliprange_value, 0.0)
    _at_least("critic.grad_clip", critic.grad_clip, 0.0, strict=True)
    for key in ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"):
        if getattr(critic, key) is not None:
            _at_least(f"critic.{key}", getattr(critic, key), 1)
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    sp = max(1, cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size)   # the critic runs at the actor's
    for key in ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"):
        if critic.use_dynamic_bsz and getattr(critic, key) * sp < need:
            raise ConfigError(f"critic.{key}", f"{getattr(critic, key)}{_times_sp(sp)} cannot hold one sequence of "
                              f"max_prompt_length + max_response_length = {need} tokens")


def _times_sp(sp: int) -> str:
    return f" x ulysses_sequence_parallel_size={sp}" if sp > 1 else ""


def _check_rollout(cfg: Any) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    if ":" not in rollout.name:  # "package.module:Class" plugs in a user engine with HFEngine's constructor
        _choice("actor_rollout_ref.rollout.name", rollout.name, ROLLOUT_NAMES)
    _choice("actor_rollout_ref.rollout.dtype", rollout.dtype, DTYPES)
    _at_least("actor_rollout_ref.rollout.n", rollout.n, 1)
    _at_least("actor_rollout_ref.rollout.temperature", rollout.temperature, 0.0)
    if rollout.max_num_seqs is not None:
        _at_least("actor_rollout_ref.rollout.max_num_seqs", rollout.max_num_seqs, 1)
    sizes = rollout.cudagraph_capture_sizes
    if sizes is not None and (not sizes or any(not isinstance(b, int) or b < 1 for b in sizes)):
        raise ConfigError("actor_rollout_ref.rollout.cudagraph_capture_sizes",
                          f"{list(sizes)} must be a non-empty list of batch sizes >= 1 (each at most max_num_seqs), "
                          "or null for the engine's default buckets")
    if sizes is not None and rollout.max_num_seqs is not None and max(sizes) > rollout.max_num_seqs:
        raise ConfigError("actor_rollout_ref.rollout.cudagraph_capture_sizes",
                          f"{list(sizes)} must be a non-empty list of batch sizes in [1, max_num_seqs="
                          f"{rollout.max_num_seqs}], or null for the engine's default buckets")
    if not 0.0 < rollout.top_p <= 1.0:
        raise ConfigError("actor_rollout_ref.rollout.top_p", f"{rollout.top_p} must be in (0, 1]")
    if rollout.top_k == 0 or rollout.top_k < -1:
        raise ConfigError("actor_rollout_ref.rollout.top_k", f"{rollout.top_k} must be -1 (off) or >= 1")
    _at_least("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n, 1)
    if not rollout.calculate_log_probs:
        logger.warning("actor_rollout_ref.rollout.calculate_log_probs=false has no effect: the engines always "
                       "return the behaviour log-probs (partial rollouts and decoupled PPO need them)")
    _choice("actor_rollout_ref.rollout.weight_sync", rollout.weight_sync,
            ("auto", "object_store", "collective", "device_ipc"))
    if rollout.weight_sync == "device_ipc" and cfg.mode == "async" and not device_ipc_applies(cfg):
        raise ConfigError("actor_rollout_ref.rollout.weight_sync", "device_ipc shares each trainer rank's weights with "
                          "the engine on the same CUDA device: only mode=async async_training.placement=colocated "
                          "trainer.device=cuda on one node (trainer.nnodes=1), a strategy whose ranks gather full "
                          "parameters (torch, fsdp, fsdp2; not megatron) and the embedded engine (rollout.name=hf); "
                          "use auto, object_store or collective")
    _at_least("actor_rollout_ref.rollout.update_weights_bucket_megabytes", rollout.update_weights_bucket_megabytes, 1)
    _choice("actor_rollout_ref.rollout.pause_mode", rollout.pause_mode, ("abort", "keep"))
    if rollout.pause_mode == "keep" and cfg.mode == "async" and not cfg.async_training.partial_rollout:
        logger.warning("actor_rollout_ref.rollout.pause_mode=keep has no effect with async_training.partial_rollout="
                       "false: in-flight work finishes on the old weights before an update")
    check_quantization(cfg)
    check_multi_turn(cfg)
    check_prefill_budget(cfg)
    if rollout.name == "vllm":
        _choice("actor_rollout_ref.rollout.load_format", rollout.load_format, ("auto", "dummy", "safetensors", "pt"))
        if not 0.0 < rollout.gpu_memory_utilization <= 1.0:
            raise ConfigError("actor_rollout_ref.rollout.gpu_memory_utilization",
                              f"{rollout.gpu_memory_utilization} must be in (0, 1]")


def _warn_pure_low_precision(cfg: Any) -> None:
    """strategy=torch in bf16/fp16 keeps its parameters and AdamW states in that dtype: say so (verl trains over
    float32 master weights, as verl's `fsdp` does here on one device too: config.fsdp_backend)."""
    from fully_async.core.config import actor_strategy

    dtype = cfg.actor_rollout_ref.actor.dtype
    if dtype != "float32" and actor_strategy(cfg) == "torch":
        logger.warning("actor_rollout_ref.actor.dtype=%s with actor.strategy=torch: parameters and AdamW states are "
                       "%s, so updates much smaller than the weights round away (lr 1e-6: most do); verl keeps "
                       "float32 master weights. Use actor.strategy=fsdp or fsdp2 (float32 masters, %s compute) or "
                       "actor.dtype=float32", dtype, dtype, dtype)


def _check_async_training(cfg: Any) -> None:
    at = cfg.async_training
    _at_least("async_training.staleness_threshold", at.staleness_threshold, 0.0)
    _at_least("async_training.trigger_parameter_sync_step", at.trigger_parameter_sync_step, 1)
    _at_least("async_training.require_batches", at.require_batches, 1)
    _at_least("async_training.behav_imp_weight_cap", at.behav_imp_weight_cap, 1.0)
    if at.decoupled_ppo and not at.use_rollout_log_probs:
        # decoupled PPO needs the behaviour log-probs next to the recomputed proximal ones
        raise ConfigError("async_training.decoupled_ppo",
                          "needs async_training.use_rollout_log_probs=true (the behaviour policy)")
    check_placement(cfg)


def _check_reward(cfg: Any) -> None:
    _choice("reward_model.reward_manager", cfg.reward_model.reward_manager, REWARD_MANAGERS)
    if cfg.reward_model.timeout_s is not None:
        _at_least("reward_model.timeout_s", cfg.reward_model.timeout_s, 0.0)
    path = cfg.custom_reward_function.path
    if path is not None and not os.path.isfile(path):
        raise ConfigError("custom_reward_function.path", f"file not found: {path}")
    sandbox = cfg.reward_model.sandbox_fusion
    if sandbox.url is not None and not str(sandbox.url).startswith(("http://", "https://")):
        raise ConfigError("reward_model.sandbox_fusion.url", f"{sandbox.url!r}: give the SandboxFusion service's "
                          "run_code endpoint as an http:// or https:// URL (e.g. http://localhost:8080/run_code)")
    _at_least("reward_model.sandbox_fusion.max_concurrent", sandbox.max_concurrent, 1)
    _at_least("reward_model.sandbox_fusion.memory_limit_mb", sandbox.memory_limit_mb, 1)


def _check_benchmark(cfg: Any) -> None:
    if cfg.benchmark.response_length != "none":
        from fully_async.core.workload import validate_config as validate_workload
        validate_workload(cfg)


# ------------------------------------------------------------------ checks that relate sections
def _check_sequence_budgets(cfg: Any) -> None:
    """A dynamic micro-batch and the vLLM context must hold one whole sequence."""
    arr = cfg.actor_rollout_ref
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    sp = max(1, arr.actor.ulysses_sequence_parallel_size)   # a sequence-parallel group shares its devices' budgets
    if arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu * sp < need:
        raise ConfigError("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                          f"{arr.actor.ppo_max_token_len_per_gpu}{_times_sp(sp)} cannot hold one sequence of "
                          f"max_prompt_length + max_response_length = {need} tokens")
    if arr.rollout.name == "vllm" and arr.rollout.max_model_len is not None and arr.rollout.max_model_len < need:
        raise ConfigError("actor_rollout_ref.rollout.max_model_len",
                          f"{arr.rollout.max_model_len} < max_prompt_length + max_response_length = {need}")


def _check_sync_batch(cfg: Any) -> None:
    if cfg.mode != "sync":
        _warn_async_train_batch_size(cfg)
        _warn_async_offload(cfg)
        return
    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    _at_least("data.train_batch_size", cfg.data.train_batch_size, 1)
    if cfg.data.train_batch_size % mini:
        raise ConfigError("data.train_batch_size", f"{cfg.data.train_batch_size} prompts per step must be a "
                          f"multiple of actor_rollout_ref.actor.ppo_mini_batch_size={mini}")


def _warn_async_offload(cfg: Any) -> None:
    """fsdp_config.{param,optimizer}_offload (and megatron.*_offload, mapped onto them) act between phases, as verl's:
    sync mode, colocated async and a shared device pool offload while the engine generates; async mode with dedicated
    devices has no such phase, so there they are named once rather than passed over in silence, with the key that
    keeps FSDP2's shards in host memory while training (offload_policy, verl's)."""
    off = cfg.actor_rollout_ref.actor.fsdp_config
    if cfg.mode == "sync" or cfg.multi_job.pool is not None or cfg.async_training.placement == "colocated":
        return   # (colocated async: the trainer offloads while the engines generate on its devices)
    for key in ("param_offload", "optimizer_offload"):
        if getattr(off, key):
            logger.warning("actor_rollout_ref.actor.fsdp_config.%s=true has no effect in async mode with dedicated "
                           "trainer devices (nothing offloads between phases); it acts in mode=sync, in colocated "
                           "async (async_training.placement=colocated) and on a shared device pool (multi_job.pool). "
                           "To keep strategy=fsdp2's shards and optimizer states in host memory while training, set "
                           "actor_rollout_ref.actor.fsdp_config.offload_policy=true (verl's key)", key)


def _warn_async_train_batch_size(cfg: Any) -> None:
    """verl's fully-async rollouter asserts data.train_batch_size == 0: a step there (and here) is
    ppo_mini_batch_size x require_batches prompt groups.  A value other than 0, verl's default (1024) or that
    step size would be read as a step size by someone, so it is named once."""
    from fully_async.core.config import DataConfig

    groups = RunPlan.of(cfg).groups_per_step
    size = cfg.data.train_batch_size
    if size not in (0, DataConfig.train_batch_size, groups):
        logger.warning("data.train_batch_size=%s has no effect in async mode: a trainer step is "
                       "actor_rollout_ref.actor.ppo_mini_batch_size x async_training.require_batches = %d prompt "
                       "groups (verl's fully-async trainer requires train_batch_size=0)", size, groups)


def _warn_inert_keys(cfg: Any) -> None:
    """Keys that act only in other modes (core/mode_keys.py), named once each."""
    from fully_async.core.mode_keys import inert_keys, run_mode

    mode = run_mode(cfg)
    for key, value, why in inert_keys(cfg):
        where = "on a shared device pool (multi_job.pool)" if mode == "pool" else f"in {mode} mode"
        logger.warning("%s=%s has no effect %s: %s", key, value, where, why)


def _check_trainer_world(cfg: Any) -> None:
    """The strategy fits the trainer's device count, and every data-parallel rank gets a response."""
    actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    world = RunPlan.of(cfg).trainer_devices
    if world > 1 and actor.strategy == "torch":
        raise ConfigError("actor_rollout_ref.actor.strategy",
                          f"strategy=torch trains on one device but the trainer has {world} "
                          "(trainer.nnodes x trainer.n_gpus_per_node); use strategy=fsdp2 or megatron")
    if actor.strategy == "megatron":
        _validate_megatron(cfg, world)
    fsdp_size = actor.fsdp_config.fsdp_size
    if fsdp_size != -1 and (fsdp_size < 1 or world % fsdp_size):
        raise ConfigError("actor_rollout_ref.actor.fsdp_config.fsdp_size",
                          f"{fsdp_size} must divide the trainer world size {world} (trainer.nnodes x "
                          "trainer.n_gpus_per_node): hybrid sharding groups of that many ranks; or -1 to shard over "
                          "all of them")
    from fully_async.core.config import actor_strategy

    if fsdp_size not in (-1, world) and actor_strategy(cfg) != "fsdp2":
        logger.warning("actor_rollout_ref.actor.fsdp_config.fsdp_size=%s has no effect with strategy %s (FSDP2's "
                       "hybrid sharding)", fsdp_size, actor_strategy(cfg))
    if actor.fsdp_config.reshard_after_forward is False and actor_strategy(cfg) != "fsdp2":
        logger.warning("actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false has no effect with strategy "
                       "%s (an FSDP2 setting)", actor_strategy(cfg))
    if actor.fsdp_config.offload_policy and actor_strategy(cfg) != "fsdp2":
        logger.warning("actor_rollout_ref.actor.fsdp_config.offload_policy=true has no effect with strategy %s (an "
                       "FSDP2 setting: shards in host memory while training)", actor_strategy(cfg))
    _check_sequence_parallel(cfg, world)
    dp = world // max(1, actor.ulysses_sequence_parallel_size)
    if dp > 1 and actor.ppo_mini_batch_size * n < dp:
        raise ConfigError("actor_rollout_ref.actor.ppo_mini_batch_size",
                          f"a mini-batch of {actor.ppo_mini_batch_size} x n={n} responses cannot give each "
                          f"of the {dp} data-parallel ranks at least one")


def _check_sequence_parallel(cfg: Any, world: int) -> None:
    """Ulysses: fsdp strategies, groups that divide the trainer's ranks, packed micro-batches."""
    arr = cfg.actor_rollout_ref
    sp, key = arr.actor.ulysses_sequence_parallel_size, "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    _at_least(key, sp, 1)
    if sp == 1:
        return
    if arr.actor.strategy == "megatron":
        raise ConfigError(key, f"{sp}: Ulysses sequence parallelism is for the fsdp strategies; megatron splits "
                               "long sequences with context parallelism (megatron.context_parallel_size), which is "
                               "not implemented: use 1")
    if world % sp:
        raise ConfigError(key, f"{sp} must divide the trainer world size {world} (trainer.nnodes x "
                               "trainer.n_gpus_per_node): groups of that many ranks split each micro-batch")
    if not arr.model.use_remove_padding:
        raise ConfigError(key, f"{sp} splits packed micro-batches: set actor_rollout_ref.model.use_remove_padding="
                               "true (verl's Ulysses scripts all do)")


def _check_overlong_buffer(cfg: Any) -> None:
    ob = cfg.reward_model.overlong_buffer
    ref_len = overlong_reference_length(cfg)
    if ob.enable and not 0 < ob.len <= ref_len:
        raise ConfigError("reward_model.overlong_buffer.len",
                          f"{ob.len} must be in (0, {ref_len}] (reward_model.overlong_buffer.max_resp_len, "
                          "else data.max_response_length)")


def _validate_megatron(cfg: Any, world: int) -> None:
    from fully_async.core.config import uses_critic

    actor = cfg.actor_rollout_ref.actor
    m = actor.megatron
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        _at_least(f"actor_rollout_ref.actor.megatron.{key}", getattr(m, key), 1)
    if m.context_parallel_size != 1:
        raise ConfigError("actor_rollout_ref.actor.megatron.context_parallel_size",
                          "context parallelism is not implemented; use 1")
    if cfg.trainer.device == "cpu":
        raise ConfigError("trainer.device", "strategy=megatron needs cuda or npu: megatron-core does not run a "
                          "forward pass on CPU")
    mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if world % mp:
        raise ConfigError("actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                          f"trainer world {world} (trainer.nnodes x trainer.n_gpus_per_node) is not a multiple of "
                          f"tp x pp x cp = {mp}")
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        raise ConfigError("actor_rollout_ref.actor.megatron.sequence_parallel", "needs tensor_model_parallel_size > 1")
    vpp = m.virtual_pipeline_model_parallel_size
    if vpp is not None:
        _at_least("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", vpp, 1)
    if (vpp or 1) > 1:
        key = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
        if m.pipeline_model_parallel_size == 1:
            raise ConfigError(key, f"{vpp}: megatron's interleaved schedule needs pipeline_model_parallel_size > 1 "
                                   "(use null)")
        if uses_critic(cfg) or cfg.reward_model.enable:
            raise ConfigError(key, f"{vpp}: virtual pipeline stages are implemented for the actor and its reference; "
                                   "a critic or a reward model on megatron needs null (one model chunk per rank)")
        if cfg.actor_rollout_ref.actor.use_dynamic_bsz:
            logger.warning("%s=%s with actor.use_dynamic_bsz: the interleaved schedule runs every micro-batch of a "
                           "pass in one shape, the most rows of any by the longest length of any (megatron_backend."
                           "_schedule), so a token budget (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu)"
                           " no longer bounds a micro-batch's memory; fixed micro-batch sizes pad less", key, vpp)


def _validate_attention(cfg: Any) -> None:
    """Static checks; the device-dependent ones (kernel installed, CPU backward) are in prepare.check_attention."""
    model = cfg.actor_rollout_ref.model
    impl = (model.override_config or {}).get("attn_implementation")
    if impl is not None:
        _choice("actor_rollout_ref.model.override_config.attn_implementation", impl, ATTN_IMPLEMENTATIONS)
        if impl == "varlen" and not model.use_remove_padding:
            raise ConfigError("actor_rollout_ref.model.override_config.attn_implementation",
                              "varlen attends within packed sequences: it needs "
                              "actor_rollout_ref.model.use_remove_padding=true")
    if model.use_remove_padding and cfg.actor_rollout_ref.actor.strategy == "megatron":
        raise ConfigError("actor_rollout_ref.model.use_remove_padding",
                          "strategy=megatron keeps right-padded rows (packed THD attention needs Transformer "
                          "Engine); set it to false or use strategy=torch/fsdp2")


def validate_with_data(cfg: Any, num_train_prompts: int) -> None:
    """Checks that need the (filtered) dataset size."""
    if num_train_prompts == 0:
        raise ConfigError("data.train_files", "the training data has no prompts left after filtering")
    if cfg.mode == "sync":
        if cfg.data.train_batch_size > num_train_prompts:
            raise ConfigError("data.train_batch_size", f"{cfg.data.train_batch_size} prompts per step but the "
                              f"training data has only {num_train_prompts}")
        return
    required = RunPlan.of(cfg).groups_per_step
    if required > num_train_prompts:
        raise ConfigError("actor_rollout_ref.actor.ppo_mini_batch_size",
                          f"a trainer step needs ppo_mini_batch_size x require_batches = {required} prompts "
                          f"but the training data has only {num_train_prompts}")


SECTION_CHECKS = (_check_mode, _check_trainer, check_rollout_devices, _check_data, _check_model, _check_actor,
                  _check_rollout, check_algorithm, _check_critic, _check_async_training, _warn_pure_low_precision,
                  _check_reward, _check_benchmark, _check_profiler,
                  check_multi_job)
CROSS_SECTION_CHECKS = (check_grpo_group, _check_sequence_budgets, _check_sync_batch, _check_trainer_world,
                        _validate_attention, check_rollout_layout,
                        _check_overlong_buffer, check_filter_groups, check_rollout_correction, check_reward_model,
                        _warn_inert_keys)
