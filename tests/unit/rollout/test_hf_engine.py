"""Embedded engine: continuous batching is exact, interrupt/resume is exact, weights update."""
import inspect
from collections import deque

import pytest
import torch

from fully_async.device import CPU
from fully_async.rollout.engines.base import run_requests
from fully_async.rollout.engines.hf_engine import HFEngine, cache_keyword
from fully_async.core.partial import PendingResponse
from fully_async.core.types import GenRequest, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [20, 21, 22, 23]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def run_all(engine, requests):
    return run_requests(engine, requests, timeout_s=120.0)


@pytest.fixture(scope="module")
def hf_model(random_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(random_model_dir).eval()


def test_continuous_batching_matches_generate_and_forward(random_model_dir, hf_model):
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[1], pad_token_id=0)
    outs = run_all(eng, [GenRequest(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        got = outs[f"r{i}"]
        ref = hf_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=1,
                                pad_token_id=0)[0, len(p):].tolist()
        assert got.token_ids == ref[:len(got.token_ids)]
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + got.token_ids])).logits[0, len(p) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(lp, torch.tensor(got.log_probs), atol=1e-4)
        assert got.versions == [0] * len(got.token_ids)


def test_interrupt_then_resume_equals_uninterrupted(random_model_dir):
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0)
    full = run_all(eng, [GenRequest("a", PROMPTS[0], GREEDY)])["a"]
    pend = PendingResponse("u", "a", PROMPTS[0], GREEDY)
    eng.submit([pend.request()])
    for _ in range(4):
        assert eng.collect() == []
    partial = eng.interrupt()
    assert eng.num_in_flight() == 0 and len(partial) == 1 and partial[0].finish_reason == "abort"
    assert 0 < len(partial[0].token_ids) < 10
    assert not pend.extend(partial[0])
    eng.version = 3  # as after a weight update with identical weights
    rest = run_all(eng, [pend.request()])["a"]
    assert pend.extend(rest)
    s = pend.to_sample()
    assert s.response_ids == full.token_ids
    assert s.rollout_log_probs == pytest.approx(full.log_probs, abs=1e-4)
    k = len(partial[0].token_ids)
    assert s.versions == [0] * k + [3] * (10 - k)


def test_update_weights_changes_outputs_and_version(random_model_dir):
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0)
    before = run_all(eng, [GenRequest("x", PROMPTS[2], GREEDY)])["x"]
    new = {k: torch.randn_like(v) * 0.3 for k, v in eng.model.named_parameters()}
    eng.update_weights(new, version=7)
    after = run_all(eng, [GenRequest("x", PROMPTS[2], GREEDY)])["x"]
    assert after.versions == [7] * len(after.token_ids)
    assert after.token_ids != before.token_ids
    with pytest.raises(KeyError, match="does not exist"):
        eng.update_weights({"nope.weight": torch.zeros(1)}, 8)
    eng.submit([GenRequest("y", PROMPTS[0], GREEDY)])
    with pytest.raises(RuntimeError, match="in flight"):
        eng.update_weights(new, 8)


def test_keep_mode_continues_in_flight_requests_on_the_new_weights(random_model_dir, hf_model):
    """pause_mode=keep: a request in flight at an update continues over the KV cache the old weights wrote; the
    token sampled from logits computed before the update is the old version's, every later one the new's, and the
    tokens and log-probs are those of the old model's cache continued by the new model."""
    import copy

    eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, keep_in_flight=True)
    assert eng.keeps_in_flight
    prompt = PROMPTS[0]
    eng.submit([GenRequest("a", prompt, GREEDY)])
    for _ in range(4):
        assert eng.collect() == []
    torch.manual_seed(0)
    new = {k: torch.randn_like(v) * 0.3 for k, v in eng.model.named_parameters()}
    eng.update_weights(new, version=5)
    assert eng.num_in_flight() == 1 and set(eng.last_update_timings) == {"pause", "load", "resume"}
    out = run_all(eng, [])["a"]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    assert out.versions == [0] * 5 + [5] * 5
    new_model = copy.deepcopy(hf_model)
    new_model.load_state_dict(new, strict=False)
    toks = out.token_ids
    with torch.no_grad():
        old = hf_model(torch.tensor([prompt + toks[:4]]), use_cache=True)
        kw = cache_keyword(new_model)   # `cache` on transformers that renamed it, else `past_key_values`
        cont = new_model(torch.tensor([toks[4:]]), **{kw: getattr(old, kw)})
    logits = torch.cat([old.logits[0, len(prompt) - 1:], cont.logits[0, :-1]]).float()
    assert logits.argmax(-1).tolist() == toks
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)
    assert torch.allclose(lp, torch.tensor(out.log_probs), atol=1e-4)


