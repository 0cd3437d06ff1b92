"""Everything the driver checks and loads before Ray starts (layer 7 helper).

Fail fast and cheaply: config rules, files, tokenizer, dataset (tokenised once here, then
shipped to the rollouter), derived step counts.  Nothing here touches a device.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from fully_async.core.config import ConfigError, FullyAsyncConfig, as_file_list, asset_path, typed_config
from fully_async.core.config_checks import validate, validate_with_data
from fully_async.core.plan import RunPlan
from fully_async.telemetry.tracking import check_installed as check_trackers_installed
from fully_async.core.types import PromptRecord

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    cfg: FullyAsyncConfig          # resolved, typed config (with the derived totals) shipped to the actors
    train: list[PromptRecord]
    val: list[PromptRecord]
    total_prompts: int             # prompts the rollouter generates
    total_steps: int               # trainer steps
    eos_token_ids: list[int]
    pad_token_id: int


def eos_ids(tokenizer: Any, model_path: str, vocab_size: Optional[int] = None) -> list[int]:
    """EOS ids from the tokenizer and generation_config; each must exist in the model's vocabulary."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    except (OSError, ValueError):
        pass
    if vocab_size is not None:
        outside = sorted(i for i in ids if i >= vocab_size)
        if outside:
            raise ConfigError("actor_rollout_ref.model.path",
                              f"the tokenizer at {model_path} has eos_token id(s) {outside} outside the model's "
                              f"vocabulary of {vocab_size} (a tokenizer without a real eos_token?): responses "
                              "could never stop")
    if not ids:
        raise ConfigError("actor_rollout_ref.model.path",
                          f"the tokenizer at {model_path} defines no eos_token: responses could never stop")
    return sorted(ids)


def check_model_folder(cfg: Any) -> Any:
    """The actor's model path must hold a loadable config and weight files of a causal LM; errors name the key.
    actor_rollout_ref.model.external_lib is imported first, as every actor does: it may register the architecture."""
    from fully_async.actors.actor_setup import import_external_lib

    model = cfg.actor_rollout_ref.model
    try:
        import_external_lib(cfg)
    except Exception as exc:  # noqa: BLE001 - any failure to import the user's module is named with the key
        raise ConfigError("actor_rollout_ref.model.external_lib", f"{model.external_lib!r} does not import in this "
                          f"process ({type(exc).__name__}: {exc}); it must import on every node of the run") from None
    conf = check_hf_folder(model.path, model.trust_remote_code, "actor_rollout_ref.model.path")
    check_causal_lm(model.path, conf, model.trust_remote_code)
    return conf


def check_hf_folder(path: str, trust_remote_code: bool, key: str) -> Any:
    """A Hugging Face model folder: a loadable config (returned) and weight files; errors name `key` and the path."""
    import glob
    import os

    from transformers import AutoConfig

    try:
        conf = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any parse/arch error means "not a model"
        raise ConfigError(key, f"{path}: config.json is not a loadable Hugging Face config ({exc})") from None
    if not any(glob.glob(os.path.join(path, pat)) for pat in ("*.safetensors", "*.bin", "*.pt")):
        raise ConfigError(key, f"{path} has a config.json but no weight files (*.safetensors or *.bin)")
    return conf


def check_causal_lm(path: str, conf: Any, trust_remote_code: bool) -> None:
    """The trainer and the embedded engine load the model as a causal LM (AutoModelForCausalLM): a family transformers
    does not load that way (a vision-language model such as qwen2_5_vl, an encoder) is refused here, naming it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(conf, "auto_map", None) or {})
    registered = type(conf) in MODEL_FOR_CAUSAL_LM_MAPPING   # AutoModelForCausalLM.register (an external_lib)
    if conf.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or remote or registered:
        return
    raise ConfigError("actor_rollout_ref.model.path",
                      f"{path} is a {conf.model_type} model ({', '.join(getattr(conf, 'architectures', None) or [])}),"
                      " which transformers does not load as a causal LM: only text-only causal LMs train here "
                      "(vision-language models are not implemented)")


def check_sync_rollout_tp(cfg: Any, model_conf: Any) -> None:
    """mode=sync with rollout tensor parallel > 1 (config_checks warns): each trainer device runs its own engine at
    TP 1, so the model's weights in rollout.dtype must fit one device.  Refused where they exceed the largest device
    the planner knows (planner/hardware.py); a device it knows less well is left to the engine's own check."""
    from fully_async.planner.hardware import DEVICES, Shape
    from fully_async.planner.memory_model import GIB, engine_weight_bytes

    rollout = cfg.actor_rollout_ref.rollout
    if cfg.mode != "sync" or rollout.tensor_model_parallel_size == 1:
        return
    try:
        weights = engine_weight_bytes(cfg, Shape.of(model_conf.to_dict())) / GIB
    except (KeyError, TypeError, AttributeError, ValueError):   # a model family the planner cannot size
        return
    largest = max(DEVICES.values(), key=lambda d: d.memory_gib)
    fp8 = ", fp8 layers" if rollout.quantization and rollout.name == "vllm" else ""
    if weights > largest.memory_gib:
        raise ConfigError("actor_rollout_ref.rollout.tensor_model_parallel_size",
                          f"{rollout.tensor_model_parallel_size}: mode=sync runs one engine per trainer device at "
                          f"tensor parallel 1, and {cfg.actor_rollout_ref.model.path}'s weights ({weights:.0f} GiB in "
                          f"{rollout.dtype}{fp8}) fit no single device "
                          f"(largest known: {largest.name}); use mode=async, whose rollout replicas span "
                          "tensor_model_parallel_size devices")


