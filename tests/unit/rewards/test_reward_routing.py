"""verl parity of the built-in rewards: routing by data_source and each rule's score.

Every expected value below was worked out by reading verl's `verl/utils/reward_score/` (the
routing in `__init__.py`, then gsm8k.py, math_reward.py, math_dapo.py, prime_math/,
geo3k.py + mathruler's grader, search_r1_like_qa_em.py, math_verify.py).
"""
from __future__ import annotations

import logging
import math
import threading
import time

import pytest

from fully_async.rewards import RewardError, RewardManager, default_compute_score, load_custom_score
from fully_async.rewards import gsm8k, hendrycks, isolated, math_dapo, prm800k, scoring, search_r1

HAS_SYMPY_EXTRA = all(scoring._installed(p) for p in ("sympy", "pylatexenc"))
needs_sympy_extra = pytest.mark.skipif(not HAS_SYMPY_EXTRA, reason="the math extra (pylatexenc) is not installed")

# ----------------------------------------------------------------------------------- routing
ROUTES = [
    ("openai/gsm8k", "gsm8k"),
    ("lighteval/MATH", "math"), ("DigitalLearningGmbH/MATH-lighteval", "math"), ("HuggingFaceH4/MATH-500", "math"),
    ("math_dapo", "math_dapo"), ("math", "math_dapo"), ("math_dapo_reasoning", "math_dapo"),
    ("aime2024", "math_dapo"), ("aime_2025", "math_dapo"), ("aime", "math_dapo"),
    ("numina_aops_forum", "prime_math"), ("numina_synthetic_math", "prime_math"), ("numina_amc_aime", "prime_math"),
    ("numina_synthetic_amc", "prime_math"), ("numina_cn_k12", "prime_math"), ("numina_olympiads", "prime_math"),
    ("hiyouga/geometry3k", "geo3k"),
    ("searchR1_nq", "search_r1"), ("searchR1_triviaqa", "search_r1"), ("searchR1_popqa", "search_r1"),
    ("searchR1_hotpotqa", "search_r1"), ("searchR1_2wikimultihopqa", "search_r1"), ("searchR1_musique", "search_r1"),
    ("searchR1_bamboogle", "search_r1"),
    ("arithmetic", "arithmetic"),
]


@pytest.mark.parametrize("data_source,rule", ROUTES)
def test_routing_matches_verl(data_source, rule):
    assert scoring.scorer_for(data_source) == rule


@pytest.mark.parametrize("data_source", ["codecontests", "apps", "codeforces", "taco"])
def test_code_sources_refused_with_the_fix(data_source):
    with pytest.raises(NotImplementedError) as e:
        default_compute_score(data_source, "print(1)", {"inputs": [], "outputs": []})
    msg = str(e.value)
    assert repr(data_source) in msg and "sandbox" in msg
    assert "custom_reward_function.path" in msg and "custom_reward_function.name" in msg


@pytest.mark.parametrize("data_source", ["my/dataset", "gsm8k", "MATH", "numina_other", "searchR1_other", ""])
def test_unknown_source_names_source_and_fix(data_source):
    """verl raises for these too ("gsm8k" alone is not verl's name: openai/gsm8k is)."""
    with pytest.raises(NotImplementedError) as e:
        default_compute_score(data_source, "x", "y")
    msg = str(e.value)
    assert repr(data_source) in msg and "custom_reward_function.path" in msg
    assert "openai/gsm8k" in msg and "numina_olympiads" in msg and "aime*" in msg


def test_verl_keyword_arguments_are_accepted():
    assert default_compute_score("openai/gsm8k", "#### 3", "3", None, sandbox_fusion_url=None,
                                 concurrent_semaphore=None, memory_limit_mb=None) == 1.0


# ----------------------------------------------------------------------------------- gsm8k
GSM8K = [
    ("...\n#### 1,234", "1234", 1.0),           # strict strips commas from the answer
    ("#### 1234", "1,234", 0.0),                # ... but the ground truth is compared as given
    ("#### 72", " 72", 0.0),
    ("#### 72", 72, 0.0),                       # a non-string ground truth never matches
    ("#### -15", "-15", 1.0),
    ("#### $2,500", "2500", 0.0),               # the number must follow '#### ' directly
    ("so #### 1 and later #### 72", "72", 1.0),  # the last one
    ("so #### 1 and later #### 72", "1", 0.0),
    ("The answer is 18.", "18", 0.0),           # strict needs '####'
    ("#### 5.", "5", 0.0),                      # the trailing dot stays
    ("#### 3.14", "3.14", 1.0),
    ("#### ,", "", 1.0),                        # punctuation only: ',' -> '' equals an empty truth
    ("#### .", "5", 0.0),
    ("#### ,", "0", 0.0),
    ("x" * 400 + "#### 9", "9", 1.0),
    ("#### 9" + "x" * 400, "9", 0.0),           # only the last 300 characters are searched
]


