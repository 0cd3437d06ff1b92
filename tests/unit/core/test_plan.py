"""RunPlan: device counts, groups per step and totals, computed in one place."""
from fully_async.core.plan import RunPlan
from fully_async.run.hydra_setup import load_config


def test_devices_and_groups_per_mode():
    a = RunPlan.of(load_config(["trainer.n_gpus_per_node=3", "rollout.n_gpus_per_node=2", "rollout.nnodes=2",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.require_batches=3",
                                "actor_rollout_ref.actor.strategy=fsdp2"]))
    assert (a.trainer_devices, a.rollout_devices, a.total_devices, a.groups_per_step) == (3, 4, 7, 12)
    s = RunPlan.of(load_config(["mode=sync", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=5",
                                "data.train_batch_size=8", "actor_rollout_ref.actor.strategy=fsdp2"]))
    assert (s.trainer_devices, s.rollout_devices, s.groups_per_step) == (2, 0, 8)   # sync: trainers generate


def test_totals_from_epochs_steps_or_prompts():
    cfg = load_config(["trainer.total_training_steps=null", "trainer.total_epochs=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    p = RunPlan.of(cfg).with_data(cfg, 100)
    assert (p.total_prompts, p.total_steps) == (200, 13)                 # ceil(200 / 16)
    cfg = load_config(["trainer.total_training_steps=5", "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert RunPlan.of(cfg).with_data(cfg, 1000).total_prompts == 80      # no prompt generated that no step uses
    cfg = load_config(["trainer.total_training_steps=5", "rollout.total_rollout_steps=300"])
    assert RunPlan.of(cfg).with_data(cfg, 1000).total_prompts == 300     # an explicit total wins
