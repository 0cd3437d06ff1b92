"""PRIME's math rule, as verl's `verl/utils/reward_score/prime_math` (data_source numina_*).

1. `match_answer` cuts the response down to its answer: after the last "answer:" / "answer is" /
   "answers are", before "is the answer" & co., the content of the last `\\boxed{}`/`\\fbox{}`, before
   the last ". ", after the last "be "/"is "/"="/": "/"get "... .
2. prm800k's `grade_answer` (variant "prime", see `fully_async.rewards.prm800k`).
3. Otherwise `math_equal` (ToRA's grader): string, numeric (rel. tolerance 1e-4, also x100 and
   /100 for percentages), interval/tuple/point/matrix element-wise comparisons; with `\\pi` in
   either side, both pi = math.pi and pi = 3.14 are tried.

Returns verl's (is_correct, format_correctness, extracted) tuple; `default_compute_score` keeps
float(is_correct).  Needs sympy and pylatexenc (the `math` extra).

Deliberate differences from verl, none of which changes a score on ordinary answers:
* verl's `symbolic_equal` wraps each step in `with timeout_limit(...)`, a decorator factory rather
  than a context manager, so every step raises TypeError inside its own try and it always returns
  False.  `symbolic_equal` here returns False without running sympy: the same scores, no wasted time.
* verl `eval()`s model output (after `\\pi` substitution, and for `[...]` predictions against a
  `\\begin{pmatrix}` reference).  Here `_safe_eval` evaluates the same Python literal/arithmetic
  expressions (numbers, strings, tuples, lists, sets, dicts, arithmetic, comparisons, subscripts)
  with Python's own operators, so those results are identical, and refuses names, calls and
  attributes (verl would run them; here they count as an expression that did not evaluate).
* verl passes `Matrix...` predictions to sympy's `parse_expr` (which also evaluates); here only
  when they contain no quote and no double underscore.

Provenance: verl's prime_math (Apache-2.0; PRIME), whose grader comes from ToRA / CRITIC (MIT) and prm800k (MIT).
"""
from __future__ import annotations

import ast
import math
import operator
import re
import warnings
from math import isclose
from typing import Any

from fully_async.rewards.prm800k import grade_answer

# ----------------------------------------------------------------------------------- safe eval
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.MatMult: operator.matmul, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}


class UnsafeExpression(ValueError):
    """The expression needs a name, call or attribute: not evaluated."""


