"""Every key of verl's trainer configs is honoured, warned or refused (verl/compat.py), and our defaults are
verl's except where DEFAULT_DIFFERENCES says why."""
import json
import logging
import os
import re

import pytest
import yaml
from omegaconf import OmegaConf

from fully_async.core.config import ConfigError, FullyAsyncConfig, typed_config
from fully_async.verl.compat import (DEFAULT_DIFFERENCES, HONOURED, MAPPED, REFUSED, WARNED, classify,
                                          find_rule, read_tsv, read_versions, render, translate)
from fully_async.verl.v1 import is_v1_key, mode_reading
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

TSV = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "docs", "verl_config_keys.tsv")
ROWS = read_tsv(TSV)
# keys whose verl default is an interpolation without a fallback, "???", or a value our type cannot hold
SENSIBLE = {"actor_rollout_ref.rollout.name": "hf", "data.seed": 1, "trainer.default_local_dir": "checkpoints/x",
            "actor_rollout_ref.ref.strategy": "fsdp", "actor_rollout_ref.actor.checkpoint.load_contents": ["model"],
            "critic.checkpoint.load_contents": ["model"],
            "critic.forward_max_token_len_per_gpu": 32768, "reward_model.forward_max_token_len_per_gpu": 32768,
            "reward_model.use_dynamic_bsz": False,
            "critic.optim.warmup_style": "cosine",
            "actor_rollout_ref.actor.optim.warmup_style": "cosine",   # null there means unset (a warning)
            # verl 0.9.1's legacy reward section is null (unset; its `reward.` keys are read), ours holds the values
            "custom_reward_function.name": "compute_score", "reward_model.enable": False,
            "reward_model.model.trust_remote_code": False, "reward_model.reward_manager": "naive",
            "algorithm.filter_groups.metric": "seq_reward",   # 0.9.1's `reward` is served as seq_reward (below)
            "sandbox_fusion.max_concurrent": 64, "sandbox_fusion.memory_limit_mb": 1024}  # null: unset there


def sensible_value(key, default_json):
    """verl's default, or for an interpolation its oc.select fallback (what verl resolves to when unset)."""
    if key in SENSIBLE:
        return SENSIBLE[key]
    value = json.loads(default_json)
    if isinstance(value, str) and "${" in value:
        m = re.fullmatch(r"\$\{oc\.select:[^,]+,(.*)\}", value.strip())
        return yaml.safe_load(m.group(1).strip()) if m else None
    return value


def test_the_reference_table_is_verls():
    """verl 0.9.1's keys and b178a3cd's (kept: a script for the older release may still pass them)."""
    assert len(ROWS) == 1220 and len({k for k, _ in ROWS}) == 1220
    versions = read_versions(TSV)
    counts = {v: sum(1 for vs in versions.values() if vs == v) for v in set(versions.values())}
    assert counts == {("0.9.1",): 487, ("0.9.1", "b178a3cd"): 618, ("b178a3cd",): 115}
    assert versions["trainer.v1.trainer_mode"] == ("0.9.1",)
    assert versions["data.gen_batch_size"] == ("0.9.1", "b178a3cd")


def _typed_plain(lines):
    return OmegaConf.to_container(OmegaConf.structured(typed_config(load_config(lines))), resolve=True)


def _at(plain, target):
    for part in target.split("."):
        plain = plain[part]
    return plain


def _lands(plain, target, expected) -> bool:
    actual = _at(plain, target)
    return actual == expected or (isinstance(expected, dict) and not expected and not actual)


def _batches(cases, size=40):
    """Honoured keys in batches whose targets are apart (no two equal, none inside another), so no key of a batch
    can set what another key is checked for: one composed config checks a batch (a compose is ~0.1 s and there
    are ~500 keys)."""
    batches: list[list] = []
    for case in cases:
        target = case[1]
        for batch in batches:
            if len(batch) < size and not any(t == target or t.startswith(target + ".") or target.startswith(t + ".")
                                             for _, t, _ in batch):
                batch.append(case)
                break
        else:
            batches.append([case])
    return batches


