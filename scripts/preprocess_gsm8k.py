"""GSM8K -> verl-format parquet (train.parquet, test.parquet), as verl's examples/data_preprocess/gsm8k.py.

  python scripts/preprocess_gsm8k.py --out_dir ~/data/gsm8k                       # from the HF hub (needs `datasets`)
  python scripts/preprocess_gsm8k.py --local_dir /data/gsm8k_raw --out_dir ~/data/gsm8k   # offline

`--local_dir` holds the original openai/gsm8k splits (columns `question`, `answer`) as
train/test `.parquet` or `.jsonl` files: `train.jsonl` (the GitHub release), `train-*.parquet`, or
the hub layout `main/train-00000-of-00001.parquet`.  Each output row:

  data_source  "openai/gsm8k"
  prompt       [{"role": "user", "content": question + INSTRUCTION}]
  ability      "math"
  reward_model {"style": "rule", "ground_truth": the number after "####" (commas removed)}
  extra_info   {"split", "index", "answer", "question"}

The gsm8k reward (fully_async.rewards) scores a response by the number after its last "####".
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Iterable, Optional

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_ANSWER = re.compile(r"#### *(\-?[0-9\.\,]+)")


class PreprocessError(ValueError):
    """Input that cannot be converted; the message names the file/row."""


def extract_answer(answer: str, where: str = "") -> str:
    """The final number of a GSM8K solution (after '####'), commas removed."""
    m = _ANSWER.search(answer)
    if m is None:
        raise PreprocessError(f"{where}: no '#### <number>' in the answer {answer[-80:]!r}")
    return m.group(1).replace(",", "")


def make_row(question: str, answer: str, split: str, index: int, where: str = "") -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer, where)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert(rows: Iterable[dict], split: str, source: str) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i}"
        missing = [k for k in ("question", "answer") if k not in row]
        if missing:
            raise PreprocessError(f"{where}: missing column(s) {missing}; expected the openai/gsm8k columns "
                                  "'question' and 'answer'")
        out.append(make_row(str(row["question"]), str(row["answer"]), split, i, where))
    return out


def read_rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def find_split_file(local_dir: str, split: str) -> str:
    patterns = [f"{split}.parquet", f"{split}.jsonl", f"{split}-*.parquet", f"main/{split}-*.parquet",
                f"main/{split}.jsonl", f"main/{split}.parquet"]
    for pattern in patterns:
        hits = sorted(glob.glob(os.path.join(local_dir, pattern)))
        if hits:
            return hits[0]
    raise PreprocessError(f"--local_dir {local_dir}: no {split} split found (looked for {', '.join(patterns)})")


def load_local(local_dir: str) -> dict[str, list[dict]]:
    out = {}
    for split in SPLITS:
        path = find_split_file(local_dir, split)
        out[split] = convert(read_rows(path), split, path)
    return out


def load_hub() -> dict[str, list[dict]]:
    """openai/gsm8k ('main' config) from the Hugging Face hub via `datasets` (imported only here)."""
    try:
        import datasets
    except ImportError as exc:
        raise PreprocessError("downloading openai/gsm8k needs `pip install datasets`; or pass --local_dir with "
                              "the train/test files") from exc
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as exc:  # ConnectionError, HfHubHTTPError, OfflineModeIsEnabled, ...
        raise PreprocessError(f"cannot load openai/gsm8k from the Hugging Face hub ({type(exc).__name__}: {exc}); "
                              "offline? download the dataset elsewhere and pass --local_dir") from exc
    return {split: convert(ds[split], split, f"openai/gsm8k[{split}]") for split in SPLITS}


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local_dir", help="folder with the raw train/test files (parquet or jsonl); default: HF hub")
    ap.add_argument("--out_dir", default=os.path.expanduser("~/data/gsm8k"), help="output folder")
    args = ap.parse_args(argv)
    try:
        splits = load_local(args.local_dir) if args.local_dir else load_hub()
    except PreprocessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(args.out_dir, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"{split}: {len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
