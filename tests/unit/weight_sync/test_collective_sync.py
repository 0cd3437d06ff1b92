"""Bucketed broadcast weight sync over a stateless gloo group (two ranks as two threads)."""
import threading

import torch

from fully_async.cluster.network import free_port
from fully_async.device import CPU
from fully_async.weight_sync.collective import ParamMeta, plan_buckets, receive, send


def test_plan_buckets_respects_size_and_order():
    metas = [ParamMeta(f"p{i}", (n,), n) for i, n in enumerate([10, 10, 30, 5, 5, 100])]
    assert plan_buckets(metas, bucket_bytes=80, elem_bytes=4) == [[0, 1], [2], [3, 4], [5]]


def test_send_receive_round_trip_in_bf16_buckets():
    torch.manual_seed(0)
    params = {"a.weight": torch.randn(4, 3), "b.bias": torch.randn(5), "c.weight": torch.randn(2, 2, 2)}
    metas = [ParamMeta(n, tuple(t.shape), t.numel()) for n, t in params.items()]
    buckets = plan_buckets(metas, bucket_bytes=20, elem_bytes=2)
    assert len(buckets) > 1
    port = free_port()
    got, sent = {}, {}

    def rank0():
        pg = CPU.new_group("127.0.0.1", port, 0, 2, timeout_s=30)
        sent["bytes"] = send(pg, iter(params.items()), metas, buckets, torch.bfloat16)

    def rank1():
        pg = CPU.new_group("127.0.0.1", port, 1, 2, timeout_s=30)
        for name, t in receive(pg, metas, buckets, torch.bfloat16, torch.device("cpu")):
            got[name] = t.clone()

    threads = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sent["bytes"] == sum(t.numel() for t in params.values()) * 2
    for name, t in params.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == t.shape
        assert torch.equal(got[name], t.to(torch.bfloat16))
