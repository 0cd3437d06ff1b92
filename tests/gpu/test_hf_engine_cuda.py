"""The embedded engine on CUDA (skipped elsewhere), 0.5B-shaped Qwen2 in bf16, with decode graphs and eager:
greedy tokens equal a plain forward token by token (allowing bf16 near-ties), sampled log-probs equal a
recomputed forward, an update mid-generation keeps per-token versions and continues exactly; the decode kernels
(split-KV attention, the MLP's gate/up + SwiGLU) against their references."""
import pytest
import torch

from fully_async.device import get_device

pytestmark = pytest.mark.gpu
DEVICE = get_device("auto")
if DEVICE.name != "cuda":
    pytest.skip("needs CUDA: the 0.5B-shaped bf16 engine check", allow_module_level=True)

from fully_async.rollout.engines.base import run_requests  # noqa: E402
from fully_async.rollout.engines.hf_engine import HFEngine  # noqa: E402
from fully_async.core.types import GenRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def shaped(shaped_dir):
    from transformers import AutoModelForCausalLM
    return shaped_dir, AutoModelForCausalLM.from_pretrained(shaped_dir, dtype=torch.bfloat16).cuda().eval()


def assert_greedy(model, prompt, got):
    """Each token is the argmax of a plain forward over the same prefix, up to a bf16 tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    top = logits.max(-1).values
    chosen = logits.gather(1, torch.tensor(got, device="cuda")[:, None]).squeeze(1)
    assert bool(((top - chosen) <= 0.05 * top.abs().clamp(min=1)).all()), (top - chosen).max().item()


MODES = {"eager": dict(enforce_eager=True), "graphs": dict(enforce_eager=False, fused_decode=False),
         "compiled": dict(enforce_eager=False)}   # the default: fused per-layer decode, compiled, in graphs


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equals_plain_forward_allowing_bf16_ties(shaped, mode):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, **MODES[mode])
    assert bool(eng._graphs) != (mode == "eager") and eng.compiled == (mode == "compiled")
    assert eng.packed_prefill == (mode != "graphs")   # the fused layer functions prefill packed (FlashAttention)
    prompts = [[3 + (i * 7 + j) % 17 for j in range(4 + i)] for i in range(12)]   # more prompts than slots
    outs = run_requests(eng, [GenRequest(f"g{i}", p, SamplingParams(0.0, max_tokens=32 + i * 4))
                              for i, p in enumerate(prompts)])                  # the last ones grow the cache
    for i, p in enumerate(prompts):
        assert len(outs[f"g{i}"].token_ids) == 32 + i * 4
        assert_greedy(model, p, outs[f"g{i}"].token_ids)


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_and_decodes_greedily(shaped):
    """The default compiled engine (packed prefill) under a 64-token budget: a 200-token prompt is prefilled in
    chunks of 64 over four steps (FlashAttention varlen for the first, SDPA with a bottom-right causal bias over
    the slot for the rest) while two short requests decode above its slot; every output is greedy under a plain
    forward, as unchunked."""
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=4, eos_token_ids=[], pad_token_id=0,
                   max_model_len=320, enforce_eager=False, max_num_batched_tokens=64)
    assert eng.packed_prefill and eng.chunked_prefill
    long_prompt = [3 + (j * 7) % 17 for j in range(200)]
    eng.submit([GenRequest("a", [5], SamplingParams(0.0, max_tokens=1)),
                GenRequest("b", [8, 9], SamplingParams(0.0, max_tokens=48)),
                GenRequest("c", [3], SamplingParams(0.0, max_tokens=48))])
    outs = {o.request_id: o for o in eng.collect()}
    eng.submit([GenRequest("long", long_prompt, SamplingParams(0.0, max_tokens=24))])
    chunks = []
    while eng.num_in_flight():
        outs.update({o.request_id: o for o in eng.collect()})
        chunks.append(eng._chunk[2] if eng._chunk is not None else None)
    assert chunks[:4] == [64, 128, 192, None]
    for rid, prompt in (("b", [8, 9]), ("c", [3]), ("long", long_prompt)):
        assert_greedy(model, prompt, outs[rid].token_ids)


@pytest.mark.parametrize("mode", ["graphs", "compiled"])
def test_update_mid_generation_with_graphs(shaped, mode):
    """Interrupt, load new weights (in place: the graphs stay), resume prompt + partial: the versions switch at
    the cut, and the continuation is greedy under the new weights."""
    from fully_async.core.partial import PendingResponse

    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=8, eos_token_ids=[], pad_token_id=0,
                   max_model_len=64, **MODES[mode])
    graphs = dict(eng._graphs)
    params = SamplingParams(0.0, max_tokens=40)
    pend = [PendingResponse(f"u{i}", f"u{i}", [4 + i, 9, 11, 2 + i], params) for i in range(6)]
    eng.submit([p.request() for p in pend])
    for _ in range(10):
        eng.collect()
    partial = {o.request_id: o for o in eng.interrupt()}
    new = {k: v * 1.02 for k, v in model.named_parameters()}
    eng.update_weights(new, version=1)
    assert eng._graphs == graphs
    for p in pend:
        assert not p.extend(partial[p.sample_id])
    rest = run_requests(eng, [p.request() for p in pend])
    before = {k: v.clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, v in model.named_parameters():
            v.copy_(new[k])
    try:
        check_continuations(model, pend, partial, rest)
    finally:
        with torch.no_grad():
            for k, v in model.named_parameters():
                v.copy_(before[k])


def check_continuations(model, pend, partial, rest):
    for p in pend:
        k = len(partial[p.sample_id].token_ids)
        assert p.extend(rest[p.sample_id])
        s = p.to_sample()
        assert 0 < k < 40 and s.versions == [0] * k + [1] * (40 - k)
        assert_greedy(model, p.prompt_ids + s.response_ids[:k], s.response_ids[k:])


@pytest.mark.parametrize("mode", list(MODES))
def test_sampled_log_probs_equal_a_recomputed_forward(shaped, mode):
    path, model = shaped
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=16, eos_token_ids=[], pad_token_id=0, seed=3,
                   **MODES[mode])
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(16)]
    outs = run_requests(eng, [GenRequest(f"s{i}", p, SamplingParams(1.0, 1.0, -1, 24)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        o = outs[f"s{i}"]
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.token_ids, device="cuda")[:, None]).squeeze(1)
        assert torch.allclose(lp.cpu(), torch.tensor(o.log_probs), atol=0.1), (i, (lp.cpu() - torch.tensor(o.log_probs)).abs().max())


def test_split_kv_kernel_equals_masked_sdpa_in_bf16():
    """The split-KV kernel against the reference (masked SDPA) on ragged lengths, splits and the span clamp,
    writing the new keys/values where the reference writes them."""
    from fully_async.rollout.engines.decode_attention import reference_decode_attention, split_kv_decode_attention

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(40, 2, 1100, 64, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(40, 2, 1100, 64, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(32, 2, 7, 64, generator=gen).to("cuda", torch.bfloat16)
    kn, vn = (torch.randn(32, 2, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    lengths = torch.randint(1, 1100, (40,), generator=gen).cuda()
    lengths[:4] = torch.tensor([1, 256, 257, 1024])
    for span in (1024, 1100):
        k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
        got = split_kv_decode_attention(q, k1, v1, lengths, span, 0.125, kn, vn)
        ref = reference_decode_attention(q, k2, v2, lengths, span, 0.125, kn, vn)
        assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2), (got.float() - ref.float()).abs().max()
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_split_kv_fold_merges_many_splits_replays_and_resets_its_counters():
    """The splits' merge folded into the kernel (the split of a (row, KV head) that arrives last on its counter
    merges them all): up to 17 splits of 64 arriving concurrently, rows of 0 (zeros) and of one split; repeated
    calls, a smaller batch on the same counters and a graph's replays equal the first call bit for bit (the merge
    order is fixed; each call leaves the counters at 0)."""
    from fully_async.rollout.engines import decode_attention
    from fully_async.rollout.engines.decode_attention import reference_decode_attention, split_kv_decode_attention

    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(64, 4, 1088, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    q = torch.randn(64, 4, 4, 64, generator=gen).to("cuda", torch.bfloat16)
    lengths = torch.randint(0, 1089, (64,), generator=gen)
    lengths[:6] = torch.tensor([0, 1, 64, 65, 1088, 0])
    lengths = lengths.cuda()

    def call(rows=64):
        return split_kv_decode_attention(q[:rows], k, v, lengths, 1088, 0.125, split=64, block_n=32)

    first = call()
    ref = reference_decode_attention(q, k, v, lengths, 1088, 0.125)
    live = lengths > 0
    assert torch.allclose(first[live].float(), ref[live].float(), atol=2e-2, rtol=2e-2)
    assert not first[~live].any()
    counters = decode_attention._COUNTERS[first.device][-1]
    for _ in range(3):
        assert torch.equal(call(), first)
    assert torch.equal(call(16), first[:16])
    out = torch.empty_like(first)
    replay = DEVICE.graphs().capture(lambda: out.copy_(call()))
    for _ in range(3):
        out.fill_(float("nan"))
        replay()
        assert torch.equal(out, first)
    assert decode_attention._COUNTERS[first.device][-1] is counters and not counters.any()


def test_decode_mlp_kernel_equals_reference_in_bf16_and_replays():
    """decode_mlp's gate/up + SwiGLU kernel at each tile TILES names, at the 0.5B shape (hidden 896, intermediate
    4,864) with a bias, on odd and bucket row counts: within bf16 rounding of the float32 reference, and no further
    from it than cuBLAS + SwiGLU (which round twice); a device graph's replay equals the eager call."""
    import torch.nn.functional as F
    from fully_async.rollout.engines.decode_mlp import TILES, reference_swiglu_matmul, swiglu_matmul

    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(2 * 4864, 896, generator=gen) / 896 ** 0.5).to("cuda", torch.bfloat16)
    b = torch.randn(2 * 4864, generator=gen).to("cuda", torch.bfloat16)
    tiles = [tile for _, tile in TILES if tile is not None]
    assert tiles
    for tile in tiles:
        for rows in (1, 17, 96, 256):
            x = torch.randn(rows, 1, 896, generator=gen).to("cuda", torch.bfloat16)
            want = reference_swiglu_matmul(x.float(), w.float(), b.float())
            got = swiglu_matmul(x, w, b, tile)
            gate, up = F.linear(x, w, b).chunk(2, dim=-1)
            err, base = ((t.float() - want).abs().max().item() for t in (got, F.silu(gate) * up))
            assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), (tile, rows, err)
            assert err <= base + 1e-3, (tile, rows, err, base)
            out = torch.empty_like(got)
            replay = DEVICE.graphs().capture(lambda: out.copy_(swiglu_matmul(x, w, b, tile)))
            out.fill_(float("nan"))
            replay()
            assert torch.equal(out, got), (tile, rows)


