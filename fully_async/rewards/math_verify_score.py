"""Math-Verify scoring (HuggingFace's `math-verify` package, the `math` extra), as verl's
`verl/utils/reward_score/math_verify.py`.

verl routes no data_source here by default (its default_compute_score keeps the MATH sources on the
Hendrycks rule and says to swap in Math-Verify by hand); its tests use it as a custom reward
function.  Do the same here: this file is a custom reward function file,

    custom_reward_function.path=$(python -c "import fully_async.rewards.math_verify_score as m; print(m.__file__)")
    custom_reward_function.name=compute_score

which scores every response with Math-Verify: the ground truth is wrapped in `\\boxed{}` and parsed as
LaTeX, the response is parsed as LaTeX or a plain expression, and the score is 1.0 when any extracted
answer verifies, else 0.0 (0.0 too when either side does not parse or when Math-Verify times out).

It runs in the scoring worker process of `fully_async.rewards.isolated` (Math-Verify's own timeouts use
`signal.alarm`, which only works in a main thread; a call over FULLY_ASYNC_REWARD_TIMEOUT_S scores 0.0
with a warning).
"""
from __future__ import annotations

from typing import Any, Optional

EXTRA_HINT = "pip install 'fully_async[math]' (or: pip install math-verify)"


def require_math_verify(what: str) -> None:
    from fully_async.rewards.scoring import RewardError, _installed

    if not _installed("math_verify"):
        raise RewardError(f"{what} scores with Math-Verify, which is not installed: {EXTRA_HINT}")


def verify(model_output: str, ground_truth: str, timeout_score: float = 0.0) -> float:
    """verl's math_verify.compute_score, in the calling process, which must be in its main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        # Math-Verify's signal-based timeouts raise ValueError in other threads, and verl's wrapper turns
        # that into a silent 0.0 for every response
        from fully_async.rewards.scoring import RewardError

        raise RewardError("Math-Verify can only run in a main thread; it runs in the scoring worker process "
                          "unless FULLY_ASYNC_REWARD_TIMEOUT_S=0 (unset it)")
    from math_verify.errors import TimeoutException
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    verify_func = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                              pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    ground_truth_boxed = "\\boxed{" + ground_truth + "}"
    score = 0.0
    try:
        score, _ = verify_func([ground_truth_boxed], [model_output])
    except Exception:  # noqa: BLE001 - no gold answer parsed, ... : 0, as verl
        pass
    except TimeoutException:  # a BaseException
        score = timeout_score
    return score


def math_verify_score(model_output: str, ground_truth: str, timeout_score: float = 0.0) -> float:
    """`verify` in the scoring worker, with the overall time limit."""
    from fully_async.rewards import isolated

    require_math_verify("math_verify_score")
    return isolated.call(verify, model_output, ground_truth, timeout_score, default=timeout_score,
                         label="math-verify")


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                  **kwargs: Any) -> float:
    """A custom reward function: every response scored with Math-Verify, whatever its data_source."""
    from fully_async.rewards.math_verify_score import math_verify_score as score  # the package's module,
    return score(solution_str, ground_truth)  # also when this file was loaded by path as a custom function
