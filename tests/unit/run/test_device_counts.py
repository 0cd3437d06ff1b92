"""Device counts are checked against what the CPU or the Ray cluster can give, for every device kind: a clear
error in seconds, never 64 processes started on 2 cores."""
import os
import subprocess
import sys
import time

import pytest

from fully_async.cluster.ray_utils import CPU_PROCESSES_PER_CORE, RunFailed, check_cpu_devices, check_resources
from fully_async.device import CPU


def test_cpu_devices_beyond_the_cores_are_refused_before_ray(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fully_async.main", "trainer.device=cpu", "trainer.n_gpus_per_node=64",
                        f"trainer.default_local_dir={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/hydra"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb")))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    cores = os.cpu_count()
    assert "asks for 65 CPU devices (trainer=64, rollout=1)" in out and f"this machine has {cores} cores" in out
    assert "trainer.n_gpus_per_node" in out and "Started a local Ray instance" not in out
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "ckpt" / "fully_async.lock")


def test_the_cpu_limit_in_numbers():
    check_cpu_devices({"trainer": 2, "rollout": 2}, cores=2)  # up to CPU_PROCESSES_PER_CORE per core
    with pytest.raises(RunFailed, match=r"asks for 5 CPU devices \(trainer=4, rollout=1\).*2 cores \(at most 4"):
        check_cpu_devices({"trainer": 4, "rollout": 1}, cores=2)
    assert CPU_PROCESSES_PER_CORE == 2


def test_a_joined_cluster_short_of_cpus_is_refused():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        check_resources(CPU, {"trainer": 1, "rollout": 1})
        with pytest.raises(RunFailed, match=r"asks for 3 CPU devices .*trainer=2, rollout=1.* has 2 CPU"):
            check_resources(CPU, {"trainer": 2, "rollout": 1})
    finally:
        ray.shutdown()


def test_the_doctor_fails_the_placement_row_as_the_run_does():
    r = subprocess.run([sys.executable, "-m", "fully_async.doctor", "--no-ray", "trainer.device=cpu",
                        "trainer.n_gpus_per_node=64"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and "FAIL  placement" in r.stdout and "asks for 65 CPU devices" in r.stdout, r.stdout
