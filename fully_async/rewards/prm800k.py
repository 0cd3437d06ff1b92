"""prm800k's answer grader (`grade_answer`), in the two variants verl's rules use.

* variant "prime": verl's `verl/utils/reward_score/prime_math/__init__.py` (data_source numina_*),
  whose sympy comparison runs under a 10 s limit (TimeoutError -> not equal).
* variant "mathruler": the `mathruler.grader` package verl's geo3k rule imports (data_source
  hiyouga/geometry3k): no "liter" unit, spaces and leftover braces dropped after normalising, `%`
  removed in the Hendrycks step, and no time limit of its own.

An answer is right when (a) the Hendrycks normalisations are equal, (b) prm800k's normalisations
are equal, or (c) element by element (tuples/intervals split on commas), unreduced fractions match
exactly, integers match exactly, and anything else has a difference that sympy simplifies to 0.
LaTeX is turned into text with pylatexenc (the `math` extra); sympy comes with torch.

The 10 s limit is a SIGALRM timer, so it only works in a main thread: `fully_async.rewards` runs
this code in a worker process of `fully_async.rewards.isolated`, where it is the main thread, under
an overall limit as well.  Called from any other thread the per-comparison limit is skipped.

Provenance: OpenAI's prm800k grader (MIT), as copied by verl and mathruler (both Apache-2.0).
"""
from __future__ import annotations

import logging
import re
import signal
import threading
from typing import Any, Optional

from fully_async.rewards.hendrycks import normalize_answer

BAD_SUBSTRINGS = ["^{", "^("]  # sympy might hang on these: not worth being lenient
BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
TUPLE_CHARS = "()[]"
SYMPY_TIMEOUT_S = 10.0  # prime variant, like verl's @timeout_limit(seconds=10)

_UNITS_PRIME = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
                "year", "foot", "feet", "inch", "yard", "liter"]
_UNITS_MATHRULER = _UNITS_PRIME[:-1]
VARIANTS = ("prime", "mathruler")


class _SympyTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so sympy's `except Exception` cannot swallow it."""


def _sympy_parse(expr: str) -> Any:
    from sympy.parsing import sympy_parser

    return sympy_parser.parse_expr(
        expr.replace("^", "**"),
        transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,))


def _parse_latex(expr: str) -> str:
    """LaTeX -> text sympy can read, via pylatexenc (whose warnings about malformed macros are muted)."""
    from pylatexenc import latex2text

    logging.getLogger("pylatexenc").setLevel(logging.ERROR)

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # play nice with mixed numbers
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for before, after in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(before, after)
    return expr.strip()


def _is_float(num: str) -> bool:
    try:
        float(num)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001 - inf / nan
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _str_is_int(x: str) -> bool:
    try:
        value = float(_strip_properly_formatted_commas(x))
        return abs(value - int(round(value))) <= 1e-7
    except Exception:  # noqa: BLE001
        return False


def _str_to_int(x: str) -> int:
    return int(float(x.replace(",", "")))


def _inject_implicit_mixed_number(step: str) -> str:
    """7 3/4 -> 7+3/4."""
    return re.sub(r"([0-9]) +([0-9])", r"\1+\2", step)


def _strip_properly_formatted_commas(expr: str) -> str:
    """1,234,567 -> 1234567 without touching tuple commas."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        next_expr = pattern.sub(r"\1\3\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def _normalize(expr: Optional[str], variant: str) -> Optional[str]:
    if expr is None:
        return None
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in (_UNITS_PRIME if variant == "prime" else _UNITS_MATHRULER):
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # noqa: BLE001
            pass
    expr = re.sub("- *", "-", expr)  # mixed numbers and negative signs
    expr = _inject_implicit_mixed_number(expr)
    if variant == "mathruler":
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()  # text answers are not case sensitive
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def count_unknown_letters_in_expr(expr: str) -> int:
    expr = expr.replace("sqrt", "").replace("frac", "")
    return len({x for x in expr if x.isalpha()})


def should_allow_eval(expr: str) -> bool:
    """No unknown text or functions of more than two variables, nothing sympy may hang on."""
    if count_unknown_letters_in_expr(expr) > 2:
        return False
    if any(bad in expr for bad in BAD_SUBSTRINGS):
        return False
    return all(re.search(bad, expr) is None for bad in BAD_REGEXES)


def _equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    try:
        expr = f"({ground_truth_normalized})-({given_normalized})"
        if should_allow_eval(expr):
            import sympy

            if sympy.simplify(_sympy_parse(expr)) == 0:
                return True
    except Exception:  # noqa: BLE001
        pass
    return False


def _alarm(signum: int, frame: Any) -> None:
    raise _SympyTimeout()


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str,
                          timeout_s: Optional[float] = None) -> bool:
    """Whether sympy simplifies the difference to 0; False when that takes more than `timeout_s`
    (the limit needs the main thread; elsewhere the call is unbounded)."""
    if not timeout_s or threading.current_thread() is not threading.main_thread():
        return _equal_under_sympy(ground_truth_normalized, given_normalized)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _equal_under_sympy(ground_truth_normalized, given_normalized)
    except _SympyTimeout:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple/interval (well-formatted thousands commas kept inside numbers)."""
    expr = _strip_properly_formatted_commas(expr)
    if len(expr) == 0:
        return []
    if (len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS
            and all(ch not in expr[1:-1] for ch in TUPLE_CHARS)):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given_answer: Optional[str], ground_truth: str, variant: str = "prime") -> bool:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {list(VARIANTS)}")
    if given_answer is None:
        return False
    plain_percent = variant == "mathruler"
    if (normalize_answer(ground_truth, drop_plain_percent=plain_percent)
            == normalize_answer(given_answer, drop_plain_percent=plain_percent)):
        return True  # at least as lenient as the MATH (mathd) normalisation
    ground_truth_normalized = _normalize(ground_truth, variant)
    given_normalized = _normalize(given_answer, variant)
    if ground_truth_normalized is None:
        return False
    if ground_truth_normalized == given_normalized:
        return True
    if len(given_normalized) == 0:
        return False
    ground_truth_elems = split_tuple(ground_truth_normalized)
    given_elems = split_tuple(given_normalized)
    if (len(ground_truth_elems) > 1
            and (ground_truth_normalized[0] != given_normalized[0]
                 or ground_truth_normalized[-1] != given_normalized[-1])):
        return False
    if len(ground_truth_elems) != len(given_elems):
        return False
    timeout_s = SYMPY_TIMEOUT_S if variant == "prime" else None
    for ground_truth_elem, given_elem in zip(ground_truth_elems, given_elems):
        if _is_frac(ground_truth_elem) and _is_frac(given_elem):
            is_correct = ground_truth_elem == given_elem  # unreduced fractions are not accepted
        elif _str_is_int(ground_truth_elem) != _str_is_int(given_elem):
            is_correct = False  # an integer answer must match exactly
        else:
            is_correct = are_equal_under_sympy(ground_truth_elem, given_elem, timeout_s)
        if not is_correct:
            return False
    return True  # (no elements is impossible here: "" == "" returned above, "" vs "x" differ in length)
