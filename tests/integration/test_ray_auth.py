"""The local Ray a run starts counts the run's accelerator kind, and answers only requests that carry the run's own
token: Ray 2.60 binds its servers to every interface whatever address it advertises (no option binds them to the
loopback), so the token is what keeps other users and machines out (real Ray, a driver process of its own)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DRIVER = r"""
import json, os, sys
import ray
from fully_async.cluster.ray_utils import start_ray
assert start_ray(num_cpus_needed=1)
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "token_path": os.environ.get("RAY_AUTH_TOKEN_PATH"),
                  "workers_see": ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_TOKEN_PATH")).remote())}),
      flush=True)
sys.stdin.readline()             # the test's joins happen here
ray.shutdown()
"""
JOIN = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED', ray.cluster_resources().get('CPU'))"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return {**env, **extra}


def joins(gcs, *envs, timeout=60):
    """Whether a driver joins the Ray at `gcs` under each of `envs`: the drivers run side by side (a refused one
    waits on its connection; one after the other they cost their waits in sum)."""
    procs = [subprocess.Popen([sys.executable, "-c", JOIN, gcs], env=clean_env(**env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in envs]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode == 0 and "JOINED" in out for p, out in zip(procs, outs)]


def test_a_local_ray_answers_only_this_runs_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=clean_env(HOME=str(home)))
    try:
        info = json.loads(driver.stdout.readline())
        path = info["token_path"]
        # a fresh token of its own, readable by this user only, inside the 0700 root; every Ray process reads it
        assert path and os.path.basename(path).startswith("ray_auth_token.")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        assert info["workers_see"] == path
        assert not (home / ".ray" / "auth_token").exists()     # Ray's shared default token is not written
        # nobody without the token gets in: no authentication, a wrong token, another run's token; the right token
        # does (the test's own control: the refusals are the token's doing)
        assert joins(info["gcs"], dict(RAY_AUTH_MODE="disabled", HOME=str(home)),
                     dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, HOME=str(home)),
                     dict(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path, HOME=str(home))) == [False, False, True]
    finally:
        driver.stdin.write("\n")
        driver.stdin.flush()
        driver.wait(timeout=60)
    assert driver.returncode == 0
    assert not os.path.exists(path)          # removed with the driver


def test_a_users_disabled_authentication_is_warned(caplog):
    from fully_async.cluster import ray_utils

    old = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        with caplog.at_level("WARNING"):
            assert ray_utils.private_auth_token() is None
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert "every network interface" in caplog.text and "RAY_AUTH_MODE=disabled" in caplog.text


COUNT = ("import sys, ray; from fully_async.cluster.ray_utils import start_ray; start_ray(2, accelerator=sys.argv[1]); "
         "print({k: v for k, v in ray.cluster_resources().items() if k in ('GPU', 'NPU')})")


def test_a_local_ray_counts_the_runs_accelerator_kind():
    """Ray keeps one accelerator family per node, the first of a set whose order changes per process: on a node
    with NPUs (the stand-in's two, through its `acl`) and GPUs, a run on one kind must not get the other.  Here
    the node has NPUs only: an NPU run counts them, a GPU run's local Ray is told the node has none.  The two runs
    are processes of their own, side by side (each starts a Ray: one after the other they cost two start-ups)."""
    import ast

    standin = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "npu_standin")
    env = clean_env(FA_NPU_STANDIN_DEVICES="2", PYTHONPATH=os.pathsep.join(
        p for p in (standin, os.environ.get("PYTHONPATH")) if p))
    runs = {kind: subprocess.Popen([sys.executable, "-c", COUNT, kind], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for kind in ("NPU", "GPU")}
    try:
        outs = {kind: p.communicate(timeout=120) for kind, p in runs.items()}
    finally:
        for p in runs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for kind, expected in (("NPU", {"NPU": 2.0}), ("GPU", {})):
        out, err = outs[kind]
        assert runs[kind].returncode == 0, (kind, err[-2000:])
        assert ast.literal_eval(out.strip().splitlines()[-1]) == expected, kind


def test_the_other_accelerator_families_are_zeroed():
    from fully_async.cluster.ray_utils import accelerator_counts

    assert accelerator_counts("") == {}
    assert accelerator_counts("GPU") == {"resources": {"NPU": 0}}
    assert accelerator_counts("NPU") == {"num_gpus": 0}
