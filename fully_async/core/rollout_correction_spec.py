"""verl's rollout-correction threshold strings (algorithm.rollout_correction.rollout_rs, rollout_is_threshold,
rollout_rs_threshold), parsed once for the config checks (core/algorithm_checks.py) and the weights
(algorithms/rollout_correction.py): which rejection options, and their bounds."""
from __future__ import annotations

from typing import Any, Optional

from fully_async.core.config import ROLLOUT_RS_OPTIONS


def rs_options(spec: str) -> list[str]:
    """The rejection options of `rollout_rs`, in order, duplicates removed; unknown ones are refused."""
    options: list[str] = []
    for opt in (o.strip() for o in str(spec).split(",")):
        if not opt:
            continue
        if opt not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs: {opt!r} is not one of "
                             f"{', '.join(ROLLOUT_RS_OPTIONS)}")
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("algorithm.rollout_correction.rollout_rs names no option")
    return options


def is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """(upper, lower or None) of algorithm.rollout_correction.rollout_is_threshold: one positive number (TIS: the
    weights truncated at it) or "lower_upper" (IcePop: weights outside [lower, upper] set to 0), as verl 0.9.1."""
    key = "algorithm.rollout_correction.rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key}={spec!r}: give a positive number or a 'lower_upper' string such as '0.5_5.0'")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"{key}={spec!r} is not a number or a 'lower_upper' pair such as '0.5_5.0'") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{key}={spec!r}: the bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}={spec!r}: the lower bound {lower} is above the upper bound {upper} "
                         "(write 'lower_upper')")
    return upper, lower


def rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[Optional[float], float]]:
    """option -> (lower, upper): one entry for all options or one per option (comma-separated).  k1 options bound
    the ratio ("lower_upper", or an upper whose reciprocal is the lower); k2/k3 take one positive upper bound."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{key} is required with rollout_rs")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"{key}={spec!r}: give one threshold for all {len(options)} rollout_rs options or one each")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[Optional[float], float]] = {}
    for opt, part in zip(options, parts):
        try:
            if opt.endswith("k1"):
                lower, upper = (float(x) for x in part.split("_", 1)) if "_" in part else (1.0 / float(part),
                                                                                          float(part))
                if lower <= 0 or upper <= 0:
                    raise ValueError
                out[opt] = (lower, upper)
            else:
                if "_" in part or float(part) <= 0:
                    raise ValueError
                out[opt] = (None, float(part))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{key}: {part!r} is not a valid threshold for {opt} (k1: a positive 'lower_upper' "
                             f"ratio pair or upper ratio; k2/k3: one positive number)") from None
    return out
