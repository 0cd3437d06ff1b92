"""Writes never follow a link planted in the run's folders (core/safe_write.py and every writer routed through it),
and the checkpoint manifest's format is checked and signed."""
import errno
import json
import logging
import os

import pytest

from fully_async.core import checkpoint as ck
from fully_async.core import safe_write
from fully_async.core.safe_write import PlantedLinkError, atomic_open


@pytest.fixture(autouse=True)
def key(tmp_path, monkeypatch):
    monkeypatch.setenv(ck.KEY_ENV, str(tmp_path / "keys" / "checkpoint.key"))


def outside(tmp_path, text="precious"):
    victim = tmp_path / "outside.txt"
    victim.write_text(text)
    return victim


def plant(link, target):
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(target, link)


def test_latest_marker_temp_link_is_not_followed(tmp_path, caplog):
    """The issue's reproduction: ck/latest_checkpointed_iteration.txt.tmp -> a file outside; save_freq=1."""
    root, victim = tmp_path / "ck", outside(tmp_path)
    plant(str(root / (ck.LATEST + ".tmp")), str(victim))
    tmp = ck.begin_checkpoint(str(root), 1)
    ck.write_json(os.path.join(tmp, ck.TRAINER_STATE), {"step": 1, "version": 1, "trained_sample_ids": []})
    with caplog.at_level(logging.WARNING, logger="fully_async"):
        ck.commit_checkpoint(str(root), 1, tmp)
    assert victim.read_text() == "precious"
    assert (root / ck.LATEST).read_text() == "1" and not (root / ck.LATEST).is_symlink()
    assert not os.path.lexists(root / (ck.LATEST + ".tmp"))
    assert "planted" in caplog.text and str(root / (ck.LATEST + ".tmp")) in caplog.text
    assert ck.verify_checkpoint(str(root / "global_step_1")) == []


def test_a_link_at_the_final_name_is_refused_naming_it(tmp_path):
    root, victim = tmp_path / "ck", outside(tmp_path)
    plant(str(root / ck.LATEST), str(victim))
    tmp = ck.begin_checkpoint(str(root), 2)
    ck.write_json(os.path.join(tmp, ck.TRAINER_STATE), {"step": 2, "version": 2, "trained_sample_ids": []})
    with pytest.raises(PlantedLinkError) as err:
        ck.commit_checkpoint(str(root), 2, tmp)
    assert str(root / ck.LATEST) in str(err.value) and str(victim) in str(err.value)
    assert victim.read_text() == "precious" and (root / ck.LATEST).is_symlink()


def test_signing_key_temp_link_cannot_leak_the_key(tmp_path):
    victim = outside(tmp_path, "")
    plant(str(tmp_path / "keys" / "checkpoint.key.tmp"), str(victim))
    made = ck.signing_key(create=True)
    assert victim.read_text() == "" and len(made) == 32
    assert oct(os.stat(tmp_path / "keys" / "checkpoint.key").st_mode & 0o777) == "0o600"


def test_retiring_a_timeline_rewrites_the_marker_without_following_a_link(tmp_path):
    root, victim = tmp_path / "ck", outside(tmp_path)
    for v in (1, 2):
        ck.atomic_save(str(root), v, lambda d, v=v: ck.write_json(os.path.join(d, ck.TRAINER_STATE), {"version": v}))
    plant(str(root / (ck.LATEST + ".tmp")), str(victim))
    ck.retire_abandoned(str(root), 1)
    assert victim.read_text() == "precious" and (root / ck.LATEST).read_text() == "1"


