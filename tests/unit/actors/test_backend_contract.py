"""The TrainBackend Protocol is the one list of backend calls: every backend and the data-parallel group implement
it, and a trainer rank >= 1 (TrainWorker) serves exactly its methods, by name, checked when the class is defined."""
import inspect

import pytest

from fully_async.train.backends import ShardedTrainBackend, TrainBackend
from fully_async.actors.train_group import (RANK0_ONLY, GroupBackend, ReplicatedGroupBackend, TrainWorker,
                                     forwarded_methods, forwards_to_backend)


def protocol_methods(proto) -> set:
    names = set()
    for cls in proto.__mro__:
        if cls in (TrainBackend, ShardedTrainBackend):
            names |= {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


def params(fn) -> list:
    return list(inspect.signature(fn).parameters)


def test_train_worker_serves_exactly_the_protocol():
    assert set(forwarded_methods(TrainWorker)) | set(RANK0_ONLY) == protocol_methods(ShardedTrainBackend)
    assert not set(forwarded_methods(TrainWorker)) & set(RANK0_ONLY)
    assert not hasattr(TrainWorker, "call")  # no dispatch by string any more


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return name
        return method


def test_each_worker_method_runs_the_backend_method_of_its_name():
    worker = object.__new__(TrainWorker)   # no actor, no device: only the forwarding
    worker.backend = Recorder()
    args = {"compute_log_probs": ("b", "ref", 3), "train_mini_batch": ("m", 2.0, 2.0, 1, 4),
            "train_step": ("b", 2), "named_parameters_for_sync": (), "stream_full_parameters": (None,),
            "save": ("/p",), "load": ("/p",), "offload": (), "onload": ()}
    for name in forwarded_methods(TrainWorker):
        assert getattr(worker, name)(*args[name]) in (name, None)
        assert worker.backend.calls[-1][0] == name
    # a replicated (megatron) rank is asked without a micro-batch count and gets none
    worker.compute_log_probs("b", "actor")
    assert worker.backend.calls[-1] == ("compute_log_probs", ("b", "actor"), {})


def test_an_undeclared_or_mismatched_method_fails_at_definition():
    with pytest.raises(TypeError, match="does not declare"):
        class Typo:
            @forwards_to_backend
            def compute_logprobs(self, batch):
                pass
    with pytest.raises(TypeError, match="does not match"):
        class Mismatch:
            @forwards_to_backend
            def save(self, directory):
                pass


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
