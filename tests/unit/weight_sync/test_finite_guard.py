"""Every transport refuses to push non-finite weights, naming the parameter and the version, before anything
reaches an engine."""
import pytest
import torch

from fully_async.train.group import load_trainer_weights
from fully_async.weight_sync import LocalWeightSync, ObjectStoreWeightSync
from fully_async.weight_sync.guard import NonFiniteWeights, finite_stream


class Backend:
    def __init__(self, bad=float("nan")):
        self.params = {"embed.weight": torch.ones(3, 2), "lm_head.weight": torch.tensor([[1.0, bad]])}

    def named_parameters_for_sync(self):
        return self.params

    def iter_full_parameters(self):
        yield from self.params.items()

    def param_shapes(self):
        return [(n, tuple(t.shape)) for n, t in self.params.items()]


class Engine:
    def __init__(self):
        self.loaded = []

    def update_weights(self, named, version):
        for name, _ in (named.items() if isinstance(named, dict) else named):
            self.loaded.append(name)


class Remote:
    def __init__(self):
        self.calls = []

    def remote(self, *args):
        self.calls.append(args)


class Rollouter:
    update_weights = Remote()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_object_store_refuses_before_put(bad):
    rollouter = Rollouter()
    rollouter.update_weights = Remote()
    with pytest.raises(NonFiniteWeights, match=r"param version 7 .*lm_head.weight has 1 non-finite values of 2"):
        ObjectStoreWeightSync(Backend(bad), rollouter).push(7)
    assert rollouter.update_weights.calls == []


def test_local_sync_refuses_rank_0_copy_and_per_rank_stream():
    engine = Engine()
    with pytest.raises(NonFiniteWeights, match="param version 3"):
        LocalWeightSync(Backend(), engine, per_rank=False).push(3)
    assert engine.loaded == []
    with pytest.raises(NonFiniteWeights, match="lm_head.weight"):
        load_trainer_weights(Backend(), engine, 4)
    assert engine.loaded == ["embed.weight"]  # the stream stops at the first bad parameter


def test_finite_weights_pass_untouched():
    params = Backend(bad=2.0).params
    assert [n for n, _ in finite_stream(params.items(), 1)] == ["embed.weight", "lm_head.weight"]
    engine = Engine()
    load_trainer_weights(Backend(bad=2.0), engine, 1)
    assert engine.loaded == ["embed.weight", "lm_head.weight"]
    ints = {"pos": torch.tensor([1, 2])}  # integer buffers are not checked (they cannot be NaN)
    assert list(finite_stream(ints.items(), 1))
