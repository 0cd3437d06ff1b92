"""Checkpoint folders, retention, backend state round trip, rollouter snapshot/restore."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from fully_async.core import checkpoint as ck
from fully_async.run.hydra_setup import load_config
from fake_engine import FakeQueue, Remote


class _T:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_atomic_save_marker_and_retention(tmp_path):
    root = str(tmp_path)
    for v in (2, 4, 6):
        ck.atomic_save(root, v, lambda d: ck.write_json(os.path.join(d, "trainer_state.json"), {"version": v}),
                       keep=2)
    assert ck.list_checkpoints(root) == [4, 6]
    assert open(os.path.join(root, ck.LATEST)).read() == "6"
    # an interrupted save leaves only a .tmp folder, which is never picked for resume
    os.makedirs(os.path.join(root, ".tmp_global_step_8"))
    os.makedirs(os.path.join(root, "global_step_10"))  # no trainer_state.json: incomplete
    cfg = _T(resume_mode="auto", default_local_dir=root, resume_from_path=None)
    assert ck.find_resume_path(cfg) == os.path.join(root, "global_step_6")
    assert ck.find_resume_path(_T(resume_mode="disable", default_local_dir=root)) is None
    assert ck.find_resume_path(_T(resume_mode="auto", default_local_dir=str(tmp_path / "none"))) is None


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    ck.atomic_save(root, 1, lambda d: ck.write_json(os.path.join(d, "trainer_state.json"), {}))

    def broken(d):
        raise OSError("disk full")

    with pytest.raises(OSError):
        ck.atomic_save(root, 2, broken)
    assert ck.list_checkpoints(root) == [1]


def test_backend_state_round_trip(tmp_path):
    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.core.batch import build_batch
    from fully_async.device import CPU
    from fully_async.train.ppo_update import ppo_update
    from fully_async.train.train_step import prepare_batch
    from tests_helpers import tiny_samples

    cfg = load_config(["actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    a = TorchBackend(cfg, CPU, 10)
    batch = build_batch(tiny_samples())
    prepare_batch(a, cfg, batch, {})
    ppo_update(a, cfg, batch, 1)
    a.save(str(tmp_path))
    b = TorchBackend(cfg, CPU, 10)
    b.load(str(tmp_path))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    # the next update is identical too (optimizer moments and scheduler restored)
    batch2 = build_batch(tiny_samples(seed=1))
    prepare_batch(a, cfg, batch2, {})
    ma = ppo_update(a, cfg, batch2, 1)
    mb = ppo_update(b, cfg, batch2, 1)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"])
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters()))


def test_rollouter_and_queue_parts_restore_partial_responses(monkeypatch, tmp_path):
    import fully_async.actors.rollouter as ro
    from fully_async.run.prepare import prepare
    from fully_async.actors.queue import GroupQueue

    monkeypatch.setattr(ro, "ray_get", lambda x: x)
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.total_training_steps=2", "data.val_files=null"])
    prep = prepare(cfg)
    q1 = FakeQueue()
    r1 = ro.Rollouter(prep.cfg, q1, prep.train, [], prep.eos_token_ids, prep.pad_token_id)
    r1.scheduler.admit()
    r1.scheduler.step()  # one engine step: every response holds exactly one token
    folder = str(tmp_path)
    r1.save_part(folder)
    assert r1.held and not r1.scheduler.in_flight()  # parked, and holding until release()
    q1.q.save_part(folder)
    snap = ck.read_state(os.path.join(folder, ck.ROLLOUT_STATE))
    partial = {p.sample_id: list(p.token_ids) for p in snap["pending"]}
    admitted = r1.scheduler.staleness.state.admitted
    assert len(partial) == 2 * admitted and all(len(t) == 1 for t in partial.values())
    assert snap["stream"]["emitted"] == r1.scheduler.stream.num_emitted == admitted
    assert ck.read_state(os.path.join(folder, ck.QUEUE_STATE)) == []
    r1.release()
    assert not r1.held and r1.scheduler.in_flight() == len(partial)

    q2 = FakeQueue()
    r2 = ro.Rollouter(prep.cfg, q2, prep.train, [], prep.eos_token_ids, prep.pad_token_id, resume_path=folder)
    assert r2.scheduler.stream.num_emitted == admitted and r2.scheduler.staleness.state == r1.scheduler.staleness.state
    r2.scheduler.resume()
    while r2.scheduler.pending:
        r2.scheduler.step()
    groups = q2.q.snapshot()
    samples = {s.sample_id: s for g in groups for s in g.samples}
    assert set(samples) == set(partial)
    for sid, first in partial.items():
        s = samples[sid]
        assert s.response_ids[:1] == first          # continued after the restored token
        assert len(s.versions) == len(s.response_ids) == len(s.rollout_log_probs)
        assert s.num_interruptions == 1
    # the queue's part: its groups come back in order in the queue that loads it
    q2.q.save_part(folder)
    assert [g.uid for g in GroupQueue(folder).snapshot()] == [g.uid for g in groups]


def test_queue_reads_checkpoints_that_kept_its_groups_in_the_rollout_part(tmp_path):
    from fully_async.actors.queue import GroupQueue
    from fully_async.core.types import SampleGroup

    old = [SampleGroup(uid="g0", prompt_index=0, epoch=0, samples=[], admitted_version=0)]
    ck.write_state(os.path.join(tmp_path, ck.ROLLOUT_STATE), {"stream": {}, "queue": old})
    assert [g.uid for g in GroupQueue(str(tmp_path)).snapshot()] == ["g0"]


def test_export_hf_round_trip(tmp_path):
    import subprocess
    import sys

    from fully_async.train.backends.torch_backend import TorchBackend
    from fully_async.device import CPU
    from fully_async.actors.trainer import save_trainer_part
    from fully_async.core.trainer_state import TrainerState

    state = TrainerState(total_steps=3, step=3, version=3, trained_sample_ids=["a"])

    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ck"])
    backend = TorchBackend(cfg, CPU, 10)
    path = ck.atomic_save(str(tmp_path / "ck"), 3, lambda d: save_trainer_part(backend, cfg, d, state))
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "scripts/export_hf.py", path, str(out)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    assert r.returncode == 0, r.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert AutoTokenizer.from_pretrained(str(out)).decode([5]) == \
        AutoTokenizer.from_pretrained(OmegaConf.select(cfg, "actor_rollout_ref.model.path")).decode([5])
    for (n, p), (_, q) in zip(model.named_parameters(), backend.model.named_parameters()):
        assert torch.equal(p, q), n


class FakeActor:
    """A handle whose `.method.remote(...)` runs `obj.method` at once, recording 'name.method' in `log`."""

    def __init__(self, name, obj, log):
        self._name, self._obj, self._log = name, obj, log

    def __getattr__(self, method):
        def run(*args):
            self._log.append(f"{self._name}.{method}")
            return getattr(self._obj, method)(*args)
        return Remote(run)


class Part:
    def __init__(self, filename, root, fail=False):
        self.filename, self.root, self.fail = filename, root, fail

    def save_part(self, folder):
        assert ck.list_checkpoints(self.root) in ([], [4])  # nothing of the one being written is visible
        if self.fail:
            ck.write_json(os.path.join(folder, "half.json"), {})
            raise OSError("disk full")
        ck.write_json(os.path.join(folder, self.filename), {"version": 4})

    def release(self):
        pass


def test_driver_checkpoint_every_part_in_one_folder_that_appears_at_once(tmp_path):
    from fully_async.run.launcher import take_checkpoint

    root = str(tmp_path)
    log = []
    actors = {"trainer": FakeActor("trainer", Part(ck.TRAINER_STATE, root), log),
              "rollouter": FakeActor("rollouter", Part(ck.ROLLOUT_STATE, root), log),
              "queue": FakeActor("queue", Part(ck.QUEUE_STATE, root), log)}
    cfg = _T(default_local_dir=root, max_ckpt_to_keep=None)
    path = take_checkpoint(cfg, actors, "trainer", 4, get=lambda x: x)
    # the rollouter holds from its part until the queue's is written (one cut), then the trainer writes
    assert log == ["rollouter.save_part", "queue.save_part", "rollouter.release", "trainer.save_part"]
    assert path == ck.step_dir(root, 4) and ck.list_checkpoints(root) == [4]
    assert sorted(os.listdir(path)) == sorted([ck.TRAINER_STATE, ck.ROLLOUT_STATE, ck.QUEUE_STATE, ck.MANIFEST])
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    assert open(os.path.join(root, ck.LATEST)).read() == "4"

    # a part that fails: the rollouter is released all the same, and checkpoint 6 never appears
    log.clear()
    actors["queue"] = FakeActor("queue", Part(ck.QUEUE_STATE, root, fail=True), log)
    with pytest.raises(OSError, match="disk full"):
        take_checkpoint(cfg, actors, "trainer", 6, get=lambda x: x)
    assert log == ["rollouter.save_part", "queue.save_part", "rollouter.release"]
    assert ck.list_checkpoints(root) == [4] and ck.find_resume_path(_T(resume_mode="auto", default_local_dir=root)) \
        == ck.step_dir(root, 4)
    # sync mode: the main actor is the only part
    log.clear()
    take_checkpoint(cfg, {"sync": FakeActor("sync", Part(ck.TRAINER_STATE, root), log)}, "sync", 8, get=lambda x: x)
    assert log == ["sync.save_part"] and ck.list_checkpoints(root) == [4, 8]


def test_a_folder_without_the_trainer_part_is_never_committed(tmp_path):
    root = str(tmp_path)
    tmp = ck.begin_checkpoint(root, 2)
    ck.write_state(os.path.join(tmp, ck.QUEUE_STATE), [])
    with pytest.raises(RuntimeError, match="not committed"):
        ck.commit_checkpoint(root, 2, tmp)
    assert ck.list_checkpoints(root) == [] and not os.path.exists(ck.step_dir(root, 2))


def test_main_actor_waits_for_the_driver_checkpoint():
    import threading

    from fully_async.actors.actor_setup import DriverFacing

    actor = DriverFacing()
    actor._init_driver_facing()
    assert actor.checkpoint_wanted() is None
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("path", actor._await_checkpoint(3)))
    waiter.start()
    for _ in range(200):
        if actor.checkpoint_wanted() == 3:
            break
        threading.Event().wait(0.01)
    assert actor.checkpoint_wanted() == 3 and "path" not in got   # run() waits until the driver is done
    actor.checkpoint_done("/ck/global_step_3")
    waiter.join(5)
    assert got["path"] == "/ck/global_step_3" and actor.checkpoint_wanted() is None


def test_checkpoints_pickled_before_the_layer_split_still_load(tmp_path):
    """A rollout_state.pkl written when PendingResponse lived in fully_async.partial loads after the move."""
    import pickle

    from fully_async.core.checkpoint import read_state
    from fully_async.core.partial import PendingResponse
    from fully_async.core.types import SamplingParams

    # protocol 0 names each class as a text line, so the old module path can be written in
    data = pickle.dumps({"p": PendingResponse("u", "s", [1, 2], SamplingParams(1.0, 1.0, -1, 4))}, protocol=0)
    data = data.replace(b"fully_async.core.partial", b"fully_async.partial").replace(
        b"fully_async.core.types", b"fully_async.types")
    assert b"fully_async.core" not in data
    path = tmp_path / "rollout_state.pkl"
    path.write_bytes(data)
    assert read_state(str(path))["p"].prompt_ids == [1, 2]
    assert read_state(str(tmp_path / ck.ROLLOUT_STATE))["p"].prompt_ids == [1, 2]  # the .json's older twin


def _write_ckpt(root, v, config=None, keep=None):
    def write(d):
        os.makedirs(os.path.join(d, "actor"))
        with open(os.path.join(d, "actor", "model.safetensors"), "wb") as fh:
            fh.write(os.urandom(4096))
        ck.write_state(os.path.join(d, ck.ROLLOUT_STATE), {"pos": v, "pad": list(range(500))})
        ck.write_json(os.path.join(d, ck.TRAINER_STATE), {"version": v})
    tmp = ck.begin_checkpoint(root, v)
    write(tmp)
    return ck.commit_checkpoint(root, v, tmp, config=config, keep=keep)


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def test_manifest_lists_every_file_and_is_verified(tmp_path):
    root = str(tmp_path)
    path = _write_ckpt(root, 2, config={"a": 1})
    manifest = ck.read_json(os.path.join(path, ck.MANIFEST))["files"]
    assert sorted(manifest) == sorted(["actor/model.safetensors", ck.ROLLOUT_STATE, ck.TRAINER_STATE, ck.CONFIG])
    assert manifest[ck.TRAINER_STATE]["size"] == os.path.getsize(os.path.join(path, ck.TRAINER_STATE))
    assert ck.verify_checkpoint(path) == []
    with open(os.path.join(path, "actor", "model.safetensors"), "r+b") as fh:  # same size, other bytes
        fh.write(b"\0" * 16)
    assert ck.verify_checkpoint(path) == ["actor/model.safetensors: sha256 differs from the manifest"]
    os.remove(os.path.join(path, ck.ROLLOUT_STATE))
    assert f"{ck.ROLLOUT_STATE}: missing" in ck.verify_checkpoint(path)


@pytest.mark.parametrize("bad", ["actor/model.safetensors", ck.ROLLOUT_STATE])
def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, bad):
    root = str(tmp_path)
    for v in (2, 4, 6):
        _write_ckpt(root, v)
    _truncate(os.path.join(root, "global_step_6", bad))
    cfg = _T(resume_mode="auto", default_local_dir=root, resume_from_path=None)
    with caplog.at_level("WARNING", logger="fully_async"):
        assert ck.find_resume_path(cfg) == ck.step_dir(root, 4)
    assert "global_step_6" in caplog.text and bad in caplog.text
    assert ck.list_checkpoints(root) == [2, 4] and os.path.isdir(os.path.join(root, "global_step_6.broken"))
    assert ck.find_resume_path(cfg) == ck.step_dir(root, 4)  # set aside: not checked again


def test_no_intact_checkpoint_fails_naming_the_files(tmp_path):
    root = str(tmp_path)
    for v in (2, 4):
        _write_ckpt(root, v)
    _truncate(os.path.join(root, "global_step_4", "actor", "model.safetensors"))
    _truncate(os.path.join(root, "global_step_2", ck.ROLLOUT_STATE))
    with pytest.raises(ck.CheckpointError) as err:
        ck.find_resume_path(_T(resume_mode="auto", default_local_dir=root, resume_from_path=None))
    msg = str(err.value)
    assert "global_step_4" in msg and "actor/model.safetensors" in msg
    assert "global_step_2" in msg and ck.ROLLOUT_STATE in msg
    # an explicit resume_from_path that is damaged fails too (no fallback: the user named it)
    _write_ckpt(root, 8)
    _truncate(os.path.join(root, "global_step_8", ck.TRAINER_STATE))
    with pytest.raises(ck.CheckpointError, match="trainer_state.json"):
        ck.find_resume_path(_T(resume_mode="resume_path", default_local_dir=root,
                               resume_from_path=ck.step_dir(root, 8)))


def test_checkpoint_without_manifest_is_not_used(tmp_path, caplog):
    """Nothing says the files of a folder without a manifest are complete: auto falls back to the previous
    complete checkpoint (setting it aside), resume_from_path refuses it naming the command that writes one."""
    root = str(tmp_path)
    older = _write_ckpt(root, 1)
    path = _write_ckpt(root, 2)
    os.remove(os.path.join(path, ck.MANIFEST))
    _truncate(os.path.join(path, ck.ROLLOUT_STATE))  # the case that failed late: a truncated file, no manifest
    with pytest.raises(ck.CheckpointError, match=f"{path} .*has no {ck.MANIFEST}.*write_manifest"):
        ck.find_resume_path(_T(resume_mode="resume_path", default_local_dir=root, resume_from_path=path))
    with caplog.at_level("WARNING", logger="fully_async"):
        assert ck.find_resume_path(_T(resume_mode="auto", default_local_dir=root, resume_from_path=None)) == older
    assert f"no {ck.MANIFEST}" in caplog.text and os.path.isdir(path + ".broken")
    os.remove(os.path.join(older, ck.MANIFEST))
    with pytest.raises(ck.CheckpointError, match="no intact checkpoint.*write_manifest"):
        ck.find_resume_path(_T(resume_mode="auto", default_local_dir=root, resume_from_path=None))


def test_state_files_round_trip_as_json_with_records_tuples_and_arrays(tmp_path):
    import numpy as np

    from fully_async.core.partial import PendingResponse
    from fully_async.core.types import PromptRecord, Sample, SampleGroup, SamplingParams

    rec = PromptRecord(3, [1, 2], "gsm8k", np.array(["7", "8"], dtype=object), {"split": "train", "k": np.int64(4)})
    sample = Sample("u", "u/0", [1], [2, 3], [-0.5, float("-inf")], [0, 1], reward=1.0,
                    reward_baseline=0.5, rm_input_ids=[4, 5])   # remax's baseline, a reward model's unscored tokens
    state = {"groups": {"u": (rec, 0, 2, [sample])}, "pending": [PendingResponse("u", "u/1", [1], SamplingParams())],
             "queue": [SampleGroup("u", 3, 0, [sample], 1)], 7: "int key", "__odd": 1}
    path = os.path.join(tmp_path, ck.ROLLOUT_STATE)
    ck.write_state(path, state)
    with open(path) as fh:
        assert fh.read(1) == "{"  # JSON, not a pickle
    got = ck.read_state(path)
    g_rec, epoch, version, done = got["groups"]["u"]
    assert (epoch, version) == (0, 2) and list(g_rec.ground_truth) == ["7", "8"] and g_rec.extra_info["k"] == 4
    assert done == [sample] and got["pending"][0].params == SamplingParams() and got["queue"][0].samples == [sample]
    assert got[7] == "int key" and got["__odd"] == 1
    with pytest.raises(TypeError, match="cannot be written"):
        ck.write_state(path, {"x": object()})


def test_a_planted_state_pickle_runs_no_code(tmp_path):
    """An older checkpoint's pickle is read by an unpickler that builds only the state's records."""
    import pickle

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "queue_state.pkl").write_bytes(pickle.dumps([Evil()]))
    with pytest.raises(ck.CheckpointError, match=r"queue_state.pkl .*names (posix|os)\.system.*refusing"):
        ck.read_state(str(tmp_path / ck.QUEUE_STATE))
    assert not marker.exists()


def test_optimizer_files_are_read_without_code(tmp_path):
    """torch.load(weights_only=True): a planted actor_optim.pt cannot run code either."""
    import pickle

    import torch

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Evil()}, str(tmp_path / "actor_optim.pt"), pickle_module=pickle)
    src = open(os.path.join(os.path.dirname(ck.__file__), "..", "train", "backends", "torch_backend.py")).read()
    # every torch.load of the backend (the actor's and the critic's optimizer files) reads weights only
    assert "weights_only=False" not in src and src.count("weights_only=True") == src.count("torch.load(") == 4
    with pytest.raises(pickle.UnpicklingError):
        torch.load(str(tmp_path / "actor_optim.pt"), weights_only=True)
    assert not marker.exists()


def test_resume_refuses_state_changing_config_keys_unless_allowed(tmp_path, caplog):
    from fully_async.core.config import typed_config
    from fully_async.run.launcher import config_dict

    old = config_dict(typed_config(load_config(["actor_rollout_ref.rollout.n=8"])))
    path = _write_ckpt(str(tmp_path), 2, config=old)
    same = config_dict(typed_config(load_config(["actor_rollout_ref.rollout.n=8", "trainer.total_training_steps=99",
                                                 "trainer.save_freq=3", "trainer.logger=[console,tensorboard]"])))
    ck.check_resume_config(path, same)  # keys that do not alter saved state change freely
    new = config_dict(typed_config(load_config(["actor_rollout_ref.rollout.n=4", "data.max_response_length=64"])))
    with pytest.raises(ck.CheckpointError) as err:
        ck.check_resume_config(path, new)
    msg = str(err.value)
    assert "actor_rollout_ref.rollout.n: 8 -> 4" in msg
    assert f"data.max_response_length: {old['data']['max_response_length']} -> 64" in msg
    assert "trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n,data.max_response_length]" in msg
    with pytest.raises(ck.CheckpointError, match="max_response_length") as err:
        ck.check_resume_config(path, new, ["actor_rollout_ref.rollout.n"])
    assert "rollout.n" not in str(err.value)
    with caplog.at_level("WARNING", logger="fully_async"):
        ck.check_resume_config(path, new, ["actor_rollout_ref.rollout.n", "data.max_response_length"])
    assert "actor_rollout_ref.rollout.n: 8 -> 4" in caplog.text


def test_resume_compares_the_backend_fsdp_selects(tmp_path):
    """A checkpoint written under strategy=torch resumes under verl's default fsdp on one device, not on two."""
    from fully_async.core.config import typed_config
    from fully_async.run.launcher import config_dict

    old = config_dict(typed_config(load_config(["actor_rollout_ref.actor.strategy=torch"])))
    path = _write_ckpt(str(tmp_path), 2, config=old)
    ck.check_resume_config(path, config_dict(typed_config(load_config(["actor_rollout_ref.actor.strategy=fsdp"]))))
    two = config_dict(typed_config(load_config(["actor_rollout_ref.actor.strategy=fsdp", "trainer.n_gpus_per_node=2"])))
    with pytest.raises(ck.CheckpointError, match="actor_rollout_ref.actor.strategy: 'torch' -> 'fsdp2'"):
        ck.check_resume_config(path, two, ["trainer.n_gpus_per_node"])


