"""Device layer: selection, Ray resources, and the rule that only device.py touches torch.cuda."""
import pathlib
import re

import pytest

from fully_async import device as dev

PKG = pathlib.Path(dev.__file__).parent   # the whole package


def test_torch_cuda_only_in_device_py():
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
                 if p.name != "device.py" and re.search(r"torch\.cuda", p.read_text())]
    assert offenders == []


def test_vendor_imports_are_lazy():
    """torch_npu / vllm / megatron are never imported at module top level outside their own file."""
    pattern = re.compile(r"^(import|from) (torch_npu|vllm|megatron)", re.M)
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_platform_names():
    assert (dev.NPU.comm_backend, dev.NPU.visible_devices_env, dev.NPU.ray_resource) == \
        ("hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU")
    assert (dev.CUDA.comm_backend, dev.CUDA.visible_devices_env, dev.CUDA.ray_resource) == \
        ("nccl", "CUDA_VISIBLE_DEVICES", "GPU")
    assert dev.CPU.comm_backend == "gloo" and not dev.CPU.is_accelerator


def test_ray_actor_options():
    assert dev.CUDA.ray_actor_options(2) == {"num_cpus": 1, "num_gpus": 2}
    assert dev.NPU.ray_actor_options(4) == {"num_cpus": 1, "resources": {"NPU": 4}}
    assert dev.CPU.ray_actor_options(1) == {"num_cpus": 1}


def test_auto_on_this_machine_and_explicit_cpu(monkeypatch):
    monkeypatch.setattr(dev, "npu_available", lambda: False)
    monkeypatch.setattr(dev, "cuda_available", lambda: False)
    assert dev.get_device("auto") is dev.CPU
    assert dev.get_device("cpu") is dev.CPU
    with pytest.raises(dev.DeviceError, match="trainer.device='tpu'"):
        dev.get_device("tpu")


def test_npu_without_torch_npu_names_the_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "torch_npu":
            raise ImportError("No module named 'torch_npu'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(dev.DeviceError, match=r"fully_async\[npu\].*set_env.sh"):
        dev.check_available(dev.NPU)


def test_cpu_memory_stats_report_rss():
    stats = dev.CPU.memory_stats()
    assert set(stats) == {"host_rss_gib"} and 0 < stats["host_rss_gib"] < 64


def test_npu_actors_get_hccl_port_ranges_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("HCCL_HOST_SOCKET_PORT_RANGE", raising=False)
    monkeypatch.setenv("HCCL_NPU_SOCKET_PORT_RANGE", "60000-60050")
    assert dev.NPU.runtime_env_vars() == {"HCCL_HOST_SOCKET_PORT_RANGE": "auto",
                                          "HCCL_NPU_SOCKET_PORT_RANGE": "60000-60050"}
    assert dev.CUDA.runtime_env_vars() == {} and dev.CPU.runtime_env_vars() == {}


def test_collective_backends_are_named_only_in_device_py():
    """The npu path never names nccl (nor any backend): every process group comes from Device.comm_backend /
    Device.new_group, so a platform's backend is chosen in one place."""
    pattern = re.compile(r"[\"'](nccl|hccl|gloo)[\"']|ProcessGroup(NCCL|HCCL|Gloo)")
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name != "device.py" and
                 pattern.search(p.read_text())]
    assert offenders == []


def test_megatron_on_npu_without_mindspeed_names_the_fix(monkeypatch):
    import builtins

    from fully_async.train.backends.megatron_backend import _import_megatron

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name.startswith("mindspeed"):
            raise ImportError("No module named 'mindspeed'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match=r"strategy=megatron on trainer.device=npu needs MindSpeed"):
        _import_megatron(dev.NPU)


def test_a_trainer_without_an_engine_beside_asks_cuda_for_expandable_segments(monkeypatch):
    """Device.prefer_expandable_segments: CUDA only, the user's PYTORCH_(CUDA_)ALLOC_CONF wins; and
    build_local_backend asks for it only in a process that hosts no engine (async's trainer ranks)."""
    import torch

    from fully_async.train import group

    asked = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", asked.append, raising=False)
    monkeypatch.setattr(dev, "_EXPANDABLE", [])
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    with dev.CUDA.classic_segments():          # nothing turned on yet: nothing to turn off
        assert asked == []
    assert dev.CPU.prefer_expandable_segments() is None and dev.NPU.prefer_expandable_segments() is None
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with monkeypatch.context() as m:
            m.setenv(var, "expandable_segments:False")
            assert dev.CUDA.prefer_expandable_segments() is None and asked == []
    assert "expandable segments" in dev.CUDA.prefer_expandable_segments()
    assert asked == ["expandable_segments:True"]
    # a buffer shared by CUDA IPC comes from ordinary segments, and the setting comes back after, also on an error
    with pytest.raises(KeyError), dev.CUDA.classic_segments():
        assert asked[-1] == "expandable_segments:False"
        raise KeyError("x")
    assert asked == ["expandable_segments:True", "expandable_segments:False", "expandable_segments:True"]
    with dev.CPU.classic_segments():
        assert len(asked) == 3

    class Probe:
        def __init__(self):
            self.calls = 0

        def prefer_expandable_segments(self):
            self.calls += 1
            return None

    import fully_async.train.backends as backends

    monkeypatch.setattr(backends, "build_backend", lambda cfg, device, steps: "backend")
    monkeypatch.setattr(group, "shards", lambda cfg: False)
    for beside, calls in ((False, 1), (True, 0)):
        probe = Probe()
        assert group.build_local_backend(None, probe, 1, 0, 1, None, engine_beside=beside) == "backend"
        assert probe.calls == calls
