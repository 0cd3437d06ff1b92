"""Rule-based scores chosen by `data_source` (verl's `default_compute_score`), and loading a user's
`custom_reward_function`.

The routing and every rule reproduce verl's `verl/utils/reward_score/` so a reward curve from this
package can be compared with one from a verl run on the same data:

| data_source | rule (module here) | result |
| --- | --- | --- |
| openai/gsm8k | gsm8k (strict `#### n`) | 1.0 / 0.0 |
| lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500 | hendrycks (last box) | 1.0 / 0.0 |
| math_dapo, math, math_dapo_reasoning, aime* | math_dapo (`Answer: x`) | {"score": 1.0 / -1.0, "acc", "pred"} |
| numina_{aops_forum, synthetic_math, amc_aime, synthetic_amc, cn_k12, olympiads} | prime_math (sympy) | 1.0 / 0.0 |
| hiyouga/geometry3k | geo3k (mathruler's grader) | 0.9 * correct + 0.1 * format |
| searchR1_{nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle} | search_r1 (EM) | 1 / 0.25 / 0 |
| codecontests, apps, codeforces, taco | sandbox_fusion (reward_model.sandbox_fusion.url: the response's code run against the test cases in a SandboxFusion service); without a URL refused (verl's fallback, prime_code, runs the code in the trainer's own process) | pass rate over the first 10 cases |
| arithmetic | this package's tiny CPU task: exact match | 1.0 / 0.0 |

prime_math and geo3k need sympy and pylatexenc (`pip install 'fully_async[math]'`) and run in a worker
process with a time limit (`fully_async.rewards.isolated`).  Math-Verify, which verl only offers as a
swap-in, is a custom reward function file here: `fully_async/rewards/math_verify_score.py`.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Callable, Optional, Union

from fully_async.rewards import gsm8k, hendrycks, math_dapo, search_r1


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


# ----------------------------------------------------------------------------------- arithmetic
def arithmetic_score(solution_str: str, ground_truth: Any) -> float:
    """Exact match of the stripped response against the ground truth."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


# ----------------------------------------------------------------------------------- routing (verl's)
MATH_HENDRYCKS_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every data_source starting with "aime"
PRIME_MATH_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                      "numina_cn_k12", "numina_olympiads")
GEO3K_SOURCES = ("hiyouga/geometry3k",)
SEARCH_R1_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # verl runs these in a sandbox
KNOWN_DATA_SOURCES = (("arithmetic", "openai/gsm8k") + MATH_HENDRYCKS_SOURCES + MATH_DAPO_SOURCES + ("aime*",)
                      + PRIME_MATH_SOURCES + GEO3K_SOURCES + SEARCH_R1_SOURCES)
MATH_EXTRA_HINT = "pip install 'fully_async[math]' (or: pip install pylatexenc)"
_CUSTOM_FIX = ("write compute_score(data_source, solution_str, ground_truth, extra_info) in a python file and set "
               "custom_reward_function.path=<file> (custom_reward_function.name=<function>, default compute_score)")


def scorer_for(data_source: str, sandbox: bool = False) -> str:
    """The name of verl's rule for `data_source` (gsm8k, math, math_dapo, prime_math, geo3k, search_r1,
    arithmetic; sandbox_fusion for the code sources when `sandbox`: a SandboxFusion URL is configured), or raise
    NotImplementedError naming the source and the fix."""
    if data_source == "arithmetic":
        return "arithmetic"
    if data_source == "openai/gsm8k":
        return "gsm8k"
    if data_source in MATH_HENDRYCKS_SOURCES:
        return "math"
    if data_source in MATH_DAPO_SOURCES or data_source.startswith("aime"):
        return "math_dapo"
    if data_source in PRIME_MATH_SOURCES:
        return "prime_math"
    if data_source in GEO3K_SOURCES:
        return "geo3k"
    if data_source in SEARCH_R1_SOURCES:
        return "search_r1"
    if data_source in CODE_SOURCES:
        if sandbox:
            return "sandbox_fusion"
        raise NotImplementedError(
            f"data_source={data_source!r} is a code task: verl scores it by running the response against its test "
            "cases in a sandbox. Set reward_model.sandbox_fusion.url=<a SandboxFusion service's run_code URL> (as "
            "in verl; fully_async does not run generated code in its own processes, verl's prime_code fallback), "
            f"or {_CUSTOM_FIX}; it must return a float, or a dict with a float 'score'")
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r}; known: {list(KNOWN_DATA_SOURCES)}. To score it, "
        f"{_CUSTOM_FIX}")


