"""Turns one decoded response into a scalar reward plus logged extras (verl's reward managers).

verl's reward functions may return a float or a dict with a "score" key and extra metrics
(DAPO's "acc", ...); this module is the single place that checks that contract, so a broken
custom function fails on its first response with its own name in the message instead of
poisoning advantages with NaN (`reward_manager=prime`, verl's prime manager, scores such a response 0.0 and
counts it).  `reward_manager=dapo` adds DAPO's overlong-buffer penalty:
a linear ramp from 0 at `max_response_length - len` tokens down to `-penalty_factor` at
`max_response_length`.

A custom function runs in a worker process of its own when `reward_model.timeout_s` is set (the default:
verl's prime reward manager allows 300 s per call): a call that overruns is killed and fails the run with a
RewardError naming the function (file:name), the sample and the limit, instead of hanging the rollouter --
a thread could not be stopped, nor even time out while the function holds the GIL (a runaway regex).  The
built-in rules stay in the calling thread (the sympy ones have their own bounded pool: isolated.py), so a
default run starts no process for its rewards.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import sys
import traceback
from typing import Any, Callable, Optional

from fully_async.core.config import REWARD_MANAGERS, OverlongBufferConfig
from fully_async.rewards.scoring import RewardError, default_compute_score, load_custom_score

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


def _inputs(data_source: str, response_str: str, ground_truth: Any) -> str:
    return f"data_source={data_source!r}, solution_str={_short(response_str)}, ground_truth={_short(ground_truth)}"


_WORKER_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {}


WORKER_START_S = 120.0  # a fresh worker's start and import of the user's file; not part of reward_model.timeout_s


def load_in_worker(path: str, name: str) -> Callable[..., Any]:
    """In the scoring worker: the custom function `name` of `path`, imported once per worker."""
    fn = _WORKER_FUNCTIONS.get((path, name))
    if fn is None:
        fn = _WORKER_FUNCTIONS[(path, name)] = load_custom_score(path, name)
    return fn


def warm_worker(path: str, name: str) -> None:
    load_in_worker(path, name)


def score_in_worker(path: str, name: str, kwargs: dict) -> tuple:
    """In the scoring worker: the custom function `name` of `path` on `kwargs`.  ("ok", result), or ("raised",
    describe_crash's report, "Type: message") built here, where the traceback is, or ("error", message) for a
    RewardError the function raised itself."""
    fn = load_in_worker(path, name)
    try:
        return ("ok", fn(**kwargs))
    except RewardError as exc:
        return ("error", str(exc))
    except Exception as exc:  # noqa: BLE001 - the user's function crashed: report it to the caller
        tb = sys.exc_info()[2]
        inputs = _inputs(kwargs["data_source"], kwargs["solution_str"], kwargs["ground_truth"])
        return ("raised", describe_crash(fn, exc, tb.tb_next if tb else None, inputs),
                f"{type(exc).__name__}: {exc}")


class RewardManager:
    """Calls `compute_score` for one response and applies the reward manager's shaping.

    `source` = (file, function name) of a custom function and `timeout_s` > 0: each call runs in a worker
    process, killed after `timeout_s` seconds (module docstring)."""

    def __init__(self, compute_score: Callable[..., Any], *, reward_manager: str = "naive",
                 max_response_length: int, overlong_buffer: Optional[OverlongBufferConfig] = None,
                 source: Optional[tuple[str, str]] = None, timeout_s: Optional[float] = None,
                 source_kwargs: Optional[dict] = None):
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
        self.source = (os.path.abspath(source[0]), source[1]) if source else None
        self.source_kwargs = dict(source_kwargs or {})   # custom_reward_function.reward_kwargs, for the worker
        self.timeout_s = float(timeout_s) if timeout_s else 0.0
        self.timeout_key = "reward_model.timeout_s"   # the key named when a call overruns (the start-up probe: its own)
        self.start_s, self.start_key = WORKER_START_S, ""   # the worker's start and import (the probe: its key)
        self.prime_failures = 0          # reward_manager=prime: responses scored 0.0 because their call failed
        self.pool: Optional[Any] = None  # the custom function's worker (isolated.ScoringPool), started on first use
        if self.source and self.timeout_s > 0:
            from fully_async.rewards.isolated import ScoringPool

            self.pool = ScoringPool(workers=1)

    def close(self) -> None:
        """Stop the custom function's worker process, if one was started."""
        if self.pool is not None:
            self.pool.shutdown()

    def _crash(self, data_source: str, response_str: str, ground_truth: Any) -> RewardError:
        _, exc, tb = sys.exc_info()
        assert exc is not None and tb is not None
        inputs = _inputs(data_source, response_str, ground_truth)
        report = describe_crash(self.compute_score, exc, tb.tb_next, inputs)  # tb_next: from the function
        return _crash_error(report, f"{type(exc).__name__}: {exc}")

    def _call_in_worker(self, kwargs: dict, sample: str) -> Any:
        """The custom function in its worker process, killed after timeout_s (see the module docstring)."""
        from fully_async.rewards.isolated import ScoringTimeout, ScoringWorkerDied

        assert self.pool is not None and self.source is not None
        path, name = self.source
        what = f"reward function {path}:{name}"
        where = (f"{sample}, " if sample else "") + _inputs(kwargs["data_source"], kwargs["solution_str"],
                                                            kwargs["ground_truth"])
        try:
            outcome = self.pool.run(score_in_worker, path, name, {**kwargs, **self.source_kwargs},
                                    timeout=self.timeout_s,
                                    warmup=(warm_worker, (path, name), self.start_s))
        except ScoringTimeout as exc:
            if exc.stage == "start":
                raise RewardError(f"{what}: its scoring process did not start and import {path} within "
                                  f"{exc.limit:g}s{self.start_key} (before scoring {where}); its process was "
                                  "killed") from None
            raise RewardError(f"{what} did not return within {self.timeout_key}={self.timeout_s:g}s on "
                              f"{where}; its process was killed. Fix the function, or raise {self.timeout_key} "
                              "(reward_model.timeout_s=null: no limit, in the calling process)") from None
        except ScoringWorkerDied:
            raise RewardError(f"{what} killed its scoring process (a crash in native code, out of memory or "
                              f"exit()) on {where}") from None
        except RewardError:
            raise  # loading the file failed in the worker
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be sent back between processes
            raise RewardError(f"{what} on {where}: its result did not come back from the scoring process "
                              f"({type(exc).__name__}: {exc})") from None
        if outcome[0] == "ok":
            return outcome[1]
        if outcome[0] == "error":
            raise RewardError(outcome[1])
        raise _crash_error(outcome[1], outcome[2])

    def _check(self, value: Any, what: str, data_source: str) -> float:
        if isinstance(value, (bool, int, float)):
            score = float(value)
            if math.isfinite(score):
                return score
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalar
            return self._check(value.item(), what, data_source)
        raise RewardError(f"reward function {_fn_name(self.compute_score)} returned {what} {value!r} "
                          f"({type(value).__name__}) for data_source {data_source!r}; expected a finite float, or a "
                          "dict with a finite 'score'")

    def _parse(self, result: Any, data_source: str) -> tuple[float, dict]:
        """(score, extras) of what the function returned; a non-finite number, the score or an extra, is refused
        (RewardError naming the key and the data source): extras are metrics (`reward_extra/<key>`), a validation's
        headline and may drive algorithm.filter_groups.metric, where one NaN would silently poison them."""
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(f"reward function {_fn_name(self.compute_score)} returned a dict without "
                                  f"'score': keys {sorted(result)}")
            score = self._check(result["score"], "score", data_source)
            extra = {}
            for key, value in result.items():
                if key == "score":
                    continue
                if isinstance(value, (bool, int, float)):
                    extra[key] = float(value)
                elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
                    extra[key] = float(value.item())
                if key in extra and not math.isfinite(extra[key]):
                    raise RewardError(f"reward function {_fn_name(self.compute_score)} returned extra {key!r} = "
                                      f"{value!r} for data_source {data_source!r}; every number it returns must be "
                                      f"finite (extras become metrics and may drive algorithm.filter_groups.metric): "
                                      f"return a finite {key!r}, or leave it out of the dict")
            return score, extra
        return self._check(result, "the value", data_source), {}

    def overlong_penalty(self, response_length: int) -> float:
        """DAPO: 0 up to `max_response_length - len` tokens, then -penalty_factor per `len` tokens over."""
        ob = self.overlong_buffer
        expected_len = self.max_response_length - ob.len
        exceed_len = response_length - expected_len
        return min(-exceed_len / ob.len * ob.penalty_factor, 0.0)

    def score(self, data_source: str, response_str: str, ground_truth: Any, extra_info: Optional[dict],
              response_length: int, sample: str = "", strict: bool = False) -> tuple[float, dict]:
        """(reward, extras) for one response; `response_length` is in tokens, `sample` names the response in
        errors (its id and prompt index).

        A custom function that raises becomes a RewardError naming the function, the file and line where it
        raised and the inputs, with the function's own traceback (describe_crash); one that overruns
        reward_model.timeout_s, a RewardError naming the function, the sample and the limit; under
        reward_manager=prime both score 0.0 instead (verl's prime manager), counted and warned, unless `strict`."""
        if self.reward_manager == "prime" and not strict:     # strict: the pre-run probe sees every failure
            return self._prime_score(data_source, response_str, ground_truth, extra_info, sample)
        return self._score(data_source, response_str, ground_truth, extra_info, response_length, sample)

    def _score(self, data_source: str, response_str: str, ground_truth: Any, extra_info: Optional[dict],
               response_length: int, sample: str) -> tuple[float, dict]:
        kwargs = dict(data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                      extra_info=extra_info)
        try:
            if self.pool is not None:
                result = self._call_in_worker(kwargs, sample)
            else:
                result = self.compute_score(**kwargs)
        except RewardError:
            raise
        except NotImplementedError:
            if inspect.unwrap(self.compute_score) is default_compute_score:
                raise  # no built-in rule for this data_source: the caller names the fix
            raise self._crash(data_source, response_str, ground_truth) from None
        except Exception:  # noqa: BLE001 - the user's function crashed: say where, with its traceback
            raise self._crash(data_source, response_str, ground_truth) from None
        score, extra = self._parse(result, data_source)
        if self.reward_manager == "dapo" and self.overlong_buffer.enable:
            penalty = self.overlong_penalty(response_length)
            score += penalty
            if self.overlong_buffer.log:
                extra["overlong_reward"] = penalty
                extra["overlong"] = penalty < 0
        return score, extra

    def _prime_score(self, data_source: str, response_str: str, ground_truth: Any, extra_info: Optional[dict],
                     sample: str) -> tuple[float, dict]:
        """verl's prime reward manager: a call that raised or overran (reward_model.timeout_s, verl's 300 s) scores
        0.0 instead of failing the run; the score is also `acc`.  Not silent here: each such response is counted
        (`reward_extra/score_failed`) and warned about with the function's own report (the first few in full)."""
        try:
            score, extra = self._score(data_source, response_str, ground_truth, extra_info, 0, sample)
        except RewardError as exc:
            self.prime_failures += 1
            if self.prime_failures <= PRIME_WARNINGS:
                logger.warning("reward_manager=prime scores %s as 0.0 (verl's prime manager does): %s%s",
                               sample or "a response", exc, "" if self.prime_failures < PRIME_WARNINGS else
                               " (further such responses are counted in reward_extra/score_failed only)")
            return 0.0, {"acc": 0.0, "score_failed": 1.0}
        return score, {**extra, "acc": score, "score_failed": 0.0}


PRIME_WARNINGS = 5    # failed calls under reward_manager=prime warned in full; the rest are counted


def with_kwargs(fn: Callable[..., Any], extra: dict) -> Callable[..., Any]:
    """`fn` called with `extra` merged over the call's keyword arguments (verl's _call_with_kwargs)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{**kwargs, **extra})
    return call


def _crash_error(report: str, user_exception: str) -> RewardError:
    err = RewardError(report)
    err.user_exception = user_exception  # type: ignore[attr-defined]
    return err


def build_reward_manager(cfg: Any) -> RewardManager:
    """The reward manager described by the full config (custom function or the built-in rules)."""
    custom = cfg.custom_reward_function
    source = None
    if custom.path:
        compute_score = load_custom_score(custom.path, custom.name)  # here too: a bad file fails in this process
        source = (custom.path, custom.name)
        if custom.reward_kwargs:  # verl merges them over the call's own keyword arguments
            compute_score = with_kwargs(compute_score, dict(custom.reward_kwargs))
        logger.info("reward: %s from %s", custom.name, custom.path)
    else:
        compute_score = default_compute_score
        sandbox = cfg.reward_model.sandbox_fusion
        if sandbox.url:     # verl hands the built-in rules its sandbox (never a custom function)
            compute_score = with_kwargs(default_compute_score, dict(
                sandbox_fusion_url=sandbox.url, memory_limit_mb=sandbox.memory_limit_mb,
                sandbox_max_concurrent=sandbox.max_concurrent))
    return RewardManager(compute_score, reward_manager=cfg.reward_model.reward_manager,
                         max_response_length=cfg.data.max_response_length,
                         overlong_buffer=cfg.reward_model.overlong_buffer, source=source,
                         timeout_s=cfg.reward_model.timeout_s, source_kwargs=dict(custom.reward_kwargs or {}))