def test_sampling_respects_max_tokens_and_eos(random_model_dir):
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=list(range(48)), pad_token_id=0)
    out = run_all(eng, [GenRequest("e", PROMPTS[0], SamplingParams(1.0, 1.0, -1, 5))])["e"]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1   # every token is an EOS here
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0)
    outs = run_all(eng, [GenRequest(f"s{i}", PROMPTS[1], SamplingParams(1.0, 0.9, 5, 6)) for i in range(4)])
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs.values())


def test_sleep_and_wake_up_on_cpu(random_model_dir):
    eng = HFEngine(random_model_dir, CPU, eos_token_ids=[], pad_token_id=0)
    eng.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        eng.submit([GenRequest("z", PROMPTS[0], GREEDY)])
    eng.wake_up()
    assert len(run_all(eng, [GenRequest("z", PROMPTS[0], GREEDY)])["z"].token_ids) == 10


def test_slot_reuse_and_cache_growth_are_exact(random_model_dir, hf_model):
    """More requests than slots (slots are freed and refilled mid-run, admissions in batches), a cache that
    starts too short for them (it grows by doubling): every greedy output still equals a plain forward."""
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=3, eos_token_ids=[], pad_token_id=0, max_model_len=4)
    reqs = [GenRequest(f"q{i}", PROMPTS[i % len(PROMPTS)] + [i + 2], SamplingParams(0.0, max_tokens=3 + 2 * i))
            for i in range(8)]
    outs = run_all(eng, reqs)
    assert eng._cache.capacity >= max(len(r.prompt_ids) + r.params.max_tokens for r in reqs)
    for r in reqs:
        got = outs[r.request_id]
        assert len(got.token_ids) == r.params.max_tokens and got.finish_reason == "length"
        ids = list(r.prompt_ids)
        with torch.no_grad():
            for _ in range(r.params.max_tokens):
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got.token_ids == ids[len(r.prompt_ids):], r.request_id


def test_sliding_window_models_are_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                      sliding_window=8, max_window_layers=0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="sliding_attention.*rollout.name=vllm"):
        HFEngine(str(tmp_path), CPU)


class RecordingGraphs:
    """A stand-in for DeviceGraphs on CPU: 'capture' runs the warm-ups and records the function (a real
    capture runs nothing), 'replay' calls it.  A real graph replays exactly what the function did at capture
    time, so this checks the engine's side of the contract: buckets, padding rows, spans, buffers that outlive
    the graphs, recapture."""

    rng = True   # as CUDA's: the sampling is captured too

    def __init__(self):
        self.captured: list = []
        self.replays = 0
        self.generators: list = []

    def capture(self, fn, warmup: int = 1, generators: tuple = ()):
        self.generators += generators
        for _ in range(warmup):
            fn()
        self.captured.append(fn)

        def replay():
            self.replays += 1
            fn()
        return replay


def test_graph_buckets_decode_exactly_like_eager(random_model_dir, hf_model, monkeypatch):
    """Decode through captured buckets (batch padded to a bucket, attention over a wider span bucket) gives the
    eager engine's greedy tokens and log-probs; a cache that grows recaptures; a weight update keeps the graphs
    (copies into the same storage); sleep/wake recaptures."""
    graphs = RecordingGraphs()
    monkeypatch.setattr(CPU.__class__, "graphs", lambda self: graphs)
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=6, eos_token_ids=[], pad_token_id=0, max_model_len=8,
                   enforce_eager=False, graph_batch_sizes=[2, 4])
    assert eng.graph_batch_sizes == [2, 4, 6]
    first = len(graphs.captured)
    assert first == 3 * 1 and eng.graph_capture_s > 0     # capacity 8 -> one span bucket per batch bucket
    eager = HFEngine(random_model_dir, CPU, max_num_seqs=6, eos_token_ids=[], pad_token_id=0, max_model_len=8)
    reqs = [GenRequest(f"q{i}", PROMPTS[i % len(PROMPTS)] + [i + 2], SamplingParams(0.0, max_tokens=3 + 2 * i))
            for i in range(9)]
    got, want = run_all(eng, reqs), run_all(eager, reqs)
    assert graphs.replays > 0
    assert len(graphs.captured) > first                    # the cache grew past 8: captured again at first use
    # the tail, moved down into the lowest slots, samples at the smallest bucket too
    assert set(eng._sample_graphs) == {(2, False), (4, False), (6, False)} and graphs.generators[0] is eng.generator
    for r in reqs:
        assert got[r.request_id].token_ids == want[r.request_id].token_ids, r.request_id
        assert got[r.request_id].log_probs == pytest.approx(want[r.request_id].log_probs, abs=1e-4)
    eng.update_weights({k: v * 1.5 for k, v in eng.model.named_parameters()}, version=2)
    eager.update_weights({k: v * 1.5 for k, v in eager.model.named_parameters()}, version=2)
    n = len(graphs.captured)
    got, want = run_all(eng, reqs[:4]), run_all(eager, reqs[:4])
    assert len(graphs.captured) == n                       # the same graphs serve the new weights
    assert all(got[k].token_ids == want[k].token_ids and got[k].versions == [2] * len(want[k].token_ids)
               for k in want)
    eng.sleep(1)                                           # free_cache_engine: weights moved, graphs dropped
    eng.wake_up()
    assert eng._graphs == {}
    assert run_all(eng, reqs[:1])["q0"].token_ids == want["q0"].token_ids
    assert len(graphs.captured) > n                        # captured again at first use
    kept = HFEngine(random_model_dir, CPU, max_num_seqs=6, eos_token_ids=[], pad_token_id=0, max_model_len=32,
                    enforce_eager=False, graph_batch_sizes=[2, 4], free_cache_engine=False)
    before = dict(kept._graphs)
    kept.sleep(1)
    kept.wake_up()
    assert kept._graphs == before                          # nothing moved: the graphs stay


