"""Partial rollout bookkeeping: concatenation of tokens, log-probs and per-token versions."""
import pytest

from fully_async.core.partial import PendingResponse
from fully_async.core.types import GenOutput, SamplingParams


def test_resume_concatenates_and_records_versions():
    p = PendingResponse("u", "u-s0", [1, 2, 3], SamplingParams(1.0, 1.0, -1, max_tokens=5))
    assert p.request().prompt_ids == [1, 2, 3] and p.request().params.max_tokens == 5
    assert not p.extend(GenOutput("u-s0", [7, 8], [-0.1, -0.2], [0, 0], "abort"))
    req = p.request()
    assert req.prompt_ids == [1, 2, 3, 7, 8] and req.params.max_tokens == 3
    assert p.extend(GenOutput("u-s0", [9, 4], [-0.3, -0.4], [1, 1], "stop"))
    s = p.to_sample()
    assert s.response_ids == [7, 8, 9, 4]
    assert s.rollout_log_probs == [-0.1, -0.2, -0.3, -0.4]
    assert s.versions == [0, 0, 1, 1]
    assert (s.param_version_start, s.param_version_end, s.num_interruptions) == (0, 1, 1)
    assert s.finish_reason == "stop"


def test_abort_exactly_at_budget_completes_as_length():
    p = PendingResponse("u", "u-s0", [1], SamplingParams(max_tokens=2))
    assert p.extend(GenOutput("u-s0", [5, 6], [-1.0, -1.0], [3, 3], "abort"))
    assert p.finish_reason == "length"


def test_mismatched_output_rejected():
    p = PendingResponse("u", "u-s0", [1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        p.extend(GenOutput("other", [5], [-1.0], [0], "stop"))
    with pytest.raises(ValueError):
        p.extend(GenOutput("u-s0", [5], [-1.0, -2.0], [0], "stop"))


# ----------------------------------------------------------------- synthetic EOS (benchmark.response_length)
def test_target_len_across_abort_resume_stops_exactly_at_target():
    p = PendingResponse("u", "u-s0", [1], SamplingParams(max_tokens=10), target_len=6)
    assert p.request().params.max_tokens == 6
    assert not p.extend(GenOutput("u-s0", [5, 6, 7], [-1.0] * 3, [0] * 3, "abort"))
    assert p.request().params.max_tokens == 3                  # the rest of the synthetic length, not of max_tokens
    assert p.extend(GenOutput("u-s0", [8, 9, 4], [-1.0] * 3, [1] * 3, "length"))   # engine hit the request's cap
    assert (len(p.token_ids), p.finish_reason, p.to_sample().finish_reason) == (6, "stop", "stop")
    # interrupted exactly at the target: complete, nothing to resume, a synthetic EOS
    q = PendingResponse("u", "u-s1", [1], SamplingParams(max_tokens=10), target_len=2)
    assert q.extend(GenOutput("u-s1", [5, 6], [-1.0] * 2, [0] * 2, "abort"))
    assert q.finish_reason == "stop" and len(q.token_ids) == 2


@pytest.mark.parametrize("target", [10, 25])
def test_target_at_or_over_max_tokens_ends_as_length(target):
    p = PendingResponse("u", "u-s0", [1], SamplingParams(max_tokens=10), target_len=target)
    assert p.request().params.max_tokens == 10
    assert not p.extend(GenOutput("u-s0", [5] * 4, [-1.0] * 4, [0] * 4, "abort"))
    assert p.extend(GenOutput("u-s0", [5] * 6, [-1.0] * 6, [1] * 6, "length"))
    assert (len(p.token_ids), p.finish_reason) == (10, "length")


def test_real_eos_before_target_stays_stop():
    p = PendingResponse("u", "u-s0", [1], SamplingParams(max_tokens=10), target_len=8)
    assert p.extend(GenOutput("u-s0", [5, 1], [-1.0] * 2, [0] * 2, "stop"))
    assert (len(p.token_ids), p.finish_reason) == (2, "stop")


def test_engine_interrupt_resume_honours_target_len(random_model_dir):
    """End to end on the embedded engine (a random model, no EOS): interrupted mid-way and resumed on
    a new version, each response ends at exactly its synthetic length, or at max_tokens as 'length'."""
    from fully_async.device import CPU
    from fully_async.rollout.engines.base import run_requests
    from fully_async.rollout.engines.hf_engine import HFEngine

    eng = HFEngine(random_model_dir, CPU, max_num_seqs=4, eos_token_ids=[], pad_token_id=0)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    pend = [PendingResponse("u", f"u-s{j}", [5, 6, 7], params, target_len=t) for j, t in enumerate([3, 7, 12, 40])]
    by_id = {p.sample_id: p for p in pend}
    eng.submit([p.request() for p in pend])
    for _ in range(2):
        for out in eng.collect():
            assert by_id[out.request_id].extend(out)
    for out in eng.interrupt():
        by_id[out.request_id].extend(out)
    assert any(p.num_interruptions for p in pend)
    eng.version = 1
    todo = [p for p in pend if not p.finish_reason]
    for rid, out in run_requests(eng, [p.request() for p in todo], timeout_s=120.0).items():
        assert by_id[rid].extend(out)
    assert [(len(p.token_ids), p.finish_reason) for p in pend] == [(3, "stop"), (7, "stop"), (12, "length"),
                                                                   (12, "length")]
