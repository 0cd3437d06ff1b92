"""Code rewards run in a SandboxFusion service (https://github.com/bytedance/SandboxFusion), as verl's
`verl/utils/reward_score/sandbox_fusion` scores the code data_sources (codecontests, apps, codeforces, taco) when
`reward_model.sandbox_fusion.url` is set.

The response's code (the last ```python block, else the first ``` block; none: score 0) runs once per test case
through the service's `run_code` API (`{"code", "stdin", "compile_timeout", "run_timeout", "memory_limit_MB",
"language"}`); a case passes when the run finished and its stdout, trailing newlines stripped, equals the
expected output.  `fn_name` test sets (LeetCode style) call that function (or `Solution().<fn_name>`) with one
JSON argument per stdin line and print its result (JSON for containers, None and booleans); `assert_case` sets
append each case's asserts to the code.  The score is the pass rate over the first 10 cases (verl's
`continuous=True`, what its default_compute_score asks for).  Each case's outcome is verl's code: True, False,
-1 (the service failed or could not be reached, after 3 tries on a 504), -2 runtime error, -3 time limit, -4
compile error (every later case then counts as one too).

Not silent here: a case the service could not run (-1) is counted in the score's extras (`sandbox_api_errors`,
logged with the reward metrics) and warned about, where verl only logs it; the run's pre-run probe calls the
service once (`probe`) and refuses a URL that does not answer, naming the key.

`max_concurrent` bounds the requests this process has in flight (verl shares one bound across its reward
workers; here a run scores in its rollouter, one process, so the bound is the same)."""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional

logger = logging.getLogger(__name__)

CONTINUOUS_CASES = 10        # verl's continuous score: the pass rate over the first 10 cases
CASE_TIMEOUT_S = 10          # compile and run limits of one case (verl's default)
API_TIMEOUT_S = 10           # added to the limits for the HTTP request itself
RETRIES = 3                  # tries on a 504 (gateway timeout), 1 s, 2 s apart
API_ERROR, RUNTIME_ERROR, TIME_LIMIT, COMPILE_ERROR = -1, -2, -3, -4

_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_LOCK = threading.Lock()


def semaphore(url: str, max_concurrent: int) -> threading.BoundedSemaphore:
    """One bound per service and limit in this process (created on first use: the manager stays picklable)."""
    with _LOCK:
        return _SEMAPHORES.setdefault((url, max_concurrent), threading.BoundedSemaphore(max_concurrent))