@pytest.mark.parametrize("status", [HONOURED, WARNED])
def test_every_verl_key_is_honoured_warned_or_refused(status, caplog):
    """Each key set to its verl default: honoured keys land in the typed config with that value; warned keys
    give one warning naming the key and why and leave nothing behind; no key is unknown.  Honoured keys are
    composed a batch at a time (targets apart); a key that a batch does not show landing is composed alone, which
    is the check."""
    seen, honoured = 0, []
    for key, default in ROWS:
        got, note = classify(key)
        assert got in (HONOURED, MAPPED, WARNED, REFUSED), f"{key}: no rule ({got})"
        if (got == MAPPED and HONOURED or got) != status or is_v1_key(key):   # V1 keys: the test below
            continue
        seen += 1
        value = sensible_value(key, default)
        line = f"{key}={render(value)}"
        if status == HONOURED:
            target, expected = key, value
            if got == MAPPED:
                rule, groups = find_rule(key)
                target = rule.target.format(*groups)
                expected = rule.convert(value) if rule.convert else value
            honoured.append((line, target, expected))
        else:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fully_async.verl.compat"):
                out = translate([line])
            assert out.overrides == [] and len(out.warnings) == 1, line
            assert key in out.warnings[0] and "has no effect here: " + note.split(";")[0] in out.warnings[0]
            assert len(caplog.records) == 1
    for batch in _batches(honoured):
        try:
            plain = _typed_plain([line for line, _, _ in batch])
        except ConfigError:   # a combination of defaults refused: every key alone is what is checked
            plain = None
        for line, target, expected in batch:
            if plain is None or not _lands(plain, target, expected):
                alone = _typed_plain([line])
                assert _lands(alone, target, expected), f"{line}: {target} is {_at(alone, target)!r}"
    assert seen > 100


def test_every_v1_key_at_verls_default_is_mapped_or_warned_once(caplog):
    """Each V1 key of the table at verl's default, alone (with the trainer_mode whose section holds it): a mapped key
    is reported mapped and leaves no V1 key for Hydra; a warned one gives exactly one warning naming it."""
    seen = 0
    for key, default in ROWS:
        if not is_v1_key(key):
            continue
        seen += 1
        status, note = classify(key)
        lines = [f"{key}={render(json.loads(default))}"]
        mode = mode_reading(key)
        if mode and status == MAPPED:
            lines.append(f"trainer.v1.trainer_mode={mode}")
        out = translate(lines)
        assert not any(line.lstrip("+").startswith("trainer.") for line in out.overrides), (key, out.overrides)
        if status == MAPPED:
            assert key in [k for k, _ in out.mapped] and not out.warnings, (key, out)
        else:
            assert status == WARNED and len(out.warnings) == 1 and key in out.warnings[0], (key, out.warnings)
    assert seen == 20


