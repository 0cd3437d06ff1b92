"""The headline, pinned: the default run (`python -m fully_async.main`, CPU, tiny bundled task) learns, in both
modes: the greedy validation reward rises by >= 0.3 and ends >= 0.8."""
import os
import subprocess
import sys

import pytest

from tests_helpers import read_scalars

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_default_run_learns(tmp_path, mode):
    env = dict(os.environ, TENSORBOARD_DIR=str(tmp_path / "tb"))
    r = subprocess.run([sys.executable, "-m", "fully_async.main", f"mode={mode}", "trainer.progress_bar=false",
                        f"trainer.default_local_dir={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/hydra"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    val = [v for _, v in sorted(read_scalars(str(tmp_path / "tb"))["val-core/arithmetic/reward/mean@1"])]
    assert val[-1] - val[0] >= 0.3 and val[-1] >= 0.8, val
