"""DAPO's math rule, as verl's `verl/utils/reward_score/math_dapo.py` (data_source math_dapo, math,
math_dapo_reasoning, aime*).

Only the last 300 characters of the response count.  Default (Minerva) check: the text after the
last `Answer:` (case-insensitive, up to the end of the line) and the ground truth are both normalised
with `normalize_final_answer` and compared as strings.  With `strict_box_verify` the content of the
last `\\boxed{}` within the last 100 characters must equal the ground truth exactly.  Returns a dict:
score 1.0 when correct and -1.0 otherwise (no answer included), `acc` (bool) and `pred`.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from fully_async.rewards.hendrycks import balanced_from

# (before, after) replacements, then removed substrings, in verl's order.
SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"


def last_boxed_only_string(string: str) -> Optional[str]:
    """The last `\\boxed{...}` with balanced braces (no `\\boxed ` or `\\fbox` forms here)."""
    idx = string.rfind("\\boxed{")
    return None if idx < 0 else balanced_from(string, idx)


def remove_boxed(s: str) -> str:
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"box error: {s}")
    return s[len("\\boxed{"):-1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer (the part after the last '=')."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)  # \fracab -> \frac{a}{b}
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)  # \sqrta -> \sqrt{a}
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = ANSWER_PATTERN) -> tuple[bool, str]:
    match = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(match[-1] if match else "[INVALID]")
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        if boxed is None:
            raise ValueError(f"box error: {gt}")
        gt = normalize_final_answer(remove_boxed(boxed))
    else:
        gt = normalize_final_answer(gt)
    return pred == gt, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: Optional[list[int]] = None
                          ) -> tuple[int, Optional[str]]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 entries, got {len(pause_tokens_index)}")
        pred = pred[pause_tokens_index[-1] - 100:]
    else:
        pred = pred[-100:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: Optional[list[int]] = None) -> dict:
    solution_str = solution_str[-300:]
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, ground_truth, pause_tokens_index)
        correct = correct == 1
    else:
        correct, pred = is_correct_minerva(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
