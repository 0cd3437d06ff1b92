"""Checkpoint folders, retention, backend state round trip, rollouter snapshot/restore."""
import os

import pytest
import torch
from omegaconf import OmegaConf

from fully_async import checkpoint as ck
from fully_async.hydra_setup import load_config


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
    from fully_async.backends.torch_backend import TorchBackend
    from fully_async.batch import build_batch
    from fully_async.device import CPU
    from fully_async.train_step import prepare_batch
    from tests_helpers import tiny_samples

    cfg = load_config(["actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    a = TorchBackend(cfg, CPU, 10)
    batch = build_batch(tiny_samples())
    prepare_batch(a, cfg, batch, {})
    a.train_step(batch, 1)
    a.save(str(tmp_path))
    b = TorchBackend(cfg, CPU, 10)
    b.load(str(tmp_path))
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), name
    # the next update is identical too (optimizer moments and scheduler restored)
    batch2 = build_batch(tiny_samples(seed=1))
    prepare_batch(a, cfg, batch2, {})
    ma = a.train_step(batch2, 1)
    mb = b.train_step(batch2, 1)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"])
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters()))


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeQueue:
    """The GroupQueue class behind `.method.remote(...)` calls, without Ray."""

    def __init__(self):
        from fully_async.queue import GroupQueue
        self.q = GroupQueue()

    def __getattr__(self, name):
        return _Remote(getattr(self.q, name))


def test_rollouter_snapshot_restores_partial_responses(monkeypatch):
    import fully_async.rollouter as ro
    from fully_async.prepare import prepare

    monkeypatch.setattr(ro, "ray_get", lambda x: x)
    cfg = load_config(["actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.total_training_steps=2", "data.val_files=null"])
    prep = prepare(cfg)
    q1 = FakeQueue()
    r1 = ro.Rollouter(prep.cfg_dict, q1, prep.train, [], prep.eos_token_ids, prep.pad_token_id)
    r1.scheduler.admit()
    r1.scheduler.step()  # one engine step: every response holds exactly one token
    snap = r1._snapshot()
    partial = {p.sample_id: list(p.token_ids) for p in snap["pending"]}
    admitted = r1.scheduler.staleness.state.admitted
    assert len(partial) == 2 * admitted and all(len(t) == 1 for t in partial.values())
    assert snap["stream"]["emitted"] == r1.scheduler.stream.num_emitted == admitted

    q2 = FakeQueue()
    r2 = ro.Rollouter(prep.cfg_dict, q2, prep.train, [], prep.eos_token_ids, prep.pad_token_id, resume_state=snap)
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


def test_export_hf_round_trip(tmp_path):
    import subprocess
    import sys

    from fully_async.backends.torch_backend import TorchBackend
    from fully_async.device import CPU
    from fully_async.trainer import save_checkpoint

    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ck"])
    backend = TorchBackend(cfg, CPU, 10)
    path = save_checkpoint(backend, cfg, 3, 3, ["a"], {"stream": {}})
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "scripts/export_hf.py", path, str(out)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert AutoTokenizer.from_pretrained(str(out)).decode([5]) == \
        AutoTokenizer.from_pretrained(OmegaConf.select(cfg, "actor_rollout_ref.model.path")).decode([5])
    for (n, p), (_, q) in zip(model.named_parameters(), backend.model.named_parameters()):
        assert torch.equal(p, q), n
