"""A trainer rank >= 1 (TrainWorker) serves exactly the TrainBackend Protocol's methods, by name, checked when the
class is defined (that every backend and the group implement the Protocol: tests/unit/train/test_backend_contract.py)."""
import inspect

import pytest

from fully_async.actors.train_worker import TrainWorker, forwarded_methods, forwards_to_backend
from fully_async.train.backends import ShardedTrainBackend
from fully_async.train.group import RANK0_ONLY


def protocol_methods(proto) -> set:
    """Public methods the Protocol declares, its base Protocols' included."""
    return {n for cls in proto.__mro__ if cls.__module__ == proto.__module__ for n, v in vars(cls).items()
            if inspect.isfunction(v) and not n.startswith("_")}


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
    args = {"compute_log_probs": ("b", "ref", 3), "forward_backward": ("m",), "optimizer_step": (True,),
            "compute_values": ("b", 3), "compute_rm_scores": ("b", 3), "compute_sum_pi_squared": ("b", 3),
            "named_parameters_for_sync": (), "stream_full_parameters": (None,),
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
