"""Partial rollout bookkeeping: concatenation of tokens, log-probs and per-token versions."""
import pytest

from fully_async.partial import PendingResponse
from fully_async.types import GenOutput, SamplingParams


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
