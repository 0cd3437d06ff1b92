"""The TrainBackend Protocol is the one list of backend calls: every strategy's backend and the data-parallel group
implement all of it, with the Protocol's parameters (a trainer rank >= 1 serves exactly it:
tests/unit/actors/test_train_worker.py)."""
import inspect

import pytest

from fully_async.train.backends import ShardedTrainBackend, TrainBackend
from fully_async.train.group import GroupBackend, ReplicatedGroupBackend


def protocol_methods(proto) -> set:
    names = set()
    for cls in proto.__mro__:
        if cls in (TrainBackend, ShardedTrainBackend):
            names |= {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


def params(fn) -> list:
    return list(inspect.signature(fn).parameters)


def test_the_protocol_lists_the_primitives_not_the_loop():
    """The PPO loop is train/ppo_update.py: a backend serves one mini-batch's forward/backward and one optimizer
    step, and nothing that runs epochs or mini-batches crosses into it."""
    assert {"forward_backward", "optimizer_step"} <= protocol_methods(TrainBackend)
    assert not {"train_step", "train_mini_batch", "ppo_update"} & protocol_methods(ShardedTrainBackend)


@pytest.mark.parametrize("cls,proto", [
    ("fully_async.train.backends.torch_backend:TorchBackend", ShardedTrainBackend),
    ("fully_async.train.backends.megatron_backend:MegatronBackend", TrainBackend),
    (GroupBackend, TrainBackend),
    (ReplicatedGroupBackend, TrainBackend),
])
def test_implementations_have_every_protocol_method(cls, proto):
    if isinstance(cls, str):
        import importlib
        module, name = cls.split(":")
        cls = getattr(importlib.import_module(module), name)
    for name in protocol_methods(proto):
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}"
        want = params(getattr(proto, name))
        assert params(impl)[:len(want)] == want, f"{cls.__name__}.{name}{params(impl)} vs the Protocol's {want}"
