"""verl's `fsdp` strategy on ONE trainer device in bf16 keeps float32 master weights and AdamW states, as verl's FSDP
mixed precision does (a one-rank fsdp2): at lr 1e-6 its weights move as a float32 run's do.  Plain torch in bf16
(`actor.strategy=torch`, what verl's `fsdp` meant here on one device before) rounds almost every update away."""
import logging

import pytest
import torch

from fully_async.core.batch import build_batch
from fully_async.core.config import actor_strategy
from fully_async.core.config_checks import validate
from fully_async.device import CPU
from fully_async.planner.memory_model import _strategy
from fully_async.run.hydra_setup import load_config
from fully_async.train.ppo_update import ppo_update
from fully_async.train.train_step import prepare_batch
from test_torch_backend import make_samples


def config(model_dir, *overrides):
    return load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-6",
                        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                        *overrides])


def share_moved(cfg, steps=3):
    """The share of the weights (their full float32 values) that `steps` PPO updates changed."""
    import torch.distributed as dist

    from fully_async.train.group import build_local_backend

    backend = build_local_backend(cfg, CPU, 10, 0, 1, None, engine_beside=False)
    try:
        before = {k: v.detach().float().clone() for k, v in backend.iter_full_parameters()}
        for step in range(steps):
            batch = build_batch(make_samples(seed=step))
            prepare_batch(backend, cfg, batch, {})
            ppo_update(backend, cfg, batch, num_mini_batches=1)
        after = {k: v.detach().float() for k, v in backend.iter_full_parameters()}
        dtypes = {v.dtype for _, v in backend.iter_full_parameters()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    changed = sum(int((before[k] != after[k]).sum()) for k in before)
    return changed / sum(v.numel() for v in before.values()), dtypes


@pytest.mark.parametrize("dtype,devices,backend", [("float32", 1, "torch"), ("bfloat16", 1, "fsdp2"),
                                                    ("float16", 1, "fsdp2"), ("float32", 2, "fsdp2"),
                                                    ("bfloat16", 2, "fsdp2")])
def test_verl_fsdp_resolves_by_devices_and_dtype(random_model_dir, dtype, devices, backend):
    cfg = config(random_model_dir, f"actor_rollout_ref.actor.dtype={dtype}", f"trainer.n_gpus_per_node={devices}")
    assert actor_strategy(cfg) == backend
    assert _strategy("fsdp", devices, dtype) == backend   # the memory model plans the same backend


def test_one_device_bf16_moves_its_weights_like_float32(random_model_dir, caplog):
    moved32, dtypes32 = share_moved(config(random_model_dir, "actor_rollout_ref.actor.dtype=float32"))
    moved16, dtypes16 = share_moved(config(random_model_dir, "actor_rollout_ref.actor.dtype=bfloat16"))
    assert dtypes32 == dtypes16 == {torch.float32}        # float32 masters in both
    assert moved32 > 0.99 and moved16 > 0.99 and abs(moved16 - moved32) < 0.01, (moved16, moved32)
    # what the same run did on plain torch: bf16 parameters, whose updates at lr 1e-6 round away, warned at start
    caplog.set_level(logging.WARNING)
    pure = config(random_model_dir, "actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.strategy=torch")
    validate(pure)
    assert "parameters and AdamW states are bfloat16" in caplog.text
    moved_pure, dtypes_pure = share_moved(pure)
    assert dtypes_pure == {torch.bfloat16} and moved_pure < 0.05, moved_pure


def test_a_backend_built_outside_a_trainer_group_joins_a_world_of_its_own(random_model_dir):
    """Benches and tests build the backend directly (no trainer group): verl's fsdp on one bf16 device still gets
    its float32 masters, in a one-rank process group of the process's own."""
    import torch.distributed as dist

    from fully_async.train.backends import build_backend

    assert not dist.is_initialized()
    backend = build_backend(config(random_model_dir, "actor_rollout_ref.actor.dtype=bfloat16"), CPU, 10)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1 and backend.fsdp
        assert {v.dtype for _, v in backend.iter_full_parameters()} == {torch.float32}
    finally:
        dist.destroy_process_group()


def one_update(cfg, lone, keeps=None):
    """The float32 master weights after one PPO update of several micro-batches, and the aten copy_ calls it made;
    `lone=False` makes the one-rank fsdp2 reduce after every micro-batch (what FSDP2 does by default)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.train.group import build_local_backend

    backend = build_local_backend(cfg, CPU, 10, 0, 1, None, engine_beside=False)
    if keeps is not None:
        assert backend.keep_gathered is keeps
    if not lone:
        backend._lone_rank = lambda model: False
    try:
        batch = build_batch(make_samples(seed=0))
        prepare_batch(backend, cfg, batch, {})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ppo_update(backend, cfg, batch, num_mini_batches=1)
        weights = {k: v.detach().float().clone() for k, v in backend.iter_full_parameters()}
        assert TorchBackend._lone_rank(backend, backend.model)   # a one-rank fsdp2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
    return weights, copies


@pytest.mark.parametrize("reshard", ["true", "false"])
def test_one_rank_fsdp2_reduces_once_a_mini_batch_to_the_same_weights(random_model_dir, reshard):
    """A one-rank fsdp2 (verl's fsdp on one bf16 device) accumulates its micro-batches' gradients in float32 and
    reduces once: the weights after the update equal those of a reduce after every micro-batch, with fewer copies
    (and with reshard_after_forward=false, no gather after the first micro-batch)."""
    cfg = config(random_model_dir, "actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.optim.lr=1e-3",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={reshard}")
    each, copies_each = one_update(cfg, lone=False)
    once, copies_once = one_update(cfg, lone=True)
    for name in each:
        torch.testing.assert_close(once[name], each[name], rtol=0, atol=0, msg=name)
    assert copies_once < copies_each, (copies_once, copies_each)


def lone_rank_keeps(cfg):
    """Whether the one-rank fsdp2 `cfg` builds keeps its layers gathered (built, read, its group ended)."""
    import torch.distributed as dist

    from fully_async.train.group import build_local_backend

    try:
        return build_local_backend(cfg, CPU, 10, 0, 1, None, engine_beside=False).keep_gathered
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_unset_reshard_keeps_a_lone_rank_gathered_where_the_copy_is_small(random_model_dir, monkeypatch):
    """fsdp_config.reshard_after_forward unset: a one-rank fsdp2 keeps its layers gathered when their bf16 copy is at
    most a tenth of the device (here as the device's reported memory makes it), so no micro-batch after the first
    casts the weights again: fewer copies, the same weights as an explicit reshard_after_forward=true.  A device too
    small, or one whose memory is unknown, reshards."""
    from fully_async.device import Device

    memory = {"gib": 1e3}
    monkeypatch.setattr(Device, "total_memory",
                        lambda self, index=0: None if memory["gib"] is None else memory["gib"] * 2**30)
    common = ("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.optim.lr=1e-3",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    # set true: resharded however large the device
    resharded, copies_resharded = one_update(
        config(random_model_dir, *common, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=true"), True,
        keeps=False)
    unset, copies_unset = one_update(config(random_model_dir, *common), True, keeps=True)
    for name in resharded:
        torch.testing.assert_close(unset[name], resharded[name], rtol=0, atol=0, msg=name)
    # kept: the casts of every micro-batch after the first are gone
    assert copies_unset < 0.9 * copies_resharded, (copies_unset, copies_resharded)
    for memory["gib"] in (1e-4, None):   # the copy over a tenth of the device; the device's memory unknown
        assert lone_rank_keeps(config(random_model_dir, *common)) is False, memory


@pytest.mark.parametrize("reshard, world, gathered, device, keeps", [
    (True, 1, 1.0, 100.0, False), (False, 4, 50.0, 100.0, True),          # as set, whatever the sizes
    (None, 2, 1.0, 100.0, False),                                          # several ranks: verl's default, resharded
    (None, 1, 10.0, 100.0, True), (None, 1, 10.1, 100.0, False), (None, 1, 1.0, None, False)])
def test_keeps_gathered_layers(reshard, world, gathered, device, keeps):
    from types import SimpleNamespace

    from fully_async.core.config import keeps_gathered_layers

    assert keeps_gathered_layers(SimpleNamespace(reshard_after_forward=reshard), world, gathered, device) is keeps


def test_a_kept_lone_rank_shards_as_one_group_and_resumes_either_way(random_model_dir, tmp_path):
    """A one-rank fsdp2 that keeps its layers gathered is one FSDP2 group (one gather and one set of hooks a
    micro-batch, not one per layer); its checkpoint and a per-layer one load into each other, optimizer included:
    the key may change between a run and its resume."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fully_async.train.backends.fsdp import decoder_layers
    from fully_async.train.group import build_local_backend

    common = ("actor_rollout_ref.actor.dtype=bfloat16", "actor_rollout_ref.actor.optim.lr=1e-3",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")

    def trained(reshard, load=None, save=None):
        cfg = config(random_model_dir, *common, f"actor_rollout_ref.actor.fsdp_config.reshard_after_forward={reshard}")
        backend = build_local_backend(cfg, CPU, 10, 0, 1, None, engine_beside=False)
        try:
            grouped = [isinstance(layer, FSDPModule) for layer in decoder_layers(backend.model)]
            assert grouped == [reshard == "true"] * len(grouped)   # per layer only where resharding
            if load:
                backend.load(load)
            batch = build_batch(make_samples(seed=1 if load else 0))
            prepare_batch(backend, cfg, batch, {})
            ppo_update(backend, cfg, batch, num_mini_batches=1)
            if save:
                backend.save(save)
            return {k: v.detach().float().clone() for k, v in backend.iter_full_parameters()}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    trained("false", save=str(tmp_path / "kept"))
    trained("true", save=str(tmp_path / "per_layer"))
    # resumed in the other layout, the next update lands on the same weights as resumed in its own
    same = trained("false", load=str(tmp_path / "kept"))
    other = trained("true", load=str(tmp_path / "kept"))
    back = trained("false", load=str(tmp_path / "per_layer"))
    for name in same:
        torch.testing.assert_close(other[name], same[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(back[name], same[name], rtol=0, atol=0, msg=name)