def test_a_plain_torch_checkpoint_names_the_strategy_that_reads_it(tmp_path):
    """One bf16 device: verl's fsdp wrote plain-torch checkpoints (actor_optim.pt) before it kept float32 masters
    there; resuming one under the fsdp2 it resolves to now is refused naming strategy=torch, which resumes it."""
    from fully_async.core.config import typed_config
    from fully_async.run.launcher import config_dict

    bf16 = ["actor_rollout_ref.actor.dtype=bfloat16"]
    path = _write_ckpt(str(tmp_path), 2, config=config_dict(typed_config(load_config(bf16))))
    open(os.path.join(path, "actor_optim.pt"), "wb").close()
    with pytest.raises(ck.CheckpointError, match=r"plain torch backend.*actor_rollout_ref.actor.strategy=torch"):
        ck.check_resume_config(path, config_dict(typed_config(load_config(bf16))))
    torch_cfg = config_dict(typed_config(load_config(bf16 + ["actor_rollout_ref.actor.strategy=torch"])))
    ck.check_resume_config(path, torch_cfg, ["actor_rollout_ref.actor.strategy"])
    os.remove(os.path.join(path, "actor_optim.pt"))
    os.makedirs(os.path.join(path, "fsdp"))
    ck.check_resume_config(path, config_dict(typed_config(load_config(bf16))))   # fsdp2 shards: read as written
    with pytest.raises(ck.CheckpointError, match=r"fsdp2 shards.*strategy=fsdp2"):
        ck.check_resume_config(path, torch_cfg, ["actor_rollout_ref.actor.strategy"])


