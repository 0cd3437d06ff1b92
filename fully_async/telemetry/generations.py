"""Validation generations as verl shows them (layer 1): `trainer.log_val_generations` and `trainer.validation_data_dir`.

`trainer.rollout_data_dir` likewise dumps every trained batch as `<dir>/<step>.jsonl` (verl's `_log_rollout_data`;
the trainer's step carries its rows under `ROLLOUT_GENERATIONS`).
A validation that is asked for them carries its responses as rows (`VAL_GENERATIONS` in its metrics dict: input and
output decoded without special tokens, the ground truth `gts`, the `score`, and the reward function's extra fields);
the driver takes them out before the scalars are logged (run/run_logging.py):
* `trainer.validation_data_dir`: every row, as `<dir>/<step>.jsonl` (verl's `_dump_generations`: one JSON object a
  line, keys input, output, gts, score, step and the reward's extras);
* `trainer.log_val_generations=N`: N of them to the sinks that show text (verl's `_maybe_log_val_generations`: rows
  sorted by input, shuffled with a fixed seed 42, the first N), under `val/generations`: TensorBoard text, a W&B
  table with one row per validation, a SwanLab table, an MLflow artifact `val_step<step>.json`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

from fully_async.core import safe_write

VAL_GENERATIONS = "val/generations"     # the metrics-dict key of a validation's rows, and the sinks' name for them
ROLLOUT_GENERATIONS = "rollout/generations"   # ... of a trained batch's rows (trainer.rollout_data_dir)


def wanted(trainer: Any) -> bool:
    """Whether validations should carry their rows (`trainer`: the config's trainer section)."""
    return int(trainer.log_val_generations) > 0 or bool(trainer.validation_data_dir)


def rows_of(texts: Sequence[tuple[str, str, Any]], samples: Iterable[Any]) -> list[dict]:
    """One row per scored sample: its (input, output, ground truth) from `texts` (same order) and its reward and
    the reward function's extra fields (those that do not reuse a base key)."""
    rows = []
    for (inp, out, gts), s in zip(texts, samples):
        row = {"input": inp, "output": out, "gts": gts, "score": float(s.reward)}
        row.update({k: v for k, v in (s.reward_extra or {}).items() if k not in row})
        rows.append(row)
    return rows


def decoded(tokenizer: Any, items: Iterable[tuple[Any, list[int], list[int], Any]]) -> list[tuple[str, str, Any]]:
    """(input, output, ground truth) of (prompt key, prompt ids, response ids, ground truth) items, decoded without
    special tokens as verl's dumps; a prompt is decoded once for all the responses to it (its key)."""
    prompts: dict[Any, str] = {}
    out = []
    for key, prompt_ids, response_ids, gts in items:
        if key not in prompts:
            prompts[key] = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        out.append((prompts[key], tokenizer.decode(response_ids, skip_special_tokens=True), gts))
    return out


def trained_rows(tokenizer: Any, samples: Sequence[Any]) -> list[dict]:
    """trainer.rollout_data_dir: the rows of a step's trained responses (verl's `_log_rollout_data`: prompt and
    response decoded, the ground truth, the score and the reward's extra fields)."""
    return rows_of(decoded(tokenizer, ((s.uid, s.prompt_ids, s.response_ids, s.ground_truth) for s in samples)),
                   samples)


def pick(rows: Sequence[dict], n: int) -> list[tuple[str, str, float]]:
    """verl's choice of the generations to show: (input, output, score) sorted by input, shuffled by numpy's
    RandomState(42), the first `n` (so the same prompts at every validation while the data is the same)."""
    import numpy as np

    samples = sorted(((r["input"], r["output"], r["score"]) for r in rows), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def _jsonable(value: Any) -> Any:
    """numpy values (a parquet ground truth) as Python ones; anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def dump(directory: str, step: int, rows: Sequence[dict]) -> str:
    """`<directory>/<step>.jsonl`, one row a line with its step (verl's `_dump_generations`); the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with safe_write.atomic_open(path, fsync=False) as fh:   # a reader never sees half a file
        for row in rows:
            fh.write(json.dumps(dict(row, step=step), ensure_ascii=False, default=_jsonable) + "\n")
    return path


def markdown(samples: Sequence[tuple[str, str, float]], step: int) -> str:
    """The TensorBoard text of `samples` (verl's layout)."""
    parts = [f"**Generation Results - Step {step}**\n\n"]
    for i, (inp, out, score) in enumerate(samples, start=1):
        parts.append(f"### Sample {i}\n**Input:** {inp}\n\n**Output:** {out}\n\n**Score:** {score}\n\n---\n\n")
    return "".join(parts)
