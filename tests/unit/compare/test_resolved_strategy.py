"""The comparison names the backend a run trained with as the trainer resolved verl's `fsdp`."""
import pytest

from fully_async.compare.runs import resolved_strategy


def saved(strategy, dtype=None, devices=1):
    actor = {"strategy": strategy} if dtype is None else {"strategy": strategy, "dtype": dtype}
    return {"actor_rollout_ref": {"actor": actor}, "trainer": {"nnodes": 1, "n_gpus_per_node": devices}}


@pytest.mark.parametrize("config, expected", [
    (saved("fsdp", "bfloat16"), "fsdp2"),     # one bf16 device: a one-rank fsdp2 (float32 master weights)
    (saved("fsdp", "float32"), "torch"),      # one float32 device: plain torch
    (saved("fsdp"), "torch"),                 # the actor's default dtype, float32
    (saved("fsdp", "float32", devices=2), "fsdp2"),
    (saved("megatron", "bfloat16"), "megatron"),
])
def test_fsdp_resolves_by_devices_and_dtype(config, expected):
    assert resolved_strategy(config) == expected
