"""Loading verl-format prompts and streaming them resumably (fully_async.core.data)."""
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fully_async.core.data import DataError, PromptStream, load_prompts, read_rows
from fully_async.core.types import PromptRecord


class CharTokenizer:
    """One id per character (ord); optional chat template '<role>content|' + 'A:'."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}


def ids(text):
    return [ord(c) for c in text]


def rows(n=3):
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": str(i), "style": "rule"}, "extra_info": {"split": "train", "i": i}}
            for i in range(n)]


def write_parquet(path, data):
    pq.write_table(pa.Table.from_pylist(data), str(path))
    return str(path)


def write_jsonl(path, data):
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


# ----------------------------------------------------------------------------------- read_rows
def test_read_rows_concatenates_parquet_and_jsonl_in_order(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", rows(2))
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "hello", "data_source": "x"}])
    out = read_rows([a, b])
    assert len(out) == 3
    assert out[0]["prompt"] == [{"role": "user", "content": "q0"}]
    assert out[1]["reward_model"] == {"ground_truth": "1", "style": "rule"}
    assert out[2] == {"prompt": "hello", "data_source": "x"}
    assert type(out[0]["prompt"]) is list  # plain python, not numpy


def test_read_rows_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"missing\.parquet: file not found"):
        read_rows([str(tmp_path / "missing.parquet")])
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        read_rows([str(bad)])
    js = tmp_path / "bad.jsonl"
    js.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl: invalid JSON on line 2"):
        read_rows([str(js)])
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"d\.csv: unsupported file type"):
        read_rows([str(csv)])


def test_read_rows_json_array(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert read_rows([str(p)]) == [{"prompt": "a"}, {"prompt": "b"}]


# ----------------------------------------------------------------------------------- load_prompts
def test_load_prompts_parquet_messages_with_chat_template(tmp_path):
    f = write_parquet(tmp_path / "t.parquet", rows(3))
    recs = load_prompts([f], CharTokenizer(chat_template="x"), max_prompt_length=64)
    assert [r.index for r in recs] == [0, 1, 2]
    assert recs[1].raw_prompt == "<user>q1|A:"
    assert recs[1].prompt_ids == ids("<user>q1|A:")
    assert recs[2].ground_truth == "2"
    assert recs[0].data_source == "arithmetic"
    assert recs[1].extra_info == {"split": "train", "i": 1}


def test_load_prompts_messages_without_chat_template_join_contents(tmp_path):
    data = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}],
             "data_source": "arithmetic"}]
    f = write_jsonl(tmp_path / "t.jsonl", data)
    (rec,) = load_prompts([f], CharTokenizer(), max_prompt_length=64)
    assert rec.raw_prompt == "be brief\n2+2"
    assert rec.prompt_ids == ids("be brief\n2+2")
    assert rec.ground_truth is None and rec.extra_info == {}


def test_load_prompts_plain_string_used_as_is(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1=", "src": "arithmetic",
                                             "reward_model": {"ground_truth": 2}}])
    (rec,) = load_prompts([f], CharTokenizer(chat_template="x"), prompt_key="question",
                          reward_fn_key="src", max_prompt_length=8)
    assert rec.raw_prompt == "1+1="
    assert rec.prompt_ids == ids("1+1=")
    assert rec.data_source == "arithmetic" and rec.ground_truth == 2


def test_load_prompts_numpy_messages():
    # rows written by pandas come back as numpy object arrays in some readers
    from fully_async.core.data import _prompt_text
    msgs = np.array([{"role": "user", "content": "hi"}], dtype=object)
    assert _prompt_text(msgs, CharTokenizer(chat_template="x"), 0, "prompt") == "<user>hi|A:"


def test_missing_prompt_column_message(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "data_source": "a"}])
    with pytest.raises(DataError) as e:
        load_prompts([f], CharTokenizer(), max_prompt_length=8)
    msg = str(e.value)
    assert "column 'prompt' not found" in msg and "t.jsonl" in msg
    assert "['data_source', 'question']" in msg and "data.prompt_key" in msg


def test_missing_reward_fn_key_column_message(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q"}])
    with pytest.raises(DataError, match="column 'data_source' not found.*data.reward_fn_key"):
        load_prompts([f], CharTokenizer(), max_prompt_length=8)


def _one_long(tmp_path):
    data = [{"prompt": "abcdefghij", "data_source": "a"}, {"prompt": "xy", "data_source": "a"}]
    return write_jsonl(tmp_path / "t.jsonl", data)


@pytest.mark.parametrize("mode,expected", [("left", "efghij"), ("right", "abcdef"), ("middle", "abchij")])
def test_truncation_modes(tmp_path, mode, expected):
    recs = load_prompts([_one_long(tmp_path)], CharTokenizer(), max_prompt_length=6, truncation=mode)
    assert recs[0].prompt_ids == ids(expected)
    assert recs[0].raw_prompt == "abcdefghij"
    assert recs[1].prompt_ids == ids("xy")


def test_middle_truncation_odd_length(tmp_path):
    recs = load_prompts([_one_long(tmp_path)], CharTokenizer(), max_prompt_length=5, truncation="middle")
    assert recs[0].prompt_ids == ids("abhij")  # first 5//2=2, last 3


def test_filter_overlong_drops_and_logs(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fully_async.core.data"):
        recs = load_prompts([_one_long(tmp_path)], CharTokenizer(), max_prompt_length=6,
                            filter_overlong_prompts=True)
    assert [r.index for r in recs] == [1]
    assert "dropped 1 of 2 prompts" in caplog.text


def test_overlong_error_mode_message(tmp_path):
    with pytest.raises(DataError) as e:
        load_prompts([_one_long(tmp_path)], CharTokenizer(), max_prompt_length=6)
    msg = str(e.value)
    assert "row 0" in msg and "10 prompt tokens" in msg and "max_prompt_length=6" in msg
    assert "data.truncation=left|right|middle" in msg and "data.filter_overlong_prompts=true" in msg


def test_invalid_truncation_value(tmp_path):
    with pytest.raises(DataError, match="data.truncation='up'"):
        load_prompts([_one_long(tmp_path)], CharTokenizer(), max_prompt_length=6, truncation="up")


def test_bad_prompt_type_names_row(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ok", "data_source": "a"}, {"prompt": 5, "data_source": "a"}])
    with pytest.raises(DataError, match="row 1: column 'prompt' must be a string"):
        load_prompts([f], CharTokenizer(), max_prompt_length=6)


# ----------------------------------------------------------------------------------- PromptStream
def recs(n):
    return [PromptRecord(index=i, prompt_ids=[i], data_source="a", ground_truth=None) for i in range(n)]


def drain(stream):
    return [(epoch, r.index) for epoch, r in stream]


def test_stream_in_order_over_epochs():
    s = PromptStream(recs(3), shuffle=False, seed=0, total_epochs=2)
    assert s.num_total == 6
    assert drain(s) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert s.exhausted and s.num_emitted == 6
    assert s.next() is None


def test_stream_shuffle_is_a_seeded_permutation_per_epoch():
    import random
    a = drain(PromptStream(recs(8), shuffle=True, seed=5, total_epochs=2))
    b = drain(PromptStream(recs(8), shuffle=True, seed=5, total_epochs=2))
    assert a == b
    e0 = [i for e, i in a if e == 0]
    e1 = [i for e, i in a if e == 1]
    want0, want1 = list(range(8)), list(range(8))
    random.Random(5).shuffle(want0)
    random.Random(6).shuffle(want1)
    assert e0 == want0 and e1 == want1
    assert e0 != e1 and sorted(e0) == list(range(8))
    c = drain(PromptStream(recs(8), shuffle=True, seed=6, total_epochs=1))
    assert [i for _, i in c] == want1


def test_stream_total_prompts_stops_mid_epoch_or_extends():
    s = PromptStream(recs(3), shuffle=False, seed=0, total_epochs=5, total_prompts=4)
    assert drain(s) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    s = PromptStream(recs(2), shuffle=False, seed=0, total_epochs=1, total_prompts=5)
    assert drain(s) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_stream_state_round_trip():
    full = drain(PromptStream(recs(5), shuffle=True, seed=3, total_epochs=3))
    for k in (0, 2, 5, 7, 15):
        s = PromptStream(recs(5), shuffle=True, seed=3, total_epochs=3)
        head = [(e, r.index) for e, r in (s.next() for _ in range(k))]
        state = s.state_dict()
        resumed = PromptStream(recs(5), shuffle=True, seed=3, total_epochs=3)
        resumed.load_state_dict(state)
        assert resumed.num_emitted == k
        assert head + drain(resumed) == full


def test_stream_state_values_and_mismatch():
    s = PromptStream(recs(3), shuffle=False, seed=0, total_epochs=2)
    for _ in range(4):
        s.next()
    assert {k: s.state_dict()[k] for k in ("epoch", "position", "emitted")} == {"epoch": 1, "position": 1, "emitted": 4}
    other = PromptStream(recs(4), shuffle=False, seed=0, total_epochs=2)
    with pytest.raises(ValueError, match="num_records=3"):
        other.load_state_dict(s.state_dict())


def test_stream_rejects_empty():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptStream([], shuffle=False, seed=0, total_epochs=1)


# ----------------------------------------------------------------------------------- invalid rows
@pytest.mark.parametrize("bad, column", [
    ({"prompt": [{"role": "user", "content": "  "}]}, "prompt"),          # an empty user message
    ({"prompt": ""}, "prompt"),
    ({"data_source": ""}, "data_source"),
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth"),   # trains on reward 0 otherwise
    ({"reward_model": {"style": "rule", "ground_truth": ""}}, "reward_model.ground_truth"),
    ({"reward_model": "1"}, "reward_model"),
])
def test_an_invalid_row_is_named_by_file_row_and_column_before_anything_runs(tmp_path, bad, column):
    good = write_parquet(tmp_path / "a.parquet", rows(3))
    data = rows(5)
    data[3].update(bad)
    second = write_jsonl(tmp_path / "b.jsonl", data)      # jsonl: a column may mix types there
    with pytest.raises(DataError, match=rf"b\.jsonl row 3 \(0-based\), column '{column}'.*1 of 8 rows are "
                                        r"invalid.*data\.skip_invalid_rows=true"):
        load_prompts([good, second], CharTokenizer(), max_prompt_length=64, require_ground_truth=True)


def test_skip_invalid_rows_drops_and_counts(tmp_path, caplog):
    data = rows(6)
    data[1]["prompt"] = [{"role": "user", "content": ""}]
    data[4]["reward_model"] = {"style": "rule"}
    path = write_parquet(tmp_path / "a.parquet", data)
    with caplog.at_level(logging.WARNING):
        recs = load_prompts([path], CharTokenizer(), max_prompt_length=64, require_ground_truth=True,
                            skip_invalid_rows=True)
    assert [r.index for r in recs] == [0, 2, 3, 5]
    assert "dropped 2 invalid rows of 6" in caplog.text and "a.parquet row 1" in caplog.text


def test_a_missing_ground_truth_is_fine_for_a_custom_reward(tmp_path):
    data = rows(2)
    data[0]["reward_model"] = {"style": "model"}
    path = write_parquet(tmp_path / "a.parquet", data)
    assert len(load_prompts([path], CharTokenizer(), max_prompt_length=64, require_ground_truth=False)) == 2


def test_chat_template_arguments_reach_the_template_as_verls_apply_chat_template_kwargs(tmp_path):
    from transformers import AutoTokenizer

    from fully_async.core.config import asset_path
    from fully_async.run.hydra_setup import load_config

    tok = AutoTokenizer.from_pretrained(asset_path("tiny_arithmetic/model"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ reasoning_effort | default('none') }}"
    f = write_parquet(tmp_path / "t.parquet", rows(1))
    (plain,) = load_prompts([f], tok, max_prompt_length=64)
    (high,) = load_prompts([f], tok, max_prompt_length=64, chat_template_kwargs={"reasoning_effort": "high"})
    assert (plain.raw_prompt, high.raw_prompt) == ("q0|none", "q0|high")
    cfg = load_config(["+data.apply_chat_template_kwargs.reasoning_effort=medium"])   # verl's spelling
    assert dict(cfg.data.apply_chat_template_kwargs) == {"reasoning_effort": "medium"}


def test_max_samples_keep_the_rows_verls_dataset_keeps():
    """data.train_max_samples / val_max_samples as verl's RLHFDataset: with data.shuffle a choice without replacement
    from numpy's default_rng(data.seed), in that order, drawn before the rows are checked; without it the first
    rows; -1 (and 0, and a count past the end) keeps every row.  A record keeps its row index in the files."""
    from fully_async.core.data import sample_rows
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.prepare import load_datasets, load_tokenizer

    verl = [int(i) for i in np.random.default_rng(7).choice(1024, size=10, replace=False)]
    assert sample_rows(1024, 10, True, 7) == verl and sample_rows(1024, 10, False, 7) == list(range(10))
    assert sample_rows(5, -1, True, 7) == sample_rows(5, 0, True, 7) == sample_rows(5, 9, True, 7) == list(range(5))
    cfg = load_config(["data.train_max_samples=10", "data.val_max_samples=3", "data.seed=7"])
    train, val = load_datasets(cfg, load_tokenizer(cfg))
    assert [r.index for r in train] == verl and len(val) == 3
    cfg = load_config(["data.train_max_samples=10", "data.shuffle=false"])
    assert [r.index for r in load_datasets(cfg, load_tokenizer(cfg))[0]] == list(range(10))
