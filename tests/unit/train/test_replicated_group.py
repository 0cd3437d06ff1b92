"""strategy=megatron's group (ReplicatedGroupBackend): every rank gets the whole batch for the critic's values and
the reward model's scores (tensor/pipeline peers need the same rows; each rank takes its own data-parallel rows
inside), and rank 0's answer is the group's; a float16 loss-scale overflow is not a bad step."""
import torch

from fully_async.train import group as group_mod
from fully_async.train.backends import StepResult
from fully_async.train.ppo_update import UpdateMetrics, record_step


class Rank:
    def __init__(self, rank):
        self.rank, self.seen = rank, []

    def compute_values(self, batch, num_micro=None):
        self.seen.append(("values", batch, num_micro))
        return torch.full((2, 3), float(self.rank))

    def compute_rm_scores(self, batch, num_micro=None):
        self.seen.append(("scores", batch, num_micro))
        return torch.full((2,), float(self.rank))


class Remote:
    """A worker handle: `.method.remote(...)` runs at once (ray_get is patched to return it)."""

    def __init__(self, rank):
        self.rank = rank

    def __getattr__(self, name):
        method = getattr(self.rank, name)
        return type("M", (), {"remote": staticmethod(lambda *a, **k: method(*a, **k))})()


def test_every_rank_gets_the_whole_batch_and_rank_0_answers(monkeypatch):
    monkeypatch.setattr(group_mod, "ray_get", lambda refs: list(refs))
    ranks = [Rank(r) for r in range(3)]
    group = object.__new__(group_mod.ReplicatedGroupBackend)
    group.local, group.workers = ranks[0], [Remote(r) for r in ranks[1:]]
    batch = object()
    assert torch.equal(group.compute_values(batch), torch.zeros(2, 3))
    assert torch.equal(group.compute_rm_scores(batch), torch.zeros(2))
    for r in ranks:
        assert [(kind, b is batch) for kind, b, _ in r.seen] == [("values", True), ("scores", True)]


class Counters:
    num_bad_steps = consecutive_bad_steps = 0


def test_a_loss_scale_overflow_is_not_a_bad_step():
    backend = Counters()
    backend.consecutive_bad_steps = 2
    overflow = StepResult(None, 1e-5, overflow=True)
    assert overflow.skipped
    record_step(backend, overflow)
    assert (backend.num_bad_steps, backend.consecutive_bad_steps) == (0, 2)     # neither counted nor reset
    record_step(backend, StepResult(None, 1e-5))
    assert (backend.num_bad_steps, backend.consecutive_bad_steps) == (1, 3)
    metrics = UpdateMetrics("actor")
    metrics.add({}, overflow)
    metrics.add({}, StepResult(0.5, 1e-5))
    out = metrics.result()
    assert out["actor/bad_steps"] == 0.0 and out["actor/loss_scale_overflows"] == 1.0 and out["actor/grad_norm"] == 0.5
