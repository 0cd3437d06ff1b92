"""Code rewards in a SandboxFusion service (reward_model.sandbox_fusion.*, verl's sandbox_fusion scorer), against a
local stand-in of the service's run_code API that really runs the code (python, in a subprocess with stdin and a
time limit), and verl's prime reward manager (a failing call scores 0.0, counted)."""
import json
import logging
from types import SimpleNamespace

import pytest

from fully_async.core.config import (ConfigError, CustomRewardConfig, DataConfig, RewardModelConfig,
                                     SandboxFusionConfig)
from fully_async.rewards import RewardError, build_reward_manager, default_compute_score, sandbox_fusion as sf
from sandbox_helpers import Sandbox


@pytest.fixture
def sandbox():
    box = Sandbox()
    yield box
    box.close()


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {"inputs": ["1 2\n", "3 4\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "7", "0\n"]}


def test_the_responses_code_is_what_verl_extracts():
    assert sf.extract_code("text ```python\nx = 1\n``` more ```python\ny = 2\n```") == "\ny = 2\n"
    assert sf.extract_code("```py\nprint(3)\n```") == "print(3)\n"          # a language line dropped
    assert sf.extract_code("```\nprint(3)\n```") == "\nprint(3)\n"
    assert sf.extract_code("print(3)") is None                                 # no block: verl scores 0


def test_a_correct_solution_passes_every_case_and_a_wrong_one_the_cases_it_gets_right(sandbox):
    assert sf.compute_score(sandbox.url, ADD, json.dumps(CASES)) == {"score": 1.0, "sandbox_api_errors": 0.0}
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a != 10 else 0)\n```"
    assert sf.compute_score(sandbox.url, wrong, CASES)["score"] == 0.75
    assert sf.compute_score(sandbox.url, "no code here", CASES)["score"] == 0.0
    assert sf.compute_score(sandbox.url, ADD, "not json")["score"] == 0.0


def test_the_continuous_score_counts_the_first_ten_cases(sandbox):
    cases = {"inputs": [f"{i} 0\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(10)] + ["x", "y"]}
    assert sf.compute_score(sandbox.url, ADD, cases)["score"] == 1.0                  # cases 11 and 12 not counted
    assert sf.compute_score(sandbox.url, ADD, cases, continuous=False)["score"] == pytest.approx(10 / 12)


def test_fn_name_and_assert_case_test_sets(sandbox):
    solution = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n"
                "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                "                return [seen[target - x], i]\n            seen[x] = i\n```")
    cases = {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[1, 2]"]}
    assert sf.compute_score(sandbox.url, solution, cases)["score"] == 1.0
    plain = "```python\ndef square(x):\n    return x * x\n```"
    asserts = {"assert_case": ["assert square(3) == 9", "assert square(4) == 15"]}
    assert sf.compute_score(sandbox.url, plain, asserts)["score"] == 0.5


def test_runtime_errors_time_limits_and_compile_errors_are_verls_codes(sandbox):
    crash = "```python\nraise SystemExit(3)\n```"
    assert sf.run_cases(sandbox.url, sf.parse_cases(CASES), sf.extract_code(crash), 5, 64)[0] == [sf.RUNTIME_ERROR] * 4
    slow = sf.extract_code("```python\nwhile True:\n    pass\n```")
    assert sf.run_cases(sandbox.url, {"inputs": [""], "outputs": [""]}, slow, 1, 64)[0] == [sf.TIME_LIMIT]
    compiled = {"status": "Failed", "compile_result": {"status": "Error", "return_code": 1}, "run_result": None}
    assert sf.case_outcome(compiled, "x") == sf.COMPILE_ERROR
    assert sf.case_outcome({"status": "SandboxError"}, "x") == sf.API_ERROR


def test_every_case_after_a_compile_error_counts_as_one(monkeypatch):
    ok = {"status": "Success", "run_result": {"status": "Finished", "stdout": "1"}}
    compile_error = {"status": "Failed", "compile_result": {"status": "TimeLimitExceeded"}}
    # the service answers by the case (cases run concurrently): the second one does not compile
    monkeypatch.setattr(sf, "call_api", lambda url, code, stdin, *a: (compile_error if stdin == "b" else ok, None))
    sf_cases = {"inputs": ["a", "b", "c"], "outputs": ["1", "1", "1"]}
    results, _ = sf.run_cases("http://x/run_code", sf_cases, "code", 5, 64)
    assert results == [True, sf.COMPILE_ERROR, sf.COMPILE_ERROR]     # the third ran fine, counted as not compiling


def test_a_gateway_timeout_is_retried_and_an_unreachable_service_is_counted_not_silent(monkeypatch, caplog):
    monkeypatch.setattr(sf.time, "sleep", lambda s: None)
    box = Sandbox(fail_first=2)                         # two 504s, then the answer: 3 tries as verl
    try:
        assert sf.compute_score(box.url, ADD, {"inputs": ["1 1"], "outputs": ["2"]})["score"] == 1.0
        assert box.requests == 3
    finally:
        box.close()
    with caplog.at_level(logging.WARNING):
        out = sf.compute_score("http://127.0.0.1:9/run_code", ADD, CASES)
    assert out == {"score": 0.0, "sandbox_api_errors": 4.0}
    assert "could not run 4 of 4 test cases" in caplog.text


def test_max_concurrent_bounds_the_requests_in_flight():
    box = Sandbox(delay_s=0.2)
    try:
        cases = {"inputs": [f"{i} 1\n" for i in range(8)], "outputs": [f"{i + 1}\n" for i in range(8)]}
        assert sf.compute_score(box.url, ADD, cases, max_concurrent=2)["score"] == 1.0
        assert box.peak == 2
    finally:
        box.close()


def cfg(url=None, path=None, reward_manager="naive"):
    return SimpleNamespace(custom_reward_function=CustomRewardConfig(path=path),
                           reward_model=RewardModelConfig(reward_manager=reward_manager,
                                                          sandbox_fusion=SandboxFusionConfig(url=url)),
                           data=DataConfig(max_response_length=20))


def test_the_run_scores_code_sources_in_the_configured_sandbox_and_refuses_them_without_one(sandbox):
    rm = build_reward_manager(cfg(url=sandbox.url))
    assert rm.score("codecontests", ADD, json.dumps(CASES), None, 5) == (1.0, {"sandbox_api_errors": 0.0})
    assert rm.score("openai/gsm8k", "#### 3", "3", None, 5) == (1.0, {})       # other sources: their own rules
    with pytest.raises(NotImplementedError, match=r"reward_model.sandbox_fusion.url"):
        build_reward_manager(cfg()).score("apps", ADD, CASES, None, 5)
    assert default_compute_score("taco", ADD, CASES, sandbox_fusion_url=sandbox.url)["score"] == 1.0


def test_the_pre_run_check_refuses_a_sandbox_that_does_not_answer_and_warns_when_it_cannot_act(sandbox, caplog):
    from fully_async.run.prepare import check_sandbox

    check_sandbox(cfg(url=sandbox.url), {"apps", "openai/gsm8k"})                 # answers print(1)
    with pytest.raises(ConfigError, match=r"reward_model.sandbox_fusion.url.*did not run print\(1\)"):
        check_sandbox(cfg(url="http://127.0.0.1:9/run_code"), {"apps"})
    with caplog.at_level(logging.WARNING):
        check_sandbox(cfg(url="http://127.0.0.1:9/run_code"), {"openai/gsm8k"})  # no code source: no call
    assert "has no effect: the data has no code data_source" in caplog.text


def test_prime_scores_a_failing_call_zero_counts_it_and_the_probe_still_sees_it(tmp_path, caplog):
    path = tmp_path / "fn.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1.0 / int(solution_str)\n")
    rm = build_reward_manager(cfg(path=str(path), reward_manager="prime"))
    rm.timeout_s = 0.0   # in this process: the crash report is the same
    rm.pool = None
    assert rm.score("x", "4", None, None, 3) == (0.25, {"acc": 0.25, "score_failed": 0.0})
    with caplog.at_level(logging.WARNING):
        assert rm.score("x", "0", None, None, 3, sample="sample 7") == (0.0, {"acc": 0.0, "score_failed": 1.0})
    assert "reward_manager=prime scores sample 7 as 0.0" in caplog.text and "ZeroDivisionError" in caplog.text
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        rm.score("x", "0", None, None, 3, strict=True)
    naive = build_reward_manager(cfg(path=str(path)))
    naive.pool = None
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        naive.score("x", "0", None, None, 3)