def test_engine_with_the_mlp_kernel_at_every_batch_size_stays_greedy(shaped, monkeypatch):
    """The engine's decode graphs with decode_mlp's kernel at every batch bucket (TILES forced): greedy tokens a
    plain forward confirms token by token (up to bf16 ties), rows of different lengths, more prompts than slots."""
    from fully_async.rollout.engines import decode_mlp

    path, model = shaped
    monkeypatch.setattr(decode_mlp, "TILES", ((1 << 30, (16, 64, 64, 4, 3)),))
    eng = HFEngine(path, DEVICE, dtype="bfloat16", max_num_seqs=16, eos_token_ids=[], pad_token_id=0,
                   max_model_len=256, enforce_eager=False)
    assert eng._fused.fused_mlp
    prompts = [[5 + (i * 3 + j) % 31 for j in range(2 + i % 7)] for i in range(20)]
    reqs = [GenRequest(f"m{i}", p, SamplingParams(0.0, max_tokens=30 + 7 * i)) for i, p in enumerate(prompts)]
    got = run_requests(eng, reqs)
    for i, p in enumerate(prompts):
        assert len(got[f"m{i}"].token_ids) == 30 + 7 * i
        assert_greedy(model, p, got[f"m{i}"].token_ids)


@pytest.fixture(scope="module")
def two_engines(shaped):
    path, _ = shaped
    kw = dict(dtype="bfloat16", max_num_seqs=16, eos_token_ids=[], pad_token_id=0, max_model_len=384,
              enforce_eager=False)
    return HFEngine(path, DEVICE, split_kv=True, **kw), HFEngine(path, DEVICE, split_kv=False, **kw)


