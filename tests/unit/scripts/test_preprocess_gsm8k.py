"""scripts/preprocess_gsm8k.py on tiny fake GSM8K files: verl-format rows, errors that name the row."""
import importlib.util
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fully_async.rewards import default_compute_score

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts", "preprocess_gsm8k.py")
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


@pytest.fixture(scope="module")
def pre():
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,200 eggs a day for 2 days. Total?", "answer": "1200*2=2400\n#### 2,400"},
]
TEST = [{"question": "It is 5 degrees and drops 8. Temperature?", "answer": "5-8=-3\n#### -3"}]


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_jsonl_to_verl_rows(pre, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "train.jsonl", TRAIN)
    write_jsonl(raw / "test.jsonl", TEST)
    out = tmp_path / "out"
    assert pre.main(["--local_dir", str(raw), "--out_dir", str(out)]) == 0
    train = pq.read_table(out / "train.parquet").to_pylist()
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert len(train) == 2 and len(test) == 1
    assert train[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": TRAIN[0]["question"] + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0, "answer": TRAIN[0]["answer"], "question": TRAIN[0]["question"]},
    }
    assert train[1]["reward_model"]["ground_truth"] == "2400"          # thousands separator removed
    assert train[1]["extra_info"]["index"] == 1
    assert test[0]["reward_model"]["ground_truth"] == "-3"
    assert test[0]["extra_info"]["split"] == "test"
    # the rows feed the built-in gsm8k reward: the reference solution scores 1, a wrong one 0
    for row in train + test:
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], row["extra_info"]["answer"], truth) == 1.0
        assert default_compute_score(row["data_source"], "#### 12345", truth) == 0.0


def test_hub_parquet_layout(pre, tmp_path):
    raw = tmp_path / "raw"
    (raw / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(TRAIN), raw / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(TEST), raw / "main" / "test-00000-of-00001.parquet")
    out = tmp_path / "out"
    assert pre.main(["--local_dir", str(raw), "--out_dir", str(out)]) == 0
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "2400"]


def test_bad_inputs_are_named(pre, tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "train.jsonl", TRAIN + [{"question": "q", "answer": "no final answer"}])
    write_jsonl(raw / "test.jsonl", TEST)
    assert pre.main(["--local_dir", str(raw), "--out_dir", str(tmp_path / "o")]) == 1
    assert "train.jsonl row 2: no '#### <number>'" in capsys.readouterr().err
    write_jsonl(raw / "train.jsonl", [{"problem": "q", "answer": "#### 1"}])
    assert pre.main(["--local_dir", str(raw), "--out_dir", str(tmp_path / "o")]) == 1
    assert "missing column(s) ['question']" in capsys.readouterr().err
    assert pre.main(["--local_dir", str(tmp_path / "empty"), "--out_dir", str(tmp_path / "o")]) == 1
    assert "no train split found" in capsys.readouterr().err
