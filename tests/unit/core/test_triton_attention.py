"""core/triton_attention.py's packed causal attention kernels (forward, dK/dV summed over each kv head's query
heads, dQ), run on CPU by Triton's interpreter (in a subprocess: TRITON_INTERPRET must be set before Triton is
imported) at blocks of 16: the output and the gradients equal plain attention per sequence in float64, over ragged
sequences (1 token, one block, block boundaries, several blocks), grouped kv heads and more keys than queries
(causality aligned to the bottom right), a sequence with keys and no queries (its keys get zero gradients);
float32 and float16; dK/dV summed by a program per kv head or per query head (added up after).  ~14 s."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fully_async.core import triton_attention, varlen_attention

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))

CODE = """
    import torch
    from fully_async.core import triton_attention as ta
    ta.BLOCKS = {16: dict.fromkeys(("fwd", "dkdv", "dq"), (16, 16, 1, 1))}

    def reference(q, k, v, cu_q, cu_k, scale):
        rep, parts = q.shape[1] // k.shape[1], []
        for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            qi = q[a:b].transpose(0, 1)
            ki, vi = (t[c:d].repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
            seen = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + (d - c) - (b - a)
            s = (qi @ ki.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
            parts.append((s.softmax(-1) @ vi).transpose(0, 1))
        return torch.cat(parts)

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 5e-3)):
        for per, (q_lens, k_lens) in enumerate((([1, 16, 17, 40, 5, 33], None), ([3, 0, 20, 1], [30, 5, 20, 9]))):
            per = per ^ (dtype == torch.float16)      # dK/dV programs a whole group (0) or a head each (1): both
            ta.BLOCKS[16]["dkdv"] = (16, 16, 1, 1, per)          # see both length sets and both dtypes
            k_lens = k_lens or q_lens
            q = torch.randn(sum(q_lens), 4, 16, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(sum(k_lens), 2, 16, dtype=dtype, requires_grad=True) for _ in range(2))
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                          for n in (q_lens, k_lens))
            grad = torch.randn(q.shape, dtype=dtype)
            out = ta.packed_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.25)
            out.backward(grad)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = reference(*leaves, cu_q, cu_k, 0.25)
            ref.backward(grad.double())
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                  (ref, *(t.grad for t in leaves))):
                err = float((a.double() - b).abs().max())
                assert err < tol * max(1.0, float(b.abs().max())), (dtype, q_lens, k_lens, name, err)
    print("ok")
"""


def test_kernels_equal_plain_attention_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE)], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout + r.stderr)[-3000:]


def test_where_the_kernels_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "cpu" in triton_attention.supported("cpu", torch.float32, 64)
    assert "head_dim" in triton_attention.supported("cuda", torch.bfloat16, 80)
    assert "dtype" in triton_attention.supported("cuda", torch.float32, 64)
    # packed_causal_attention picks a fused CUDA kernel only on CUDA; on CPU it runs sdpa per sequence
    assert varlen_attention.fused_kernel(torch.empty(1, 2, 64)) is None


def test_bad_shapes_are_refused_with_their_sizes():
    q, k = torch.empty(5, 3, 16), torch.empty(5, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_attention.packed_attention(q, k, k, cu, cu, 5, 5, 0.25)
    with pytest.raises(ValueError, match="int32"):
        triton_attention.packed_attention(q[:, :2], k, k, cu.long(), cu, 5, 5, 0.25)


def test_auto_picks_triton_on_hopper_only_and_decides_once(monkeypatch):
    from fully_async.device import Device

    for capability, want in (((9, 0), "triton"), ((8, 0), "flash"), ((10, 0), "flash"), (None, "flash")):
        monkeypatch.setattr(varlen_attention, "_AUTO", [])
        monkeypatch.setattr(Device, "compute_capability", lambda self, index=0, c=capability: c)
        assert varlen_attention.resolve_packed_kernel(torch.device("cuda")) == want
        monkeypatch.setattr(Device, "compute_capability", lambda self, index=0: (9, 0) if want == "flash" else (7, 5))
        assert varlen_attention.resolve_packed_kernel(torch.device("cuda")) == want     # kept, not asked again


def test_dkdv_programs_sum_over_a_divisor_of_the_group():
    assert [triton_attention.dkdv_heads(7, asked) for asked in (0, 1, 3, 7, 9)] == [7, 1, 1, 7, 7]
    assert [triton_attention.dkdv_heads(4, asked) for asked in (0, 1, 2, 3)] == [4, 1, 2, 2]


def test_blocks_fall_back_to_the_nearest_measured_head_dim_above(monkeypatch):
    monkeypatch.setattr(triton_attention, "BLOCKS", {64: {"fwd": 1}, 128: {"fwd": 2}})
    assert [triton_attention.blocks(d)["fwd"] for d in (16, 32, 64, 96, 128, 256)] == [1, 1, 1, 2, 2, 2]


def test_auto_keeps_flash_at_head_dims_not_measured_faster(monkeypatch):
    monkeypatch.setattr(varlen_attention, "_AUTO", ["triton"])           # a Hopper device, as resolved at set-up
    monkeypatch.setattr(varlen_attention, "flash_runs", lambda *a: True)
    monkeypatch.setattr(triton_attention, "supported", lambda *a: None)
    monkeypatch.setattr(triton_attention, "FASTER_ON_HOPPER", frozenset({64}))
    meta = {d: torch.empty(1, 2, d, device="meta") for d in (32, 64)}
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    assert varlen_attention.fused_kernel(meta[64]) == "triton"
    assert varlen_attention.fused_kernel(meta[32]) == "flash"
    monkeypatch.setattr(varlen_attention, "_AUTO", ["flash"])            # not Hopper
    assert varlen_attention.fused_kernel(meta[64]) == "flash"