@pytest.mark.parametrize("response,truth,expected", GSM8K)
def test_gsm8k_scores(response, truth, expected):
    score = default_compute_score("openai/gsm8k", response, truth)
    assert score == expected and type(score) is float


@pytest.mark.parametrize("text,method,expected", [
    ("#### 1,234", "strict", "1234"),
    ("#### -1,000.50", "strict", "-1000.50"),
    ("#### ,.,", "strict", "."),
    ("the answer is 7", "strict", None),
    ("it costs 5 dollars, not 1,200", "flexible", "1,200"),  # flexible keeps commas
    ("it costs 5.", "flexible", "5."),
    ("total -3 apples", "flexible", "-3"),
    ("a , b", "flexible", ","),                              # only '' and '.' are skipped
    ("a . b . c", "flexible", "."),                          # every run is '.': verl's loop ends on the first
    ("no numbers", "flexible", None),
])
def test_gsm8k_extraction(text, method, expected):
    assert gsm8k.extract_solution(text, method) == expected


def test_gsm8k_score_and_format_score_semantics():
    # found and right -> score; found but wrong -> format_score; nothing found -> 0
    assert gsm8k.compute_score("#### 7", "7", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("#### .", "7", format_score=0.1) == 0.1   # punctuation counts as an answer
    assert gsm8k.compute_score("no answer", "7", format_score=0.1) == 0
    assert gsm8k.compute_score("costs 1,200", "1200", method="flexible") == 0.0
    assert gsm8k.compute_score("costs 1,200", "1,200", method="flexible") == 1.0
    assert gsm8k.compute_score("a . b", "5", method="flexible", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="method='loose'"):
        gsm8k.extract_solution("1", method="loose")


def test_gsm8k_warns_once_about_non_string_truth(caplog, monkeypatch):
    monkeypatch.setattr(gsm8k, "_warned_non_str", False)
    with caplog.at_level(logging.WARNING, logger="fully_async.rewards.gsm8k"):
        assert gsm8k.compute_score("#### 72", 72) == 0.0
        assert gsm8k.compute_score("#### 72", 72) == 0.0
    assert sum("not a string" in r.message for r in caplog.records) == 1


# ----------------------------------------------------------------------------------- MATH (Hendrycks)
MATH = [
    (r"thus $\boxed{\dfrac{1}{2}}$.", r"\frac12", 1.0),
    (r"\boxed{2} wait \boxed{3}", "3", 1.0),
    (r"\boxed{2} wait \boxed{3}", "2", 0.0),
    ("the answer is 3", "3", 0.0),                 # no box
    (r"\boxed{45^\circ}", "45", 1.0),
    (r"\boxed{45}", r"\boxed{45}", 0.0),            # the ground truth is not unboxed
    (r"\fbox{7}", "7", 0.0),                       # found, but remove_boxed only opens \boxed
    (r"so $\boxed 5$.", "5", 1.0),                 # '\boxed ' up to the next '$'
    (r"\boxed{\$5}", "5", 1.0),
    (r"\boxed{$5$}", "5", 0.0),                    # plain '$' is not removed
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed{10\text{ cm}}", "10", 1.0),          # units after '\text{ '
    (r"\boxed{5.}", "5", 0.0),                     # no trailing-dot removal
    (r"\boxed{\text{(A)}}", "(A)", 0.0),           # \text{} is not unwrapped
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{y=2x+1}", "2x+1", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50%}", "50", 0.0),                   # only '\%' is dropped
    (r"\boxed{5\sqrt}", r"5\sqrt", 1.0),           # normalising raises: raw strings compared
    (r"\boxed{5\sqrt}", r"5\sqrt{}", 0.0),
    (r"\boxed{1}", 1, 0.0),                        # a non-string ground truth never matches
]


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
@pytest.mark.parametrize("response,truth,expected", MATH)
def test_math_scores(source, response, truth, expected):
    score = default_compute_score(source, response, truth)
    assert score == expected and type(score) is float


