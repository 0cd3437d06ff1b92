"""The test-only NPU stand-in (tests/npu_standin) itself: it stays out of this process and the package, places npu
tensors on its backend, honours ASCEND_RT_VISIBLE_DEVICES, computes npu_fusion_attention as attention does, and
its torch.cuda / nccl poison fails a call from the package.  Each check runs in a child process: registering
torch.npu cannot be undone."""
import importlib.util
import pathlib
import subprocess
import sys
import textwrap

from npu_standin_helpers import REPO, read_log, standin_env

PKG = pathlib.Path(REPO) / "fully_async"


def run_standin(tmp_path, code: str, **env: str) -> subprocess.CompletedProcess:
    e = standin_env(str(tmp_path / "log.jsonl"), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=120)


def test_the_standin_is_only_on_the_path_tests_give_it():
    spec = importlib.util.find_spec("torch_npu")                  # None here, or a real torch_npu on an Ascend box
    assert spec is None or "npu_standin" not in (spec.origin or ""), spec
    assert not [p for p in sys.path if "npu_standin" in p]
    assert not [p for p in PKG.rglob("*.py") if "npu_standin" in p.read_text()]   # the package never names it


def test_npu_device_module_tensors_and_visible_devices(tmp_path):
    r = run_standin(tmp_path, """
        import torch, torch_npu
        from fully_async.device import NPU, get_device
        assert get_device("auto") is NPU and NPU.device_count() == 1, NPU.device_count()
        NPU.set_device(0)
        x = torch.ones(3, device=NPU.torch_device()) + torch.nn.Linear(3, 3).to(NPU.torch_device()).weight.sum()
        g = torch.Generator(device=NPU.torch_device()).manual_seed(1)
        assert isinstance(g, torch.Generator) and torch.rand(2, generator=g).shape == (2,)
        assert set(NPU.memory_stats()) == {"host_rss_gib", "allocated_gib", "reserved_gib", "max_allocated_gib",
                                           "max_reserved_gib", "device_used_gib"}
        assert NPU.graphs() is None                              # the CPU backend has no device graphs
        assert NPU.total_memory() == NPU.mem_info()[1] > 0      # the size the driver sizes engine slots by
        try:
            NPU.set_device(1)
        except RuntimeError as exc:
            print("refused:", exc)
        print("ok", x.device)
    """, ASCEND_RT_VISIBLE_DEVICES="3", FA_NPU_STANDIN_TENSORS="backend")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: npu set_device(1): only 1 NPU(s) visible (ASCEND_RT_VISIBLE_DEVICES=[3])" in r.stdout
    assert "ok cpu" in r.stdout


def test_npu_tensors_can_be_privateuse1_tensors_that_train(tmp_path):
    """FA_NPU_STANDIN_TENSORS=npu (the CUDA backend's default): npu tensors are PrivateUse1 tensors over backend
    memory, as torch_npu's are, so autograd meets only npu tensors (with CUDA tensors it cannot train once
    PrivateUse1 is torch's accelerator); they give the backend's numbers, leave for the host and come back."""
    r = run_standin(tmp_path, """
        import torch, torch_npu
        from fully_async.device import NPU
        torch.manual_seed(0)
        ref = torch.nn.Linear(8, 4)
        m = torch.nn.Linear(8, 4).to(NPU.torch_device())
        m.load_state_dict(ref.state_dict())
        x = torch.randn(3, 8)
        for model, inp in ((ref, x), (m, x.to(NPU.torch_device()))):
            model(inp).square().sum().backward()
            torch.optim.AdamW(model.parameters(), lr=0.1).step()
        w = m.weight
        assert w.device.type == "npu" and w.grad.device.type == "npu" and type(w).__name__ == "NpuTensor"
        assert torch.equal(w.cpu(), ref.weight) and type(w.cpu()) is torch.Tensor and w.cpu().device.type == "cpu"
        assert torch.equal(w.grad.cpu(), ref.weight.grad)
        t = torch.tensor([1, 2], device="npu") + torch.arange(2, device="npu:0")
        assert t.device.type == "npu" and t.tolist() == [1, 3] and int(t.sum()) == 4
        host = w.detach().cpu()
        w.data = host                                   # host offload moves a parameter so, and back
        w.data = w.data.to(NPU.torch_device())
        assert w.device.type == "npu" and torch.equal(w.cpu(), host)
        from fully_async.core.host_offload import HostOffload
        offload, bias = HostOffload(), m.bias
        offload.module_to_host(m)                       # an engine's sleep: pinned host buffers, read as cpu tensors
        assert m.weight.device.type == "cpu" and m.bias is bias and torch.equal(m.weight.cpu(), host)
        assert m.weight.grad.device.type == "cpu" and torch.equal(m.weight.grad, ref.weight.grad)
        offload.module_to_device(m, NPU.torch_device())  # and its wake-up moves them back because they read so
        assert m.weight.device.type == "npu" and m.bias is bias and torch.equal(m(x.to("npu")).cpu(), ref(x))
        assert m.weight.grad.device.type == "npu" and torch.equal(m.weight.grad.cpu(), ref.weight.grad)
        buf = torch.arange(4.0, device="npu")
        with torch.inference_mode():                    # HF's rope indexes its inv_freq buffer so while generating
            view, fresh = buf[None, :, None], torch.ones(2, device="npu")[None]
            assert view.float().shape == (1, 4, 1) and not view.is_inference() and fresh.is_inference()
        buf.add_(1)
        assert view._version == buf._version == 1 and view.flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
        print("ok", torch.accelerator.current_accelerator())
    """, FA_NPU_STANDIN_TENSORS="npu")
    assert r.returncode == 0 and "ok npu" in r.stdout, r.stderr[-3000:]


