"""Two gloo data-parallel ranks (FSDP2) under the one PPO update give the same update as one device on the same
global batch."""
import pytest
import torch
import torch.distributed as dist

from fully_async.cluster.network import free_port
from fully_async.train.backends.torch_backend import TorchBackend
from fully_async.core.batch import build_batch
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config
from fully_async.train.train_step import prepare_batch
from fully_async.actors.train_worker import TrainWorker
from fully_async.train.group import GroupBackend, connect_trainer_group
from fully_async.train.ppo_update import ppo_update
from fully_async.train.sharding import shard_rows
import tests_helpers
from tests_helpers import tiny_samples

COMMON = ["actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.rollout.n=3",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=true",
          "async_training.use_rollout_log_probs=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]


@pytest.fixture(scope="module")
def ray_cpus():
    import ray
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_shard_rows():
    assert shard_rows(5, 2) == [[0, 2, 4], [1, 3]]


PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16", "data.max_prompt_length=4",
          "data.max_response_length=4"]


@pytest.mark.parametrize("mode,shared,extra", [
    ("token-mean", [], []),
    ("seq-mean-token-mean", [], ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
                                 "actor_rollout_ref.actor.fsdp_config.param_offload=true"]),
    # packed ranks with token-budget micro-batches (packed == padded is tests/unit/test_remove_padding.py)
    ("token-mean", PACKED, []),
    # verl's hybrid sharding (fsdp_size below the world): shard groups of 1 rank, replicated across 2
    ("token-mean", [], ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1"]),
    # the actor's layers keep their gathered weights from forward to backward; r::dp shares, not token-balanced ones
    ("token-mean", [], ["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
                        "trainer.balance_batch=false"]),
])
def test_two_fsdp2_gloo_ranks_match_one_device(ray_cpus, tmp_path, mode, shared, extra):
    samples = tiny_samples(groups=4, n=3)   # 12 responses, 2 mini-batches of 6, 3 rows per rank
    single_cfg = load_config(COMMON + [f"actor_rollout_ref.actor.loss_agg_mode={mode}", *shared])
    single = TorchBackend(single_cfg, CPU, 10)
    batch = build_batch(samples)
    prepare_batch(single, single_cfg, batch, {})
    ref_metrics = ppo_update(single, single_cfg, batch, num_mini_batches=2)

    cfg = load_config(COMMON + [f"actor_rollout_ref.actor.loss_agg_mode={mode}",
                                "actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2", *shared, *extra])
    group = connect_trainer_group(cfg, CPU, 10, ("127.0.0.1", free_port()), {"num_cpus": 1}, worker=TrainWorker)
    try:
        assert isinstance(group, GroupBackend) and group.world == 2 == group.data_parallel_size
        assert group.rng is group.local.rng          # rank 0 shuffles for all ranks, from its checkpointed RNG
        layer = group.local.model.model.layers[0]._get_fsdp_state()._fsdp_param_group
        assert (layer.post_forward_mesh_info is None) == ("reshard_after_forward=false" in " ".join(extra))
        meshes = {tuple(p.device_mesh.shape) for p in group.local.model.parameters()}
        assert meshes == ({(2, 1)} if "actor_rollout_ref.actor.fsdp_config.fsdp_size=1" in extra else {(2,)})
        batch2 = build_batch(samples)
        prepare_batch(group, cfg, batch2, {})
        assert torch.allclose(batch2.old_log_probs, batch.old_log_probs, atol=1e-5)
        assert torch.allclose(batch2.ref_log_probs, batch.ref_log_probs, atol=1e-5)
        metrics = ppo_update(group, cfg, batch2, num_mini_batches=2)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        full = group.named_parameters_for_sync()
        for name, p in single.model.named_parameters():
            # Adam divides by sqrt(v): gradients that are ~0 (e.g. k_proj.bias, which softmax ignores) turn
            # reduction-order rounding into up to ~1e-5 differences; 1e-4 is 1% of one lr=0.01 step
            assert torch.allclose(full[name], p.detach(), atol=1e-4), name
        if "actor_rollout_ref.actor.fsdp_config.fsdp_size=1" in extra:   # hybrid shards save and restore too
            group.save(str(tmp_path))
            ppo_update(group, cfg, batch2, num_mini_batches=2)
            group.load(str(tmp_path))
            for name, t in group.named_parameters_for_sync().items():
                assert torch.equal(t, full[name]), name
        # a last batch smaller than the world: the rank without rows runs a masked dummy, nothing hangs
        tiny = build_batch(tiny_samples(groups=1, n=1))
        prepare_batch(group, cfg, tiny, {})
        assert tiny.old_log_probs[0, 4:].abs().sum() > 0          # rank 0's row was computed
        metrics = ppo_update(group, cfg, tiny, num_mini_batches=1)
        assert metrics["actor/bad_steps"] == 0.0 and metrics["actor/grad_norm"] > 0
    finally:
        tests_helpers.close_group(group)



class DiesBeforeTheRendezvous(TrainWorker):
    """A rank whose set-up fails before it reaches the process group (a missing file, a bad config on that node)."""

    def __init__(self, cfg, rank, world, master, optimizer_steps, engine_args=None):
        raise FileNotFoundError(f"rank {rank}: /no/such/model/config.json")


def test_a_rank_that_dies_before_the_rendezvous_is_named_at_once(ray_cpus):
    import time

    from fully_async.cluster.ray_utils import RunFailed

    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import this test module
    cfg = load_config(COMMON + ["actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2"])
    start = time.monotonic()
    with pytest.raises(RunFailed, match=r"trainer rank 1 died before joining the trainer's process group: "
                                        r"FileNotFoundError: rank 1: /no/such/model/config.json"):
        connect_trainer_group(cfg, CPU, 10, ("127.0.0.1", free_port()), {"num_cpus": 1},
                              worker=DiesBeforeTheRendezvous)
    assert time.monotonic() - start < 60   # not the store's 15 minutes
    assert not dist.is_initialized()


def test_await_ranks_returns_once_every_rank_arrived_and_times_out_on_a_silent_one(ray_cpus):
    import time

    import ray

    from fully_async.cluster.ray_utils import RunFailed
    from fully_async.train.backends.fsdp import arrived_key
    from fully_async.train.group import await_ranks

    @ray.remote
    class Silent:
        def ready(self):
            time.sleep(30)

    store = dist.HashStore()
    workers = [Silent.remote(), Silent.remote()]
    store.set(arrived_key(1), "1")
    with pytest.raises(RunFailed, match=r"trainer rank\(s\) \[2\] did not reach"):
        await_ranks(store, workers, timeout_s=1.0, poll_s=0.2)
    store.set(arrived_key(2), "1")
    await_ranks(store, workers, timeout_s=1.0, poll_s=0.2)
    for w in workers:
        ray.kill(w)