def test_math_boxes_and_normalisation():
    text = r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} done"
    assert hendrycks.last_boxed_only_string(text) == r"\boxed{\frac{1}{\sqrt{2}}}"
    assert hendrycks.remove_boxed(hendrycks.last_boxed_only_string(text)) == r"\frac{1}{\sqrt{2}}"
    assert hendrycks.last_boxed_only_string(r"\boxed{unclosed {x}") is None
    assert hendrycks.last_boxed_only_string("no box") is None
    assert hendrycks.last_boxed_only_string(r"\fbox{7}") == r"\fbox{7}"
    assert hendrycks.strip_string(r"\tfrac12") == r"\frac{1}{2}"
    assert hendrycks.strip_string(r"5\!000") == "5000"
    assert hendrycks.strip_string("-3/4") == r"\frac{-3}{4}"
    assert hendrycks.strip_string("+3/4") == "+3/4"
    assert hendrycks.strip_string("50%", drop_plain_percent=True) == "50"
    with pytest.raises(ValueError):
        hendrycks.strip_string(r"1\text{ m}\text{ s}")


# ----------------------------------------------------------------------------------- DAPO
DAPO = [
    ("Let me think.\nAnswer: 3", "3", 1.0, True, "3"),
    ("answer : 3", "3", 1.0, True, "3"),            # case-insensitive, spaces around ':'
    ("Answer: 4", "3", -1.0, False, "4"),
    (r"\boxed{3}", "3", -1.0, False, "[INVALID]"),   # no 'Answer:' -> wrong, -1
    ("Answer: 3\nAnswer: 4", "4", 1.0, True, "4"),   # the last one
    ("Answer: 1,000", "1000", 1.0, True, "1000"),
    ("Answer: 5 \\text{ cm}", "5", 1.0, True, "5"),
    ("Answer: x = 5", "5", 1.0, True, "5"),
    ("Answer: $\\frac34$", "\\frac{3}{4}", 1.0, True, "\\frac{3}{4}"),
    ("Answer: \\boxed{3}", "3", 1.0, True, "3"),
    ("x" * 400 + "Answer: 7", "7", 1.0, True, "7"),
    ("Answer: 7" + "x" * 400, "7", -1.0, False, "[INVALID]"),  # only the last 300 characters
]


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025"])
@pytest.mark.parametrize("response,truth,score,acc,pred", DAPO)
def test_dapo_scores(source, response, truth, score, acc, pred):
    assert default_compute_score(source, response, truth) == {"score": score, "acc": acc, "pred": pred}


def test_dapo_strict_box():
    assert math_dapo.compute_score(r"so \boxed{3}", "3", strict_box_verify=True) == {
        "score": 1.0, "acc": True, "pred": "3"}
    assert math_dapo.compute_score(r"\boxed{3}" + "x" * 100, "3", strict_box_verify=True) == {
        "score": -1.0, "acc": False, "pred": None}
    assert math_dapo.compute_score(r"\boxed{03}", "3", strict_box_verify=True)["score"] == -1.0


def test_dapo_acc_reaches_the_manager():
    rm = RewardManager(default_compute_score, max_response_length=8)
    assert rm.score("aime2024", "Answer: 12", "12", None, 4) == (1.0, {"acc": 1.0})
    assert rm.score("aime2024", "Answer: 11", "12", None, 4) == (-1.0, {"acc": 0.0})


# ----------------------------------------------------------------------------------- Search-R1
@pytest.mark.parametrize("response,truth,expected", [
    ("<answer>The Paris.</answer>", {"target": ["paris"]}, 1.0),
    ("<answer>\nParis!\n</answer>", {"target": "Paris"}, 1.0),
    ("<answer>London</answer> <answer>Paris</answer>", {"target": ["Paris"]}, 1.0),
    ("<answer>Paris, France</answer>", {"target": ["Paris"]}, 0.0),
    ("<answer>Paris, France</answer>", {"target": ["London", "paris france"]}, 1.0),
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}, 0.25),  # more than 10 tags: a quarter
    ("Paris", {"target": ["Paris"]}, 0.0),
])
def test_search_r1_scores(response, truth, expected):
    assert default_compute_score("searchR1_nq", response, truth) == expected


def test_search_r1_format_score_and_subem():
    assert search_r1.compute_score("<answer>x</answer>", {"target": ["y"]}, format_score=0.2) == 0.2
    assert search_r1.compute_score("no tags", {"target": ["y"]}, format_score=0.2) == 0
    assert search_r1.compute_score_subem("<answer>it is Paris</answer>", {"target": ["paris"]}) == 1.0