def check_parallel_layout(cfg: Any, model_conf: Any) -> None:
    """strategy=megatron: the model's sizes must split over tensor/pipeline ranks (else megatron asserts); Ulysses:
    the attention heads over the sequence-parallel group."""
    from fully_async.core.config import sequence_parallel_size

    actor = cfg.actor_rollout_ref.actor
    sp = sequence_parallel_size(cfg)
    if sp > 1 and model_conf.num_attention_heads % sp:
        raise ConfigError("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                          f"{sp}: {cfg.actor_rollout_ref.model.path}'s {model_conf.num_attention_heads} attention "
                          "heads do not split over the sequence-parallel group (use a divisor of them)")
    if actor.strategy != "megatron":
        return
    tp, pp = actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size
    vpp = actor.megatron.virtual_pipeline_model_parallel_size or 1
    if model_conf.num_hidden_layers % (pp * vpp) and vpp > 1:
        raise ConfigError("actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
                          f"the model's num_hidden_layers={model_conf.num_hidden_layers} does not split into "
                          f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp * vpp} blocks")
    sizes = {"vocab_size": (model_conf.vocab_size, tp),
             "num_key_value_heads": (getattr(model_conf, "num_key_value_heads", None) or
                                     model_conf.num_attention_heads, tp),
             "num_attention_heads": (model_conf.num_attention_heads, tp),
             "intermediate_size": (model_conf.intermediate_size, tp),
             "num_hidden_layers": (model_conf.num_hidden_layers, pp)}
    for name, (value, parts) in sizes.items():
        if value % parts:
            key = "tensor_model_parallel_size" if parts == tp else "pipeline_model_parallel_size"
            raise ConfigError(f"actor_rollout_ref.actor.megatron.{key}",
                              f"the model's {name}={value} does not split into {parts} parts")


def check_attention(cfg: Any, model_conf: Any) -> None:
    """override_config names real HF config fields; the attention kernel exists and can train on this device."""
    import importlib.util

    from fully_async.core.config import sequence_parallel_size
    from fully_async.train.backends.torch_backend import model_overrides
    from fully_async.device import get_device

    model = cfg.actor_rollout_ref.model
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        return
    unknown = [k for k in (model.override_config or {}) if k != "attn_implementation" and not hasattr(model_conf, k)]
    if unknown:
        raise ConfigError("actor_rollout_ref.model.override_config",
                          f"{unknown} are not fields of {model.path}/config.json ({type(model_conf).__name__})")
    device = get_device(cfg.trainer.device)
    impl = model_overrides(model, device)["attn_implementation"]
    key = "actor_rollout_ref.model.override_config.attn_implementation"
    if device.name == "cpu" and impl not in ("sdpa", "eager", "varlen"):
        raise ConfigError(key, f"{impl} cannot train on the CPU (no backward there); use varlen, sdpa or eager")
    if sequence_parallel_size(cfg) > 1 and impl != "varlen" and not impl.startswith("flash_attention"):
        raise ConfigError(key, f"{impl} cannot run under Ulysses sequence parallelism (ulysses_sequence_parallel_size="
                               f"{sequence_parallel_size(cfg)}): it needs a kernel that takes the packed sequences' "
                               "boundaries: varlen or flash_attention_2")
    if impl.startswith("flash_attention") and device.name == "cuda":
        package = "flash_attn" if impl == "flash_attention_2" else "flash_attn_interface"
        if importlib.util.find_spec(package) is None:
            raise ConfigError(key, f"{impl} needs the {package} package, which is not installed; use "
                              "varlen (torch's own varlen kernel) or sdpa")


