"""multi_job.*: off by default, and every mistake is named before Ray or the data are touched."""
import pytest

from fully_async.core.config import ConfigError
from fully_async.core.config_checks import validate
from fully_async.run.hydra_setup import load_config


def check(*overrides, env=None, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
    validate(load_config(list(overrides)))


def test_off_by_default_needs_nothing(monkeypatch):
    check(monkeypatch=monkeypatch)          # no pool: no Ray address needed, async mode fine
    assert load_config([]).multi_job.pool is None


@pytest.mark.parametrize("overrides, env, key, text", [
    (["mode=sync", "multi_job.pool=p"], {}, "multi_job.ray_address", "RAY_ADDRESS=<host:port>"),
    # async: the trainer's and the rollout side's devices must exist in the pool
    (["multi_job.pool=p"], {"RAY_ADDRESS": "h:1"}, "multi_job.devices", r"trainer \(1\) and rollout \(1\) devices "
     "do not fit"),
    (["multi_job.pool=p", "multi_job.devices=2", "multi_job.job_devices=[1]", "trainer.n_gpus_per_node=1",
      "rollout.n_gpus_per_node=2"], {"RAY_ADDRESS": "h:1"}, "multi_job.devices", "do not fit"),  # default rollout: 1, 2
    (["multi_job.pool=p", "multi_job.devices=2", "multi_job.rollout_devices=[2]"], {"RAY_ADDRESS": "h:1"},
     "multi_job.rollout_devices", r"\[2\] must be distinct ids in 0..1"),
    (["mode=sync", "multi_job.pool=p", "multi_job.rollout_devices=[0]"], {"RAY_ADDRESS": "h:1"},
     "multi_job.rollout_devices", "is for mode=async"),
    (["multi_job.pool=p", "multi_job.devices=2", "actor_rollout_ref.rollout.weight_sync=collective"],
     {"RAY_ADDRESS": "h:1"}, "actor_rollout_ref.rollout.weight_sync", "use object_store"),
    (["multi_job.pool=p", "multi_job.devices=2", "multi_job.min_slice_s=-1"], {"RAY_ADDRESS": "h:1"},
     "multi_job.min_slice_s", ">= 0"),
    (["mode=sync", "multi_job.pool=a/b"], {"RAY_ADDRESS": "h:1"}, "multi_job.pool", "letters, digits"),
    (["mode=sync", "multi_job.pool=p", "multi_job.devices=2", "multi_job.job_devices=[2]"], {"RAY_ADDRESS": "h:1"},
     "multi_job.job_devices", r"\[2\] must be distinct ids in 0..1"),
    (["mode=sync", "multi_job.pool=p", "multi_job.job_devices=[0,0]"], {"RAY_ADDRESS": "h:1"},
     "multi_job.job_devices", "distinct"),
    (["mode=sync", "multi_job.pool=p", "multi_job.max_lease_s=0"], {"RAY_ADDRESS": "h:1"}, "multi_job.max_lease_s",
     "> 0"),
    (["mode=sync", "multi_job.pool=p", "actor_rollout_ref.rollout.free_cache_engine=false"], {"RAY_ADDRESS": "h:1"},
     "actor_rollout_ref.rollout.free_cache_engine", "free the devices"),
    (["mode=sync", "multi_job.pool=p", "trainer.nnodes=2", "actor_rollout_ref.actor.strategy=fsdp2"],
     {"RAY_ADDRESS": "h:1"}, "trainer.nnodes", "one node"),
])
def test_bad_multi_job_input_names_the_key(monkeypatch, overrides, env, key, text):
    with pytest.raises(ConfigError, match=text) as info:
        check(*overrides, "trainer.device=cpu", env=env, monkeypatch=monkeypatch)
    assert info.value.key == key


@pytest.mark.parametrize("overrides", [
    ["multi_job.devices=2"],                                                       # trainer [0], rollout [1]
    ["multi_job.devices=1", "multi_job.job_devices=[0]", "multi_job.rollout_devices=[0]"],   # sides take turns
])
def test_async_jobs_may_share(monkeypatch, overrides):
    check("multi_job.pool=p", "trainer.device=cpu", *overrides, env={"RAY_ADDRESS": "h:1"}, monkeypatch=monkeypatch)


def test_async_devices_default_after_the_trainer():
    from fully_async.placement.device_pool import job_devices, rollout_devices

    cfg = load_config(["multi_job.pool=p", "multi_job.devices=4", "trainer.n_gpus_per_node=2",
                       "rollout.n_gpus_per_node=2"])
    assert job_devices(cfg) == [0, 1] and rollout_devices(cfg) == [2, 3]
    cfg = load_config(["mode=sync", "multi_job.pool=p", "multi_job.devices=2"])
    assert job_devices(cfg) == [0, 1]


def test_a_shared_pool_syncs_weights_through_the_object_store():
    from fully_async.device import get_device
    from fully_async.weight_sync import ObjectStoreWeightSync, build_weight_sync

    class Backend:
        pass

    cuda = get_device("cuda")
    assert isinstance(build_weight_sync(load_config(["multi_job.pool=p"]), Backend(), None, cuda),
                      ObjectStoreWeightSync)


def test_address_from_the_config_key_is_enough(monkeypatch):
    check("mode=sync", "multi_job.pool=p", "multi_job.ray_address=127.0.0.1:6379", "trainer.device=cpu",
          monkeypatch=monkeypatch)


def test_unreachable_cluster_fails_fast():
    from fully_async.placement.device_pool import check_reachable
    from fully_async.cluster.ray_utils import RunFailed

    with pytest.raises(RunFailed, match="no Ray cluster answers at 127.0.0.1:1"):
        check_reachable("127.0.0.1:1", timeout_s=2)