@pytest.mark.parametrize("line,key,alternative", [
    ("trainer.v1.sampler.sync_refill_failed_groups=true", "trainer.v1.sampler.sync_refill_failed_groups",
     "not implemented"),
    ("trainer.v1.sampler.custom_sampler.path=/x.py", "trainer.v1.sampler.custom_sampler.path", "not implemented"),
    ("actor_rollout_ref.actor.qat.enable=true", "actor_rollout_ref.actor.qat.enable", "actor.dtype"),
    ("actor_rollout_ref.actor.optim.use_precision_aware_optimizer=true",
     "actor_rollout_ref.actor.optim.use_precision_aware_optimizer", "precision-aware"),
    ("actor_rollout_ref.rollout.multi_turn.function_tool_path=t.py",
     "actor_rollout_ref.rollout.multi_turn.function_tool_path", "tool_config_path"),
    ("skip.rollout.enable=true", "skip.rollout.enable", "not implemented"),
    ("actor_rollout_ref.rollout.data_parallel_size=2", "actor_rollout_ref.rollout.data_parallel_size", "use 1"),
    ("+reward.reward_kwargs.foo=1", "reward.reward_kwargs.foo", "custom_reward_function.reward_kwargs"),
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true", "reward_model.reward_kwargs.max_resp_len",
     "verl's DAPO reward manager asserts"),
    ("actor_rollout_ref.model.lora.type=canonical_lora", "actor_rollout_ref.model.lora.type", "fused `lora` type"),
    ("actor_rollout_ref.actor.optim.lr_decay_style=wsd", "actor_rollout_ref.actor.optim.lr_decay_style",
     "lr_scheduler_type"),
    ("critic.model.lora_rank=8", "critic.model.lora_rank", "LoRA"),
    ("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.do_sample", "temperature=0"),
    ("+reward_model.reward_kwargs.foo=1", "reward_model.reward_kwargs.foo", "custom_reward_function.reward_kwargs"),
    ("+trainer.typo=3", "trainer.typo", "not a key of fully_async's schema"),
    ("trainer.totl_epochs=3", "trainer.totl_epochs", "did you mean trainer.total_epochs"),
])
def test_refused_values_name_the_key_and_the_alternative(line, key, alternative):
    with pytest.raises(ConfigError) as err:
        load_config([line])
    assert err.value.key == key and alternative in str(err.value)


def test_ported_spellings_are_mapped_onto_our_keys():
    cfg = typed_config(load_config([
        "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
        "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4", "+reward_model.reward_kwargs.max_resp_len=6",
        "+actor_rollout_ref.model.override_config.model_config.max_position_embeddings=64",
        "+custom_reward_function.reward_kwargs.alpha=0.5", "trainer.max_actor_ckpt_to_keep=2",
        "actor_rollout_ref.hybrid_engine=False", "data.return_raw_chat=True",
        "+ray_kwargs.ray_init.address=10.0.0.1:6379"]))
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == "fsdp" and arr.actor.optim.lr_scheduler_type == "cosine"
    assert arr.actor.fsdp_config.param_offload is True and arr.actor.grad_clip == 0.5
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.max_resp_len) == (True, 4, 6)
    assert arr.model.override_config == {"max_position_embeddings": 64}
    assert cfg.custom_reward_function.reward_kwargs == {"alpha": 0.5}
    assert cfg.trainer.max_ckpt_to_keep == 2
    assert cfg.multi_job.ray_address == "10.0.0.1:6379"   # the Ray cluster to join (the launcher's start_ray)


def test_fsdp_is_torch_on_one_device_and_fsdp2_on_several():
    from fully_async.core.config import actor_strategy
    from fully_async.core.config_checks import validate
    one = load_config(["actor_rollout_ref.actor.strategy=fsdp"])
    two = load_config(["actor_rollout_ref.actor.strategy=fsdp", "trainer.n_gpus_per_node=2"])
    validate(one)
    validate(two)
    assert (actor_strategy(one), actor_strategy(two)) == ("torch", "fsdp2")


def _resolved_defaults():
    return OmegaConf.to_container(OmegaConf.structured(FullyAsyncConfig), resolve=False)


def test_defaults_are_verls_except_the_documented_differences():
    ours = _resolved_defaults()
    differ = set()
    for key, default in ROWS:
        node = ours
        try:
            for part in key.split("."):
                node = node[part]
        except (KeyError, TypeError):
            continue
        verl = json.loads(default)
        if isinstance(verl, str) and "${oc.select" in verl:  # verl follows another key; so do we (or a constant)
            continue
        if node != verl and not (isinstance(node, float) and node == verl):
            differ.add(key)
    assert differ == set(DEFAULT_DIFFERENCES), (sorted(differ - set(DEFAULT_DIFFERENCES)),
                                                sorted(set(DEFAULT_DIFFERENCES) - differ))


