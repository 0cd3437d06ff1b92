"""CollectiveWeightSync sizes its group by the rollouter's receiver count: an engine that receives in
its own processes (one rank per vLLM worker) makes the world 1 + workers, and every rank gets every bucket."""
import os
import threading

import pytest
import torch

from fully_async.device import CPU
from fully_async.rollout.engines.base import receives_weights_directly
from fully_async.rollout.engines.hf_engine import HFEngine
from fully_async.weight_sync.collective import CollectiveWeightSync, receive


class ThreeWorkerRollouter:
    """A Ray actor shaped like the rollouter whose engine has three receiving workers (threads here)."""

    def __init__(self):
        self.groups, self.received = [], []

    def weight_receivers(self) -> int:
        return 3

    def init_weight_group(self, addr: str, port: int, first_rank: int, world: int) -> list[int]:
        self.world = world
        ranks = list(range(first_rank, first_rank + 3))
        self.groups = [None] * 3

        def join(i: int) -> None:
            self.groups[i] = CPU.new_group(addr, port, ranks[i], world, timeout_s=60)

        _run_threads(join)
        return ranks

    def receive_weights(self, metas: list, buckets: list, dtype: str, version: int) -> dict:
        self.received = [{} for _ in range(3)]

        def worker(i: int) -> None:
            for name, t in receive(self.groups[i], metas, buckets, getattr(torch, dtype.split(".")[-1]),
                                   torch.device("cpu")):
                self.received[i][name] = t.clone()

        _run_threads(worker)
        return {"pause": 0.0, "load": 0.0, "resume": 0.0}

    def state(self) -> tuple[int, list[dict]]:
        return self.world, self.received


def _run_threads(fn) -> None:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


class Params:
    """The two TrainBackend methods CollectiveWeightSync uses."""

    def __init__(self, named: dict):
        self.named = named

    def param_shapes(self) -> list:
        return [(n, tuple(t.shape)) for n, t in self.named.items()]

    def stream_full_parameters(self, consumer):
        return consumer(iter(self.named.items()))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    here = os.path.dirname(os.path.abspath(__file__))  # the actor class below is imported from this module
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_world_is_trainer_plus_every_receiver_and_all_get_each_bucket(ray_local):
    import ray

    torch.manual_seed(0)
    named = {"a.weight": torch.randn(64, 32), "b.bias": torch.randn(7), "c.weight": torch.randn(3, 5, 2)}
    rollouter = ray.remote(ThreeWorkerRollouter).options(max_concurrency=4).remote()
    sync = CollectiveWeightSync(Params(named), rollouter, CPU, bucket_mb=0.002, dtype=torch.bfloat16)
    for version in (1, 2):
        named["b.bias"] += version
        metrics = sync.push(version)
        world, received = ray.get(rollouter.state.remote())
        assert world == 4 and metrics["perf/param_sync_buckets"] == len(sync.buckets) > 1
        assert len(received) == 3
        for got in received:
            assert set(got) == set(named)
            assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in named.items())


def test_embedded_engine_leaves_receiving_to_the_rollouter(random_model_dir):
    assert not receives_weights_directly(HFEngine(random_model_dir, CPU))   # the rollouter is its one receiver
