"""scripts/bench_packing.py --count-ops: the operators a step dispatches, counted below autograd; --profile's
list of what took the time."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from bench_packing import count_ops, print_profile  # noqa: E402


def test_count_ops_counts_forward_and_backward_operators():
    w = torch.ones(3, requires_grad=True)

    def step():
        loss = (w * torch.full((3,), 2.0)).sum()
        loss.backward()

    counted = count_ops(step)
    by_op = counted["by_op"]
    assert by_op["mul"] >= 1 and by_op["sum"] == 1        # the forward's
    assert by_op["expand"] >= 1                              # sum's backward broadcasts the gradient
    assert counted["total"] == sum(by_op.values()) and list(by_op.values()) == sorted(by_op.values(), reverse=True)
    assert torch.equal(w.grad, torch.full((3,), 2.0))        # the step ran as it would have
    assert count_ops(lambda: None) == {"total": 0, "by_op": {}}


def test_profile_lists_the_operators_by_their_own_time(capsys):
    from fully_async.device import get_device

    a = torch.randn(256, 256)
    got = print_profile("tiny", lambda: [a @ a for _ in range(3)], get_device("cpu"), rows=4)
    top = got["top_by_own_time"]
    assert 0 < len(top) <= 4 and [t["own_ms"] for t in top] == sorted((t["own_ms"] for t in top), reverse=True)
    assert any(t["name"] == "aten::mm" and t["calls"] == 3 for t in top), top
    assert "aten::mm" in capsys.readouterr().out
