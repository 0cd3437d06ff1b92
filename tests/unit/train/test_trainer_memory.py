"""What the trainer holds on its device, by kind (device_memory/tenant.py), and the step's
`memory/<job>/trainer/*_gib` metrics tagged like the engines' arenas."""
import torch

from fully_async.device_memory.tenant import held_bytes, optimizer_tensors
from fully_async.train.train_step import train_step
from test_torch_backend import backend_for, make_samples
from test_train_step import as_groups


class _Sharded:
    """A DTensor stand-in: counted by its local shard."""

    def __init__(self, local):
        self.local = local

    def to_local(self):
        return self.local


def test_each_storage_counts_once_in_the_first_group_and_only_on_the_device_type():
    a = torch.zeros(1000, dtype=torch.float32)          # 4,000 bytes
    view = a[10:20]                                     # same storage: not again
    b = torch.zeros(100, dtype=torch.bfloat16)          # 200 bytes
    emptied = torch.zeros(50)
    emptied.untyped_storage().resize_(0)                # an offloaded megatron buffer
    shard = _Sharded(torch.zeros(25, dtype=torch.float32))
    got = held_bytes({"weights": [a, None, emptied, shard], "grads": [view, b], "optimizer": [a]}, "cpu")
    assert got == {"weights": 4000 + 100, "grads": 200, "optimizer": 0}
    assert held_bytes({"weights": [a]}, "cuda") == {"weights": 0}     # on the host: not on the device


def test_the_step_reports_weights_grads_and_adam_moments(random_model_dir):
    cfg, backend = backend_for(random_model_dir, "trainer.experiment_name=mem")
    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    gib = {k.rsplit("/", 1)[1]: v * 2**30 for k, v in metrics.items() if k.startswith("memory/mem/trainer/")}
    assert set(gib) == {"weights_gib", "grads_gib", "optimizer_gib"}
    assert gib["weights_gib"] >= params and gib["grads_gib"] > 0
    moments = sum(t.numel() * t.element_size() for t in optimizer_tensors(backend.optimizer) if t.dim() > 0)
    assert moments > 0 and abs(gib["optimizer_gib"] - moments) <= 64 * len(backend.optimizer.state)   # + steps
    assert backend.memory_parts()["optimizer"] == round(gib["optimizer_gib"])
