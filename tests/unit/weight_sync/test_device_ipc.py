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
    # IPC with the embedded engine on one CUDA device; the object store on several devices and for vLLM engines
    auto = load_config(COLOCATED + ["multi_job.pool=colocated"])
    assert isinstance(build_weight_sync(auto, Backend(), None, cuda), DeviceIpcWeightSync)
    for other in (["trainer.n_gpus_per_node=2"], ["actor_rollout_ref.rollout.name=vllm"]):
        cfg = load_config(COLOCATED + ["multi_job.pool=colocated", *other])
        assert isinstance(build_weight_sync(cfg, Backend(), None, cuda), ObjectStoreWeightSync), other


@pytest.mark.parametrize("overrides", [
    ["mode=sync", "trainer.device=cuda"],
    ["mode=async", "trainer.device=cuda", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"],
    ["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0", "trainer.device=cpu"],
    COLOCATED + ["trainer.n_gpus_per_node=2"],
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
