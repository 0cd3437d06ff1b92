"""Ulysses sequence parallelism (train/backends/ulysses.py) on gloo ranks: the split attention equals the unsplit one
(values and gradients, grouped-query heads fewer than the group), and a trainer of 2 ranks at
ulysses_sequence_parallel_size=2 (and 4 ranks: 2 data-parallel shards) compute the same log-probs, values, updates
and weights as one device."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fully_async.cluster.network import free_port
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config
from fully_async.core import varlen_attention
from fully_async.core.batch import PackedRows
from fully_async.train.backends import ulysses
import tests_helpers
from ulysses_parity import check_parity

SP = 2


def _attention_rank(rank: int, port: int, heads: int, kv_heads: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=SP)
    try:
        ulysses.setup(SP, "varlen")
        g = torch.Generator().manual_seed(0)
        total, dim = 12, 8                                   # three packed sequences: 5, 4 and 3 tokens
        pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
        q = torch.randn(1, heads, total, dim, generator=g, requires_grad=True)
        k = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
        v = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
        w = torch.randn(1, total, heads, dim, generator=g)
        kwargs = PackedRows.of(torch.tensor([[1] * 5, [1] * 4 + [0], [1] * 3 + [0, 0]])).kwargs()   # pos's bounds
        ref, _ = varlen_attention.varlen_attention_forward(None, q, k, v, None, scaling=0.3, **kwargs)
        (ref * w).sum().backward()
        n = total // SP
        mine = slice(rank * n, (rank + 1) * n)
        lq, lk, lv = (t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v))
        out, _ = ulysses.attention_forward(None, lq, lk, lv, None, scaling=0.3, position_ids=pos[:, mine], **kwargs)
        (out * w[:, mine]).sum().backward()
        torch.save({"out": (out, ref[:, mine]), "dq": (lq.grad, q.grad[:, :, mine]),
                    "dk": (lk.grad, k.grad[:, :, mine]), "dv": (lv.grad, v.grad[:, :, mine])},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        ulysses.teardown()
        dist.destroy_process_group()


@pytest.mark.parametrize("kv_heads", [2, 1])   # 1: fewer key/value heads than the group, repeated first
def test_split_attention_equals_the_whole_rows(tmp_path, kv_heads):
    mp.spawn(_attention_rank, args=(free_port(), 4, kv_heads, str(tmp_path)), nprocs=SP)
    for rank in range(SP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, (mine, ref) in got.items():
            # the key/value gradient of one rank's tokens is summed over every rank's queries: the whole row's
            assert torch.allclose(mine, ref, atol=1e-5), (rank, name, (mine - ref).abs().max())


@pytest.fixture(scope="module")
def ray_cpus():
    yield from tests_helpers.ray_session(num_cpus=4)


@pytest.mark.parametrize("world", [2, 4])   # 4: two data-parallel shards of two sequence-parallel ranks each
def test_ranks_at_sequence_parallel_2_match_one_device(ray_cpus, world):
    check_parity(CPU, world, {"num_cpus": 1}, [])


@pytest.mark.parametrize("overrides,message", [
    ([], "must divide the trainer world size 1"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=false"], "use_remove_padding=true"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron"], "context parallelism"),
    (["trainer.n_gpus_per_node=3"], "must divide the trainer world size 3"),
])
def test_sequence_parallel_configs_that_cannot_run_are_refused_naming_the_key(overrides, message):
    from fully_async.core.config import ConfigError
    from fully_async.core.config_checks import validate

    cfg = load_config(["actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cuda",
                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", *overrides])
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert err.value.key == "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


def test_a_sequence_parallel_group_shares_its_devices_token_budgets_as_verl():
    from fully_async.core.config import ConfigError
    from fully_async.core.config_checks import validate

    base = ["actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cuda", "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3000",
            "data.max_prompt_length=1024", "data.max_response_length=4096"]
    validate(load_config(base + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]))   # 2 x 3000 >= 5120
    with pytest.raises(ConfigError, match=r"3000 cannot hold one sequence"):
        validate(load_config(base))


def test_the_heads_must_split_over_the_group_and_the_kernel_take_boundaries():
    from types import SimpleNamespace

    from fully_async.core.config import ConfigError
    from fully_async.run.prepare import check_attention, check_parallel_layout

    cfg = load_config(["actor_rollout_ref.model.use_remove_padding=true", "trainer.n_gpus_per_node=8",
                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8"])
    with pytest.raises(ConfigError, match="4 attention heads do not split"):
        check_parallel_layout(cfg, SimpleNamespace(num_attention_heads=4))
    check_parallel_layout(cfg, SimpleNamespace(num_attention_heads=16))
    sdpa = load_config(["actor_rollout_ref.model.use_remove_padding=true", "trainer.n_gpus_per_node=2",
                        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"])
    with pytest.raises(ConfigError, match="sdpa cannot run under Ulysses"):
        check_attention(sdpa, SimpleNamespace())


def test_verl_scripts_reference_and_critic_sizes_follow_the_actors(caplog):
    cfg = load_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                       "critic.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert "critic.ulysses_sequence_parallel_size" in caplog.text and "run at actor_rollout_ref.actor" in caplog.text


def test_the_memory_model_gives_each_device_of_a_group_its_share_of_the_micro_batch():
    import json

    from fully_async.core.config import asset_path, typed_config
    from fully_async.planner.hardware import Shape
    from fully_async.planner.memory_model import trainer_memory

    shape = Shape.of(json.load(open(asset_path("tiny_arithmetic/model/config.json"))))
    base = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.model.use_remove_padding=true"]
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    acts = {sp: trainer_memory(typed_config(load_config(base + [f"{key}={sp}"])), shape, 4).parts["activations"]
            for sp in (1, 2)}
    assert acts[2] == pytest.approx(acts[1] / 2)


def test_a_ranks_slice_carries_the_whole_rows_bounds_from_the_host_layout_with_the_pad_sequence():
    """split_packed: the boundaries of the row padded to a multiple of the group come from the packed inputs' own
    (core/batch.PackedRows, no read-back from the device) plus the pad sequence: what the positions give."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])   # 5 + 2 + 4 = 11 tokens
    rows = PackedRows.of(mask)
    inputs = {"input_ids": torch.arange(11)[None], "position_ids": rows.positions[None], "cu_seq_lens_q": rows.cu,
              "cu_seq_lens_k": rows.cu, "max_length_q": rows.max_len, "max_length_k": rows.max_len}
    for rank in range(4):                      # 11 tokens over 4 ranks: one pad token
        sp = ulysses.SequenceParallel(group=None, size=4, rank=rank, base="varlen")
        local, targets, _ = ulysses.split_packed(inputs, torch.arange(11)[None], sp)
        assert local["cu_seq_lens_q"].tolist() == [0, 5, 7, 11, 12]    # the pad token: a sequence of its own
        assert local["max_length_q"] == 5
        assert local["input_ids"].shape == targets.shape == (1, 3)