def test_npu_fusion_attention_matches_sdpa(tmp_path):
    r = run_standin(tmp_path, """
        import torch, torch.nn.functional as F, torch_npu
        torch.manual_seed(0)
        q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8), torch.randn(2, 5, 2, 8)   # B S N D, GQA 4:2
        mask = torch.ones(2048, 2048).triu(1).bool()
        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=mask, scale=0.3, sparse_mode=3)[0]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
                                             v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True, scale=0.3)
        assert torch.allclose(out, ref.transpose(1, 2), atol=1e-6)
        # TND: the two batch rows packed (lengths 5, 5) attend only within themselves
        tnd = torch_npu.npu_fusion_attention(q.reshape(10, 4, 8), k.reshape(10, 2, 8), v.reshape(10, 2, 8), 4,
                                             "TND", atten_mask=mask, scale=0.3, actual_seq_qlen=(5, 10),
                                             actual_seq_kvlen=(5, 10), sparse_mode=3)[0]
        assert torch.allclose(tnd, out.reshape(10, 4, 8), atol=1e-6)
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_the_poison_fails_a_torch_cuda_call_from_the_package(tmp_path):
    r = run_standin(tmp_path, """
        import torch, torch_npu
        torch.cuda.is_available()                      # a probe, allowed
        from fully_async.device import CUDA
        try:
            CUDA.synchronize()
        except RuntimeError as exc:
            print("refused:", exc)
        import torch.distributed as dist
        print(dist.Backend.backend_list.count("hccl"), dist.is_hccl_available())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: NPU stand-in: the npu path called torch.cuda.synchronize at" in r.stdout, r.stdout
    assert "1 True" in r.stdout
    violations = [e for e in read_log(str(tmp_path / "log.jsonl")) if e["event"] == "violation"]
    assert [v["what"] for v in violations] == ["torch.cuda.synchronize"]
    assert "fully_async/device.py" in violations[0]["caller"]


def test_npu_graphs_capture_thread_local_like_cuda(tmp_path):
    """torch_npu's graph takes capture_error_mode as torch.cuda's does: the npu path asks for thread_local too (a
    Ray actor's other threads keep using the device during a capture); a torch_npu without the argument gets
    none.  The stand-in's CPU backend has no graphs, so its module is given a graph API here."""
    r = run_standin(tmp_path, """
        import torch, torch_npu
        from fully_async.device import NPU
        assert NPU.graphs() is None
        def graph(npu_graph, pool=None, stream=None, capture_error_mode="global"): ...
        def old_graph(npu_graph, pool=None, stream=None): ...
        torch.npu.NPUGraph, torch.npu.graph_pool_handle = object, lambda: None
        for fn in (graph, old_graph):
            torch.npu.graph = fn
            print(fn.__name__, NPU.graphs().capture_kwargs)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "graph {'capture_error_mode': 'thread_local'}" in r.stdout and "old_graph {}" in r.stdout, r.stdout


def test_the_npu_profiler_is_torch_npus(tmp_path):
    """Device.profiler on an NPU asks torch_npu.profiler for host and NPU activity and writes through its trace
    handler (the stand-in's profiler is torch's, so the trace is a Chrome trace here); verl's contents pick what
    it records: [cpu] the host alone, [npu, shapes] (or torch's name, cuda) the device too, with shapes."""
    r = run_standin(tmp_path, f"""
        import torch, torch_npu
        from fully_async.device import NPU
        for i, contents in enumerate([(), ("cpu",), ("npu", "shapes"), ("cuda",)]):
            with NPU.profiler({str(tmp_path / "prof")!r} + str(i), contents):
                (torch.ones(64, 64, device=NPU.torch_device()) @ torch.ones(64, 64, device=NPU.torch_device())).sum()
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    asked = [e for e in read_log(str(tmp_path / "log.jsonl")) if e["event"] == "profiler"]
    assert [e["activities"] for e in asked] == [["CPU", "NPU"], ["CPU"], ["CPU", "NPU"], ["CPU", "NPU"]]
    assert [e["record_shapes"] for e in asked] == [False, False, True, False]
    assert len(list((tmp_path / "prof0").glob("*.pt.trace.json"))) == 1
