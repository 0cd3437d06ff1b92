"""The placement objects (fully_async/placement/): for a config of each way of sharing devices, what `placement_of`
returns and what it answers -- device layout, each side's residency, responses kept in flight, trainer offload,
engine layout, weight-sync route -- and the planner's simulation keyed from the object, checked against schedules
worked out by hand (tests/unit/planner/test_placement_sim.py).  No Ray: a pool's lease client is given a fake pool."""
from types import SimpleNamespace

import pytest

from fully_async.core.config import ConfigError
from fully_async.device import get_device
from fully_async.placement import (ColocatedAsync, ElasticLending, MultiJobPool, Split, SyncTurns, placement_of)
from fully_async.placement import device_pool
from fully_async.placement.residency import Dedicated, Elastic, PoolLease, Turns
from fully_async.planner.pipeline_sim import StageCosts, Workload
from fully_async.run.hydra_setup import load_config

CPU = get_device("cpu")
CUDA = SimpleNamespace(name="cuda", is_accelerator=True)
NPU = SimpleNamespace(name="npu", is_accelerator=True)
NOTHING = (lambda ph, phase: {}, lambda ph, phase: {})
POOL = ["multi_job.pool=p", "multi_job.devices=4", "multi_job.job_name=j"]


@pytest.fixture(scope="module")
def cfgs():
    """One config per way of sharing devices (Hydra composes each once for the module)."""
    return {
        "split": load_config(["mode=async", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=4",
                              "actor_rollout_ref.rollout.name=vllm",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
        "sync": load_config(["mode=sync", "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=3"]),
        "sync_pool": load_config(["mode=sync", "trainer.n_gpus_per_node=2"] + POOL),
        "colocated": load_config(["mode=async", "async_training.placement=colocated", "trainer.n_gpus_per_node=2",
                                  "rollout.n_gpus_per_node=0"]),
        "colocated_kept": load_config(["mode=async", "async_training.placement=colocated",
                                       "trainer.n_gpus_per_node=2", "rollout.n_gpus_per_node=0",
                                       "actor_rollout_ref.rollout.free_cache_engine=false",
                                       "actor_rollout_ref.actor.fsdp_config.param_offload=true"]),
        "elastic": load_config(["mode=async", "async_training.placement=elastic", "trainer.n_gpus_per_node=2",
                                "rollout.n_gpus_per_node=1"]),
        "pool": load_config(["mode=async", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2"] + POOL),
    }


@pytest.fixture
def fake_pool(monkeypatch):
    """LeaseClient finds its pool actor by name: a stand-in, so a pool's residency is built without Ray."""
    monkeypatch.setattr(device_pool, "get_pool", lambda name: SimpleNamespace(name=name))


@pytest.mark.parametrize("name, cls", [("split", Split), ("sync", SyncTurns), ("sync_pool", SyncTurns),
                                       ("colocated", ColocatedAsync), ("elastic", ElasticLending),
                                       ("pool", MultiJobPool)])
def test_placement_of_picks_one_object_per_way_of_sharing(cfgs, name, cls):
    assert type(placement_of(cfgs[name])) is cls


def test_an_unknown_placement_names_the_key(cfgs):
    cfg = cfgs["split"]
    bad = SimpleNamespace(mode="async", async_training=SimpleNamespace(placement="ring"), multi_job=cfg.multi_job)
    with pytest.raises(ConfigError, match="async_training.placement") as err:
        placement_of(bad)
    assert "'split'" in str(err.value) and "'colocated'" in str(err.value)


def test_device_layouts(cfgs):
    split = placement_of(cfgs["split"]).layout()
    assert (split.trainer_devices, split.rollout_devices, split.engine_replicas, split.devices_per_replica,
            split.engine_devices) == (2, 4, 2, 2, 4)
    assert split.trainer_pool_devices is None and split.rollout_pool_devices is None
    colocated = placement_of(cfgs["colocated"]).layout()
    assert (colocated.rollout_devices, colocated.engine_replicas, colocated.devices_per_replica,
            colocated.engine_devices) == (0, 2, 1, 2)
    elastic = placement_of(cfgs["elastic"]).layout()   # the rollout device's engine and one beside each rank
    assert (elastic.engine_replicas, elastic.engine_devices) == (1, 3)
    sync = placement_of(cfgs["sync"]).layout()   # one engine per trainer rank, whatever rollout.* says
    assert (sync.rollout_devices, sync.engine_replicas, sync.devices_per_replica) == (0, 2, 1)
    pool = placement_of(cfgs["pool"]).layout()   # the trainer on pool device 0, the rollout side on the next two
    assert pool.trainer_pool_devices == (0,) and pool.rollout_pool_devices == (1, 2)
    sync_pool = placement_of(cfgs["sync_pool"]).layout()
    assert sync_pool.rollout_pool_devices is None and sync_pool.trainer_pool_devices == (0, 1, 2, 3)


def test_in_flight_and_offload_answers(cfgs):
    """free_cache_engine is read once, by the colocated placement; offload keys count only where turns exist."""
    answers = {name: (p.keeps_in_flight, p.trainer_offloads, p.trainer_hosts_engines, p.engines_load_asleep,
                      p.private_pool)
               for name, p in ((n, placement_of(c)) for n, c in cfgs.items())}
    assert answers == {"split": (False, False, False, False, False),
                       "sync": (False, False, False, False, False),
                       "sync_pool": (False, True, False, True, False),      # hf engines take weights asleep
                       "colocated": (False, False, False, False, True),     # engines freed; the trainer stays
                       "colocated_kept": (True, True, False, False, True),  # cache kept; param_offload asked
                       "elastic": (False, False, True, False, False),
                       "pool": (False, True, False, False, False)}


def test_residencies_without_a_pool(cfgs):
    split = placement_of(cfgs["split"])
    assert type(split.residency("rollout")) is Dedicated and type(split.residency("train")) is Dedicated
    elastic = placement_of(cfgs["elastic"])
    assert type(elastic.residency("rollout")) is Dedicated
    lent = elastic.residency("train", lend=lambda ph, phase: {"lent": 1.0}, reclaim=lambda ph, phase: {})
    assert type(lent) is Elastic and lent.wanted()   # not lent yet: the rollout pool can use the engines
    lent.give_back("waiting")
    assert lent.lent and lent.hold("train") == {"lent": 1.0}   # the lend's metrics ride with the reclaim
    with pytest.raises(ValueError, match="lend and reclaim"):
        elastic.residency("train")
    turns = placement_of(cfgs["sync"]).residency("sync", engines=NOTHING, trainer=NOTHING)
    assert type(turns) is Turns and type(turns.outer) is Dedicated and not turns.shared
    with pytest.raises(ValueError, match="'sync'"):
        placement_of(cfgs["sync"]).residency("train")
    with pytest.raises(ValueError, match="rollout"):
        split.residency("sync")


def test_residencies_on_a_pool_lease_their_devices(cfgs, fake_pool, caplog):
    pool = placement_of(cfgs["pool"])
    with caplog.at_level("INFO", logger="fully_async.placement.base"):
        roll, train = pool.residency("rollout"), pool.residency("train")
    said = [r.getMessage() for r in caplog.records]     # an async job's sides declare no need: they say so
    assert len(said) == 2 and "the rollout side of this async job leases its devices alone" in said[0]
    assert type(roll) is PoolLease and type(train) is PoolLease
    assert (roll.client.holder, roll.client.devices) == ("j/rollout", [1, 2])
    assert (train.client.holder, train.client.devices, train.client.poll_s) == ("j/train", [0], 0.5)
    turns = placement_of(cfgs["sync_pool"]).residency("sync", engines=NOTHING, trainer=NOTHING)
    assert turns.shared and (turns.outer.client.holder, turns.outer.client.poll_s) == ("j/colocated", 2.0)


def test_weight_sync_routes(cfgs):
    split, pool = placement_of(cfgs["split"]), placement_of(cfgs["pool"])
    assert (split.weight_sync_route(CUDA), split.weight_sync_route(CPU)) == ("collective", "object_store")
    assert pool.weight_sync_route(CUDA) == "object_store"   # the rollouter takes updates while it waits
    assert placement_of(cfgs["sync"]).weight_sync_route(CUDA) == "local"
    assert placement_of(cfgs["elastic"]).weight_sync_route(NPU) == "collective"
    colocated = cfgs["colocated"]
    # device IPC needs the config's device to be cuda (core/placement_checks.device_ipc_applies) and a cuda device
    ipc = load_config(["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0",
                       "trainer.device=cuda"])
    assert placement_of(ipc).weight_sync_route(CUDA) == "device_ipc"
    assert placement_of(colocated).weight_sync_route(CPU) == "object_store"
    named = load_config(["mode=async", "actor_rollout_ref.rollout.weight_sync=object_store"])
    assert placement_of(named).weight_sync_route(CUDA) == "object_store"   # a named route is kept


def test_replica_and_rank_options_pin_only_on_a_pool(cfgs):
    assert placement_of(cfgs["split"]).rank_options(CPU) is None
    assert placement_of(cfgs["split"]).replica_options(CPU) is None
    opts = placement_of(cfgs["pool"]).rank_options(CPU)
    assert opts is not None and opts(0) == CPU.ray_actor_options(1, num_cpus=1)   # on CPU pool devices are labels


# ---------------------------------------------------------------- the planner's simulation, keyed from the object
FLAT = StageCosts(decode_step_s=0.01, train_token_s=0.0, train_step_s=0.1)


def one_long_response(sample_id):
    """Prompt 0's response is 100 tokens, every other one 10."""
    return 100 if sample_id.startswith("e0-p0-") else 10


ONE_GROUP = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.max_num_seqs=8"]


def test_sync_and_colocated_simulations_from_their_configs_match_the_schedules_worked_by_hand():
    """As planner/test_placement_sim's hand-worked case: sync waits 1.0 s for p0's tail at step 1, colocated parks
    it and trains every 0.2 s."""
    work = Workload(n=1, prompt_len=0, length=one_long_response, steps=10)
    sync = placement_of(load_config(["mode=sync", "data.train_batch_size=1"] + ONE_GROUP)).simulate(FLAT, work)
    colocated = placement_of(load_config(
        ["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0",
         "actor_rollout_ref.actor.ppo_mini_batch_size=1", "async_training.require_batches=1",
         "async_training.staleness_threshold=1.0"] + ONE_GROUP)).simulate(FLAT, work)
    assert sync.mode == "sync" and colocated.mode == "colocated"
    assert sync.step_ends == pytest.approx([1.1 + 0.2 * k for k in range(10)])
    assert colocated.step_ends == pytest.approx([0.2 * (k + 1) for k in range(10)])


def test_split_elastic_and_pool_simulations(cfgs):
    work = Workload(n=2, prompt_len=4, length=lambda sample_id: 20, steps=4)
    costs = StageCosts(decode_step_s=0.01, train_token_s=0.001, train_step_s=0.05)
    split = placement_of(cfgs["split"]).simulate(costs, work)
    elastic = placement_of(cfgs["elastic"]).simulate(costs, work)
    assert split.mode == "async" and split.trainer_engines == 0 and split.steps == 4
    assert elastic.mode == "elastic" and elastic.trainer_engines == 2   # one engine beside each trainer rank
    # steps x groups per step (ppo_mini_batch_size 16 x require_batches 1) x n x (prompt + response) tokens
    assert split.tokens == elastic.tokens == 4 * 16 * 2 * (4 + 20)
    assert elastic.seconds <= split.seconds   # the trainer's engines generate while it waits
    assert placement_of(cfgs["pool"]).simulate(costs, work) is None     # its pace is the other jobs' too