def test_log_prob_budgets_follow_the_actors_as_in_verl():
    cfg = typed_config(load_config(["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                    "actor_rollout_ref.actor.use_dynamic_bsz=true"]))
    for section in (cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.ref):
        assert section.log_prob_max_token_len_per_gpu == 4096 and section.log_prob_use_dynamic_bsz is True


def test_the_bundled_preset_applies_only_without_data_files():
    from fully_async.core.config import asset_path
    tiny = load_config([])
    assert (tiny.actor_rollout_ref.rollout.n, tiny.data.max_response_length, tiny.actor_rollout_ref.actor.optim.lr) \
        == (8, 8, 1e-4)
    assert load_config(["actor_rollout_ref.rollout.n=4"]).actor_rollout_ref.rollout.n == 4  # the user's wins
    ported = load_config([f"data.train_files={asset_path('tiny_arithmetic/data/train.parquet')}"])
    assert (ported.actor_rollout_ref.rollout.n, ported.data.max_response_length,
            ported.actor_rollout_ref.actor.optim.lr, ported.async_training.trigger_parameter_sync_step) \
        == (1, 512, 1e-6, 4)


# a value outside each rule's accepted ones (by its allowed_doc); an unknown allowed_doc fails the test below
OUTSIDE = {"-1": 5, "0": 5, "0.0": 0.5, "1": 2, "1.0": 0.9, "AdamW": "sgd", "constant": "linear",
           "constant|cosine": "wsd", "false": True, "null": 2, "null|constant|cosine": "wsd", "null|false": True,
           "torch.optim": "apex.optimizers", "true": False, "vanilla": "clip_cov", "{}": {"enable_thinking": True},
           "xavier|kaiming|normal": "orthogonal", "zero": "xavier", "lora": "dora"}


def test_every_value_a_verl_key_cannot_honour_is_refused_naming_the_key_and_the_alternative():
    guarded = 0
    for key, _ in ROWS:
        rule, _groups = find_rule(key) or (None, ())
        if rule is None or rule.allowed is None:
            continue
        guarded += 1
        bad = OUTSIDE[rule.allowed_doc]
        assert not rule.allowed(bad), (key, bad)
        with pytest.raises(ConfigError) as err:
            translate([f"{key}={render(bad)}"])
        assert err.value.key == key and rule.refusal in str(err.value), str(err.value)
    assert guarded > 60


def test_fsdp_size_is_accepted_at_minus_one_and_at_every_divisor_of_the_trainer_world():
    """-1 or the world: full sharding; a divisor: verl's hybrid sharding (tests/unit/train/test_group.py trains it);
    anything else is refused naming the key."""
    from fully_async.core.config_checks import validate
    for line, world in (("actor_rollout_ref.actor.fsdp_config.fsdp_size=-1", 2),
                        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=2", 2),
                        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=1", 1),
                        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=2", 4)):
        validate(load_config([line, f"trainer.n_gpus_per_node={world}", "actor_rollout_ref.actor.strategy=fsdp"]))
    for bad in (3, 0):
        with pytest.raises(ConfigError) as err:
            validate(load_config([f"actor_rollout_ref.actor.fsdp_config.fsdp_size={bad}", "trainer.n_gpus_per_node=4",
                                  "actor_rollout_ref.actor.strategy=fsdp2"]))
        assert err.value.key == "actor_rollout_ref.actor.fsdp_config.fsdp_size"
        assert "must divide the trainer world size 4" in str(err.value)


def test_dapo_dynamic_sampling_and_the_newer_reward_spelling_are_honoured():
    out = translate(["algorithm.filter_groups.enable=true", "+algorithm.filter_groups.metric=acc",
                     "+algorithm.filter_groups.max_num_gen_batches=10", "+reward.reward_manager.name=dapo",
                     "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                     "+reward.reward_kwargs.overlong_buffer_cfg.len=4", "+reward.reward_kwargs.max_resp_len=8"])
    assert not [w for w in out.warnings if "filter_groups" in w]
    cfg = typed_config(load_config(out.overrides))
    validate(cfg)
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    assert (fg.enable, fg.metric, fg.max_num_gen_batches) == (True, "acc", 10)
    assert (cfg.reward_model.reward_manager, ob.enable, ob.len, ob.max_resp_len) == ("dapo", True, 4, 8)


@pytest.mark.parametrize("overrides,key,message", [
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.metric", "is required"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=pass"], "algorithm.filter_groups.metric",
     "seq_final_reward"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "algorithm.filter_groups.metric", "use seq_reward"),
    (["algorithm.rollout_correction.rollout_is=tokens"], "algorithm.rollout_correction.rollout_is", "sequence"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "algorithm.rollout_correction.rollout_rs",
     "rollout_rs_threshold is required"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     "algorithm.rollout_correction.rollout_rs", "not one of"),
    (["algorithm.rollout_correction.loss_type=pg"], "algorithm.rollout_correction.loss_type", "ppo_clip"),
    (["algorithm.rollout_correction.loss_type=reinforce", "algorithm.rollout_correction.bypass_mode=true",
      "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "algorithm.rollout_correction.loss_type", "vanilla"),
    (["algorithm.rollout_correction.rollout_rs=token_k3", "algorithm.rollout_correction.rollout_rs_threshold=1",
      "algorithm.rollout_correction.bypass_mode=true", "async_training.decoupled_ppo=true"],
     "algorithm.rollout_correction.bypass_mode", "choose one"),
])
def test_dynamic_sampling_and_rollout_correction_refuse_bad_values_naming_the_key(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(overrides))
    assert err.value.key == key and message in str(err.value)


def test_rollout_rejection_goes_with_decoupled_ppo():
    validate(load_config(["algorithm.rollout_correction.rollout_rs=token_k3", "async_training.decoupled_ppo=true",
                          "algorithm.rollout_correction.rollout_rs_threshold=0.5"]))


@pytest.mark.parametrize("name,mode,strategy,manager", [
    ("ppo_trainer", "sync", "fsdp", "naive"), ("ppo_megatron_trainer", "sync", "megatron", "naive"),
    ("fully_async_ppo_trainer", "async", "fsdp", "naive"), ("fully_async_ppo_megatron_trainer", "async", "megatron",
                                                            "naive"),
    ("one_step_off_ppo_trainer", "async", "fsdp", "naive"), ("one_step_off_ppo_megatron_trainer", "async", "megatron",
                                                              "naive"),
    ("dapo_trainer", "sync", "fsdp", "dapo"), ("dapo_megatron_trainer", "sync", "megatron", "dapo")])
def test_verls_config_names_resolve(name, mode, strategy, manager):
    from fully_async.core.config import asset_path
    cfg = typed_config(load_config([f"data.train_files={asset_path('tiny_arithmetic/data/train.parquet')}",
                                    "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
                                   config_name=name))
    assert (cfg.mode, cfg.actor_rollout_ref.actor.strategy, cfg.reward_model.reward_manager) == (mode, strategy, manager)
    if name.startswith("one_step_off"):   # a step is train_batch_size prompts, weights pushed after every step
        at = cfg.async_training
        assert (at.require_batches, at.trigger_parameter_sync_step, at.staleness_threshold, at.partial_rollout) == \
            (4, 1, 1.0, False)


def test_train_batch_size_in_async_mode_is_named_once_saying_what_a_step_is(caplog):
    from fully_async.core.config_checks import validate
    with caplog.at_level(logging.WARNING, logger="fully_async.core.config_checks"):
        validate(load_config(["data.train_batch_size=512", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                              "async_training.require_batches=2"]))
    assert [r.getMessage() for r in caplog.records] == [
        "data.train_batch_size=512 has no effect in async mode: a trainer step is "
        "actor_rollout_ref.actor.ppo_mini_batch_size x async_training.require_batches = 32 prompt groups (verl's "
        "fully-async trainer requires train_batch_size=0)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fully_async.core.config_checks"):
        validate(load_config(["data.train_batch_size=0"]))   # verl's fully-async value: silent
    assert not caplog.records


@pytest.mark.parametrize("lines,warned", [
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true"], ["param_offload"]),          # 1 device: torch
    (["actor_rollout_ref.actor.megatron.optimizer_offload=true"], ["optimizer_offload"]),
    # fsdp2 too, as verl's (between phases only; host-resident shards while training are offload_policy's)
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true", "trainer.n_gpus_per_node=2"], ["param_offload"]),
    (["actor_rollout_ref.actor.fsdp_config.offload_policy=true", "trainer.n_gpus_per_node=2"], []),
    (["actor_rollout_ref.actor.fsdp_config.offload_policy=true"], ["offload_policy"]),      # 1 float32 device: torch
    (["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "trainer.n_gpus_per_node=2"], ["optimizer_offload"]),
    (["actor_rollout_ref.actor.fsdp_config.param_offload=true", "mode=sync"], []),             # sync loop offloads
])
def test_offload_that_does_nothing_in_async_mode_is_named(lines, warned, caplog):
    from fully_async.core.config_checks import validate
    with caplog.at_level(logging.WARNING, logger="fully_async.core.config_checks"):
        validate(load_config(lines + ["actor_rollout_ref.actor.strategy=fsdp"]))
    got = [r.getMessage() for r in caplog.records if "offload" in r.getMessage()]
    assert [m.split("=")[0].rsplit(".", 1)[1] for m in got] == warned


@pytest.mark.parametrize("name", ["sglang", "trtllm"])
def test_sglang_and_trtllm_rollouts_run_on_vllm_with_a_warning(name):
    from fully_async.verl.compat import translate

    out = translate([f"actor_rollout_ref.rollout.name={name}", "actor_rollout_ref.rollout.temperature=0.7"])
    assert out.overrides == ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.temperature=0.7"]
    assert len(out.warnings) == 1 and f"name={name} runs as actor_rollout_ref.rollout.name=vllm" in out.warnings[0]
    cfg = typed_config(load_config([f"actor_rollout_ref.rollout.name={name}"]))
    assert cfg.actor_rollout_ref.rollout.name == "vllm"


def test_chunked_prefill_set_for_an_engine_that_never_read_it_is_dropped():
    """verl's sglang server reads neither enable_chunked_prefill nor max_num_batched_tokens, so its scripts'
    enable_chunked_prefill=False meant nothing there; served here by vLLM it would make a budget below the longest
    sequence refused (as vLLM refuses it): dropped, warned.  A vLLM script keeps it (and gets vLLM's refusal)."""
    from fully_async.core.config import ConfigError
    from fully_async.core.config_checks import validate
    from fully_async.verl.compat import translate

    long = ["data.max_prompt_length=2048", "data.max_response_length=8192"]
    for order in ([0, 1], [1, 0]):
        lines = ["actor_rollout_ref.rollout.enable_chunked_prefill=False", "actor_rollout_ref.rollout.name=sglang"]
        out = translate([lines[i] for i in order])
        assert out.overrides == ["actor_rollout_ref.rollout.name=vllm"]
        said = "enable_chunked_prefill is dropped: verl's sglang server does not read it"
        assert any(said in w for w in out.warnings)
    validate(load_config([*long, "actor_rollout_ref.rollout.name=sglang",
                          "actor_rollout_ref.rollout.enable_chunked_prefill=False"]))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        validate(load_config([*long, "actor_rollout_ref.rollout.name=vllm",
                              "actor_rollout_ref.rollout.enable_chunked_prefill=False"]))