def _eval_node(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_eval_node(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_eval_node(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_eval_node(e) for e in node.elts}
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_eval_node(k): _eval_node(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval_node(node.left)
        return _BINARY[type(node.op)](left, _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BoolOp):
        value = None
        for operand in node.values:
            value = _eval_node(operand)
            if (not value) if isinstance(node.op, ast.And) else value:
                return value
        return value
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _eval_node(node.left)
        result: Any = True
        for op, comparator in zip(node.ops, node.comparators):
            right = _eval_node(comparator)
            result = _COMPARE[type(op)](left, right)
            if not result:
                return result
            left = right
        return result
    if isinstance(node, ast.IfExp):
        return _eval_node(node.body) if _eval_node(node.test) else _eval_node(node.orelse)
    if isinstance(node, ast.Subscript):
        value = _eval_node(node.value)
        return value[_eval_node(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if part is None else _eval_node(part) for part in (node.lower, node.upper, node.step)))
    raise UnsafeExpression(f"{type(node).__name__} is not evaluated")


def _safe_eval(expr: str) -> Any:
    """`eval(expr)` for literal/arithmetic expressions; UnsafeExpression for anything else."""
    with warnings.catch_warnings():  # "invalid decimal literal" for 1x and the like
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(expr.lstrip(" \t"), mode="eval")
    return _eval_node(tree.body)


# ----------------------------------------------------------------------------------- ToRA's math_equal
def is_digit(s: Any) -> tuple[bool, Any]:
    try:
        if "{,}" in str(s):
            return True, float(str(s).replace("{,}", ""))
        return True, float(str(s).replace(",", ""))
    except ValueError:
        return False, None


def handle_base(x: Any) -> Any:
    """`101_2` -> 101 (the digits before the base subscript); may raise on anything else."""
    if isinstance(x, str) and "_" in x:
        return int(float(x.split("_")[0]))
    return x


def handle_pi(string: Any, pi: float) -> Any:
    """Replace each `\\pi` by `*pi` (after a digit) or `1*pi`, then evaluate the result if it evaluates."""
    if isinstance(string, str) and "\\pi" in string:
        idx = string.find("\\pi")
        while idx != -1:
            if idx > 0 and string[idx - 1].isdigit():
                string = string[:idx] + f"*{pi}" + string[idx + 3:]
            else:
                string = string[:idx] + f"1*{pi}" + string[idx + 3:]
            idx = string.find("\\pi", idx + 1)
        try:
            string = _safe_eval(string)
        except Exception:  # noqa: BLE001 - SyntaxError, ZeroDivisionError, UnsafeExpression, ...
            pass
    return string


def normalize(answer: Any, pi: float) -> Any:
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]  # "$5" -> "5"
    if isinstance(answer, str) and (re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer)):
        return answer.replace("\\%", "").replace("%", "")
    answer = handle_base(answer)
    return handle_pi(answer, pi)


def format_intervals(prediction: str) -> str:
    """sympy's Interval(a, b) / .Ropen / .Lopen / .open -> [a, b] / [a, b) / (a, b] / (a, b)."""
    for pattern, left, right in ((r"^Interval\((.*)\)$", "[", "]"), (r"^Interval\.Ropen\((.*)\)$", "[", ")"),
                                 (r"^Interval\.Lopen\((.*)\)$", "(", "]"), (r"^Interval\.open\((.*)\)$", "(", ")")):
        match = re.match(pattern, prediction)
        if match:
            return f"{left}{match.group(1)}{right}"
    return prediction


def symbolic_equal(a: Any, b: Any, tolerance: float, timeout: float = 10.0) -> bool:
    """Always False, as verl's is (see the module docstring)."""
    return False


def _parse_matrix(prediction: str) -> Any:
    if "__" in prediction or "'" in prediction or '"' in prediction:
        raise UnsafeExpression("not parsed")
    from sympy.parsing.sympy_parser import parse_expr

    return parse_expr(prediction)


def math_equal(prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4,
               timeout: float = 10.0, pi: float = math.pi) -> bool:
    """Equal as strings, as numbers (within `tolerance`, percentages too) or element-wise; may raise."""
    prediction = normalize(prediction, pi)
    reference = normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]

    # 0. string comparison
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True

    # 1. numerical comparison
    try:
        if is_digit(prediction)[0] and is_digit(reference)[0]:
            prediction = is_digit(prediction)[1]
            reference = is_digit(reference)[1]
            candidates = [reference / 100, reference, reference * 100] if include_percentage else [reference]
            for item in candidates:
                try:
                    if isclose(item, prediction, rel_tol=tolerance):
                        return True
                except Exception:  # noqa: BLE001
                    continue
            return False
    except Exception:  # noqa: BLE001
        pass

    if not prediction and prediction not in [0, False]:
        return False

    # 2. structural comparison
    reference = str(reference).strip()
    prediction = format_intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    if ((prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("("))
            or (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("["))):
        pred_str = pred_str.strip("[]()")
        ref_str = ref_str.strip("[]()")
    for s in ("{", "}", "(", ")"):
        ref_str = ref_str.replace(s, "")
        pred_str = pred_str.replace(s, "")
    if pred_str == ref_str:
        return True

    # [a, b] vs [c, d]: a == c and b == d (every pair compared: a raise in any pair propagates, as in verl)
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        pred_parts = prediction[1:-1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and all(
                [math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)]):
            return True

    if "," in prediction and "," in reference:
        pred_parts = [item.strip() for item in prediction.split(",")]
        ref_parts = [item.strip() for item in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return bool(all([math_equal(pred_parts[i], ref_parts[i], include_percentage, tolerance)
                             for i in range(len(pred_parts))]))

    # Point(a, b) vs (a, b)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1:-1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and all(
                [math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)]):
            return True

    # the reference is a matrix
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:
            pred_matrix = _parse_matrix(prediction)
            ref_matrix_items = reference.split()[1:-1:2]
            if len(pred_matrix) == len(ref_matrix_items) and all(
                    [math_equal(p, r, include_percentage, tolerance) for r, p in zip(ref_matrix_items, pred_matrix)]):
                return True
        except Exception:  # noqa: BLE001
            pass
    elif r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(_safe_eval(prediction), list):  # raises out of math_equal, like verl's eval
            try:
                pred_matrix = _safe_eval(prediction)
                ref_matrix_items = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                                    .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}"))
                ref_matrix_items = [row.split("&") if "&" in row else row for row in ref_matrix_items.split("\\")]
                if len(pred_matrix) == len(ref_matrix_items) and all(
                        [math_equal(p, r, include_percentage, tolerance)
                         for r, p in zip(ref_matrix_items, pred_matrix)]):
                    return True
            except Exception:  # noqa: BLE001
                pass

    return symbolic_equal(prediction, reference, tolerance, timeout)


# ----------------------------------------------------------------------------------- answer extraction
def _last_boxed_content(string: str) -> Any:
    """The stripped content of the last `\\boxed{}` (else `\\fbox{}`), or None."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    left = None
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
            if left is None:
                left = i
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[left + 1:i].strip() if left is not None else None
    return None


def match_answer(response: str) -> tuple[bool, str]:
    """(whether an answer marker or a digit-bearing answer was found, the answer text)."""
    is_matched = False
    for marker in ("answer:", "answer is", "answers are"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            is_matched = True
            response = response[idx + len(marker):].strip()
            if response.endswith("\n"):
                response = response[:-2]
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            is_matched = True
            response = response[:idx].strip()
            if response.endswith("\n"):
                response = response[:-2]
    boxed = _last_boxed_content(response)
    if boxed:
        is_matched = True
        response = boxed
    if ". " in response:
        idx = response.lower().rfind(". ")
        if idx != -1:
            response = response[:idx].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        idx = response.lower().rfind(marker)
        if idx != -1:
            is_matched = True
            response = response[idx + len(marker):].strip()
            if response.endswith("\n"):
                response = response[:-2]
    is_matched = is_matched if any(c.isdigit() for c in response) else False  # an answer has a digit
    return is_matched, response


def compute_score(model_output: Any, ground_truth: Any) -> tuple[bool, bool, str]:
    model_output = str(model_output)
    ground_truth = str(ground_truth)
    _, extracted = match_answer(model_output)
    format_correctness = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(extracted, ground_truth, variant="prime"):
        return True, True, extracted
    try:
        if "\\pi" in extracted or "\\pi" in ground_truth:
            # both evaluated before any(): a raise from either makes the answer wrong, as in verl
            equivs = [math_equal(extracted, ground_truth, timeout=True, pi=pi) for pi in (math.pi, 3.14)]
            is_correct = any(equivs)
        else:
            is_correct = math_equal(extracted, ground_truth, timeout=True)
    except Exception:  # noqa: BLE001
        is_correct = False
    return is_correct, format_correctness, extracted
