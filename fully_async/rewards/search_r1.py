"""Search-R1 exact match, as verl's `verl/utils/reward_score/search_r1_like_qa_em.py` (data_source searchR1_*).

The answer is the last `<answer>...</answer>` (spanning lines), stripped.  It and each golden answer
(`ground_truth["target"]`: a string or a list of them) are normalised SQuAD-style: lower case,
punctuation removed, articles a/an/the replaced by spaces, whitespace collapsed.  No answer -> 0; an
exact match -> `score` (divided by 4 when the response has more than 10 `<answer>` or `</answer>`
tags); otherwise `format_score`.  verl also prints one response in 64 at random; this does not.
"""
from __future__ import annotations

import re
import string
from typing import Any, Optional

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golden_list(golden_answers: Any) -> Any:
    return [golden_answers] if isinstance(golden_answers, str) else golden_answers


def em_check(prediction: str, golden_answers: Any) -> int:
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(g) == normalized for g in _golden_list(golden_answers)))


def subem_check(prediction: str, golden_answers: Any) -> int:
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(g) in normalized for g in _golden_list(golden_answers)))


def extract_solution(solution_str: str) -> Optional[str]:
    matches = list(_ANSWER.finditer(solution_str))
    return matches[-1].group(1).strip() if matches else None


def count_answer_tags(text: str) -> tuple[int, int]:
    return text.count("<answer>"), text.count("</answer>")


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """Exact match (EM); `method` is accepted and ignored, like verl."""
    answer = extract_solution(solution_str)
    open_count, close_count = count_answer_tags(solution_str)
    if answer is None:
        return 0
    if em_check(answer, ground_truth["target"]):
        if open_count > 10 or close_count > 10:  # discourage spamming </answer>
            return score / 4
        return score
    return format_score


def compute_score_subem(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """Substring exact match: a normalised golden answer inside the normalised answer (not routed by default)."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, ground_truth["target"]) else format_score
