"""Device-IPC weight sync on a real CUDA device: another process opens the trainer's packed weights, sees them
cast to the rollout dtype, and sees the next push's values in the same buffers."""
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA IPC handles")


class Backend:
    def __init__(self, model):
        self.model = model

    def iter_full_parameters(self):
        return ((n, p.detach()) for n, p in self.model.named_parameters())


class Rollouter:
    """Stands in for the rollouter actor: records the handle the push sends."""
    def __init__(self):
        self.sent = []

    @property
    def update_weights(self):
        outer = self

        class Remote:
            @staticmethod
            def remote(handle, version):
                outer.sent.append((handle, version))
                return None
        return Remote


def _child(handle, q):
    torch.cuda.set_device(0)
    opened = handle.open()
    q.put({name: (str(t.dtype), float(t.float().sum()), tuple(t.shape)) for name, t in opened.items()})


def _open_elsewhere(handle):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(handle, q))
    p.start()
    out = q.get(timeout=120)
    p.join(60)
    return out


def test_another_process_reads_the_packed_weights_and_the_next_push():
    from fully_async.weight_sync.device_ipc import DeviceIpcWeightSync

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
    sync = DeviceIpcWeightSync(Backend(model), Rollouter(), torch.bfloat16)
    sync.push(1)
    handle, version = sync.rollouter.sent[-1]
    assert version == 1
    seen = _open_elsewhere(handle)
    for name, p in model.named_parameters():
        dtype, total, shape = seen[name]
        assert dtype == "torch.bfloat16" and shape == tuple(p.shape)
        assert total == pytest.approx(float(p.detach().to(torch.bfloat16).float().sum()), rel=1e-3, abs=1e-3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sync._pending = None
    sync.push(2)
    assert sync.rollouter.sent[-1][0] is handle      # the same buffers, rewritten in place
    seen = _open_elsewhere(handle)
    for name, p in model.named_parameters():
        assert seen[name][1] == pytest.approx(float(p.detach().to(torch.bfloat16).float().sum()), rel=1e-2, abs=1e-2)


def test_a_non_finite_weight_is_named_before_anything_is_sent():
    from fully_async.weight_sync.device_ipc import DeviceIpcWeightSync
    from fully_async.weight_sync.guard import NonFiniteWeights

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).cuda()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    sync = DeviceIpcWeightSync(Backend(model), Rollouter(), torch.bfloat16)
    with pytest.raises(NonFiniteWeights, match="1.weight"):
        sync.push(3)
    assert sync.rollouter.sent == []