def test_resume_allow_config_change_names_checked_keys():
    from fully_async.core.config import ConfigError
    from fully_async.core.config_checks import validate

    validate(load_config(["trainer.resume_allow_config_change=[actor_rollout_ref.rollout.n]"]))
    with pytest.raises(ConfigError, match="trainer.resume_allow_config_change.*trainer.save_freq"):
        validate(load_config(["trainer.resume_allow_config_change=[trainer.save_freq]"]))


def test_resuming_from_an_older_step_retires_the_abandoned_timeline(tmp_path):
    """The issue's scenario: global_step_1..3 present, resume from global_step_1 with save_freq=1 and
    max_ckpt_to_keep=1 for 2 steps.  The new global_step_2 survives, the old 2 and 3 are moved aside (not
    deleted), the marker names the new step 2, and the next auto resume continues the new timeline."""
    root = str(tmp_path)
    for v in (1, 2, 3):
        _write_ckpt(root, v)
    old_2 = ck.read_json(os.path.join(ck.step_dir(root, 2), ck.MANIFEST))
    aside = ck.retire_abandoned(root, ck.checkpoint_version(ck.step_dir(root, 1)))
    assert ck.list_checkpoints(root) == [1] and open(os.path.join(root, ck.LATEST)).read() == "1"
    assert sorted(os.listdir(aside)) == ["global_step_2", "global_step_3"]
    new_2 = _write_ckpt(root, 2, keep=1)
    assert ck.list_checkpoints(root) == [2] and open(os.path.join(root, ck.LATEST)).read() == "2"
    assert ck.read_json(os.path.join(new_2, ck.MANIFEST)) != old_2  # the new timeline's step 2, not the old one
    assert ck.find_resume_path(_T(resume_mode="auto", default_local_dir=root, resume_from_path=None)) == new_2
    assert ck.retire_abandoned(root, 2) is None  # nothing newer: nothing moved


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    root = str(tmp_path)
    for v in (1, 2, 5):
        _write_ckpt(root, v)
    _write_ckpt(root, 3, keep=2)  # a newer folder (5) is left alone; 3 and the newest older one (2) stay
    assert ck.list_checkpoints(root) == [2, 3, 5] and open(os.path.join(root, ck.LATEST)).read() == "3"


