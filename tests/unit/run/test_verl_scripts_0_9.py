"""verl 0.9's launch scripts (tests/fixtures/verl_scripts_0_9.tsv: every examples/ folder, the fully-async and
one-step-off recipes and the V1 async trainer's recipes, at verl-project/verl 1dda039b, the newest verl commit stored
here; verl 0.9.1 on PyPI ships no scripts) port like b178a3cd's (test_verl_scripts.py): each translates, composes
and passes validation, or is refused for a reason docs/verl_compat.md lists.  The counts over both sets are the
ones docs/verl_compat.md and the README state.
"""
import os

import pytest

from test_verl_scripts import DOC, ROOT, TABLE, rows, table_outcomes  # noqa: I100


TABLE_09 = os.path.join(ROOT, "tests", "fixtures", "verl_scripts_0_9.tsv")


def counts(table):
    """(translated without a warning, translated with warnings, refused, unexplained paths) over one table."""
    results = table_outcomes(table).items()
    unexplained = [path for path, (reason, _, _) in results if reason is None]
    refused = sum(1 for _, (reason, _, _) in results if reason not in (None, "ok"))
    warned = sum(1 for _, (reason, _, w) in results if reason == "ok" and w)
    clean = sum(1 for _, (reason, _, w) in results if reason == "ok" and not w)
    return clean, warned, refused, unexplained


@pytest.fixture(scope="module")
def both():
    return counts(TABLE), counts(TABLE_09)


def test_the_second_table_is_verl_0_9s_scripts():
    head = open(TABLE_09).read().splitlines()[:3]
    assert "verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9" in head[1]
    paths = [r[1] for r in rows(TABLE_09)]
    assert len(paths) == 128
    v1 = sorted(os.path.basename(p) for p in paths if "special_e2e" in p)
    assert v1 == ["run_v1_colocate_async_disrm.sh", "run_v1_separate_async.sh", "run_v1_separate_async_opd.sh"]


def test_every_0_9_script_translates_or_is_refused_for_a_documented_reason(both):
    assert both[1][3] == [], both[1][3]
    assert both[0][3] == [], both[0][3]


def test_the_counts_over_both_sets_are_the_docs_and_readmes(both):
    (c1, w1, r1, _), (c2, w2, r2, _) = both
    line = (f"{c1 + w1 + c2 + w2} of {c1 + w1 + r1 + c2 + w2 + r2} verl launch scripts translate ({c1 + c2} without "
            f"a warning, {w1 + w2} with warnings) and {r1 + r2} are refused for a documented reason: b178a3cd "
            f"{c1}/{w1}/{r1}, verl 0.9 {c2}/{w2}/{r2} (translated / warned / refused)")
    assert line in " ".join(open(DOC).read().split()), line
    assert line in " ".join(open(os.path.join(ROOT, "README.md")).read().split()), line
