"""The headline, pinned: the default run (`python -m fully_async.main`, CPU, tiny bundled task, nothing but its
output folders set) learns, in both modes: the greedy validation reward rises by >= 0.3 and ends >= 0.8.  The same
runs, with stdout/stderr to pipes and the progress bar at its default, print plain step lines (no \\r, no colour
codes, no FutureWarning/DeprecationWarning) that Hydra's main.log holds too.

Slow: the default run itself (`python -m fully_async.main` in a subprocess, Ray start-up and all), in both modes;
~35 s alone and up to ~90 s beside the suite's other worker."""
import os
import subprocess
import sys

import pytest

from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory):
    """mode -> (the finished process, its folder): each mode's default run, once."""
    done = {}

    def get(mode):
        if mode not in done:
            tmp = tmp_path_factory.mktemp(f"default_{mode}")
            env = dict(os.environ, TENSORBOARD_DIR=str(tmp / "tb"))
            done[mode] = subprocess.run([sys.executable, "-m", "fully_async.main", f"mode={mode}",
                                         f"trainer.default_local_dir={tmp}/ckpt", f"hydra.run.dir={tmp}/hydra"],
                                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600), tmp
        return done[mode]
    return get


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_default_run_learns(default_runs, mode):
    r, tmp = default_runs(mode)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    val = [v for _, v in sorted(read_scalars(str(tmp / "tb"))["val-core/arithmetic/reward/mean@1"])]
    assert val[-1] - val[0] >= 0.3 and val[-1] >= 0.8, val


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_default_run_output_to_a_pipe(default_runs, mode):
    r, tmp = default_runs(mode)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "\r" not in r.stdout + r.stderr and "\x1b[" not in r.stdout + r.stderr     # no colour codes into pipes
    assert "FutureWarning" not in r.stderr and "DeprecationWarning" not in r.stderr
    log = (tmp / "hydra" / "main.log").read_text()
    for step in (1, 2, 3):
        assert f"\nstep {step} | reward" in r.stdout and f"step {step} | reward" in log
    assert "step 0 | val" in log and "run finished" in log
