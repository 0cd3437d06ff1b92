"""docs/verl_compat.md is what scripts/gen_verl_compat.py generates from the rules."""
import os
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

import gen_verl_compat  # noqa: E402
import verl_config_keys  # noqa: E402


def test_the_committed_doc_is_the_generated_one():
    with open(gen_verl_compat.DOC) as f:
        committed = f.read()
    assert committed == gen_verl_compat.render(), "run: python scripts/gen_verl_compat.py"


def test_the_doc_lists_every_key_once_with_its_status():
    text = gen_verl_compat.render()
    table = text[text.index("## Every key"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 1220
    assert all(line.split(" | ")[2] in ("honoured", "warned", "refused") for line in rows)
    assert "| `actor_rollout_ref.hybrid_engine` | `true` | warned | async mode puts" in table
    # a key verl 0.9.1 removed is kept, marked, with b178a3cd's default; a new one has no mark
    older = [line for line in rows if "*b178a3cd only.*" in line]
    assert len(older) == 115
    assert "| `actor_rollout_ref.actor.load_weight` | `true` | warned | *b178a3cd only.* the actor always" in older[0]
    assert "| `trainer.v1.trainer_mode` | `\"sync\"` | honoured | sync is mode=sync" in table
    assert "**1220 keys (1105 of verl 0.9.1, 115 of b178a3cd only): " in text


def _write_verl(root, base, megatron, overlay=None):
    """A tiny verl tree: the two flattened trainer configs and, optionally, the fully-async overlay."""
    import yaml

    files = {verl_config_keys.BASES["ppo_trainer"]: base, verl_config_keys.BASES["ppo_megatron_trainer"]: megatron}
    if overlay is not None:
        files[verl_config_keys.OVERLAYS["fully_async_ppo_trainer"]] = overlay
    for path, tree in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            yaml.safe_dump(tree, f)
    return files


def test_the_key_table_flattens_each_versions_configs_newest_first(tmp_path):
    """Leaves (an empty dict and a list are leaves), the configs that have each key, an overlay's keys only where the
    base lacks them (its hydra/defaults ignored), and a key only the older version has kept with its default."""
    new, old = tmp_path / "new", tmp_path / "old"
    _write_verl(new, {"trainer": {"lr": 1.0e-06, "v1": {"sync": {}, "mode": "sync"}}, "data": {"keys": ["a", "b"]}},
                {"trainer": {"lr": 2.0e-06, "tp": 2}},
                {"hydra": {"searchpath": ["x"]}, "defaults": ["ppo_trainer"], "trainer": {"lr": 9.0},
                 "async_training": {"staleness_threshold": 0.1}})
    files = _write_verl(old, {"trainer": {"lr": 3.0e-06, "gone": True}}, {"trainer": {"lr": 3.0e-06}})
    wheel = tmp_path / "verl-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in files:
            zf.write(old / path, path)
    out = tmp_path / "keys.tsv"
    assert verl_config_keys.main(["1.0=" + str(new), f"0.0.1={wheel}", "-o", str(out)]) == 0
    rows = [line.split("\t") for line in out.read_text().splitlines() if not line.startswith(("#", "key\t"))]
    assert rows == [
        ["async_training.staleness_threshold", "0.1", "fully_async_ppo_trainer", "1.0"],
        ["data.keys", '["a", "b"]', "ppo_trainer", "1.0"],
        ["trainer.gone", "true", "ppo_trainer", "0.0.1"],
        ["trainer.lr", "1e-06", "ppo_trainer,ppo_megatron_trainer", "1.0,0.0.1"],
        ["trainer.tp", "2", "ppo_megatron_trainer", "1.0"],
        ["trainer.v1.mode", '"sync"', "ppo_trainer", "1.0"],
        ["trainer.v1.sync", "{}", "ppo_trainer", "1.0"]]
    with pytest.raises(SystemExit, match="has no verl/trainer/config/_generated_ppo_trainer.yaml"):
        verl_config_keys.main(["x=" + str(tmp_path)])


def test_the_committed_table_has_the_columns_the_doc_reads():
    from fully_async.verl.compat import read_tsv, read_versions

    versions = read_versions(gen_verl_compat.TSV)
    assert [k for k, _ in read_tsv(gen_verl_compat.TSV)] == sorted(versions)
    assert {v for vs in versions.values() for v in vs} == {gen_verl_compat.NEWEST, "b178a3cd"}
