"""The split-KV decode attention (rollout/engines/decode_attention.py): its reference is plain SDPA over each
row's own cached positions; the Triton kernel (run on CPU by Triton's interpreter, in a subprocess because
TRITON_INTERPRET must be set before Triton is imported) equals the reference, cache writes included, and the
engine decoding through it samples what transformers' own modules sample (same tokens and log-probs from one
seed, over admission mid-run, interrupt and resume)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fully_async.rollout.engines.decode_attention import reference_decode_attention, supported

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def test_reference_equals_sdpa_over_each_rows_own_length():
    torch.manual_seed(0)
    q, kn, vn = torch.randn(4, 2, 3, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    k, v = torch.randn(6, 2, 40, 16), torch.randn(6, 2, 40, 16)
    lengths = torch.tensor([1, 7, 33, 40, 9, 9])
    span = 36                                 # row 3 (length 40) is clamped to the span: its new key not written
    k_ref, v_ref = k.clone(), v.clone()
    out = reference_decode_attention(q, k, v, lengths, span, 0.25, kn, vn)
    for b in range(4):
        n = min(int(lengths[b]), span)
        if lengths[b] <= span:
            k_ref[b, :, n - 1], v_ref[b, :, n - 1] = kn[b], vn[b]
        want = torch.nn.functional.scaled_dot_product_attention(q[b], k_ref[b, :, :n], v_ref[b, :, :n], scale=0.25)
        assert torch.allclose(out[b], want, atol=1e-6), b
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)          # rows 4, 5 (beyond the batch) untouched


def test_the_settings_follow_the_batchs_rows():
    """SETTINGS: the first entry whose bound holds the rows; past the last bound, the last entry."""
    from fully_async.rollout.engines.decode_attention import SETTINGS, settings_for

    bounds = [bound for bound, _ in SETTINGS]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 20
    for i, (bound, setting) in enumerate(SETTINGS):
        assert settings_for(bound) == setting
        if i:
            assert settings_for(SETTINGS[i - 1][0] + 1) == setting
    assert settings_for(1) == SETTINGS[0][1] and settings_for(1 << 40) == SETTINGS[-1][1]
    for split, block_n, warps, stages in (s for _, s in SETTINGS):
        assert split % block_n == 0 and warps in (1, 2, 4, 8) and stages >= 1


def test_the_kernel_is_cuda_only_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "cpu" in supported("cpu", torch.float32) and "npu" in supported("npu", torch.bfloat16)
    assert "int8" in supported("cuda", torch.int8)


def start_interpreted(code: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def kernel_code() -> str:
    return """
        import math
        import torch
        from fully_async.rollout.engines import decode_attention
        from fully_async.rollout.engines.decode_attention import (reference_decode_attention, rotate,
                                                                  split_kv_decode_attention)

        # every float tensor made here starts as NaN, so an output never written or scratch never filled shows up
        # (a freed tensor's memory could otherwise hold the right numbers from the call before)
        empty, empty_like = torch.empty, torch.empty_like
        nan = lambda t: t.fill_(math.nan) if t.is_floating_point() else t
        torch.empty = lambda *a, **kw: nan(empty(*a, **kw))
        torch.empty_like = lambda *a, **kw: nan(empty_like(*a, **kw))

        def written(cache, new_rows, lengths, span):
            cache = cache.float().clone()
            for b in range(new_rows.shape[0]):
                if lengths[b] <= span:
                    cache[b, :, lengths[b] - 1] = new_rows[b].float()
            return cache

        torch.manual_seed(0)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            q = torch.randn(6, 2, 5, 32, dtype=dtype)
            k, v = torch.randn(8, 2, 100, 32, dtype=dtype), torch.randn(8, 2, 100, 32, dtype=dtype)
            kn, vn = torch.randn(6, 2, 32, dtype=dtype), torch.randn(6, 2, 32, dtype=dtype)
            lengths = torch.tensor([1, 16, 17, 64, 97, 99, 100, 3])
            angle = torch.rand(6, 16) * 3
            cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
            wide = torch.randn(6, 2, 5, 40, dtype=dtype)   # q as a strided view (of a fused projection's output)
            for new, rope, view in ((False, False, False), (True, False, False), (True, True, True), (False, True, False)):
                k1, v1 = k.clone(), v.clone()
                kw = dict(k_new=kn, v_new=vn) if new else {}
                rot = dict(cos=cos, sin=sin) if rope else {}
                qq = wide[..., 8:40] if view else q
                got = split_kv_decode_attention(qq, k1, v1, lengths, 97, 0.2, split=32, block_n=16, **kw, **rot)
                want_q = rotate(qq, cos, sin) if rope else qq           # rounded to dtype as the kernel does
                want_kn = rotate(kn, cos, sin) if rope else kn
                ref = reference_decode_attention(want_q.float(), k.float().clone(), v.float().clone(), lengths, 97,
                                                 0.2, **({"k_new": want_kn.float(), "v_new": vn.float()} if new else {}))
                err = (got.float() - ref).abs().max().item()
                assert err < tol, (dtype, new, rope, err)
                assert torch.equal(k1.float(), written(k, want_kn, lengths, 97) if new else k.float()), (dtype, new)
                assert torch.equal(v1.float(), written(v, vn, lengths, 97) if new else v.float()), (dtype, new)
            print("ok", dtype)

        # the merge folded into the kernel: per (row, KV head) the split arriving last merges the others; rows of
        # 0 (zeros out), 1 split (no merge), a split boundary, up to 7 splits of 16
        q, k, v = torch.randn(7, 2, 3, 16), torch.randn(7, 2, 112, 16), torch.randn(7, 2, 112, 16)
        lengths = torch.tensor([0, 5, 16, 17, 112, 0, 64])
        call = lambda rows: split_kv_decode_attention(q[:rows], k, v, lengths, 112, 0.3, split=16, block_n=16)
        got = call(7)
        ref = reference_decode_attention(q, k, v, lengths, 112, 0.3)
        live = lengths > 0
        assert (got[live] - ref[live]).abs().max().item() < 1e-5
        assert torch.equal(got[~live], torch.zeros_like(got[~live]))
        kept = decode_attention._COUNTERS[torch.device("cpu")]
        counters = kept[-1]
        assert counters.numel() == 16 and not counters.any()          # 7 rows x 2 KV heads, each reset to 0
        assert torch.equal(call(7), got)                              # the next call starts from zeros
        assert torch.equal(call(3), got[:3]) and kept[-1] is counters and not counters.any()   # a smaller batch
        wide = torch.randn(9, 2, 3, 16)                               # a larger batch grows them; the old stay kept
        more = split_kv_decode_attention(wide, k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1), lengths.repeat(2), 112,
                                         0.3, split=16, block_n=16)
        assert len(kept) == 2 and kept[0] is counters and kept[1].numel() == 32 and not kept[1].any()
        want = reference_decode_attention(wide, k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1), lengths.repeat(2), 112, 0.3)
        assert (more - want)[lengths.repeat(2)[:9] > 0].abs().max().item() < 1e-5
        assert torch.equal(call(7), got)
        print("ok fold")

        # the decode MLP's gate/up + SwiGLU kernel (decode_mlp.py): odd row counts, a K that is not a multiple of
        # the tile's, with and without bias, against the float32 reference rounded once
        from fully_async.rollout.engines.decode_mlp import reference_swiglu_matmul, swiglu_matmul
        for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):     # of the largest output: fp16's ulp
            for rows, k, n, bias, tile in ((5, 48, 40, False, (16, 16, 16, 1, 1)),
                                           (33, 72, 24, True, (32, 16, 32, 4, 2))):
                x = torch.randn(rows, 1, k, dtype=dtype)
                w = (torch.randn(2 * n, k) / k ** 0.5).to(dtype)
                b = torch.randn(2 * n, dtype=dtype) if bias else None
                got = swiglu_matmul(x, w, b, tile)
                want = reference_swiglu_matmul(x.float(), w.float(), None if b is None else b.float())
                err = (got.float() - want).abs().max().item()
                assert got.shape == (rows, 1, n) and err < tol * want.abs().max().item(), (dtype, rows, err)
        print("ok mlp")
    """


def engine_code(tmp_path) -> str:
    return f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_fused_decode import build
        from fully_async.device import CPU
        from fully_async.rollout.engines.base import run_requests
        from fully_async.rollout.engines.hf_engine import HFEngine
        from fully_async.core.partial import PendingResponse
        from fully_async.core.types import GenRequest, SamplingParams
        import pathlib
        from fully_async.rollout.engines import decode_mlp

        decode_mlp.TILES = ((1 << 30, (16, 128, 64, 4, 1)),)   # the MLP kernel at every batch size, one program per 16 rows

        def run(path, split):
            eng = HFEngine(path, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, seed=5, max_model_len=8,
                           fused_decode=split, split_kv=True if split else None)
            assert (eng._fused is not None and eng._fused.split_kv and eng._fused.fused_mlp) == split
            prompts = [[3 + (i * 5 + j) % 50 for j in range(2 + i % 4)] for i in range(7)]
            params = [SamplingParams(1.0, 1.0, -1, 12 + i) if i % 2 else SamplingParams(0.0, max_tokens=10 + i)
                      for i in range(7)]
            outs = run_requests(eng, [GenRequest(f"r{{i}}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
            pend = [PendingResponse(f"u{{i}}", f"u{{i}}", [4 + i, 9, 11], SamplingParams(1.0, 1.0, -1, 20))
                    for i in range(3)]
            eng.submit([p.request() for p in pend])
            for _ in range(6):
                eng.collect()
            partial = {{o.request_id: o for o in eng.interrupt()}}
            for p in pend:
                assert not p.extend(partial[p.sample_id])
            rest = run_requests(eng, [p.request() for p in pend])
            for p in pend:
                assert p.extend(rest[p.sample_id])
                outs[p.sample_id] = p.to_sample()
            return outs

        for kind in ("qwen2", "qwen3"):
            path = build(pathlib.Path({str(tmp_path)!r}), kind)
            new, ref = run(path, True), run(path, False)
            for rid, want in ref.items():
                got = new[rid]
                ids = [getattr(x, "token_ids", None) or x.response_ids for x in (got, want)]
                lps = [getattr(x, "log_probs", None) for x in (got, want)]
                assert ids[0] == ids[1], (kind, rid)
                if lps[0] is not None:
                    assert max(abs(a - b) for a, b in zip(*lps)) < 1e-4, (kind, rid)
            print("ok", kind)
    """


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The two interpreter runs (each ~10 s of imports and interpreted kernels), started side by side: {name: stdout}."""
    pytest.importorskip("triton")
    procs = {"kernel": start_interpreted(kernel_code()),
             "engine": start_interpreted(engine_code(tmp_path_factory.mktemp("engine")))}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        out[name] = (proc.returncode, stdout, stderr)
    return out


def interpreter_output(interpreted, name: str) -> str:
    code, stdout, stderr = interpreted[name]
    assert code == 0, stderr[-3000:]
    return stdout


def test_kernel_equals_reference_under_the_interpreter(interpreted):
    """Ragged lengths across several splits and blocks, a length of 1, one past the span, rows beyond the batch;
    fp32 (exact dot products) and fp16.  The fold of the splits' merge into the kernel (the last split to arrive
    merges): rows of 0 (zeros), 1 and up to 7 splits; repeated calls equal the first (the counters reset), a
    smaller batch on the same counters, a larger one growing them; outputs and scratch start as NaN.  The decode
    MLP's gate/up + SwiGLU kernel (decode_mlp.py) against its float32 reference: odd rows, ragged K, bias."""
    out = interpreter_output(interpreted, "kernel")
    assert out.count("ok") == 4 and "ok fold" in out and "ok mlp" in out


def test_engine_through_the_kernel_samples_what_transformers_modules_sample(interpreted):
    """HFEngine(split_kv=True) on CPU under the interpreter (its attention and MLP kernels: decode_mlp's at every
    batch size) against HFEngine(fused_decode=False): rows of different
    lengths (more prompts than slots, admission mid-run, the cache grown past max_model_len), then an interrupt
    and a resume of prompt + partial, all with one seed."""
    out = interpreter_output(interpreted, "engine")
    assert out.count("ok") == 2
