"""fully_async/compare/report.py: the repeat summary (median, spread, warnings) and the speedup wording."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from fully_async.compare.report import _speedup, format_repeats, summarize_repeats  # noqa: E402


def table(a, s, step_a=1.0, step_s=1.0):
    return {"modes": {"async": {"tokens_per_s": a, "time_per_step_s": step_a},
                      "sync": {"tokens_per_s": s, "time_per_step_s": step_s}},
            "speedup": {"tokens_per_s": a / s}}


def test_median_min_max_spread_and_a_warning_above_20_percent():
    summary = summarize_repeats([table(100, 100), table(130, 100), table(110, 100)], busy=["repeat 1: busy"])
    sp = summary["figures"]["speedup async/sync"]
    assert sp["values"] == [1.0, 1.3, 1.1] and sp["median"] == 1.1 and sp["min"] == 1.0 and sp["max"] == 1.3
    assert sp["spread"] == pytest.approx(0.3 / 1.1)
    assert summary["figures"]["tokens/s sync"]["spread"] == 0.0
    assert any(w.startswith("speedup async/sync: spread 27%") for w in summary["warnings"])
    assert not any(w.startswith("tokens/s sync") for w in summary["warnings"])
    assert "repeat 1: busy" in summary["warnings"]
    text = format_repeats(summary)
    assert "over 3 repeats" in text and "speedup async/sync" in text and "WARNING: speedup" in text


def test_steady_repeats_warn_nothing_and_unreached_thresholds_say_so():
    summary = summarize_repeats([table(100, 80), table(104, 81)])
    assert summary["warnings"] == []
    assert _speedup(None) == "not reached (by one mode or both)" and _speedup(1.234) == "1.23x"
