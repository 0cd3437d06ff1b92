"""The critic under two gloo data-parallel ranks (FSDP2): the same values and the same critic update as one device
on the same batch, and its sharded checkpoint (fsdp_critic/) restores the state it was saved in."""
import pytest
import torch

from fully_async.actors.train_worker import TrainWorker
from fully_async.cluster.network import free_port
from fully_async.core.batch import build_batch
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config
from fully_async.train.backends.torch_backend import TorchBackend
from fully_async.train.group import connect_trainer_group
from fully_async.train.ppo_update import critic_update
from fully_async.train.train_step import prepare_batch
import tests_helpers
from tests_helpers import tiny_samples

COMMON = ["actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "algorithm.adv_estimator=gae", "critic.optim.lr=0.01", "critic.ppo_micro_batch_size_per_gpu=2",
          "algorithm.gamma=0.99", "algorithm.lam=0.95"]


@pytest.fixture(scope="module")
def ray_cpus():
    yield from tests_helpers.ray_session(num_cpus=4)


def test_two_fsdp2_ranks_train_the_critic_as_one_device_and_restore_it(ray_cpus, tmp_path):
    samples = tiny_samples(groups=4, n=3)   # 12 responses, 2 critic mini-batches of 6, 3 rows per rank
    single_cfg = load_config(COMMON)
    single = TorchBackend(single_cfg, CPU, 10)
    batch = build_batch(samples)
    prepare_batch(single, single_cfg, batch, {})
    ref = critic_update(single, single_cfg, batch, num_mini_batches=2)
    ref_after = single.compute_values(batch)

    cfg = load_config(COMMON + ["actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"])
    group = connect_trainer_group(cfg, CPU, 10, ("127.0.0.1", free_port()), {"num_cpus": 1}, worker=TrainWorker)
    try:
        batch2 = build_batch(samples)
        prepare_batch(group, cfg, batch2, {})
        assert torch.allclose(batch2.values, batch.values, atol=1e-5)
        assert torch.allclose(batch2.advantages, batch.advantages, atol=1e-4)
        got = critic_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
        assert torch.allclose(group.compute_values(batch2), ref_after, atol=1e-4)

        group.save(str(tmp_path))
        assert (tmp_path / "fsdp_critic").is_dir()
        then = critic_update(group, cfg, batch2, num_mini_batches=2)
        group.load(str(tmp_path))
        again = critic_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/lr"):
            assert again[key] == pytest.approx(then[key], rel=1e-5), key
    finally:
        tests_helpers.close_group(group)
