"""Rule-based scores chosen by `data_source`, and loading a user's `custom_reward_function`.

The gsm8k and MATH rules reproduce verl's (`verl/utils/reward_score/{gsm8k,math}.py`) so a
reward curve from this package can be compared with one from a verl run on the same data.
`arithmetic` is the tiny task shipped with the package for CPU smoke tests.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Callable, Optional


class RewardError(ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


# ----------------------------------------------------------------------------------- arithmetic
def arithmetic_score(solution_str: str, ground_truth: Any) -> float:
    """Exact match of the stripped response against the ground truth."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


# ----------------------------------------------------------------------------------- gsm8k (verl)
_GSM8K_CLIP_CHARS = 300  # verl only searches the tail: regexes on long responses are slow


def gsm8k_extract(solution_str: str, method: str = "strict") -> Optional[str]:
    """strict: the last `#### <number>`; flexible: the last number anywhere. Commas removed."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r} is not one of ['strict', 'flexible']")
    text = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(re.findall(r"(\-?[0-9\.\,]+)", text)):
        if candidate not in ("", "."):
            return candidate.replace(",", "")
    return None


def gsm8k_score(solution_str: str, ground_truth: Any, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).strip().replace(",", "") else format_score


# ----------------------------------------------------------------------------------- MATH (verl / Hendrycks)
def last_boxed_only_string(text: str) -> Optional[str]:
    """The last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, or None."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx:i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    for left in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(left):
            return boxed[len(left):-1] if left.endswith("{") else boxed[len(left):]
    return boxed


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(s: str) -> str:
    if s.count("/") != 1:
        return s
    a, b = s.split("/")
    if re.fullmatch(r"-?\d+", a) and re.fullmatch(r"\d+", b):
        return "\\frac{" + a + "}{" + b + "}"
    return s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _strip_text(s: str) -> str:
    """Drop trailing units (`\\text{ cm}`, verl) and unwrap a remaining `\\text{...}`."""
    if "\\text{ " in s:
        s = s.split("\\text{ ")[0]
    return re.sub(r"\\(?:text|textbf|mbox)\{([^{}]*)\}", r"\1", s)


def normalize_math_answer(s: str) -> str:
    """verl's `strip_string`: canonical form used for string comparison of MATH answers."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _strip_text(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.strip().rstrip(".")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    halves = s.split("=")
    if len(halves) == 2 and len(halves[0].strip()) <= 2:  # "k = 3" -> "3"
        s = halves[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def math_score(solution_str: str, ground_truth: Any) -> float:
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    truth_boxed = last_boxed_only_string(truth)  # some datasets keep the whole \boxed{} as truth
    if truth_boxed is not None:
        truth = remove_boxed(truth_boxed)
    return 1.0 if normalize_math_answer(remove_boxed(boxed)) == normalize_math_answer(truth) else 0.0


# ----------------------------------------------------------------------------------- dispatch
_GSM8K = ("openai/gsm8k", "gsm8k")
_MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math")
KNOWN_DATA_SOURCES = ("arithmetic",) + _GSM8K + _MATH


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None) -> float:
    """Score one response with the rule for its `data_source` (verl's default_compute_score)."""
    if data_source == "arithmetic":
        return arithmetic_score(solution_str, ground_truth)
    if data_source in _GSM8K:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in _MATH:
        return math_score(solution_str, ground_truth)
    raise NotImplementedError(
        f"no built-in reward for data_source={data_source!r}; known: {list(KNOWN_DATA_SOURCES)}. "
        "Write compute_score(data_source, solution_str, ground_truth, extra_info) in a file and set "
        "custom_reward_function.path=<file> (custom_reward_function.name=<function>)")


def load_custom_score(path: str, name: str) -> Callable[..., Any]:
    """Import `name` from the python file at `path` (verl's custom_reward_function)."""
    if not os.path.isfile(path):
        raise RewardError(f"custom_reward_function.path={path!r}: file not found")
    module_name = "fully_async_custom_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError("not a python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # like verl; dataclasses in the file look themselves up here
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise RewardError(f"custom_reward_function.path={path!r}: import failed "
                          f"({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and not inspect.isclass(v)
                         and getattr(v, "__module__", None) == module_name)
        raise RewardError(f"custom_reward_function.name={name!r}: {path} defines no callable of that name; "
                          f"functions it defines: {defined}")
    return fn
