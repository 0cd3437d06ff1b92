"""Synthetic response lengths (benchmark.response_length): determinism, shape, histograms, bad input."""
import json
import math
from statistics import NormalDist

import pytest

from fully_async.core.config import ConfigError
from fully_async.run.hydra_setup import load_config
from fully_async.core.workload import LengthProfile, validate_config

IDS = [f"u{i}-s{j}" for i in range(2500) for j in range(4)]   # 10k sample ids as group_pendings names them


def cfg_with(*overrides):
    return load_config(["data.max_response_length=512", *overrides])


def test_none_is_off():
    assert LengthProfile.from_config(cfg_with()) is None
    validate_config(cfg_with())


def test_deterministic_across_instances_and_seeds():
    a = LengthProfile.from_config(cfg_with("benchmark.response_length=lognormal"))
    b = LengthProfile.from_config(cfg_with("benchmark.response_length=lognormal"))
    assert [a.target(i) for i in IDS[:500]] == [b.target(i) for i in IDS[:500]]
    other = LengthProfile.from_config(cfg_with("benchmark.response_length=lognormal", "benchmark.seed=7"))
    assert [a.target(i) for i in IDS[:200]] != [other.target(i) for i in IDS[:200]]


def test_stable_hash_pinned():
    """The same id gets the same length in another process with another hash salt (no Python hash())."""
    p = LengthProfile.lognormal(512)
    got = [p.target(f"g{i}-s0") for i in range(6)]
    import subprocess
    import sys
    code = ("from fully_async.core.workload import LengthProfile; p = LengthProfile.lognormal(512); "
            "print([p.target(f'g{i}-s0') for i in range(6)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == str(got)


def test_lognormal_shape_on_10k_ids():
    p = LengthProfile.from_config(cfg_with("benchmark.response_length=lognormal"))
    lengths = sorted(p.target(i) for i in IDS)
    assert all(1 <= n <= 512 for n in lengths)
    assert abs(lengths[len(lengths) // 2] - 128) <= 6                      # median = 0.25 x 512
    expected_max = 1 - NormalDist().cdf(math.log(511.5 / 128) / 0.75)      # ~3.2%
    assert expected_max == pytest.approx(0.032, abs=0.002)
    assert lengths.count(512) / len(lengths) == pytest.approx(expected_max, abs=0.006)
    s = p.stats()                                                          # exact stats agree with sampling
    assert s["p_max"] == pytest.approx(expected_max, rel=1e-6)
    assert s["p50"] == 128 and s["mean"] == pytest.approx(sum(lengths) / len(lengths), rel=0.03)
    assert s["p90"] == pytest.approx(lengths[int(0.9 * len(lengths))], abs=10)
    assert sum(p.pmf().values()) == pytest.approx(1.0)
    d = p.describe()
    assert d.startswith("synthetic response lengths: lognormal(median 128 = 0.25 x 512, sigma 0.75)")
    assert "clipped at 512" in d and "p50 128" in d and "P(hit max) 3.2%" in d
    assert p.as_dict()["expected"]["p50"] == 128 and json.dumps(p.as_dict())


def test_lognormal_parameters_move_the_distribution():
    narrow = LengthProfile.lognormal(512, median_ratio=0.5, sigma=0.1)
    lengths = [narrow.target(i) for i in IDS[:2000]]
    assert all(160 <= n <= 410 for n in lengths) and narrow.stats()["p_max"] < 1e-9
    assert abs(sorted(lengths)[1000] - 256) <= 4
    assert LengthProfile.lognormal(512, median_ratio=1.0).stats()["p50"] == 512   # half hit the max


def test_histogram_proportions_and_clipping(tmp_path):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"lengths": [10, 100, 400, 2000, 5000], "weights": [1, 2, 0, 1, 0.5]}))
    p = LengthProfile.from_config(cfg_with(f"benchmark.response_length={path}"))
    counts = {}
    for i in IDS:
        counts[p.target(i)] = counts.get(p.target(i), 0) + 1
    assert set(counts) == {10, 100, 512}                                  # 400 has weight 0; 2000, 5000 -> 512
    total = len(IDS)
    assert counts[10] / total == pytest.approx(1 / 4.5, abs=0.015)
    assert counts[100] / total == pytest.approx(2 / 4.5, abs=0.015)
    assert counts[512] / total == pytest.approx(1.5 / 4.5, abs=0.015)
    assert p.pmf() == pytest.approx({10: 1 / 4.5, 100: 2 / 4.5, 512: 1.5 / 4.5})
    assert p.stats()["p50"] == 100 and p.stats()["p90"] == 512
    assert "(3 lengths, 10..512)" in p.describe() and "P(hit max) 33.3%" in p.describe()
    # without weights, every listed length counts once
    path.write_text(json.dumps({"lengths": [5, 5, 5, 20]}))
    assert LengthProfile.histogram(str(path), 512).pmf() == pytest.approx({5: 0.75, 20: 0.25})