def test_split_kv_engine_greedy_equals_masked_sdpa_engine(shaped, two_engines):
    """Greedy generation with the split-KV attention (the default on CUDA) against the same engine with the masked
    SDPA over the span bucket, rows of different lengths across span buckets and kernel splits (256 positions):
    both are greedy under a plain forward token by token, and where the two first differ the plain forward has a
    bf16 near-tie between their two tokens (sums in another order may flip one; on H200 6 of these 24 random-weight
    sequences stay identical to the end, the rest part at such a tie)."""
    _, model = shaped
    new, old = two_engines
    assert new._fused.split_kv and not old._fused.split_kv
    prompts = [[3 + (i * 5 + j) % 29 for j in range(3 + i % 9)] for i in range(24)]          # more than slots
    reqs = [GenRequest(f"v{i}", p, SamplingParams(0.0, max_tokens=40 + 13 * i)) for i, p in enumerate(prompts)]
    got, ref = run_requests(new, reqs), run_requests(old, reqs)
    for i, p in enumerate(prompts):
        a, b = got[f"v{i}"].token_ids, ref[f"v{i}"].token_ids
        assert len(a) == len(b) == 40 + 13 * i
        assert_greedy(model, p, a)
        assert_greedy(model, p, b)
        cut = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if cut is not None:
            with torch.no_grad():
                logits = model(torch.tensor([p + a[:cut]], device="cuda")).logits[0, -1].float()
            top = logits.max()
            assert abs(float(logits[a[cut]] - logits[b[cut]])) <= 0.05 * max(1.0, abs(float(top))), (i, cut)
