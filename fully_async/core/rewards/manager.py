"""Turns one decoded response into a scalar reward plus logged extras (verl's reward managers).

verl's reward functions may return a float or a dict with a "score" key and extra metrics
(DAPO's "acc", ...); this module is the single place that checks that contract, so a broken
custom function fails on its first response with its own name in the message instead of
poisoning advantages with NaN.  `reward_manager=dapo` adds DAPO's overlong-buffer penalty:
a linear ramp from 0 at `max_response_length - len` tokens down to `-penalty_factor` at
`max_response_length`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import traceback
from typing import Any, Callable, Optional

from fully_async.core.config import REWARD_MANAGERS, OverlongBufferConfig
from fully_async.core.rewards.scoring import RewardError, default_compute_score, load_custom_score

logger = logging.getLogger(__name__)


def _fn_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def describe_crash(fn: Callable[..., Any], exc: BaseException, tb: Any, inputs: str) -> str:
    """What a reward function's exception says to its author: the function, its file, the file and line
    where it raised, the inputs, and the traceback of the function's own frames (`tb` starts at the
    function's frame: ours are trimmed)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)   # unwrap: reward_kwargs wrap the user's function
    fn_file = code.co_filename if code is not None else None
    name = getattr(fn, "__qualname__", None) or repr(fn)
    frames = traceback.extract_tb(tb)
    # where it raised: the deepest frame in the function's own file (else the deepest frame at all)
    own = [f for f in frames if fn_file and f.filename == fn_file] or frames
    where = f" at {own[-1].filename}:{own[-1].lineno} (in {own[-1].name})" if own else ""
    head = (f"reward function {name}" + (f" ({fn_file})" if fn_file else "") +
            f" raised {type(exc).__name__}: {exc}{where}; inputs: {inputs}")
    body = "".join(traceback.format_list(frames)).rstrip()
    tail = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    return f"{head}\nTraceback of the reward function (most recent call last):\n{body}\n{tail}"


class RewardManager:
    """Calls `compute_score` for one response and applies the reward manager's shaping."""

    def __init__(self, compute_score: Callable[..., Any], *, reward_manager: str = "naive",
                 max_response_length: int, overlong_buffer: Optional[OverlongBufferConfig] = None):
        if reward_manager not in REWARD_MANAGERS:
            raise ValueError(f"reward_model.reward_manager={reward_manager!r} is not one of "
                             f"{'|'.join(REWARD_MANAGERS)}")
        self.compute_score = compute_score
        self.reward_manager = reward_manager
        self.overlong_buffer = overlong_buffer or OverlongBufferConfig()
        ob = self.overlong_buffer
        # verl's DAPO counts the penalty from reward_kwargs.max_resp_len (our overlong_buffer.max_resp_len)
        self.max_response_length = int(ob.max_resp_len if ob.max_resp_len is not None else max_response_length)
        if reward_manager == "dapo" and ob.enable and not 0 < ob.len <= self.max_response_length:
            raise ValueError(f"reward_model.overlong_buffer.len={ob.len} must be in "
                             f"(0, max_resp_len={self.max_response_length}]")
        if reward_manager == "naive" and ob.enable:
            logger.warning("reward_model.overlong_buffer.enable=true has no effect with "
                           "reward_model.reward_manager=naive; use reward_manager=dapo")

    def _crash(self, data_source: str, response_str: str, ground_truth: Any) -> RewardError:
        import sys

        _, exc, tb = sys.exc_info()
        assert exc is not None and tb is not None
        inputs = (f"data_source={data_source!r}, solution_str={_short(response_str)}, "
                  f"ground_truth={_short(ground_truth)}")
        err = RewardError(describe_crash(self.compute_score, exc, tb.tb_next, inputs))  # tb_next: from the function
        err.user_exception = f"{type(exc).__name__}: {exc}"  # type: ignore[attr-defined]
        return err

    def _check(self, value: Any, what: str) -> float:
        if isinstance(value, (bool, int, float)):
            score = float(value)
            if math.isfinite(score):
                return score
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalar
            return self._check(value.item(), what)
        raise RewardError(f"reward function {_fn_name(self.compute_score)} returned {what} {value!r} "
                          f"({type(value).__name__}); expected a finite float, or a dict with a finite 'score'")

    def _parse(self, result: Any) -> tuple[float, dict]:
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(f"reward function {_fn_name(self.compute_score)} returned a dict without "
                                  f"'score': keys {sorted(result)}")
            score = self._check(result["score"], "score")
            extra = {}
            for key, value in result.items():
                if key == "score":
                    continue
                if isinstance(value, (bool, int, float)):
                    extra[key] = float(value)
                elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
                    extra[key] = float(value.item())
            return score, extra
        return self._check(result, "the value"), {}

    def overlong_penalty(self, response_length: int) -> float:
        """DAPO: 0 up to `max_response_length - len` tokens, then -penalty_factor per `len` tokens over."""
        ob = self.overlong_buffer
        expected_len = self.max_response_length - ob.len
        exceed_len = response_length - expected_len
        return min(-exceed_len / ob.len * ob.penalty_factor, 0.0)

    def score(self, data_source: str, response_str: str, ground_truth: Any, extra_info: Optional[dict],
              response_length: int) -> tuple[float, dict]:
        """(reward, extras) for one response; `response_length` is in tokens.

        A custom function that raises becomes a RewardError naming the function, the file and line where it
        raised and the inputs, with the function's own traceback (describe_crash)."""
        try:
            result = self.compute_score(data_source=data_source, solution_str=response_str,
                                        ground_truth=ground_truth, extra_info=extra_info)
        except RewardError:
            raise
        except NotImplementedError:
            if self.compute_score is default_compute_score:
                raise  # no built-in rule for this data_source: the caller names the fix
            raise self._crash(data_source, response_str, ground_truth) from None
        except Exception:  # noqa: BLE001 - the user's function crashed: say where, with its traceback
            raise self._crash(data_source, response_str, ground_truth) from None
        score, extra = self._parse(result)
        if self.reward_manager == "dapo" and self.overlong_buffer.enable:
            penalty = self.overlong_penalty(response_length)
            score += penalty
            if self.overlong_buffer.log:
                extra["overlong_reward"] = penalty
                extra["overlong"] = penalty < 0
        return score, extra


def with_kwargs(fn: Callable[..., Any], extra: dict) -> Callable[..., Any]:
    """`fn` called with `extra` merged over the call's keyword arguments (verl's _call_with_kwargs)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{**kwargs, **extra})
    return call


def build_reward_manager(cfg: Any) -> RewardManager:
    """The reward manager described by the full config (custom function or the built-in rules)."""
    custom = cfg.custom_reward_function
    if custom.path:
        compute_score = load_custom_score(custom.path, custom.name)
        if custom.reward_kwargs:  # verl merges them over the call's own keyword arguments
            compute_score = with_kwargs(compute_score, dict(custom.reward_kwargs))
        logger.info("reward: %s from %s", custom.name, custom.path)
    else:
        compute_score = default_compute_score
    return RewardManager(compute_score, reward_manager=cfg.reward_model.reward_manager,
                         max_response_length=cfg.data.max_response_length,
                         overlong_buffer=cfg.reward_model.overlong_buffer)