@pytest.mark.parametrize("override, key", [
    ("benchmark.response_length=uniform", "benchmark.response_length"),
    ("benchmark.response_length=/no/such/file.json", "benchmark.response_length"),
    ("benchmark.response_length_median_ratio=0", "benchmark.response_length_median_ratio"),
    ("benchmark.response_length_median_ratio=1.5", "benchmark.response_length_median_ratio"),
    ("benchmark.response_length_median_ratio=-0.1", "benchmark.response_length_median_ratio"),
    ("benchmark.response_length_sigma=0", "benchmark.response_length_sigma"),
    ("benchmark.response_length_sigma=-1", "benchmark.response_length_sigma"),
])
def test_bad_values_name_the_key(override, key):
    cfg = cfg_with(override) if override.startswith("benchmark.response_length=") else \
        cfg_with("benchmark.response_length=lognormal", override)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg)
    assert exc.value.key == key
    if key == "benchmark.response_length":
        assert "'none', 'lognormal' or an existing .json" in str(exc.value)


@pytest.mark.parametrize("content, words", [
    ("{not json", "cannot read"),
    ("[1, 2, 3]", "expected a JSON object"),
    ('{"weights": [1]}', "expected a JSON object"),
    ('{"lengths": []}', "non-empty list"),
    ('{"lengths": [10, 20], "weights": [1]}', "one number per length"),
    ('{"lengths": [10, 0], "weights": [1, 1]}', "length 0 is not a positive integer"),
    ('{"lengths": [10, -3]}', "length -3 is not a positive integer"),
    ('{"lengths": [10, 2.5]}', "length 2.5 is not a positive integer"),
    ('{"lengths": [10, 20], "weights": [1, -1]}', "weight -1 is not a finite number >= 0"),
    ('{"lengths": [10, 20], "weights": [0, 0]}', "all weights are 0"),
])
def test_bad_histograms_name_the_key(tmp_path, content, words):
    path = tmp_path / "h.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg_with(f"benchmark.response_length={path}"))
    assert exc.value.key == "benchmark.response_length" and words in str(exc.value) and str(path) in str(exc.value)


def test_group_pendings_applies_the_profile():
    from fully_async.rollout.generation import group_pendings
    from fully_async.core.types import PromptRecord, SamplingParams

    p = LengthProfile.lognormal(64)
    rec = PromptRecord(index=0, prompt_ids=[1, 2], data_source="x", ground_truth="", extra_info={})
    pend = group_pendings("g7", rec, 3, SamplingParams(max_tokens=64), lengths=p)
    assert [q.target_len for q in pend] == [p.target(f"g7-s{j}") for j in range(3)]
    assert [q.request().params.max_tokens for q in pend] == [min(64, p.target(f"g7-s{j}")) for j in range(3)]
    assert all(q.target_len is None for q in group_pendings("g7", rec, 3, SamplingParams(max_tokens=64)))


def test_a_runs_length_counts_load_as_a_histogram(tmp_path):
    """launcher writes response_lengths.json with length_histogram; load_histogram (benchmark.response_length,
    plan.response_lengths) reads it back; empty responses are left out."""
    import json

    from fully_async.core.workload import length_histogram, load_histogram

    path = tmp_path / "response_lengths.json"
    path.write_text(json.dumps(length_histogram({7: 2, 3: 5, 0: 1, 12: 1})))
    assert load_histogram(str(path)) == ([3, 7, 12], [5.0, 2.0, 1.0])