def test_default_graph_buckets():
    from fully_async.rollout.engines.hf_engine import default_graph_batch_sizes, span_buckets

    assert default_graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert default_graph_batch_sizes(5) == [1, 2, 4, 5]
    assert span_buckets(272) == [128, 256, 272] and span_buckets(100) == [100]


def test_prefill_budget_admits_what_fits_and_changes_no_token(random_model_dir):
    """max_num_batched_tokens (verl's rollout key, honoured by the embedded engine): one step's joiners fit the
    budget as one padded prefill (joiners x the longest of them); the oldest always joins (a prompt over the budget
    is prefilled alone), with the waiting ones that make the most real tokens at one padded width; the rest join at
    the next steps; no token changes."""
    prompts = [[5, 6, 7, 8], [8, 9], [10, 11, 12], list(range(20, 31)), [3], [4, 5]]
    reqs = [GenRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    free = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0)
    want = run_all(free, reqs)
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0, max_num_batched_tokens=12)
    eng.submit(reqs)
    eng.collect()
    # the oldest (4 tokens) and, at width 4, the two longest no longer than it (3 and 2 tokens): 3 x 4 = 12, 9 real
    assert [r.request_id for r in eng.slots if r is not None] == ["r0", "r2", "r5"]
    assert [r.request_id for r in eng.waiting] == ["r1", "r3", "r4"]
    eng.admit_batch = 1   # admit at every step from here (8 slots would wait for 1 free anyway)
    eng.collect()
    assert [r.request_id for r in eng.waiting] == ["r3"]          # r1 (2) with r4 (1); 11 tokens would be alone
    eng.collect()
    assert int(eng._occ.sum()) == 6 and not eng.waiting            # 11 tokens: over the budget, alone
    got = run_all(eng, [])
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids and got[rid].log_probs == pytest.approx(out.log_probs, abs=1e-5)
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        HFEngine(random_model_dir, CPU, max_num_batched_tokens=0)


def test_a_burst_of_resumed_responses_is_prefilled_at_similar_lengths():
    """The joiners of each step when a weight update's parked responses come back (lognormal lengths up to 3072,
    budget 8192): every request joins exactly once, the oldest at each step, and far less of each prefill is padding
    than first come first served (measured here: 90% real tokens over 37 steps against 62% over 61)."""
    import random
    import types

    rng = random.Random(0)
    reqs = [types.SimpleNamespace(prompt_ids=[0] * int(min(3072, 16 + rng.lognormvariate(6.6, 0.75))), n=i)
            for i in range(256)]
    eng = types.SimpleNamespace(max_num_batched_tokens=8192, waiting=deque(reqs), packed_prefill=False)
    seen, steps, padded, real = [], 0, 0, 0
    while eng.waiting:
        oldest = eng.waiting[0]
        joining = HFEngine._joining(eng, 256)
        assert joining[0] is oldest
        width = max(len(r.prompt_ids) for r in joining)
        assert len(joining) == 1 or len(joining) * width <= 8192
        seen += [r.n for r in joining]
        steps, padded, real = steps + 1, padded + width * len(joining), real + sum(len(r.prompt_ids) for r in joining)
    assert sorted(seen) == list(range(256)) and steps < 45 and real / padded > 0.85, (steps, real / padded)