def test_a_fresh_start_moves_every_old_checkpoint_aside(tmp_path):
    root = str(tmp_path)
    _write_ckpt(root, 4)
    aside = ck.retire_abandoned(root, 0)
    assert ck.list_checkpoints(root) == [] and not os.path.exists(os.path.join(root, ck.LATEST))
    assert os.listdir(aside) == ["global_step_4"] and aside.endswith("abandoned_after_0")


def test_a_manifest_is_signed_and_an_altered_or_unsigned_one_is_not_trusted(tmp_path, monkeypatch):
    """Someone who can write into the checkpoint folder but cannot read the key cannot make a resume load altered
    files: rebuilding the checksums is not enough."""
    monkeypatch.setenv(ck.KEY_ENV, str(tmp_path / "keys" / "k"))
    path = str(tmp_path / "c")
    os.makedirs(path)
    with open(os.path.join(path, ck.TRAINER_STATE), "w") as fh:
        fh.write('{"step": 1}')
    manifest = ck.write_manifest(path)
    assert oct(os.stat(tmp_path / "keys" / "k").st_mode & 0o777) == "0o600"
    assert manifest["signature"]["key_id"] and ck.verify_checkpoint(path) == []
    # a planted file with its checksum rebuilt in the manifest (the hash is public): the signature fails
    with open(os.path.join(path, ck.TRAINER_STATE), "w") as fh:
        fh.write('{"step": 9}')
    forged = ck.read_json(os.path.join(path, ck.MANIFEST))
    forged["files"][ck.TRAINER_STATE] = {"size": os.path.getsize(os.path.join(path, ck.TRAINER_STATE)),
                                         "sha256": ck.sha256_file(os.path.join(path, ck.TRAINER_STATE))}
    with open(os.path.join(path, ck.MANIFEST), "w") as fh:
        json.dump(forged, fh)
    [problem] = ck.verify_checkpoint(path)
    assert "signature does not verify" in problem and "write_manifest" in problem
    del forged["signature"]
    with open(os.path.join(path, ck.MANIFEST), "w") as fh:
        json.dump(forged, fh)
    assert "is not signed" in ck.verify_checkpoint(path)[0]
    ck.write_manifest(path)   # the owner trusts the files: re-signed
    assert ck.verify_checkpoint(path) == []
    monkeypatch.setenv(ck.KEY_ENV, str(tmp_path / "elsewhere"))   # another machine, no key: named
    assert f"no key at {tmp_path / 'elsewhere'}" in ck.verify_checkpoint(path)[0]