def _writers(tmp_path):
    """(path it writes, the call) for every writer of the package that takes a path or a folder."""
    from types import SimpleNamespace

    from fully_async.core.state_files import write_state
    from fully_async.telemetry import generations, timeline
    from fully_async.telemetry.metrics import MetricLogger

    tb = tmp_path / "tb"
    tb.mkdir()
    sink = MetricLogger.__new__(MetricLogger)
    sink.log_dir = str(tb)
    span = SimpleNamespace(job="a", track="d0", name="x", start=0.0, end=1.0, args={})
    return [
        (tmp_path / "state.json", lambda p: write_state(str(p), {"stream": (1, 2)})),
        (tmp_path / "trainer_state.json", lambda p: ck.write_json(str(p), {"step": 1})),
        (tmp_path / "manifest.json", lambda p: ck.write_manifest(str(p.parent))),
        (tb / "summary.json", lambda p: sink.write_json(p.name, {"steps": 3})),
        (tmp_path / "gens" / "3.jsonl", lambda p: generations.dump(str(p.parent), 3, [{"input": "q"}])),
        (tmp_path / "trace.json", lambda p: timeline.write_trace(str(p), [])),
        (tmp_path / "pool.json", lambda p: timeline.write_pool_trace(str(p), [span])),
        (tmp_path / "optim.pt", lambda p: safe_write.torch_save({"a": 1}, str(p))),
        (tmp_path / "adapter" / "adapter_config.json", lambda p: _save_adapter(p.parent)),
    ]


def _save_adapter(folder):
    import torch

    from fully_async.train.backends.lora import save_adapter

    save_adapter(str(folder), {"x.lora_A": torch.zeros(1, 1)}, 1, 1.0, ["x"], "base")


@pytest.mark.parametrize("index", range(9))
def test_every_writer_removes_a_planted_temp_link_and_refuses_a_planted_final_link(tmp_path, index):
    path, write = _writers(tmp_path)[index]
    victim = outside(tmp_path)
    plant(str(path) + ".tmp", str(victim))
    write(path)
    assert victim.read_text() == "precious" and path.is_file() and not path.is_symlink()
    os.remove(path)
    os.symlink(victim, path)
    with pytest.raises(PlantedLinkError, match="symbolic link"):
        write(path)
    assert victim.read_text() == "precious"


def test_run_lock_link_is_removed_not_followed(tmp_path):
    from fully_async.run.run_lock import LOCK_NAME, acquire

    victim = outside(tmp_path, '{"pid": 1, "hostname": "elsewhere"}')
    plant(str(tmp_path / "run" / LOCK_NAME), str(victim))
    lock = acquire(str(tmp_path / "run"))
    assert not (tmp_path / "run" / LOCK_NAME).is_symlink()
    assert victim.read_text() == '{"pid": 1, "hostname": "elsewhere"}'
    lock.release()


def test_a_failed_write_leaves_neither_temporary_nor_file(tmp_path):
    path = tmp_path / "f.json"
    with pytest.raises(OSError, match="No space"):
        with atomic_open(str(path)) as fh:
            fh.write("partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(tmp_path) == []


def test_a_temporary_that_is_a_folder_is_an_error_not_a_write_through(tmp_path):
    (tmp_path / "f.json.tmp").mkdir()
    with pytest.raises(OSError):
        safe_write.write_text(str(tmp_path / "f.json"), "x")
    assert not (tmp_path / "f.json").exists()


# ----------------------------------------------------------------------------------- the manifest's format
def _checkpoint(tmp_path):
    folder = tmp_path / "global_step_1"
    folder.mkdir()
    ck.write_json(str(folder / ck.TRAINER_STATE), {"step": 1, "version": 1})
    ck.write_manifest(str(folder))
    return folder


def test_manifest_format_is_written_signed_and_checked(tmp_path):
    folder = _checkpoint(tmp_path)
    manifest = json.loads((folder / ck.MANIFEST).read_text())
    assert manifest["format"] == ck.MANIFEST_FORMAT == 2 and ck.verify_checkpoint(str(folder)) == []
    for fmt, says in ((1, "signature does not verify"), (3, "format 3"), ("2", "format '2'")):
        manifest["format"] = fmt
        (folder / ck.MANIFEST).write_text(json.dumps(manifest))
        problems = ck.verify_checkpoint(str(folder))
        assert len(problems) == 1 and says in problems[0], (fmt, problems)


def test_an_older_format_1_manifest_still_verifies(tmp_path):
    folder = _checkpoint(tmp_path)
    manifest = json.loads((folder / ck.MANIFEST).read_text())
    key = ck.signing_key(create=False)
    old = {"format": 1, "files": manifest["files"], "signature": ck._signature(key, manifest["files"], 1)}
    (folder / ck.MANIFEST).write_text(json.dumps(old))
    assert ck.verify_checkpoint(str(folder)) == []
