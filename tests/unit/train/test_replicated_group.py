"""strategy=megatron: its forward-only passes put each row's result in place; its group (ReplicatedGroupBackend)
gives every rank the whole batch for the critic's values and the reward model's scores (tensor/pipeline peers need
the same rows; each rank takes its own data-parallel rows inside), and rank 0's answer is the group's; a float16
loss-scale overflow is not a bad step."""
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


def test_a_megatron_forward_pass_puts_each_rows_result_in_place():
    """MegatronBackend.forward_rows (the log-probs, the critic's values, the reward model's scores): this rank's
    data-parallel rows in micro-batches through the schedule, each micro-batch's per-row results written to its rows
    (2-D results shorter than the batch padded with 0, 1-D ones as they are), then summed over the replicas."""
    from fully_async.core.batch import TrainBatch
    from fully_async.train.backends.megatron_backend import MegatronBackend

    backend = object.__new__(MegatronBackend)
    backend.torch_device = torch.device("cpu")
    backend._dp_rows = lambda batch: ([1, 3], 1.0)                  # this rank's rows of 4
    backend._sum_replicas = lambda t: t
    seen = []

    def schedule(model, mbs, fn, forward_only):
        seen.append([mb.input_ids[:, 0].tolist() for mb in mbs])
        return [fn(mb, None)[1] for mb in mbs]
    backend._schedule = schedule
    ids = torch.arange(4).unsqueeze(1).repeat(1, 5)                  # row r holds r everywhere
    batch = TrainBatch(ids, torch.ones(4, 5, dtype=torch.long), torch.ones(4, 5), torch.zeros(4, 5), torch.zeros(4),
                       ["a", "b", "c", "d"])
    model = torch.nn.Linear(1, 1)
    rows2d = backend.forward_rows(model, batch, 1, False, 0, lambda mb, _: (0, mb.input_ids[:, :3].float()), (4, 5))
    assert seen == [[[1], [3]]] and model.training                   # one row per micro-batch; the mode restored
    assert rows2d.tolist() == [[0] * 5, [1, 1, 1, 0, 0], [0] * 5, [3, 3, 3, 0, 0]]
    rows1d = backend.forward_rows(model, batch, None, False, 0, lambda mb, _: (0, mb.input_ids[:, 0].float()), (4,))
    assert rows1d.tolist() == [0, 1, 0, 3]
