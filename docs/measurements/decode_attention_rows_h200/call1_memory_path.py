"""Session 11 experiment: where the split-KV decode attention's time goes at the engine's shapes (1x H200).
Kept as it ran on the device, but for lint fixes (unused imports, a del).

Variants over one layer's slot cache (2 KV heads x 64, 7 query heads each, bf16), all CUDA-graph timed:
  cur    : the package's kernel (rope + new key + arrival merge), its settings and a few others
  ptr    : attention over cached positions only, pointer loads, tl.range(num_stages) -- one split per row or
           partials written (no merge): the memory path alone
  tma    : the same with TMA tensor-descriptor loads (host descriptors over the (S*H*T, D) cache)
  read   : a pure streaming read of the same bytes (sum of K and V), the bandwidth ceiling for this grid
prints ms, GB/s on the bytes each must read, and n_regs / shared / spills of each compiled kernel.
"""
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing as tt

from fully_async.rollout.engines import decode_attention as da

H, G, D, CAP = 2, 7, 64, 3088
dev = torch.device("cuda")
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception as e:  # noqa
    TensorDescriptor = None
    print("no TensorDescriptor", e)


@triton.jit
def ptr_kernel(Q, K, V, LENS, O, T, scale_log2, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
               SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(LENS + b)
    start = s * SPLIT
    if start < length:
        end = tl.minimum(start + SPLIT, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        rows = g < G
        q = tl.load(Q + ((b * 2 + h) * G + g[:, None]) * D + d[None, :], mask=rows[:, None], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        base = (b * 2 + h) * T * D
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(K + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale_log2
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        part = (b * 2 + h) * NSPLIT + s
        tl.store(O + (part * G_PAD + g[:, None]) * D + d[None, :], acc / l_i[:, None], mask=rows[:, None])


@triton.jit
def tma_kernel(Q, KD, VD, LENS, O, T, scale_log2, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
               SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(LENS + b)
    start = s * SPLIT
    if start < length:
        end = tl.minimum(start + SPLIT, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        rows = g < G
        q = tl.load(Q + ((b * 2 + h) * G + g[:, None]) * D + d[None, :], mask=rows[:, None], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        row0 = (b * 2 + h) * T
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = KD.load([row0 + n0, 0])
            qk = tl.dot(q, tl.trans(k)) * scale_log2
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = VD.load([row0 + n0, 0])
            v = tl.where(valid[:, None], v, 0.0).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        part = (b * 2 + h) * NSPLIT + s
        tl.store(O + (part * G_PAD + g[:, None]) * D + d[None, :], acc / l_i[:, None], mask=rows[:, None])


@triton.jit
def read_kernel(K, V, LENS, O, T, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                NSPLIT: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length = tl.load(LENS + b)
    start = s * SPLIT
    if start < length:
        end = tl.minimum(start + SPLIT, length)
        d = tl.arange(0, D)
        acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        base = (b * 2 + h) * T * D
        for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(K + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(V + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            acc += k.to(tl.float32) + v.to(tl.float32)
        tl.store(O + ((b * 2 + h) * NSPLIT + s) * D + d, tl.sum(acc, 0))


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=60) / 1e3   # seconds


def info(compiled):
    try:
        return {"regs": compiled.n_regs, "spills": compiled.n_spills, "shared": compiled.metadata.shared}
    except Exception as e:  # noqa
        return {"err": str(e)[:80]}


def main():
    out = {"hardware": torch.cuda.get_device_name(), "triton": triton.__version__, "cases": {}}
    gen = torch.Generator().manual_seed(0)
    cases = [(256, "uniform", 1536), (256, "uniform", 3072), (256, "uniform", 512), (1024, "uniform", 1536),
             (256, "lognormal", 3072)]
    for rows, kind, L in cases:
        if kind == "uniform":
            lens = torch.full((rows,), L)
        else:
            z = torch.randn(rows, generator=gen)
            lens = (0.25 * 3072 * torch.exp(0.75 * z)).round().clamp(1, 3072).long() + 16
        lens = lens.to(dev)
        kc = torch.randn(rows, H, CAP, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(rows, H, CAP, D, device=dev, dtype=torch.bfloat16)
        q = torch.randn(rows, H, G, D, device=dev, dtype=torch.bfloat16)
        nbytes = float(lens.sum().item()) * H * D * 2 * 2
        ref = da.reference_decode_attention(q, kc, vc, lens, CAP, D ** -0.5).float()
        case = {"rows": rows, "kind": kind, "mean_len": float(lens.float().mean()), "mb": nbytes / 1e6}
        name = f"{rows}x{kind}{L}"
        print(name, case, flush=True)
        # the package's kernel (no new key, no rope: attention over the cache as is)
        for split, bn, w, st in [(512, 64, 4, 2), (1024, 64, 4, 2), (2048, 64, 4, 2), (4096, 64, 4, 2),
                                 (512, 64, 4, 3), (512, 64, 4, 4), (1024, 128, 8, 2), (256, 64, 4, 2)]:
            fn = lambda: da.split_kv_decode_attention(q, kc, vc, lens, CAP, D ** -0.5, split=split, block_n=bn,
                                                     num_warps=w, num_stages=st)
            try:
                err = (fn().float() - ref).abs().max().item()
                t = bench(fn)
                case[f"cur_{split}_{bn}_w{w}_s{st}"] = {"ms": t * 1e3, "gbs": nbytes / t / 1e9, "err": err}
                print(f"  cur {split} {bn} w{w} s{st}: {t*1e6:.1f} us {nbytes/t/1e9:.0f} GB/s err {err:.4f}", flush=True)
            except Exception as e:  # noqa
                print("  cur fail", split, bn, w, st, str(e)[:200])
        for variant in ("ptr", "tma", "read"):
            if variant == "tma" and TensorDescriptor is None:
                continue
            for split, bn, w, st in [(4096, 64, 4, 2), (4096, 64, 4, 3), (4096, 64, 4, 4), (4096, 128, 4, 3),
                                     (4096, 128, 8, 3), (4096, 32, 4, 4), (1024, 64, 4, 3), (512, 64, 4, 3),
                                     (512, 64, 4, 4), (1024, 128, 8, 3)]:
                nsplit = -(-CAP // split)
                o = torch.empty(rows * H * nsplit * 16 * D, device=dev, dtype=torch.float32)
                grid = (rows, H, nsplit)
                if variant == "ptr":
                    launch = lambda: ptr_kernel[grid](q, kc, vc, lens, o, CAP, D ** -0.5 * 1.4426950408889634, G=G,
                                                      G_PAD=16, D=D, SPLIT=split, BLOCK_N=bn, NSPLIT=nsplit,
                                                      STAGES=st, num_warps=w)
                elif variant == "tma":
                    kd = TensorDescriptor.from_tensor(kc.view(-1, D), block_shape=[bn, D])
                    vd = TensorDescriptor.from_tensor(vc.view(-1, D), block_shape=[bn, D])
                    launch = lambda: tma_kernel[grid](q, kd, vd, lens, o, CAP, D ** -0.5 * 1.4426950408889634, G=G,
                                                      G_PAD=16, D=D, SPLIT=split, BLOCK_N=bn, NSPLIT=nsplit,
                                                      STAGES=st, num_warps=w)
                else:
                    launch = lambda: read_kernel[grid](kc, vc, lens, o, CAP, D=D, SPLIT=split, BLOCK_N=bn,
                                                       NSPLIT=nsplit, STAGES=st, num_warps=w)
                try:
                    compiled = launch()
                    err = None
                    if variant != "read" and split >= CAP:
                        got = o.view(rows, H, nsplit, 16, D)[:, :, 0, :G].to(torch.bfloat16).float()
                        err = (got - ref).abs().max().item()
                    t = bench(launch)
                    case[f"{variant}_{split}_{bn}_w{w}_s{st}"] = {"ms": t * 1e3, "gbs": nbytes / t / 1e9, "err": err,
                                                                  **info(compiled)}
                    print(f"  {variant} {split} {bn} w{w} s{st}: {t*1e6:.1f} us {nbytes/t/1e9:.0f} GB/s err {err} "
                          f"{info(compiled)}", flush=True)
                except Exception as e:  # noqa
                    print("  fail", variant, split, bn, w, st, str(e)[:300], flush=True)
        out["cases"][name] = case
        torch.cuda.empty_cache()
    # the package kernel's compiled info
    try:
        k = da._KERNELS[0]
        for dev_cache in k.device_caches.values():
            for key, c in list(dev_cache[0].items())[:8]:
                print("cur compiled", info(c))
    except Exception as e:  # noqa
        print("no cache info", str(e)[:100])
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_exp.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
