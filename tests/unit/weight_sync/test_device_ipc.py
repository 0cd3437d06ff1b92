"""Device-IPC weight sync (weight_sync/device_ipc.py): who gets it, who is refused, and the packed layout."""
import pytest
import torch

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config

COLOCATED = ["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0", "trainer.device=cuda"]


class Backend:
    pass


def test_device_ipc_by_name_and_by_auto_on_one_cuda_device():
    from fully_async.device import get_device
    from fully_async.weight_sync import ObjectStoreWeightSync, build_weight_sync
    from fully_async.weight_sync.device_ipc import DeviceIpcWeightSync

    cuda = get_device("cuda")
    named = load_config(COLOCATED + ["actor_rollout_ref.rollout.weight_sync=device_ipc"])
    validate(named)
    assert isinstance(build_weight_sync(named, Backend(), None, cuda), DeviceIpcWeightSync)
    # auto (the launcher puts colocated async on its private pool before the trainer builds its weight sync): device
    # IPC with the embedded engine on the CUDA devices of one node; the object store for vLLM engines, megatron
    # trainers and several nodes
    for devices in (1, 2):
        auto = load_config(COLOCATED + ["multi_job.pool=colocated", f"trainer.n_gpus_per_node={devices}"])
        assert isinstance(build_weight_sync(auto, Backend(), None, cuda), DeviceIpcWeightSync), devices
    for other in (["actor_rollout_ref.rollout.name=vllm"], ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"],
                  ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron"]):
        cfg = load_config(COLOCATED + ["multi_job.pool=colocated", *other])
        assert isinstance(build_weight_sync(cfg, Backend(), None, cuda), ObjectStoreWeightSync), other


@pytest.mark.parametrize("overrides", [
    ["mode=async", "trainer.device=cuda", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"],
    ["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0", "trainer.device=cpu"],
    COLOCATED + ["trainer.nnodes=2"],
    COLOCATED + ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron"],
    COLOCATED + ["actor_rollout_ref.rollout.name=vllm"],
])
def test_device_ipc_elsewhere_is_refused_naming_the_key(overrides):
    with pytest.raises(ConfigError) as err:
        validate(load_config(overrides + ["actor_rollout_ref.rollout.weight_sync=device_ipc"]))
    assert err.value.key == "actor_rollout_ref.rollout.weight_sync"
    assert "colocated" in str(err.value)


def test_views_lay_each_parameter_out_in_its_dtype_buffer():
    from fully_async.weight_sync.device_ipc import views

    flat = {"bfloat16": torch.arange(10, dtype=torch.bfloat16), "int64": torch.arange(3)}
    layout = [("a", "bfloat16", 0, (2, 3)), ("b", "bfloat16", 6, (4,)), ("c", "int64", 0, (3,))]
    out = views(flat, layout)
    assert out["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and out["b"].tolist() == [6, 7, 8, 9]
    assert out["c"].tolist() == [0, 1, 2]
    out["b"][0] = 42   # views, not copies: the engine reads the trainer's buffer
    assert flat["bfloat16"][6].item() == 42


def test_open_in_the_packing_process_is_refused():
    import os

    from fully_async.weight_sync.device_ipc import SharedWeights

    with pytest.raises(RuntimeError, match="two processes"):
        SharedWeights({}, [], "uuid", os.getpid()).open()


def test_several_devices_of_one_node_by_name():
    from fully_async.device import get_device
    from fully_async.weight_sync import build_weight_sync
    from fully_async.weight_sync.device_ipc import DeviceIpcWeightSync

    cfg = load_config(COLOCATED + ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.weight_sync=device_ipc"])
    validate(cfg)
    assert isinstance(build_weight_sync(cfg, Backend(), None, get_device("cuda")), DeviceIpcWeightSync)


class FakeHandle:
    def __init__(self, uuid):
        self.device_uuid = uuid

    def open(self):
        return {"opened": self.device_uuid}


def test_each_engine_opens_the_handle_packed_on_its_own_device(monkeypatch):
    from fully_async.weight_sync import device_ipc

    class Cuda:
        here = "GPU-b"

        def uuid(self, index=None):
            return self.here
    cuda = Cuda()
    monkeypatch.setattr(device_ipc, "_cuda", lambda: cuda)
    both = device_ipc.SharedWeightsByDevice([FakeHandle("GPU-a"), FakeHandle("GPU-b")])
    assert device_ipc.open_weights(both) == {"opened": "GPU-b"}
    cuda.here = "GPU-c"
    with pytest.raises(RuntimeError, match="no trainer rank packed its weights on this engine's device GPU-c"):
        device_ipc.open_weights(both)
    assert device_ipc.open_weights({"w": 1}) == {"w": 1}     # anything else is loaded as it is


def test_a_push_over_several_ranks_sends_every_ranks_handle(monkeypatch):
    """The group packs on every rank at once (rank 0 into the sync's own packer); one rank's handle goes as it is,
    several go together; rank 0's buffers are checked for non-finite values."""
    from fully_async.weight_sync import device_ipc

    class Packer(device_ipc.IpcPacker):
        def pack(self, params):
            self.handle = FakeHandle("GPU-0")
            return self.handle

        def check_finite(self, version):
            self.checked = version

    class Group:
        def pack_shared_weights(self, packer):
            return [packer.pack(()), FakeHandle("GPU-1")]

    class Rollouter:
        sent = []

        class update_weights:   # noqa: N801 - a Ray actor method's shape: .remote(...)
            @staticmethod
            def remote(handle, version):
                Rollouter.sent.append((handle, version))
    sync = device_ipc.DeviceIpcWeightSync(Group(), Rollouter, torch.bfloat16)
    sync.packer = Packer(torch.bfloat16)
    out = sync.push(3)
    (handle, version), = Rollouter.sent
    assert version == 3 and sync.packer.checked == 3 and "timing_s/param_sync/gather" in out
    assert isinstance(handle, device_ipc.SharedWeightsByDevice)
    assert [h.device_uuid for h in handle.handles] == ["GPU-0", "GPU-1"]


def test_sync_mode_warns_the_transport_inert(caplog):
    """Sync mode has no transport to choose (each rank's engine loads that rank's weights in process): the key is
    named as inert, so a comparison can hand both modes the same overrides."""
    with caplog.at_level("WARNING"):
        validate(load_config(["mode=sync", "trainer.device=cuda", "actor_rollout_ref.rollout.weight_sync=device_ipc"]))
    assert "actor_rollout_ref.rollout.weight_sync=device_ipc has no effect in sync mode" in caplog.text


def test_the_engine_pool_hands_device_ipc_handles_to_every_replica_as_they_are():
    """A handle (or every rank's) is never copied into the object store: each replica opens it on its own device
    (the first 2-GPU run failed here: the pool iterated the handles of both ranks as if they were tensors)."""
    from fully_async.rollout.engines.pool import _share
    from fully_async.weight_sync import device_ipc

    one = device_ipc.SharedWeights({}, [], "GPU-0", owner_pid=0)
    both = device_ipc.SharedWeightsByDevice([one, device_ipc.SharedWeights({}, [], "GPU-1", owner_pid=0)])
    for handle in (one, both):
        for remote, inline in ((True, False), (False, True), (True, True)):
            assert _share(handle, remote, inline) == (handle, handle)
