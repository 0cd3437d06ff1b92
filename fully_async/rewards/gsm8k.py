"""GSM8K answer extraction and score, as verl's `verl/utils/reward_score/gsm8k.py` (data_source openai/gsm8k).

strict: the last `#### <number>` in the response, thousands separators removed (`#### 1,234` -> "1234").
flexible: the last run of digits/dots/commas/minus that is not just ".", commas kept ("1,234" stays
"1,234"); when every run is ".", the first one (verl's loop leaves it there), which matches nothing.
Only the last 300 characters are searched.  The extracted string is compared with the ground truth
as given: no stripping, no comma removal, no str() (a non-string ground truth never matches, as in
verl; a warning says so once).  No answer found -> 0; found and equal -> `score`; found but wrong
-> `format_score` (0 by default, so verl's default_compute_score gives 1/0).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional

logger = logging.getLogger(__name__)

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_warned_non_str = False


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r} is not one of ['strict', 'flexible']")
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _FLEXIBLE.findall(text)
    if not found:
        return None
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    return found[0]


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    global _warned_non_str
    if not isinstance(ground_truth, str) and not _warned_non_str:
        _warned_non_str = True
        logger.warning("gsm8k ground truth %r is a %s, not a string: verl's rule compares strings, so no "
                       "response can match it (store reward_model.ground_truth as a string)",
                       ground_truth, type(ground_truth).__name__)
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
