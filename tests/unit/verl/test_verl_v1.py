"""verl 0.9's V1 trainer keys (fully_async/verl/v1.py) and 0.9 one-key rules (verl/rules_09.py): each mapping and
refusal, on the translated override list."""
import pytest

from fully_async.core.config import ConfigError
from fully_async.verl.compat import classify, translate


def ours(lines):
    out = {}
    for line in translate(lines).overrides:
        key, value = line.lstrip("+").split("=", 1)
        out[key] = value
    return out


def test_colocate_async_is_the_colocated_placement_with_verls_step_and_window():
    o = ours(["trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async", "data.train_batch_size=64",
              "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.v1.colocate_async.num_warmup_batches=1.5"])
    assert o["mode"] == "'async'" and o["async_training.placement"] == "'colocated'"
    assert (o["rollout.n_gpus_per_node"], o["async_training.trigger_parameter_sync_step"],
            o["async_training.require_batches"], o["async_training.staleness_threshold"]) == ("0", "1", "4", "1.5")
    assert o["async_training.partial_rollout"] == "true" and "data.train_batch_size" not in o


def test_separate_async_is_split_or_elastic_and_checks_verls_assert():
    base = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    o = ours(base + ["actor_rollout_ref.rollout.n_gpus_per_node=3"])
    assert (o["async_training.placement"], o["async_training.trigger_parameter_sync_step"],
            o["async_training.require_batches"], o["rollout.n_gpus_per_node"]) == ("'split'", "4", "1", "3")
    t = translate(base + ["trainer.v1.separate_async.hybrid_rollout.enable_switch=true",
                          "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio=0.4"])
    assert "++async_training.placement='elastic'" in t.overrides
    assert any("switch_threshold_ratio" in w for w in t.warnings)
    with pytest.raises(ConfigError, match="parameter_sync_step x ppo_mini_batch_size = 4 x 2") as err:
        translate(base[:2] + ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    assert err.value.key == "data.train_batch_size"


def test_sync_mode_and_the_off_policy_threshold():
    assert ours(["trainer.v1.trainer_mode=sync"])["mode"] == "'sync'"
    o = ours(["trainer.v1.trainer_mode=colocate_async", "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.sampler.max_off_policy_threshold=1",
              "trainer.v1.sampler.max_off_policy_strategy=wait"])
    assert (o["async_training.staleness_threshold"], o["async_training.partial_rollout"]) == ("0.0", "false")
    t = translate(["trainer.v1.sampler.max_off_policy_threshold=null"])
    assert any("no cap on the versions" in w for w in t.warnings)
    for strategy in ("drop", "wait"):
        with pytest.raises(ConfigError, match="async_training.staleness_threshold") as err:
            translate(["trainer.v1.trainer_mode=colocate_async", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.sampler.max_off_policy_threshold=8",
                       f"trainer.v1.sampler.max_off_policy_strategy={strategy}"])
        assert err.value.key == "trainer.v1.sampler.max_off_policy_threshold"
    with pytest.raises(ConfigError, match="drop"):
        translate(["trainer.v1.sampler.max_off_policy_strategy=keep"])
    with pytest.raises(ConfigError, match="sync.*colocate_async"):
        translate(["trainer.v1.trainer_mode=fully_async"])
    with pytest.raises(ConfigError, match="custom samplers"):
        translate(["trainer.v1.sampler.custom_sampler.path=x.py"])


def test_model_engine_and_the_0_9_one_key_rules():
    assert ours(["model_engine=megatron"])["actor_rollout_ref.actor.strategy"] == "'megatron'"
    assert any("model_engine" in w for w in translate(["model_engine=dp"]).warnings)
    with pytest.raises(ConfigError, match="veomni engine is not implemented"):
        translate(["model_engine=veomni"])
    assert ours(["actor_rollout_ref.actor.policy_loss.tau_pos=1.5"])["actor_rollout_ref.actor.tau_pos"] == "1.5"
    assert ours(["reward.custom_reward_function.name=f"])["custom_reward_function.name"] == "f"
    assert classify("transfer_queue.enable")[0] == "warned"
    for line, match in (("distillation.enabled=true", "distillation"),
                        ("async_training.use_dynamic_resource_scheduling=true", "elastic"),
                        ("actor_rollout_ref.actor.engine.tp=2", "tensor,pipeline,expert"),
                        ("actor_rollout_ref.rollout.single_turn_response_length=4", "data.max_response_length")):
        with pytest.raises(ConfigError, match=match):
            translate([line])


def test_a_key_of_another_modes_section_is_named_not_dropped_silently():
    t = translate(["trainer.v1.colocate_async.num_warmup_batches=2"])
    assert t.overrides == [] and len(t.warnings) == 1
    assert "trainer.v1.colocate_async.num_warmup_batches=2" in t.warnings[0] and "trainer_mode=colocate_async" \
        in t.warnings[0]
    t = translate(["trainer.v1.trainer_mode=sync", "trainer.v1.separate_async.parameter_sync_step=2"])
    assert t.overrides == ["++mode='sync'"] and len(t.warnings) == 1 and "this script's is sync" in t.warnings[0]


def test_the_sampler_and_sync_sections_at_verls_defaults_are_warned_and_other_values_refused():
    t = translate(["trainer.v1.sync={}", "trainer.v1.sampler.sampler_kwargs={}",
                   "trainer.v1.sampler.custom_sampler.name=null", "trainer.v1.sampler.sync_refill_failed_groups=false"])
    assert t.overrides == [] and len(t.warnings) == 4
    for line in ("trainer.v1.sampler.sync_refill_failed_groups=true", "trainer.v1.sampler.custom_sampler.name=mine",
                 "+trainer.v1.sampler.sampler_kwargs.k=1"):
        with pytest.raises(ConfigError, match="custom samplers"):
            translate([line])


def test_0_9_1s_moved_and_renamed_keys():
    assert ours(["reward.sandbox_fusion.url=http://h:8080/run_code"])["reward_model.sandbox_fusion.url"] == \
        "http://h:8080/run_code"
    assert ours(["sandbox_fusion.max_concurrent=8"])["reward_model.sandbox_fusion.max_concurrent"] == "8"
    t = translate(["sandbox_fusion.url=null"])      # 0.9.1's legacy section is null: unset
    assert t.overrides == [] and len(t.warnings) == 1
    t = translate(["algorithm.filter_groups.metric=reward"])
    assert t.overrides == ["algorithm.filter_groups.metric=seq_reward"] and "pre-KL reward" in t.warnings[0]
    assert classify("actor_rollout_ref.actor.optim.muon_momentum") == ("warned", "read only with actor_rollout_ref."
                                                                       "actor.optim.optimizer=muon (refused: the "
                                                                       "optimizer is torch's AdamW)")
    with pytest.raises(ConfigError, match="context_parallel_size must be 1"):
        translate(["actor_rollout_ref.actor.megatron.dynamic_context_parallel=true"])
