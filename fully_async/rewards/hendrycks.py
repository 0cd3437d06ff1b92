"""Hendrycks MATH answer normalisation, as verl uses it (data_source lighteval/MATH, ...).

The rules follow verl's `verl/utils/reward_score/math_reward.py` (from lm-evaluation-harness's
hendrycks_math task) step by step, including where they give up: a normalisation step that
raises (two `\\text{ ` units, a trailing `\\sqrt`, a dangling `\\frac`) makes `is_equiv` fall back
to comparing the raw strings, and a last box that `remove_boxed` cannot open (`\\fbox{..}`,
`\\boxed5 {..}`) scores 0.  The same `strip_string` is used by prime_math's and mathruler's
graders (prm800k's `normalize_answer`), which differ only in how they drop percent signs.

Provenance: Hendrycks et al.'s MATH `math_equivalence` (MIT) via lm-evaluation-harness and verl (Apache-2.0).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- boxes
def last_boxed_only_string(string: str) -> Optional[str]:
    """The last `\\boxed{...}` / `\\boxed ...` (up to a `$`) / `\\fbox{...}`, braces balanced; else None.

    `\\boxed ` (with a space) anywhere wins over braces, like verl.
    """
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    return balanced_from(string, idx)


def balanced_from(string: str, idx: int) -> Optional[str]:
    """string[idx:] up to the brace that closes the first `{` at or after idx (None when it never closes)."""
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx:i + 1]
    return None


def remove_boxed(s: str) -> str:
    """The content of `\\boxed ...` or `\\boxed{...}`; ValueError for anything else (`\\fbox{}` too)."""
    if "\\boxed " in s:
        if not s.startswith("\\boxed "):
            raise ValueError(f"not a box: {s!r}")
        return s[len("\\boxed "):]
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"not a box: {s!r}")
    return s[len("\\boxed{"):-1]


# ----------------------------------------------------------------------------------- normalisation
def fix_fracs(string: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; IndexError on `\\frac` followed by nothing."""
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":
            new_str += substr
            continue
        if len(substr) < 2:
            return string  # verl gives up on the whole string here
        a, b, post = substr[0], substr[1], substr[2:]
        if b != "{":
            new_str += "{" + a + "}{" + b + "}" + post
        else:
            new_str += "{" + a + "}" + b + post
    return new_str


def fix_a_slash_b(string: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when the string is exactly two integers as Python prints them."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def remove_right_units(string: str) -> str:
    """Drop everything from `\\text{ ` on; ValueError when it occurs twice (verl asserts)."""
    if "\\text{ " not in string:
        return string
    splits = string.split("\\text{ ")
    if len(splits) != 2:
        raise ValueError("more than one unit")
    return splits[0]


def fix_sqrt(string: str) -> str:
    """\\sqrt3 -> \\sqrt{3}; IndexError on a `\\sqrt` followed by nothing."""
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        if split[0] != "{":
            new_string += "\\sqrt{" + split[0] + "}" + split[1:]
        else:
            new_string += "\\sqrt" + split
    return new_string


def strip_string(string: str, *, drop_plain_percent: bool = False) -> str:
    """verl's `strip_string`: the canonical form MATH answers are compared in; may raise.

    drop_plain_percent: mathruler's copy removes `\\%` then `%`; verl's removes `\\\\%` then `\\%`.
    """
    string = string.replace("\n", "")
    string = string.replace("\\!", "")
    string = string.replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = remove_right_units(string)
    if drop_plain_percent:
        string = string.replace("\\%", "").replace("%", "")
    else:
        string = string.replace("\\\\%", "").replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if len(string) == 0:
        return string
    if string[0] == ".":
        string = "0" + string
    halves = string.split("=")
    if len(halves) == 2 and len(halves[0]) <= 2:  # "k = 3" -> "3" (" k" and "k " count as short)
        string = halves[1]
    string = fix_sqrt(string)
    string = string.replace(" ", "")
    string = fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return fix_a_slash_b(string)


def is_equiv(str1: Any, str2: Any) -> bool:
    """Equal after `strip_string`; equal as given when normalising either one fails."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:  # noqa: BLE001 - verl's fallback, ground truths that are not strings included
        return str1 == str2


_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def normalize_answer(answer: Optional[str], *, drop_plain_percent: bool = False) -> Optional[str]:
    """prm800k's `normalize_answer` (used by prime_math and mathruler): strip, unwrap one `\\text{}`,
    then `strip_string`; the unwrapped answer when that raises."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = _TEXT_WRAPPED.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return strip_string(answer, drop_plain_percent=drop_plain_percent)
    except Exception:  # noqa: BLE001
        return answer


# ----------------------------------------------------------------------------------- score
def compute_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last box of the response is equivalent to the ground truth, else 0.0.

    The ground truth is compared as given (not searched for a box), like verl.
    """
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception as e:  # noqa: BLE001 - verl prints the error and scores 0
        logger.debug("MATH scoring failed: %s", e)
    return 0.0