def check_lora_adapter(cfg: Any) -> None:
    """actor_rollout_ref.model.lora_adapter_path, before Ray: a peft LoRA adapter folder with its weights."""
    import os

    from fully_async.train.backends.lora import ADAPTER_WEIGHTS, read_adapter_config

    path = cfg.actor_rollout_ref.model.lora_adapter_path
    if not path:
        return
    try:
        read_adapter_config(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("actor_rollout_ref.model.lora_adapter_path", str(exc)) from None
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise ConfigError("actor_rollout_ref.model.lora_adapter_path", f"{path} has no {ADAPTER_WEIGHTS}")
    if cfg.actor_rollout_ref.actor.strategy == "megatron":
        check_fused_adapter(cfg, path)


def check_fused_adapter(cfg: Any, path: str) -> None:
    """strategy=megatron: the adapter fits the model's fused LoRA layers (its targets, one lora_A per fused layer)."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from fully_async.core.lora_targets import is_target, layer_names, megatron_targets
    from fully_async.train.backends.lora import ADAPTER_WEIGHTS, lora_settings
    from fully_async.train.backends.megatron_lora import peft_to_local

    model = cfg.actor_rollout_ref.model
    _, _, targets, excludes = lora_settings(model)
    hf_config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    try:
        spec = megatron_targets(targets, excludes)
        wanted = [n for n in layer_names(hf_config.num_hidden_layers) if is_target(n, *spec)]
        peft_to_local(load_file(os.path.join(path, ADAPTER_WEIGHTS)), wanted, hf_config, 0, 1, 0, 1, path)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError("actor_rollout_ref.model.lora_adapter_path", str(exc)) from None


def check_reward_model(cfg: Any, records: list[PromptRecord]) -> None:
    """reward_model.enable, before Ray: the reward model's folder holds a config, weights and (re-templating) a
    tokenizer with a chat template, and the prompts are chat messages to re-template."""
    from transformers import AutoTokenizer

    rm = cfg.reward_model
    key = "reward_model.model.path"
    check_hf_folder(rm.model.path, rm.model.trust_remote_code, key)
    if rm.model.input_tokenizer is None:
        return
    try:
        template = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=rm.model.trust_remote_code
                                                 ).chat_template
    except Exception as exc:  # noqa: BLE001 - the tokenizer cannot load
        raise ConfigError(key, f"{rm.model.path}: its tokenizer does not load ({exc}); the responses are "
                               "re-templated with it (reward_model.model.input_tokenizer=null reads the policy's "
                               "tokens instead)") from None
    if not template:
        raise ConfigError("reward_model.model.input_tokenizer", f"set, but {rm.model.path}'s tokenizer has no chat "
                          "template to re-template the responses with: set reward_model.model.input_tokenizer=null "
                          "(the reward model reads the policy's tokens) or use a reward model with a chat template")
    plain = next((r for r in records if r.messages is None), None)
    if plain is not None:
        raise ConfigError("reward_model.model.input_tokenizer", f"set, but prompt {plain.index} (column "
                          f"'{cfg.data.prompt_key}') is a plain string, not chat messages to re-template: set "
                          "reward_model.model.input_tokenizer=null (the reward model reads the policy's tokens)")


def probe_rewards(cfg: Any, records: list[PromptRecord]) -> None:
    """Call the reward function once per data_source (ground truth as the response) before Ray.

    Catches a missing function, an unknown data_source and a non-number result in the driver,
    instead of in the rollouter after the engines started.  Bounded by reward_model.probe_timeout_s per import
    and call, and logged as it waits (run/reward_probe.py).
    """
    from fully_async.run.reward_probe import bounded_probe, reward_function

    limit = cfg.reward_model.probe_timeout_s
    bounded_probe(lambda watch: _probe_all(cfg, records, watch, limit), reward_function(cfg), limit)


def _probe_all(cfg: Any, records: list[PromptRecord], watch: Any, limit: float) -> None:
    from fully_async.rewards import build_reward_manager

    function = cfg.custom_reward_function
    watch.stage(f"importing {function.path}:{function.name}" if function.path else "loading the built-in rules")
    manager = build_reward_manager(cfg)
    if manager.pool is not None:   # a call in its worker process: bounded (and killed) by the probe's own limit
        if limit < manager.timeout_s:
            manager.timeout_s, manager.timeout_key = limit, "reward_model.probe_timeout_s"
        manager.start_s, manager.start_key = limit, " (reward_model.probe_timeout_s)"
        watch.on_timeout = manager.pool.kill
    firsts: dict[str, PromptRecord] = {}
    for rec in records:
        firsts.setdefault(rec.data_source, rec)
    key = "custom_reward_function.path" if cfg.custom_reward_function.path else f"data.{cfg.data.reward_fn_key}"
    check_sandbox(cfg, set(firsts))
    try:
        for source, rec in firsts.items():
            watch.stage(f"scoring data_source {source!r}, row {rec.index} (its ground truth as the response)")
            _probe(manager, key, source, rec)
    finally:
        manager.close()


def check_sandbox(cfg: Any, sources: set[str]) -> None:
    """reward_model.sandbox_fusion.url acts only on the code data_sources scored by the built-in rules: warned
    when it cannot act, else the service is called once (print(1)) and a URL that does not answer is refused."""
    from fully_async.rewards import sandbox_fusion
    from fully_async.rewards.scoring import CODE_SOURCES

    sandbox = cfg.reward_model.sandbox_fusion
    if not sandbox.url:
        return
    code = sorted(sources & set(CODE_SOURCES))
    if cfg.custom_reward_function.path or not code:
        why = ("custom_reward_function.path scores every response (verl hands the sandbox to its built-in rules "
               "only)" if cfg.custom_reward_function.path else
               f"the data has no code data_source ({'|'.join(CODE_SOURCES)}); its sources: {sorted(sources)}")
        logger.warning("reward_model.sandbox_fusion.url=%s has no effect: %s", sandbox.url, why)
        return
    error = sandbox_fusion.probe(sandbox.url, sandbox.memory_limit_mb)
    if error:
        raise ConfigError("reward_model.sandbox_fusion.url", f"{sandbox.url}: the SandboxFusion service did not run "
                          f"print(1) ({error}); the data's {code} responses are scored there. Start the service or "
                          "fix the URL (its run_code endpoint)")
    logger.info("reward: data_sources %s scored in the SandboxFusion service at %s", code, sandbox.url)


def _probe(manager: Any, key: str, source: str, rec: PromptRecord) -> None:
    """Score row `rec` with its own ground truth as the response; a failure says it was the pre-run probe."""
    from fully_async.rewards import RewardError

    try:
        manager.score(source, str(rec.ground_truth), rec.ground_truth, rec.extra_info, 1,
                      sample=f"the pre-run probe (row {rec.index}, its ground truth as the response)", strict=True)
    except RewardError as exc:
        if not hasattr(exc, "user_exception"):
            raise
        # the function crashed (its traceback is in the message): say it was the pre-run probe
        raise RewardError(f"{exc}\n(probed before the run with data_source={source!r} and the ground truth of "
                          f"row {rec.index} as the response; {key})") from None
    except NotImplementedError as exc:
        raise ConfigError(key, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the user's function crashed on a plain input
        raise ConfigError(key, f"the reward function raised {type(exc).__name__}: {exc} when probed with "
                          f"data_source={source!r} and the ground truth of row {rec.index} as the response")


def engine_slots(cfg: Any, model_conf: Any) -> int:
    """actor_rollout_ref.rollout.max_num_seqs for the actors: the value set, else the slots the memory model gives
    each engine on the devices the driver sees (planner/memory_model.engine_slots, logged with why), else verl's 256
    (cpu, a model shape the memory model does not size)."""
    from fully_async.core.config import VERL_MAX_NUM_SEQS
    from fully_async.device import get_device
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import engine_slots as sized

    r = cfg.actor_rollout_ref.rollout
    if r.max_num_seqs is not None:
        return int(r.max_num_seqs)
    key = "actor_rollout_ref.rollout.max_num_seqs"
    total = get_device(cfg.trainer.device).total_memory()
    try:
        shape = Shape.of(model_conf.to_dict() if hasattr(model_conf, "to_dict") else dict(model_conf))
    except (ValueError, TypeError) as exc:
        logger.info("%s=null: verl's %d slots per engine (the memory model does not size this model: %s)", key,
                    VERL_MAX_NUM_SEQS, exc)
        return VERL_MAX_NUM_SEQS
    if total is None:
        return VERL_MAX_NUM_SEQS   # cpu: engine_slots' rule there (an accelerator was checked visible here)
    slots, why = sized(cfg, shape, total)
    logger.info("%s=null: %d slots per engine (%s; set the key to fix the count)", key, slots, why)
    return slots


def load_tokenizer(cfg: Any) -> Any:
    from fully_async.actors.actor_setup import build_tokenizer
    try:
        return build_tokenizer(cfg)
    except Exception as exc:  # noqa: BLE001
        model = cfg.actor_rollout_ref.model
        key = "actor_rollout_ref.model." + ("tokenizer_path" if model.tokenizer_path else "path")
        raise ConfigError(key, f"{model.tokenizer_path or model.path}: the tokenizer does not load ({exc})") from None


BUNDLED_TASK_STEPS = 40   # the embedded default run: the tiny arithmetic task learns in these, in about 15 s on CPU
# The schema's defaults are verl's, so a ported script that leaves a key unset gets verl's value.  The bundled tiny
# task (a 2-layer model, 16-token prompts, 8-token answers) learns in ~40 steps only with these instead; they are
# applied, before the command line's own overrides (which win), when no data.train_files is given.
BUNDLED_TASK_OVERRIDES = (
    "data.max_prompt_length=16",
    "data.max_response_length=8",
    "data.train_batch_size=16",                      # mode=sync: prompts per step (= one mini-batch here)
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",  # a tiny model: recomputing only costs time
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.max_num_seqs=128",
    "actor_rollout_ref.rollout.dtype=float32",       # on CPU float32 is the fast and exact choice
    "actor_rollout_ref.actor.dtype=float32",
    "trainer.test_freq=10",
    "async_training.staleness_threshold=0.5",
    "async_training.trigger_parameter_sync_step=1",
)


def bundled_task_overrides(overrides: list[str], mode: str = "async") -> list[str]:
    """The bundled task's preset when the overrides name no data.train_files (it is the task being run); in sync
    mode (`mode`: what the config composes to, hydra_setup.config_mode) without the async knobs."""
    from fully_async.core.mode_keys import MODE_ONLY

    named = any(o.lstrip("+").split("=", 1)[0] == "data.train_files" for o in overrides)
    if named:
        return []
    # mode=sync: without the async knobs, which do nothing there (core/mode_keys.py would name them)
    def inert_in_sync(override: str) -> bool:
        rule = MODE_ONLY.get(override.split("=", 1)[0])
        return rule is not None and "sync" not in rule.acts_in

    sync = mode == "sync"
    return [o for o in BUNDLED_TASK_OVERRIDES if not (sync and inert_in_sync(o))]


def apply_bundled_task_preset(cfg: Any) -> None:
    """`python -m fully_async.main` with no arguments trains the bundled tiny task for 40 steps.  The preset
    applies only to that task's own data and only when no length is set, so a ported verl script that leaves
    trainer.total_training_steps unset gets verl's meaning (total_epochs passes over its data)."""
    bundled = asset_path("tiny_arithmetic/data/train.parquet")
    if (cfg.trainer.total_training_steps is None and not cfg.rollout.total_rollout_steps
            and [os.path.abspath(f) for f in as_file_list(cfg.data.train_files)] == [os.path.abspath(bundled)]):
        cfg.trainer.total_training_steps = BUNDLED_TASK_STEPS
        logger.info("the bundled tiny task: trainer.total_training_steps=%d (its preset; set it to change)",
                    BUNDLED_TASK_STEPS)


def check_multi_turn(cfg: Any, tokenizer: Any) -> list[dict]:
    """rollout.multi_turn.enable: the tool YAML builds (rollout/tools.load_tools) and the tokenizer has a chat
    template (the tool answers are rendered with it); the tools' schemas, [] when off."""
    if not cfg.actor_rollout_ref.rollout.multi_turn.enable:
        return []
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable",
                          f"{cfg.actor_rollout_ref.model.path}'s tokenizer has no chat template: multi-turn tool "
                          "rollouts render the tool answers with it (verl's agent loop does too)")
    from fully_async.rewards.sandbox_fusion import probe
    from fully_async.rollout.tools import SandboxCodeTool, load_tools

    tools = load_tools(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path) if \
        cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path else []
    for tool in tools:
        if isinstance(tool, SandboxCodeTool):
            problem = probe(tool.url, tool.memory_limit_mb)
            if problem is not None:
                raise ConfigError("actor_rollout_ref.rollout.multi_turn.tool_config_path",
                                  f"tool {tool.name!r}: the SandboxFusion service at {tool.url} did not run print(1): "
                                  f"{problem}")
    return [t.schema for t in tools]


