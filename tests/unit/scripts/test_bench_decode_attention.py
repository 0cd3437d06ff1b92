"""scripts/bench_decode_attention.py's pick rule: per row count, the swept setting whose worst time over the length
cases, against each case's best, is least; ties broken by the sum of those ratios."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from bench_decode_attention import CONFIGS, label, pick  # noqa: E402

SWEPT = [c for c in CONFIGS if c]


def test_the_setting_least_behind_the_best_in_its_worst_case_is_picked():
    labels = [label(c) for c in SWEPT]
    slow = {label: {"ms": 100.0} for label in labels}
    cases = {"uniform": dict(slow, **{labels[0]: {"ms": 5.0}, labels[1]: {"ms": 5.3}, labels[2]: {"ms": 5.2}}),
             "ragged": dict(slow, **{labels[0]: {"ms": 7.0}, labels[1]: {"ms": 6.0}, labels[2]: {"ms": 6.3}}),
             "other": dict(slow, settings={"ms": 0.1})}    # the table's own entry is not a candidate
    # worst ratios: labels[0] 7/6 = 1.17 (fastest on uniform, but 17% behind on ragged), labels[1] 1.06, labels[2] 1.05
    assert pick(cases) == list(SWEPT[2])
    cases["uniform"][labels[1]] = {"ms": 5.25}               # labels[1] and [2]: both 1.05 at worst; [1]'s sum less
    assert pick(cases) == list(SWEPT[1])


def test_a_setting_that_failed_somewhere_is_not_picked():
    labels = [label(c) for c in SWEPT]
    cases = {"a": {label: {"ms": 1.0} for label in labels}}
    cases["a"][labels[0]] = {"ms": 0.1}
    cases["b"] = {label: {"ms": 1.0} for label in labels}
    cases["b"][labels[0]] = {"error": "OutOfResources"}
    assert pick(cases) != list(SWEPT[0])
