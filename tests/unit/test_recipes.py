"""Every recipe composes (`--cfg job`: Hydra prints the config the run would use, validation aside) with its
stated devices and mode, and its committed planner output (recipes/make_plans.sh) is what the planner says now.
The ~30 bash runs are CPU-bound subprocesses: the module starts the ones its selected tests need on every core at
once (`recipe_runs`), and each test reads its own."""
import functools
import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
RECIPES = sorted(os.path.basename(os.path.dirname(p))
                 for p in glob.glob(os.path.join(ROOT, "recipes", "*", "plan_npu_8.txt")))
SECTIONS = ("== memory per device", "== device plan", "== predicted throughput", "== recommendation", "== assumptions")


@functools.lru_cache(maxsize=None)
def python_shim():
    """A folder whose `python` is this interpreter (what the scripts call), written once: rewriting it while another
    run executes it would fail with 'Text file busy'."""
    shim = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"recipe_python_{os.getpid()}")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "python"), "w") as fh:
        fh.write(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    os.chmod(os.path.join(shim, "python"), 0o755)
    return shim


def run(script, *args, **env):
    full = dict(os.environ, PATH=python_shim() + os.pathsep + os.environ["PATH"], PYTHONPATH=ROOT, **env)
    return subprocess.run(["bash", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=full)


def plan_args(name, mode):
    model = next(line.split("$HOME/models/")[1].rstrip('}"\n') for line in open(os.path.join(ROOT, "recipes", name,
                                                                                              "async.sh"))
                 if line.startswith("MODEL_PATH="))
    return (f"recipes/{name}/{mode}.sh",), dict(ENTRY="fully_async.plan", DEVICE="npu", N_DEVICES="8",
                                                 MODEL_PATH=model, DATA_DIR="/nonexistent/data")


def cfg_args(name, mode, device, n):
    return (f"recipes/{name}/{mode}.sh", "--cfg", "job"), dict(DEVICE=device, N_DEVICES=str(n))


@pytest.fixture(scope="module")
def recipe_runs(request):
    """{key: CompletedProcess} for the selected tests of this module, run side by side on every core."""
    wanted = {}
    for item in request.session.items:
        if item.module is not request.module or not hasattr(item, "callspec"):
            continue
        p = item.callspec.params
        if item.originalname == "test_cfg_job_composes_with_the_stated_devices":
            wanted[("cfg", p["name"], p["mode"], p["device"], p["n"])] = cfg_args(p["name"], p["mode"], p["device"],
                                                                                 p["n"])
        elif item.originalname == "test_committed_plan_matches_the_planner":
            wanted[("plan", p["name"], p["mode"])] = plan_args(p["name"], p["mode"])
    python_shim()
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1)) as pool:
        futures = {key: pool.submit(run, *args, **env) for key, (args, env) in wanted.items()}
        return {key: f.result() for key, f in futures.items()}


def test_there_are_recipes_for_the_models_users_train():
    assert set(RECIPES) >= {"qwen2_5_1_5b_gsm8k", "qwen2_5_7b_gsm8k", "qwen2_5_7b_math", "qwen3_4b_dapo_math",
                            "qwen3_8b_dapo_math"}


@pytest.mark.parametrize("mode,device,n", [("async", "npu", 16), ("sync", "cuda", 8)])
@pytest.mark.parametrize("name", RECIPES)
def test_cfg_job_composes_with_the_stated_devices(recipe_runs, name, mode, device, n):
    """One device/size pair per mode (the committed plans cover all four: the planner composes the same config)."""
    r = recipe_runs[("cfg", name, mode, device, n)]
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = yaml.safe_load(r.stdout)
    assert cfg["mode"] == mode and cfg["trainer"]["device"] == device
    trainer = cfg["trainer"]["nnodes"] * cfg["trainer"]["n_gpus_per_node"]
    rollout = cfg["rollout"]["nnodes"] * cfg["rollout"]["n_gpus_per_node"]
    assert (trainer + rollout if mode == "async" else trainer) == n
    with open(os.path.join(ROOT, "recipes", name, f"{mode}.sh")) as fh:
        head = fh.read().split("set -euo pipefail")[0]
    assert "Hardware expected" in head and "--cfg job" in head


def test_an_unsupported_device_count_is_refused():
    r = run("recipes/qwen2_5_7b_gsm8k/async.sh", "--cfg", "job", N_DEVICES="12")
    assert r.returncode == 2 and "N_DEVICES=12" in r.stderr


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("name", RECIPES)
def test_committed_plan_matches_the_planner(recipe_runs, name, mode):
    """npu:8 of each recipe is recomputed (recipes/make_plans.sh regenerates all of them)."""
    r = recipe_runs[("plan", name, mode)]
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    committed = os.path.join(ROOT, "recipes", name, f"plan_{'sync_' if mode == 'sync' else ''}npu_8.txt")
    with open(committed) as fh:
        assert r.stdout == fh.read(), f"{committed} is stale: bash recipes/make_plans.sh {name}"


@pytest.mark.parametrize("name", RECIPES)
def test_every_committed_plan_has_its_sections_and_fits(name):
    files = sorted(glob.glob(os.path.join(ROOT, "recipes", name, "plan_*.txt")))
    assert len(files) == 8
    for path in files:
        text = open(path).read()
        assert all(s in text for s in SECTIONS), path
        assert "REFUSED" not in text and "DOES NOT FIT" not in text, path