# ----------------------------------------------------------------------------------- prime_math, geo3k
PRIME = [
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"The answer is \boxed{\frac{2}{4}}", r"\frac{1}{2}", 0.0),  # unreduced fractions are not accepted
    (r"\boxed{x+1}", "1+x", 1.0),                                 # sympy
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),
    ("so the answer is 1,000,000.", "1000000", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{2\pi}", "6.28", 1.0),                               # pi = 3.14 is tried too
    (r"\boxed{2\pi}", "6.3", 0.0),
    (r"\boxed{3}", "4", 0.0),
    ("Therefore x = 7", "7", 1.0),
    ("no digits at all", "abc", 0.0),
    (r"\boxed{Point(1, 2)}", "(1, 2)", 0.0),                      # the comma rule answers before the Point one
    (r"\boxed{\frac12}", "1/2", 1.0),
]


@needs_sympy_extra
@pytest.mark.parametrize("response,truth,expected", PRIME)
def test_prime_math_scores(response, truth, expected):
    score = default_compute_score("numina_olympiads", response, truth)
    assert score == expected and type(score) is float


GEO3K = [
    (r"<think>r</think> so \boxed{3}", "3", 1.0),
    (r"\boxed{3}", "3", 0.9),                          # right but no <think></think>: 0.9
    (r"<think>r</think> \boxed{4}", "3", 0.1),         # format only: 0.1
    ("<think>r</think> the answer is 3", "3", 0.0),    # no box: the answer is "None"
    (r"<think>r</think> \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"<think>r</think> \boxed{50%}", "50", 1.0),      # mathruler drops plain '%'
]


@needs_sympy_extra
@pytest.mark.parametrize("response,truth,expected", GEO3K)
def test_geo3k_scores(response, truth, expected):
    assert default_compute_score("hiyouga/geometry3k", response, truth) == pytest.approx(expected)


@needs_sympy_extra
def test_sympy_rules_run_in_process_when_isolation_is_off(monkeypatch):
    monkeypatch.setenv("FULLY_ASYNC_REWARD_TIMEOUT_S", "0")
    assert default_compute_score("numina_cn_k12", r"\boxed{x+1}", "1+x") == 1.0
    assert default_compute_score("hiyouga/geometry3k", r"\boxed{3}", "3") == pytest.approx(0.9)


@pytest.mark.parametrize("source,rule", [("numina_olympiads", "prime_math"), ("hiyouga/geometry3k", "geo3k")])
def test_sympy_rules_name_the_missing_extra(monkeypatch, source, rule):
    monkeypatch.setattr(scoring, "_installed", lambda pkg: pkg != "pylatexenc")
    with pytest.raises(RewardError) as e:
        default_compute_score(source, r"\boxed{1}", "1")
    msg = str(e.value)
    assert repr(source) in msg and rule in msg and "pylatexenc" in msg and "fully_async[math]" in msg


def test_prime_sympy_comparison_has_a_time_limit(monkeypatch):
    """verl gives each sympy comparison 10 s; here a SIGALRM timer in the worker's main thread."""
    def slow(a, b):
        time.sleep(5)
        return True

    monkeypatch.setattr(prm800k, "_equal_under_sympy", slow)
    start = time.perf_counter()
    assert prm800k.are_equal_under_sympy("x", "x", timeout_s=0.2) is False
    assert time.perf_counter() - start < 2
    fast = []
    monkeypatch.setattr(prm800k, "_equal_under_sympy", lambda a, b: True)
    t = threading.Thread(target=lambda: fast.append(prm800k.are_equal_under_sympy("x", "x", timeout_s=0.2)))
    t.start()
    t.join()
    assert fast == [True]  # outside the main thread: no timer, no error


def test_safe_eval_matches_eval_on_arithmetic_and_refuses_code():
    from fully_async.rewards.prime_math import UnsafeExpression, _safe_eval, handle_pi

    for expr in ["2*3.14", " 1+2", "-2**2", "(1, 2*3)", "[1/2, [3]]", "7//2 % 3", "1 < 2 < 3", "2 > 3 or 5",
                 "{1, 2}", "[1, 2][1]", "(2^3)*1"]:
        assert _safe_eval(expr) == eval(expr), expr
    for expr in ["__import__('os').getcwd()", "abs(-1)", "x", "(1).real", "lambda: 0"]:
        with pytest.raises(UnsafeExpression):
            _safe_eval(expr)
    assert handle_pi("2\\pi", math.pi) == 2 * math.pi
    assert handle_pi("\\pi/2", 3.14) == 1.57
    assert handle_pi("abs(-2)*\\pi", math.pi) == "abs(-2)*1*3.141592653589793"  # verl would eval() this


# ----------------------------------------------------------------------------------- the scoring pool
@pytest.fixture(scope="module")
def scoring_pool():
    pool = isolated.ScoringPool(workers=1)
    yield pool
    pool.shutdown()


def test_pool_runs_and_propagates_errors(scoring_pool):
    assert scoring_pool.call(abs, -3, default=None, label="t") == 3
    with pytest.raises(ValueError):
        scoring_pool.call(int, "x", default=None, label="t")
    out = []
    t = threading.Thread(target=lambda: out.append(scoring_pool.call(abs, -4, default=None, label="t")))
    t.start()
    t.join()
    assert out == [4]  # from a non-main thread too (where signal-based timeouts cannot work)


def test_pool_timeout_scores_default_warns_and_recovers(caplog):
    pool = isolated.ScoringPool(workers=1)
    try:
        with caplog.at_level(logging.WARNING, logger="fully_async.rewards.isolated"):
            start = time.perf_counter()
            assert pool.call(time.sleep, 60, default=0.0, label="data_source='x'", timeout=3.0) == 0.0
            assert time.perf_counter() - start < 30
        assert any("data_source='x'" in r.message and "FULLY_ASYNC_REWARD_TIMEOUT_S" in r.message
                   for r in caplog.records)
        assert pool.restarts == 1
        assert pool.call(abs, -5, default=None, label="t", timeout=60) == 5  # a fresh worker
    finally:
        pool.shutdown()


def test_pool_worker_death_scores_default(caplog):
    import os

    pool = isolated.ScoringPool(workers=1)
    try:
        with caplog.at_level(logging.WARNING, logger="fully_async.rewards.isolated"):
            assert pool.call(os._exit, 3, default=0.0, label="crash", timeout=60) == 0.0
        assert any("died" in r.message for r in caplog.records)
        assert pool.call(abs, -6, default=None, label="t", timeout=60) == 6
    finally:
        pool.shutdown()


def test_pool_off_runs_inline(monkeypatch):
    monkeypatch.setenv("FULLY_ASYNC_REWARD_TIMEOUT_S", "0")
    assert isolated.call(threading.get_ident, default=None, label="t") == threading.get_ident()


# ----------------------------------------------------------------------------------- Math-Verify
def test_math_verify_missing_names_the_extra(monkeypatch):
    from fully_async.rewards import math_verify_score

    monkeypatch.setattr(scoring, "_installed", lambda pkg: pkg != "math_verify")
    with pytest.raises(RewardError) as e:
        math_verify_score.compute_score("any", r"\boxed{1}", "1")
    assert "Math-Verify" in str(e.value) and "fully_async[math]" in str(e.value)


def test_math_verify_scores_as_custom_function():
    pytest.importorskip("math_verify")
    from fully_async.rewards import math_verify_score

    fn = load_custom_score(math_verify_score.__file__, "compute_score")  # loaded by path, as users do
    assert fn(data_source="any", solution_str=r"so $\boxed{\frac{1}{2}}$", ground_truth="0.5") == 1.0
    assert fn(data_source="any", solution_str=r"so $\boxed{3}$", ground_truth="4") == 0.0
    assert fn(data_source="any", solution_str="no answer", ground_truth="4") == 0.0
    out = []  # from a Ray-actor-like thread: math-verify's own signal timeouts would fail here
    t = threading.Thread(target=lambda: out.append(
        fn(data_source="any", solution_str=r"$\boxed{x+1}$", ground_truth="1+x")))
    t.start()
    t.join()
    assert out == [1.0]
    assert RewardManager(fn, max_response_length=8).score("any", r"\boxed{2}", "2", None, 3) == (1.0, {})


def test_math_verify_in_process():
    pytest.importorskip("math_verify")
    from fully_async.rewards.math_verify_score import verify

    assert verify(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}") == 1.0
    assert verify(r"\boxed{1}", "") == 0.0  # nothing to parse in the ground truth: 0, as verl


def test_math_verify_refuses_a_non_main_thread_without_the_pool(monkeypatch):
    pytest.importorskip("math_verify")
    from fully_async.rewards import math_verify_score

    monkeypatch.setenv("FULLY_ASYNC_REWARD_TIMEOUT_S", "0")
    errors = []

    def run():
        try:
            math_verify_score.compute_score("any", r"\boxed{1}", "1")
        except RewardError as e:
            errors.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and "FULLY_ASYNC_REWARD_TIMEOUT_S" in errors[0]
    assert math_verify_score.compute_score("any", r"\boxed{1}", "1") == 1.0  # the main thread is fine
