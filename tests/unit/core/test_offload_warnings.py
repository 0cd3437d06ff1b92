"""fsdp_config.*_offload acts where the trainer has phases away from its devices (sync, colocated async, a shared
pool, fsdp2's host-resident shards); elsewhere it is named once, never passed over in silence."""
import logging

import pytest

from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]


@pytest.mark.parametrize("overrides,warned", [
    (["mode=async"], True),                                   # dedicated devices, strategy torch: nothing offloads
    (["mode=sync"], False),
    (["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0"], False),
])
def test_offload_is_warned_only_where_it_cannot_act(caplog, overrides, warned):
    with caplog.at_level(logging.WARNING):
        validate(load_config(overrides + OFFLOAD))
    said = [r.getMessage() for r in caplog.records if "optimizer_offload=true has no effect" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert "colocated async" in said[0]
