"""data.custom_cls: rows made by the user's callable (data_files, data_config) instead of the parquet/jsonl reader,
checked like the reader's; verl's own dataset classes are refused with what to write instead."""
import os

import pandas as pd
import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.core.data import DataError
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import load_datasets

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "verl_custom_rows.py")


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    from fully_async.core.config import asset_path
    return AutoTokenizer.from_pretrained(asset_path("tiny_arithmetic/model"))


def config(tmp_path, path, name, files=None):
    return load_config([f"data.train_files={files or tmp_path / 'd.parquet'}", "data.val_files=null",
                        "actor_rollout_ref.rollout.n=2",
                        f"data.custom_cls.path={path}", f"data.custom_cls.name={name}"])


def test_a_ported_verl_dataset_class_makes_the_rows(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": str(2 * a)}} for a in range(3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    cfg = config(tmp_path, FIXTURE, "CustomRLHFDataset")
    validate(cfg)
    train, _ = load_datasets(cfg, tok)
    assert [r.ground_truth for r in train] == ["0", "2", "4"]
    assert all(r.messages[0]["content"].endswith("\\boxed{'The final answer goes here.'}") for r in train)
    assert train[1].raw_prompt.startswith("1+1=\nThe answer format must be")


def test_bad_custom_classes_are_refused_naming_the_key(tmp_path, tok):
    (tmp_path / "verl_style.py").write_text("from verl.utils.dataset import RLHFDataset\n\n"
                                            "class CustomRLHFDataset(RLHFDataset):\n    pass\n")
    (tmp_path / "odd.py").write_text("def rows(files, data):\n    return ['not a row']\n")
    pd.DataFrame([{"prompt": "1+1=", "data_source": "arithmetic"}]).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match="both are needed"):
        validate(load_config([f"data.custom_cls.path={FIXTURE}"]))
    with pytest.raises(ConfigError, match="data.custom_cls.path.*file not found"):
        validate(config(tmp_path, tmp_path / "missing.py", "f"))
    # the files are the callable's: a dataset folder (as verl's retool script passes) is not checked as a file
    validate(config(tmp_path, FIXTURE, "CustomRLHFDataset", files=tmp_path))
    with pytest.raises(ConfigError, match=r"import failed \(ModuleNotFoundError: No module named 'verl[\w.]*'\); "
                                          r"verl's dataset classes subclass its RLHFDataset and need verl"):
        load_datasets(config(tmp_path, tmp_path / "verl_style.py", "CustomRLHFDataset"), tok)
    with pytest.raises(ConfigError, match="defines no callable of that name; functions it defines: \\['rows'\\]"):
        load_datasets(config(tmp_path, tmp_path / "odd.py", "CustomRLHFDataset"), tok)
    with pytest.raises(DataError, match="data.custom_cls made row 0 .* a str, not a dict"):
        load_datasets(config(tmp_path, tmp_path / "odd.py", "rows"), tok)
