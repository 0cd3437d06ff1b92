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


def test_run_length_is_the_smaller_of_the_requested_samples_and_the_epochs_as_verl():
    """verl's fully-async rollouter: total = min(rollout.total_rollout_steps, len(data) x trainer.total_epochs), and
    its iterator stops after rollout.total_epochs passes.  The seed-003 command (51,200 samples, 1 epoch, 1,024
    prompts, 64 groups a step) trains one pass: 16 steps, not 800."""
    seed3 = ["trainer.total_training_steps=null", "rollout.total_rollout_steps=51200", "trainer.total_epochs=1",
             "actor_rollout_ref.actor.ppo_mini_batch_size=16", "async_training.require_batches=4"]
    cfg = load_config(seed3)
    p = RunPlan.of(cfg).with_data(cfg, 1024)
    assert (p.total_prompts, p.total_steps) == (1024, 16)
    cfg = load_config(seed3[:1] + ["rollout.total_rollout_steps=300", "trainer.total_epochs=2",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert RunPlan.of(cfg).with_data(cfg, 1024).total_prompts == 300     # fewer samples than the epochs hold
    cfg = load_config(seed3[:1] + ["trainer.total_epochs=30", "rollout.total_epochs=2",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    p = RunPlan.of(cfg).with_data(cfg, 100)
    assert (p.total_prompts, p.total_steps) == (200, 13)                 # verl's rollout.total_epochs bounds too
