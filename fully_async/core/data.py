"""verl-format prompt data: reading, tokenising, and a resumable prompt stream (layer 0).

Users bring the parquet files they already made for verl (`prompt` as chat messages or a plain
string, `data_source`, `reward_model.ground_truth`, `extra_info`), so the column conventions
and the truncation options (`data.truncation`, `data.filter_overlong_prompts`) are verl's.
Prompts are tokenised once, up front: an over-long prompt is reported before any device is
touched, and the rollouter only ever handles token ids.

`PromptStream` derives each epoch's order from `seed + epoch` instead of keeping a shuffled
copy, so a checkpoint only has to store three integers to resume the exact same sequence.
"""
from __future__ import annotations

import json
import logging
import os
import random
from typing import Any, Callable, Iterable, Iterator, Optional

from fully_async.core.config import TRUNCATIONS
from fully_async.core.types import PromptRecord

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file, row or column."""


# ----------------------------------------------------------------------------------- reading
def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for corrupt files
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from e


def path_problem(path: str) -> Optional[str]:
    """What keeps `path` from being read as a data file (None: nothing): a folder, a link that loops or points
    nowhere, a missing, unreadable or empty file."""
    import errno

    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path} is a symbolic link that loops (it resolves to itself): point it at a data file"
        if os.path.islink(path):
            return f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist (file not found)"
        return f"{path}: file not found"
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith((".parquet", ".jsonl", ".json")))[:3]
        return (f"{path} is a folder, not a data file: name the .parquet/.jsonl files"
                + (f" in it (e.g. {os.path.join(path, inside[0])})" if inside else ""))
    if not os.access(path, os.R_OK):
        return f"{path} is not readable by this user"
    if st.st_size == 0:
        return f"{path} is empty (0 bytes): it holds no prompts"
    return None


def _decode_lines(path: str) -> str:
    """The file's text; a line that is not UTF-8 is a DataError naming the file, the line and the byte."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"{path}: line {lineno} is not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
                        f"{column}); save the file as UTF-8") from None


def _read_jsonl(path: str) -> list[dict]:
    """One JSON object per line; a .json file may instead hold one array of objects."""
    text = _decode_lines(path)
    rows: list[Any] = []
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = list(json.loads(text))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e})") from e
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: invalid JSON on line {lineno} ({e})") from e
    if not rows:
        raise DataError(f"{path} is empty: it holds no rows (no prompts), only blank lines or []")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a {type(row).__name__}, expected a JSON object")
    return rows


def read_rows_with_origin(files: list[str]) -> list[tuple[str, int, dict]]:
    """(file, row number in that file, row) for all `files` (parquet, jsonl, or a .json array/lines), in order."""
    if isinstance(files, str):
        files = [files]
    out: list[tuple[str, int, dict]] = []
    for path in files:
        path = str(path)
        problem = path_problem(path)
        if problem:
            raise DataError(problem)
        if path.endswith(".parquet"):
            rows = _read_parquet(path)
        elif path.endswith((".jsonl", ".json")):
            rows = _read_jsonl(path)
        else:
            raise DataError(f"{path}: unsupported file type; expected .parquet or .jsonl")
        out.extend((path, i, row) for i, row in enumerate(rows))
    return out


def read_rows(files: list[str]) -> list[dict]:
    """Rows of all `files` (parquet, jsonl, or a .json array/lines), concatenated in order."""
    return [row for _, _, row in read_rows_with_origin(files)]


def _is_blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, (list, dict, tuple)) and len(value) == 0)


def row_problem(row: dict, prompt_key: str, reward_fn_key: str,
                require_ground_truth: bool) -> Optional[tuple[str, str]]:
    """(column, what is wrong) for a row the run cannot use, or None.  Checked for every row before Ray starts:
    an empty prompt would kill the rollouter late, a missing ground truth would train on reward 0 silently."""
    prompt = _to_python(row.get(prompt_key))
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        if all(_is_blank(m.get("content")) for m in prompt):
            return prompt_key, "has no message with content (an empty prompt)"
    elif _is_blank(prompt):
        return prompt_key, "is empty"
    if _is_blank(_to_python(row.get(reward_fn_key))):
        return reward_fn_key, "is empty (it selects the reward function)"
    reward_model = _to_python(row.get("reward_model"))
    if reward_model is not None and not isinstance(reward_model, dict):
        return "reward_model", ("must be a dict like {'style': 'rule', 'ground_truth': ...}, got "
                                f"{type(reward_model).__name__}")
    if require_ground_truth and _is_blank((reward_model or {}).get("ground_truth")):
        return "reward_model.ground_truth", ("is missing or empty: the rule-based reward would score every response "
                                             "0 (set custom_reward_function.path for rewards without a ground truth)")
    return None


