"""GroupQueue blocking and ordering (the plain class the Ray actor wraps)."""
import threading
import time

import pytest

from fully_async.actors.queue import GroupQueue
from fully_async.core.types import SampleGroup


def group(i: int) -> SampleGroup:
    return SampleGroup(uid=f"g{i}", prompt_index=i, epoch=0, samples=[], admitted_version=0)


def test_fifo_order_and_batch_size():
    q = GroupQueue()
    q.put_many([group(i) for i in range(5)])
    res = q.get_batch(3, timeout_s=0.1)
    assert [g.uid for g in res["groups"]] == ["g0", "g1", "g2"]
    assert not res["closed"]
    assert q.size() == 2


def test_get_blocks_until_enough_groups():
    q = GroupQueue()
    q.put_many([group(0)])
    got = {}

    def consumer():
        got["res"] = q.get_batch(2, timeout_s=5)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.2)
    assert "res" not in got                       # still waiting for the second group
    q.put_many([group(1)])
    t.join(2)
    assert [g.uid for g in got["res"]["groups"]] == ["g0", "g1"]


def test_timeout_removes_nothing():
    q = GroupQueue()
    q.put_many([group(0)])
    start = time.monotonic()
    res = q.get_batch(2, timeout_s=0.2)
    assert res["groups"] == [] and time.monotonic() - start >= 0.19
    assert q.size() == 1


def test_close_returns_remainder_then_closed_empty():
    q = GroupQueue()
    q.put_many([group(0)])
    q.close()
    res = q.get_batch(4, timeout_s=1)
    assert [g.uid for g in res["groups"]] == ["g0"] and res["closed"]
    assert q.get_batch(4)["groups"] == []
    with pytest.raises(RuntimeError, match="closed"):
        q.put_many([group(1)])


def test_queue_carries_groups_only():
    """Validation results go from the rollouter to the driver and the rollouter's metrics to the trainer:
    the queue holds sample groups and nothing else."""
    q = GroupQueue()
    assert not hasattr(q, "put_val_metrics")
    with pytest.raises(TypeError):
        q.put_many([group(0)], {"generated_samples": 2})
    q.put_many([group(0)])
    assert set(q.get_batch(1, timeout_s=0.01)) == {"groups", "closed"}