def custom_rows(cfg: Any) -> Any:
    """data.custom_cls: the user's row maker, data_files -> verl-format rows (core/config.CustomDatasetConfig)."""
    from fully_async.rewards.scoring import load_file_callable

    custom = cfg.data.custom_cls   # both set and the file there (config_checks)
    make = load_file_callable(custom.path, custom.name, "data.custom_cls", lambda m: ConfigError("data.custom_cls", m),
                              hint="; verl's dataset classes subclass its RLHFDataset and need verl: here "
                              "data.custom_cls names a callable (data_files, data_config) -> verl-format rows")
    return lambda files: make(files, cfg.data)


def load_datasets(cfg: Any, tokenizer: Any) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Train and validation prompts, every row checked (data.load_prompts); the run and the doctor both call this."""
    from fully_async.core.data import load_prompts

    data = cfg.data
    kwargs = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                  truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                  reward_fn_key=data.reward_fn_key, skip_invalid_rows=data.skip_invalid_rows,
                  # rule rewards score against it
                  require_ground_truth=not (cfg.custom_reward_function.path or cfg.reward_model.enable),
                  chat_template_kwargs=dict(data.apply_chat_template_kwargs or {}))
    schemas = check_multi_turn(cfg, tokenizer)
    if schemas:   # the prompts offer the tools, as verl's tool agent loop renders them
        kwargs["chat_template_kwargs"]["tools"] = schemas
    custom = data.custom_cls
    if custom.path or custom.name:
        kwargs["row_source"] = custom_rows(cfg)
    kwargs.update(shuffle=data.shuffle, seed=data.seed)
    train = load_prompts(as_file_list(data.train_files), tokenizer, max_samples=data.train_max_samples, **kwargs)
    val = (load_prompts(as_file_list(data.val_files), tokenizer, max_samples=data.val_max_samples, **kwargs)
           if data.val_files else [])
    return train, val


def prepare(cfg: Any) -> Prepared:
    from omegaconf import OmegaConf

    validate(cfg)
    check_trackers_installed(cfg.trainer.logger)
    model_conf = check_model_folder(cfg)
    check_parallel_layout(cfg, model_conf)
    check_sync_rollout_tp(cfg, model_conf)
    check_attention(cfg, model_conf)
    check_lora_adapter(cfg)
    tokenizer = load_tokenizer(cfg)
    train, val = load_datasets(cfg, tokenizer)
    validate_with_data(cfg, len(train))
    if cfg.reward_model.enable:
        check_reward_model(cfg, train + val)
    else:
        probe_rewards(cfg, train)

    apply_bundled_task_preset(cfg)
    slots = engine_slots(cfg, model_conf)
    plan = RunPlan.of(cfg).with_data(cfg, len(train))
    total_prompts, total_steps, required = plan.total_prompts, plan.total_steps, plan.groups_per_step
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict["rollout"]["total_rollout_steps"] = total_prompts
    cfg_dict["trainer"]["total_training_steps"] = total_steps
    cfg_dict["trainer"]["steps_from_data"] = cfg.trainer.total_training_steps is None
    cfg_dict["actor_rollout_ref"]["rollout"]["max_num_seqs"] = slots
    if cfg.mode == "sync":   # one engine per trainer device (config_checks warned a larger tensor parallel size)
        cfg_dict["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] = 1
    actor = cfg_dict["actor_rollout_ref"]["actor"]
    if actor["loss_scale_factor"] is None:   # seq-mean-token-sum-norm's constant, as verl: the response length
        actor["loss_scale_factor"] = cfg.data.max_response_length
    if cfg_dict["benchmark"]["response_length"].endswith(".json"):  # actors may run in another directory
        cfg_dict["benchmark"]["response_length"] = os.path.abspath(cfg_dict["benchmark"]["response_length"])
    cfg_dict["global_profiler"]["save_path"] = os.path.abspath(cfg_dict["global_profiler"]["save_path"])
    logger.info("data: %d train prompts, %d val prompts; %d prompts to generate, %d trainer steps of %d groups",
                len(train), len(val), total_prompts, total_steps, required)
    eos = eos_ids(tokenizer, cfg.actor_rollout_ref.model.path, getattr(model_conf, "vocab_size", None))
    if cfg.benchmark.ignore_eos:
        logger.warning("benchmark.ignore_eos=true: the engines ignore EOS %s (a benchmark setting, not for training)",
                       eos)
        eos = []
    return Prepared(typed_config(cfg_dict), train, val, total_prompts, total_steps, eos, int(pad))