# ----------------------------------------------------------------------------------- tokenising
def _to_python(value: Any) -> Any:
    """numpy arrays (pandas-written parquet read back by other tools) -> plain lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


def _prompt_text(prompt: Any, tokenizer: Any, index: int, prompt_key: str,
                 template_kwargs: Optional[dict] = None) -> str:
    prompt = _to_python(prompt)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                 **(template_kwargs or {}))
        return "\n".join(str(m["content"]) for m in prompt)
    raise DataError(f"row {index}: column '{prompt_key}' must be a string or a list of "
                    f"{{'role', 'content'}} messages, got {type(prompt).__name__}: {prompt!r:.200}")


def truncate_ids(ids: list[int], max_len: int, truncation: str) -> list[int]:
    """verl's truncation: left keeps the tail, right the head, middle both halves."""
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "middle":
        left = max_len // 2
        right = max_len - left
        return ids[:left] + (ids[-right:] if right > 0 else [])
    raise ValueError(f"data.truncation={truncation!r} is not one of {list(TRUNCATIONS)}")


def load_prompts(files: list[str], tokenizer: Any, *, prompt_key: str = "prompt", max_prompt_length: int,
                 truncation: str = "error", filter_overlong_prompts: bool = False,
                 reward_fn_key: str = "data_source", require_ground_truth: bool = False,
                 skip_invalid_rows: bool = False, chat_template_kwargs: Optional[dict] = None,
                 row_source: Optional[Callable[[list[str]], Iterable[dict]]] = None, max_samples: int = -1,
                 shuffle: bool = False, seed: Optional[int] = None) -> list[PromptRecord]:
    """Read, check and tokenise verl-format prompts; `index` is the row in the concatenated files.  Chat prompts
    go through the tokenizer's chat template with `chat_template_kwargs` (data.apply_chat_template_kwargs).
    `row_source` (data.custom_cls) makes the rows from the files instead of the parquet/jsonl reader.
    `max_samples` (data.train_max_samples / val_max_samples) keeps that many rows (`sample_rows`), before anything
    else is checked.

    Every row is checked (row_problem): a bad row is an error naming its file, row and column, or with
    `skip_invalid_rows` (data.skip_invalid_rows) it is dropped and counted."""
    if truncation not in TRUNCATIONS:
        raise DataError(f"data.truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
    files = [files] if isinstance(files, str) else [str(f) for f in files]
    if row_source is None:
        located = read_rows_with_origin(files)
    else:
        made = list(row_source(files))
        bad = next((i for i, row in enumerate(made) if not isinstance(row, dict)), None)
        if bad is not None:
            raise DataError(f"data.custom_cls made row {bad} of {files} a {type(made[bad]).__name__}, not a dict of "
                            "verl-format columns")
        located = [("data.custom_cls rows of " + ",".join(files), i, row) for i, row in enumerate(made)]
    rows = [row for _, _, row in located]
    for key, option in ((prompt_key, "data.prompt_key"), (reward_fn_key, "data.reward_fn_key")):
        missing = next((i for i, row in enumerate(rows) if key not in row), None)
        if missing is not None:
            present = sorted(rows[missing].keys())
            raise DataError(f"column '{key}' not found in {files} (row {missing} has columns {present}); "
                            f"set {option} to the column that holds it")

    chosen = sample_rows(len(rows), max_samples, shuffle, seed)
    if len(chosen) < len(rows):
        logger.info("data: %d of %d rows of %s (max_samples=%d, %s)", len(chosen), len(rows), files, max_samples,
                    f"a random subset, seed {seed}" if shuffle else "the first ones")
    records: list[PromptRecord] = []
    overlong: list[tuple[int, int]] = []  # (row index, length)
    invalid: list[tuple[int, str, str]] = []  # (row index, column, problem)
    for index in chosen:
        row = rows[index]
        problem = row_problem(row, prompt_key, reward_fn_key, require_ground_truth)
        text = "" if problem is not None else _prompt_text(row[prompt_key], tokenizer, index, prompt_key,
                                                           chat_template_kwargs)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if problem is None else []
        if problem is None and not ids:
            problem = (prompt_key, "tokenizes to no tokens (an empty prompt)")
        if problem is not None:
            invalid.append((index, *problem))
            continue
        if len(ids) > max_prompt_length:
            overlong.append((index, len(ids)))
            if filter_overlong_prompts:
                continue
            if truncation != "error":
                ids = truncate_ids(ids, max_prompt_length, truncation)
        reward_model = _to_python(row.get("reward_model"))
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        extra_info = _to_python(row.get("extra_info"))
        if extra_info is None:
            extra_info = {}
        elif not isinstance(extra_info, dict):
            raise DataError(f"row {index}: 'extra_info' must be a dict, got {type(extra_info).__name__}")
        prompt = _to_python(row[prompt_key])
        records.append(PromptRecord(index=index, prompt_ids=ids, data_source=str(row[reward_fn_key]),
                                    ground_truth=ground_truth, extra_info=extra_info, raw_prompt=text,
                                    messages=prompt if isinstance(prompt, list) else None))

    if invalid:
        index, column, what = invalid[0]
        path, row_in_file, _ = located[index]
        where = f"{path} row {row_in_file} (0-based), column '{column}' {what}"
        if not skip_invalid_rows:
            raise DataError(f"{where}; {len(invalid)} of {len(chosen)} rows are invalid: fix them, or set "
                            "data.skip_invalid_rows=true to drop them")
        logger.warning("dropped %d invalid rows of %d (data.skip_invalid_rows=true); the first: %s",
                       len(invalid), len(chosen), where)
    if overlong and filter_overlong_prompts:
        logger.info("dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (%s)",
                    len(overlong), len(chosen), max_prompt_length, files)
    elif overlong and truncation == "error":
        index, length = overlong[0]
        raise DataError(f"row {index} of {files} has {length} prompt tokens > data.max_prompt_length="
                        f"{max_prompt_length} ({len(overlong)} of {len(chosen)} rows are over); raise "
                        "data.max_prompt_length, or set data.truncation=left|right|middle or "
                        "data.filter_overlong_prompts=true")
    return records


def sample_rows(total: int, max_samples: int, shuffle: bool, seed: Optional[int]) -> list[int]:
    """The rows kept of `total` (their indices, in the order verl's RLHFDataset keeps them): all where max_samples
    is not in (0, total); else a random choice without replacement from numpy's default_rng(seed) when `shuffle`
    (verl's data.shuffle and data.seed, its default true), or the first max_samples."""
    if not 0 < max_samples < total:
        return list(range(total))
    if shuffle:
        import numpy as np

        rng = np.random.default_rng(*(() if seed is None else (seed,)))
        return [int(i) for i in rng.choice(total, size=max_samples, replace=False)]
    return list(range(max_samples))


# ----------------------------------------------------------------------------------- stream
class PromptStream:
    """Prompts epoch by epoch, stopping after `total_prompts`; resumable from `state_dict()`.

    `total_prompts` (default `total_epochs * len(records)`) wins over `total_epochs`: a larger
    value keeps going into further epochs, a smaller one stops mid-epoch.
    """

    def __init__(self, records: list[PromptRecord], *, shuffle: bool, seed: int, total_epochs: int,
                 total_prompts: Optional[int] = None):
        if not records:
            raise ValueError("PromptStream needs at least one prompt (the data is empty after filtering)")
        if total_epochs < 1:
            raise ValueError(f"total_epochs={total_epochs} must be >= 1")
        if total_prompts is None:
            total_prompts = total_epochs * len(records)
        if total_prompts < 0:
            raise ValueError(f"total_prompts={total_prompts} must be >= 0")
        self._records = list(records)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._total = int(total_prompts)
        self._epoch = 0
        self._position = 0  # prompts already emitted from the current epoch
        self._emitted = 0
        self._order_epoch: Optional[int] = None
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self._records)))
            if self._shuffle:
                random.Random(self._seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_emitted(self) -> int:
        return self._emitted

    @property
    def exhausted(self) -> bool:
        return self._emitted >= self._total

    def next(self) -> Optional[tuple[int, PromptRecord]]:
        """(epoch, record) of the next prompt, or None once `num_total` have been emitted."""
        if self.exhausted:
            return None
        if self._position >= len(self._records):
            self._epoch += 1
            self._position = 0
        record = self._records[self._order_for(self._epoch)[self._position]]
        self._position += 1
        self._emitted += 1
        return self._epoch, record

    def __iter__(self) -> Iterator[tuple[int, PromptRecord]]:
        while (item := self.next()) is not None:
            yield item

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "emitted": self._emitted,
                "num_records": len(self._records), "shuffle": self._shuffle, "seed": self._seed}

    def load_state_dict(self, state: dict) -> None:
        """Resume where `state` left off; the data, seed and shuffle must match the saved stream."""
        for key, mine in (("num_records", len(self._records)), ("shuffle", self._shuffle), ("seed", self._seed)):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the prompt stream: saved {key}={state[key]!r} but this "
                                 f"stream has {key}={mine!r} (the data or data.shuffle/data.seed changed)")
        position = int(state["position"])
        if not 0 <= position <= len(self._records):
            raise ValueError(f"saved position {position} is outside an epoch of {len(self._records)} prompts")
        self._epoch = int(state["epoch"])
        self._position = position
        self._emitted = int(state["emitted"])