@functools.lru_cache(maxsize=None)
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _require_sympy_extra(data_source: str, rule: str) -> None:
    missing = [pkg for pkg in ("pylatexenc", "sympy") if not _installed(pkg)]
    if missing:
        raise RewardError(f"data_source={data_source!r} is scored with verl's {rule} rule, which needs "
                          f"{' and '.join(missing)} (not installed): {MATH_EXTRA_HINT}")


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None, sandbox_fusion_url: Optional[str] = None,
                          memory_limit_mb: int = 1024, sandbox_max_concurrent: int = 64,
                          **kwargs: Any) -> Union[float, dict]:
    """Score one response with verl's rule for its `data_source` (verl's default_compute_score).

    A float, or for the DAPO rule a dict {"score": 1.0 | -1.0, "acc": bool, "pred": str}, for a code source with
    `sandbox_fusion_url` {"score": pass rate, "sandbox_api_errors": n}.  The sympy-based rules (prime_math, geo3k)
    run in a worker process with a time limit (fully_async.rewards.isolated).  Other keyword arguments are ignored.
    """
    rule = scorer_for(data_source, sandbox=bool(sandbox_fusion_url))
    if rule == "arithmetic":
        return arithmetic_score(solution_str, ground_truth)
    if rule == "sandbox_fusion":
        from fully_async.rewards import sandbox_fusion

        return sandbox_fusion.compute_score(str(sandbox_fusion_url), solution_str, ground_truth,
                                            memory_limit_mb=memory_limit_mb, max_concurrent=sandbox_max_concurrent)
    if rule == "gsm8k":
        res = gsm8k.compute_score(solution_str, ground_truth)
    elif rule == "math":
        res = hendrycks.compute_score(solution_str, ground_truth)
    elif rule == "math_dapo":
        res = math_dapo.compute_score(solution_str, ground_truth)
    elif rule == "prime_math":
        _require_sympy_extra(data_source, rule)
        from fully_async.rewards import isolated, prime_math

        res = isolated.call(prime_math.compute_score, solution_str, ground_truth, default=(False, False, ""),
                            label=f"data_source={data_source!r} (prime_math)")
    elif rule == "geo3k":
        _require_sympy_extra(data_source, rule)
        from fully_async.rewards import geo3k, isolated

        res = isolated.call(geo3k.compute_score, solution_str, ground_truth, default=0.0,
                            label=f"data_source={data_source!r} (geo3k)")
    else:
        res = search_r1.compute_score(solution_str, ground_truth)
    if isinstance(res, dict):
        return res
    if isinstance(res, (int, float, bool)):
        return float(res)
    return float(res[0])


def load_custom_score(path: str, name: str) -> Callable[..., Any]:
    """Import `name` from the python file at `path` (verl's custom_reward_function)."""
    return load_file_callable(path, name, "custom_reward_function", lambda message: RewardError(message))


def load_file_callable(path: str, name: str, section: str, error: Callable[[str], Exception],
                       hint: str = "") -> Callable[..., Any]:
    """Import `name` from the python file at `path` (`section`.path / `section`.name name it in errors, each
    raised as `error(message)`; `hint` is added to an import failure)."""
    if not os.path.isfile(path):
        raise error(f"{section}.path={path!r}: file not found")
    module_name = f"fully_async_{section.replace('.', '_')}_" + re.sub(r"\W", "_", os.path.abspath(path))
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError("not a python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # like verl; dataclasses in the file look themselves up here
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise error(f"{section}.path={path!r}: import failed ({type(e).__name__}: {e}){hint}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and not inspect.isclass(v)
                         and getattr(v, "__module__", None) == module_name)
        raise error(f"{section}.name={name!r}: {path} defines no callable of that name; functions it defines: "
                    f"{defined}")
    return fn
