"""Benchmark-only synthetic response lengths (`benchmark.response_length`), the same in both modes.

Why: async training pays off when response lengths have a long tail. A step's batch then waits for
its slowest response, and a synchronous loop leaves its devices idle while the few long ones
finish. Benchmarks run random-weight models (scripts/build_shaped_model.py) that never emit EOS,
so every response runs to `data.max_response_length`, every batch is uniform and that tail never
shows. This module gives each training response a synthetic length instead, a stand-in EOS.
`PendingResponse.target_len` ends the response with finish_reason "stop" after that many tokens,
or with "length" when the target reaches `max_tokens`. It holds across interruptions and resumes.

Benchmark only: it makes the model's own EOS irrelevant to the length of a response, so never set it
for real training. It is off by default (`benchmark.response_length=none`) and never applies to
validation.

Same in both modes: the length is a pure function of (`benchmark.seed`, sample id). The sample id
is `<group uid>-s<j>` (fully_async.rollout.generation.group_pendings). A stable hash (blake2b, not Python's
salted `hash()`) maps it to a uniform u in (0, 1), and u goes through the inverse CDF of the chosen
distribution. So a given sample gets the same length in sync mode, in async mode, on every replica,
after a resume and in every run. scripts/bench_pipeline.py applies the same profile, so measured
ceilings and both modes see one workload.

Distributions (lengths are integers in [1, data.max_response_length]; longer ones are clipped to the max):
  lognormal   round(median * exp(sigma * z)), z standard normal, median = response_length_median_ratio x
              max_response_length, sigma = response_length_sigma.  With the defaults (0.25, 0.75) the median
              is a quarter of the max and P(length >= max) = P(z >= ln 4 / 0.75) = 3.2%.
  <file>.json a length histogram (e.g. lengths observed from a real model on the task):
                {"lengths": [64, 128, 512, 2048], "weights": [10, 40, 30, 2]}
              `lengths`: positive integers; `weights`: non-negative numbers, one per length, not necessarily
              normalised, at least one positive; without `weights` every listed length counts once (a raw
              sample of observed lengths).  A response gets length L with probability weight(L) / sum(weights).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from statistics import NormalDist
from typing import Any, Optional, Sequence

from fully_async.core.config import ConfigError

NONE, LOGNORMAL = "none", "lognormal"
KEY = "benchmark.response_length"
_UNIT = 2.0 ** 53


def _uniform(seed: int, sample_id: str) -> float:
    """A deterministic u in (0, 1) for (seed, sample id): stable across processes, runs and machines."""
    digest = hashlib.blake2b(f"{seed}\x00{sample_id}".encode(), digest_size=8).digest()
    return ((int.from_bytes(digest, "big") >> 11) + 0.5) / _UNIT


class LengthProfile:
    """Synthetic response lengths.  Build one with `from_config` (or `lognormal` / `histogram`)."""

    def __init__(self, kind: str, max_len: int, seed: int = 0, median_ratio: float = 0.25, sigma: float = 0.75,
                 lengths: Sequence[int] = (), weights: Sequence[float] = (), path: Optional[str] = None):
        if max_len < 1:
            raise ConfigError("data.max_response_length", f"{max_len} must be >= 1")
        self.kind, self.max_len, self.seed = kind, int(max_len), int(seed)
        self.median_ratio, self.sigma, self.path = float(median_ratio), float(sigma), path
        if kind == LOGNORMAL:
            self.median = self.median_ratio * self.max_len
            self._normal = NormalDist()
        else:  # histogram: merge clipped duplicates; cumulative weights over ascending lengths
            merged: dict[int, float] = {}
            for length, weight in zip(lengths, weights):
                merged[min(int(length), self.max_len)] = merged.get(min(int(length), self.max_len), 0.0) + weight
            self.lengths = sorted(merged)
            self._cum = []
            total = 0.0
            for length in self.lengths:
                total += merged[length]
                self._cum.append(total)
        self._stats: Optional[dict] = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def lognormal(cls, max_len: int, median_ratio: float = 0.25, sigma: float = 0.75, seed: int = 0) -> "LengthProfile":
        return cls(LOGNORMAL, max_len, seed, median_ratio=median_ratio, sigma=sigma)

    @classmethod
    def histogram(cls, path: str, max_len: int, seed: int = 0) -> "LengthProfile":
        lengths, weights = load_histogram(path)
        return cls("histogram", max_len, seed, lengths=lengths, weights=weights, path=path)

    @classmethod
    def from_config(cls, cfg: Any) -> Optional["LengthProfile"]:
        """The profile of `cfg.benchmark` (None when benchmark.response_length=none); ConfigError if invalid."""
        b = cfg.benchmark
        kind = str(b.response_length)
        if kind == NONE:
            return None
        max_len = int(cfg.data.max_response_length)
        if kind == LOGNORMAL:
            ratio, sigma = float(b.response_length_median_ratio), float(b.response_length_sigma)
            if not 0.0 < ratio <= 1.0:
                raise ConfigError("benchmark.response_length_median_ratio",
                                  f"{ratio} must be in (0, 1] (the median length as a fraction of "
                                  "data.max_response_length)")
            if not sigma > 0.0 or math.isinf(sigma):
                raise ConfigError("benchmark.response_length_sigma",
                                  f"{sigma} must be a finite number > 0 (standard deviation of log(length))")
            return cls.lognormal(max_len, ratio, sigma, int(b.seed))
        if not kind.endswith(".json") or not os.path.isfile(kind):
            raise ConfigError(KEY, f"{kind!r} is not one of {NONE!r}, {LOGNORMAL!r} or an existing .json length "
                              "histogram file ({\"lengths\": [...], \"weights\": [...]}; see fully_async/core/workload.py)")
        return cls.histogram(kind, max_len, int(b.seed))

    # ------------------------------------------------------------------ sampling
    def quantile(self, u: float) -> int:
        """The length at cumulative probability u in (0, 1) (the inverse CDF `target` applies)."""
        if self.kind == LOGNORMAL:
            x = self.median * math.exp(self.sigma * self._normal.inv_cdf(u))
            return max(1, min(self.max_len, math.floor(x + 0.5)))
        return self.lengths[min(bisect.bisect_right(self._cum, u * self._cum[-1]), len(self.lengths) - 1)]

    def target(self, sample_id: str) -> int:
        """The synthetic length of one response: the same for this (seed, sample id) in every run and mode."""
        return self.quantile(_uniform(self.seed, sample_id))

    def pmf(self) -> dict[int, float]:
        """Exact probability of every length `target` can return (ascending lengths)."""
        if self.kind != LOGNORMAL:
            prev, out = 0.0, {}
            for length, cum in zip(self.lengths, self._cum):
                if cum > prev:
                    out[length] = (cum - prev) / self._cum[-1]
                prev = cum
            return out

        def cdf(x: float) -> float:  # P(median * exp(sigma z) < x)
            return 0.0 if x <= 0 else self._normal.cdf(math.log(x / self.median) / self.sigma)
        out, prev = {}, 0.0
        for k in range(1, self.max_len):  # k covers [k - 0.5, k + 0.5); 1 takes everything below 1.5
            c = cdf(k + 0.5)
            if c > prev:
                out[k] = c - prev
            prev = c
        out[self.max_len] = 1.0 - prev
        return out

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """Expected mean, p50, p90 and P(length = max) of the distribution (exact, from `pmf`)."""
        if self._stats is None:
            pmf = self.pmf()
            mean = sum(k * p for k, p in pmf.items())

            def pct(q: float) -> int:
                acc = 0.0
                for k, p in pmf.items():
                    acc += p
                    if acc >= q - 1e-12:
                        return k
                return self.max_len
            self._stats = {"mean": mean, "p50": pct(0.5), "p90": pct(0.9), "p_max": pmf.get(self.max_len, 0.0)}
        return self._stats

    def describe(self) -> str:
        """One line for reports."""
        if self.kind == LOGNORMAL:
            dist = (f"lognormal(median {self.median:g} = {self.median_ratio:g} x {self.max_len}, "
                    f"sigma {self.sigma:g})")
        else:
            support = list(self.pmf())
            dist = f"histogram {self.path} ({len(support)} lengths, {support[0]}..{support[-1]})"
        s = self.stats()
        return (f"synthetic response lengths: {dist}, seed {self.seed}, clipped at {self.max_len}: expected mean "
                f"{s['mean']:.1f}, p50 {s['p50']}, p90 {s['p90']}, P(hit max) {100 * s['p_max']:.1f}%")

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "max_response_length": self.max_len, "seed": self.seed}
        if self.kind == LOGNORMAL:
            out.update(median_ratio=self.median_ratio, median=self.median, sigma=self.sigma)
        else:
            out.update(path=self.path, lengths=len(self.lengths))
        out.update(expected=dict(self.stats()), description=self.describe())
        return out


def workload_report(cfg: Any) -> Optional[dict]:
    """What a report says about the benchmark workload of `cfg`: the length profile (as_dict) and whether the
    engines ignored EOS (benchmark.ignore_eos); None when neither applies."""
    profile = LengthProfile.from_config(cfg)
    ignore = bool(getattr(cfg.benchmark, "ignore_eos", False))
    if profile is None and not ignore:
        return None
    out = profile.as_dict() if profile else {"kind": NONE, "description": "response lengths: the model's own"}
    if ignore:
        out.update(ignore_eos=True, description=out["description"] + "; EOS ignored (benchmark.ignore_eos=true: "
                   "responses run to their synthetic length or data.max_response_length)")
    return out


RESPONSE_LENGTHS = "response_lengths.json"   # a run writes it next to its TensorBoard events when it finishes


def length_histogram(counts: dict) -> dict:
    """A run's response-length counts {length: responses} as a histogram file's content (the format above), so
    a run's `response_lengths.json` can be replayed (benchmark.response_length=<file>) or planned with
    (plan.response_lengths=<file>); empty responses are left out (a histogram's lengths are >= 1)."""
    lengths = sorted(int(n) for n, c in counts.items() if int(n) >= 1 and c > 0)
    return {"lengths": lengths, "weights": [float(counts[n] if n in counts else counts[str(n)]) for n in lengths]}


def load_histogram(path: str) -> tuple[list[int], list[float]]:
    """(lengths, weights) of a histogram file (format in the module docstring); ConfigError naming the problem."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(KEY, f"cannot read length histogram {path}: {exc}") from exc
    if not isinstance(doc, dict) or "lengths" not in doc:
        raise ConfigError(KEY, f"{path}: expected a JSON object {{\"lengths\": [...], \"weights\": [...]}}")
    lengths, weights = doc["lengths"], doc.get("weights")
    if not isinstance(lengths, list) or not lengths:
        raise ConfigError(KEY, f"{path}: 'lengths' must be a non-empty list of positive integers")
    if weights is None:
        weights = [1.0] * len(lengths)
    if not isinstance(weights, list) or len(weights) != len(lengths):
        raise ConfigError(KEY, f"{path}: 'weights' must be a list with one number per length "
                          f"({len(lengths)} lengths)")
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(KEY, f"{path}: length {length!r} is not a positive integer")
    for weight in weights:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(KEY, f"{path}: weight {weight!r} is not a finite number >= 0")
    if not sum(weights) > 0:
        raise ConfigError(KEY, f"{path}: all weights are 0 (at least one must be positive)")
    return list(lengths), [float(w) for w in weights]


def validate_config(cfg: Any) -> None:
    """Check `cfg.benchmark` (and a histogram file's content); raises ConfigError naming the key."""
    LengthProfile.from_config(cfg)
