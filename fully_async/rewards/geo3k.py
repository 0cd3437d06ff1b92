"""Geometry3K's rule, as verl's `verl/utils/reward_score/geo3k.py` (data_source hiyouga/geometry3k).

score = 0.9 * accuracy + 0.1 * format, where accuracy grades the content of the last `\\boxed{}`
("None" when there is none) against the ground truth with mathruler's `grade_answer` (the
"mathruler" variant in `fully_async.rewards.prm800k`), and format is whether the whole response
matches `<think>.*</think>.*\\boxed{.*}.*` (dot matching newlines).  Needs sympy and pylatexenc
(the `math` extra) instead of the `mathruler` package itself.
"""
from __future__ import annotations

import re

from fully_async.rewards.prm800k import grade_answer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def extract_boxed_content(text: str) -> str:
    """mathruler's: the stripped content of the last `\\boxed{`...matching `}`, or the string "None"."""
    start = text.rfind(r"\boxed{")
    if start == -1:
        return "None"
    content = text[start + len(r"\boxed{"):]
    depth = 0
    for i, char in enumerate(content):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        if depth == -1:
            return content[:i].strip()
    return "None"


def format_reward(predict_str: str) -> float:
    return 1.0 if _FORMAT.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if grade_answer(answer, ground_truth, variant="mathruler") else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    return ((1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed)
            + format_score * format_reward(predict_str))