def test_the_cache_goes_under_the_keyword_the_model_takes(random_model_dir):
    """transformers renamed forward's `past_key_values` to `cache` (the old name warns on every call until 5.40):
    the engine passes its slot cache under whichever name the model's forward declares."""
    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
            return cache

    class Before(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    assert cache_keyword(Renamed()) == "cache"
    assert cache_keyword(Before()) == "past_key_values"
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[], pad_token_id=0)
    assert eng._cache_kw == cache_keyword(eng.base)
    assert eng._cache_kw in inspect.signature(eng.base.forward).parameters


def test_a_tail_left_in_high_slots_moves_down_and_decodes_as_it_would_have(random_model_dir, hf_model):
    """Seven short responses and one long one in the highest slot: once the short ones finish, the long one moves to
    slot 0 (the decode batch shrinks from 8 rows to 1) and its tokens and log-probs are those of generate."""
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0)
    short = SamplingParams(temperature=0.0, max_tokens=2)
    long_ = SamplingParams(temperature=0.0, max_tokens=12)
    reqs = [GenRequest(f"s{i}", PROMPTS[i % 5], short) for i in range(7)] + [GenRequest("long", PROMPTS[2], long_)]
    eng.submit(reqs)
    widths, outs = [], {}
    while eng.num_in_flight():
        for o in eng.collect():
            outs[o.request_id] = o
        widths.append(eng._hi())
    # (the width after each step): the short ones finish at the second step, the next one moves the long one down
    assert widths == [8, 8] + [1] * 9 + [0]
    got = outs["long"]
    ref = hf_model.generate(torch.tensor([PROMPTS[2]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.token_ids == ref[0, len(PROMPTS[2]):].tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPTS[2] + got.token_ids])).logits[0, len(PROMPTS[2]) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(lp, torch.tensor(got.log_probs), atol=1e-4)
    for i in range(7):
        assert len(outs[f"s{i}"].token_ids) == 2


def test_a_packed_prefill_generates_what_the_padded_one_does(random_model_dir, hf_model):
    """packed_prefill (the default where FlashAttention's varlen kernel runs; forced here on the CPU): the joiners'
    prompts go back to back through the fused layer functions, no padding.  Sampled tokens and behaviour log-probs
    equal the padded prefill's from the same seed; greedy outputs equal generate, through slot reuse, a budget
    that counts real tokens (first come first served, the oldest alone when it is longer), and an interrupted
    response resumed from prompt + partial response."""
    prompts = [PROMPTS[i % 5] + list(range(2, 2 + i)) for i in range(9)]    # ragged: 1 to 13 tokens
    sampled = SamplingParams(temperature=1.0, max_tokens=6)
    runs = {}
    for packed in (False, True):
        eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, seed=3,
                       packed_prefill=packed)
        assert eng.packed_prefill is packed
        runs[packed] = run_all(eng, [GenRequest(f"p{i}", p, sampled) for i, p in enumerate(prompts)])
    for rid, out in runs[False].items():
        assert runs[True][rid].token_ids == out.token_ids
        assert runs[True][rid].log_probs == pytest.approx(out.log_probs, abs=1e-5)
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0, packed_prefill=True,
                   max_num_batched_tokens=6)
    eng.submit([GenRequest(f"g{i}", p, GREEDY) for i, p in enumerate(prompts[:6])])    # 3, 3, 7, 4, 8, 8 tokens
    eng.collect()
    assert [r.request_id for r in eng.slots if r is not None] == ["g0", "g1"]   # 3 + 3 = 6; g2 would pass it
    eng.admit_batch = 1
    eng.collect()
    assert [r.request_id for r in eng.waiting] == ["g3", "g4", "g5"]            # g2 (7 > 6): the oldest, alone
    outs = run_all(eng, [])
    for rid, out in outs.items():
        p = prompts[int(rid[1:])]
        ref = hf_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist(), rid
    pend = PendingResponse("u", "r", prompts[8], GREEDY)
    eng.submit([pend.request()])
    for _ in range(4):
        eng.collect()
    assert not pend.extend(eng.interrupt()[0])
    assert pend.extend(run_all(eng, [pend.request()])["r"])
    ref = hf_model.generate(torch.tensor([prompts[8]]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert pend.to_sample().response_ids == ref[0, len(prompts[8]):].tolist()
    with pytest.raises(ValueError, match=r"packed_prefill=True\) needs the fused decode"):
        HFEngine(random_model_dir, CPU, fused_decode=False, packed_prefill=True)


def test_the_engine_counts_what_its_decode_steps_attend_over(random_model_dir):
    """cached_token_steps (the planner's per-cached-token cost reads it through the run's metrics): each decode step
    adds the tokens its running sequences had cached.  A 3-token prompt with 4 new tokens decodes 3 times on the CPU
    (the last token is sampled, not decoded), over 3, 4 and 5 cached tokens; a second one alongside adds its own."""
    from fully_async.telemetry.metrics import engine_metrics

    eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0)
    run_all(eng, [GenRequest("a", [5, 6, 7], SamplingParams(0.0, max_tokens=4))])
    assert eng.cached_token_steps == 3 + 4 + 5
    run_all(eng, [GenRequest("b", [5, 6, 7], SamplingParams(0.0, max_tokens=4)),
                  GenRequest("c", [8, 9], SamplingParams(0.0, max_tokens=2))])
    assert eng.cached_token_steps == 12 + (3 + 2) + 4 + 5
    m = engine_metrics([{"tokens": 50, "busy_s": 1.0, "iterations": 10, "engine_s": 0.02, "kv_tokens": 900}],
                       [{"tokens": 10, "busy_s": 0.5, "iterations": 5, "engine_s": 0.01, "kv_tokens": 100}], 1.0)
    assert m["fully_async/rollouter/engine_0/kv_tokens_per_step"] == 160.0     # (900 - 100) / 5 steps
    assert "fully_async/rollouter/engine_0/kv_tokens_per_step" not in engine_metrics(
        [{"tokens": 50, "busy_s": 1.0, "iterations": 10, "engine_s": 0.02}], None, 1.0)   # engines that do not count


def test_a_request_longer_than_the_budget_is_prefilled_in_chunks_over_steps(random_model_dir, hf_model):
    """enable_chunked_prefill (verl's default) with the packed prefill: a 13-token prompt under a 4-token budget takes
    its slot's positions in chunks of 4, 4, 4 and 1 over four steps, attending over what its slot already holds,
    while two running sequences above its slot go on decoding (their decode steps run over its slot too); it joins
    the decode after its last chunk.  Every greedy output equals generate; the same without chunking (prefilled
    alone).  A chunked request counts as in flight, comes back from interrupt() as an aborted output with no
    tokens, and a sleep that frees the cache sends it back to the head of the queue, to be prefilled again."""
    long_prompt = list(range(2, 15))
    ref = lambda p, n: hf_model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,  # noqa: E731
                                         pad_token_id=0)[0, len(p):].tolist()

    def run(chunked, sleep_at=None):
        eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0, packed_prefill=True,
                       max_num_batched_tokens=4, chunked_prefill=chunked)
        eng.submit([GenRequest("a", [5], SamplingParams(0.0, max_tokens=1)),
                    GenRequest("b", [8, 9], SamplingParams(0.0, max_tokens=12)),
                    GenRequest("c", [3], SamplingParams(0.0, max_tokens=12))])
        outs = {o.request_id: o for o in eng.collect()}            # a finishes at once: slot 0 frees, b and c run
        assert "a" in outs and eng._occ.tolist() == [False, True, True, False]
        eng.submit([GenRequest("long", long_prompt, SamplingParams(0.0, max_tokens=6))])
        chunks = []
        for step in range(30):
            if step == sleep_at:
                assert eng._chunk is not None and eng.num_in_flight() == 3
                eng.sleep(1, keep_in_flight=True)
                assert eng._chunk is None and eng.waiting[0].request_id == "long"
                eng.wake_up()
            outs.update({o.request_id: o for o in eng.collect()})
            chunks.append(eng._chunk[2] if eng._chunk is not None else None)
            if len(outs) == 4:
                break
        for rid, prompt, n in (("b", [8, 9], 12), ("c", [3], 12), ("long", long_prompt, 6)):
            assert outs[rid].token_ids == ref(prompt, n), (chunked, rid)
        return chunks

    assert run(True)[:4] == [4, 8, 12, None]                           # 4 + 4 + 4, then the last token: seated
    assert run(False)[0] is None                                        # alone, at once
    run(True, sleep_at=2)
    eng = HFEngine(random_model_dir, CPU, max_num_seqs=2, eos_token_ids=[], pad_token_id=0, packed_prefill=True,
                   max_num_batched_tokens=4)
    eng.submit([GenRequest("long", long_prompt, GREEDY)])
    eng.collect()
    assert eng._chunk is not None and eng.num_in_flight() == 1 and not eng._occ.any()
    out = eng.interrupt()
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in out] == [("long", [], "abort")]
    assert eng.num_in_flight() == 0 and eng._chunk is None