def extract_code(completion: str) -> Optional[str]:
    """The code a response gives: its last ```python block, else its first ``` block (a language name on the
    block's first line dropped), else None."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        code = parts[1]
        if "\n" in code:
            first, rest = code.split("\n", 1)
            if first.strip().isalpha():
                code = rest
        return code
    return None


def parse_cases(test_cases: Any) -> Optional[dict]:
    """The test set as a dict with equally long "inputs" and "outputs" (and "assert_case", "fn_name"), or None."""
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, json.JSONDecodeError):
            return None
    if not isinstance(test_cases, dict):
        return None
    if isinstance(test_cases.get("assert_case"), list):
        test_cases = dict(test_cases)
        test_cases.setdefault("inputs", ["" for _ in test_cases["assert_case"]])
        test_cases.setdefault("outputs", [None for _ in test_cases["assert_case"]])
    if "inputs" not in test_cases or "outputs" not in test_cases:
        return None
    return test_cases


FN_CALL = '''

import json as _fa_json
import sys as _fa_sys


def _fa_call():
    _raw = _fa_sys.stdin.read()
    _args = [_fa_json.loads(_line) for _line in _raw.split("\\n")] if _raw.strip() else []
    _fn = globals().get({fn_name!r})
    if _fn is None and "Solution" in globals():
        _fn = getattr(globals()["Solution"](), {fn_name!r})
    if _fn is None:
        raise SystemExit("function {fn_name} not found")
    _out = _fn(*_args)
    print(_fa_json.dumps(_out) if isinstance(_out, (dict, list, tuple, bool)) or _out is None else str(_out))


_fa_call()
'''


def call_api(url: str, code: str, stdin: Optional[str], timeout_s: int, memory_limit_mb: int,
             language: str = "python") -> tuple[Optional[dict], Optional[str]]:
    """(the service's JSON answer, None) or (None, what went wrong)."""
    payload = json.dumps({"compile_timeout": timeout_s, "run_timeout": timeout_s, "code": code, "stdin": stdin,
                          "memory_limit_MB": memory_limit_mb, "language": language, "files": {},
                          "fetch_files": []}).encode()
    error = None
    for attempt in range(RETRIES):
        request = urllib.request.Request(url, data=payload, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2 * timeout_s + API_TIMEOUT_S) as response:
                return json.loads(response.read().decode()), None
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code} {exc.reason}"
            if exc.code != 504:
                break
            if attempt < RETRIES - 1:
                time.sleep(attempt + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:   # unreachable, reset, timeout, not JSON
            error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            break
    return None, error


def case_outcome(answer: dict, expected: Any) -> Any:
    """verl's outcome of one case from the service's answer: True, False or an error code."""
    status = answer.get("status")
    compiled, ran = answer.get("compile_result") or {}, answer.get("run_result") or {}
    if status == "Success":
        if ran.get("status") != "Finished":
            return API_ERROR
        out = ran.get("stdout") or ""
        return expected is None or str(out).rstrip("\n") == str(expected).rstrip("\n")
    if status == "Failed":
        if compiled and (compiled.get("status") in ("Error", "TimeLimitExceeded")
                         or (compiled.get("status") == "Finished" and compiled.get("return_code") != 0)):
            return COMPILE_ERROR
        if ran.get("status") == "TimeLimitExceeded":
            return TIME_LIMIT
        if ran.get("status") == "Error" or (ran.get("status") == "Finished" and ran.get("return_code") != 0):
            return RUNTIME_ERROR
    return API_ERROR


def run_cases(url: str, cases: dict, code: str, timeout_s: int, memory_limit_mb: int,
              bound: Optional[threading.BoundedSemaphore] = None) -> tuple[list[Any], list[Optional[str]]]:
    """Every case's outcome, in order, and the service's error for each case it could not run."""
    inputs, outputs = cases["inputs"], cases["outputs"]
    asserts = cases.get("assert_case", [""] * len(inputs))
    if len(outputs) != len(inputs) or len(asserts) != len(inputs):
        return [API_ERROR] * len(inputs), ["test set: inputs, outputs and assert_case differ in length"] * len(inputs)
    fn_name = cases.get("fn_name")

    def one(i: int) -> tuple[Any, Optional[str]]:
        program = code + "\n\n" + (asserts[i] or "")
        if fn_name:
            program += FN_CALL.format(fn_name=str(fn_name))
        stdin = None if inputs[i] is None else str(inputs[i])
        if bound is not None:
            with bound:
                answer, error = call_api(url, program, stdin, timeout_s, memory_limit_mb)
        else:
            answer, error = call_api(url, program, stdin, timeout_s, memory_limit_mb)
        if answer is None:
            return API_ERROR, error
        outcome = case_outcome(answer, outputs[i])
        return outcome, (f"the service answered status {answer.get('status')!r}" if outcome == API_ERROR else None)

    if not inputs:
        return [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(inputs))) as pool:
        done = list(pool.map(one, range(len(inputs))))
    results, errors = [r for r, _ in done], [e for _, e in done]
    if COMPILE_ERROR in results:          # verl: every case after the first compile error counts as one
        first = results.index(COMPILE_ERROR)
        results[first:] = [COMPILE_ERROR] * (len(results) - first)
    return results, errors


def compute_score(url: str, completion: str, test_cases: Any, memory_limit_mb: int = 1024,
                  max_concurrent: int = 64, continuous: bool = True, timeout_s: int = CASE_TIMEOUT_S) -> dict:
    """{"score": the pass rate, "sandbox_api_errors": cases the service could not run} for one response."""
    code = extract_code(completion)
    cases = parse_cases(test_cases)
    if code is None or cases is None:
        return {"score": 0.0, "sandbox_api_errors": 0.0}
    results, errors = run_cases(url, cases, code, timeout_s, memory_limit_mb, semaphore(url, max_concurrent))
    counted = results[:CONTINUOUS_CASES] if continuous else results
    failed = [e for e in errors if e]
    if failed:
        logger.warning("sandbox %s could not run %d of %d test cases (scored as failing, as verl does): %s", url,
                       len(failed), len(results), failed[0])
    score = sum(r is True for r in counted) / len(counted) if counted else 0.0
    return {"score": float(score), "sandbox_api_errors": float(len(failed))}


def probe(url: str, memory_limit_mb: int = 1024) -> Optional[str]:
    """None when the service at `url` runs `print(1)` and answers 1; else what it said or why it did not answer."""
    answer, error = call_api(url, "print(1)", None, CASE_TIMEOUT_S, memory_limit_mb)
    if answer is None:
        return error
    outcome = case_outcome(answer, "1")
    return None if outcome is True else f"it answered {json.dumps(answer)[:300]} to print(1)"
