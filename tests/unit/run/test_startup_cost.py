"""What a start of `python -m fully_async.main` does not pay for: a refused config exits before torch or Ray is
imported (hydra_setup.user_errors, the launcher's late imports), and a local Ray's actors get their environment
variables from the processes Ray starts, not through a runtime_env (ray_utils.inherited_by_ray)."""
import os
import subprocess
import sys

from fully_async.cluster.ray_utils import inherited_by_ray
from fully_async.core.config import ConfigError
from fully_async.run.hydra_setup import user_errors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_refused_config_exits_1_without_importing_torch_or_ray(tmp_path):
    code = ("import runpy, sys\n"
            f"sys.argv = ['fully_async.main', 'trainer.total_training_steps=0', 'hydra.run.dir={tmp_path}']\n"
            "try:\n    runpy.run_module('fully_async.main', run_name='__main__')\n"
            "except SystemExit as exc:\n    print('exit', exc.code, 'torch' in sys.modules, 'ray' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.stdout.splitlines()[-1:] == ["exit 1 False False"], r.stdout + r.stderr[-2000:]
    assert "config error at 'trainer.total_training_steps': 0 must be >= 1" in r.stdout + r.stderr


def test_user_errors_holds_the_classes_of_the_imported_modules(monkeypatch):
    from fully_async.cluster.ray_utils import RunFailed, Unresponsive
    from fully_async.device import DeviceError

    errors = user_errors()
    assert errors[0] is ConfigError and {DeviceError, RunFailed} <= set(errors)
    assert isinstance(Unresponsive("x"), errors)   # a subclass is caught with its base
    monkeypatch.delitem(sys.modules, "fully_async.device")   # never imported: its error cannot have been raised
    assert DeviceError not in user_errors() and RunFailed in user_errors()


def test_inherited_by_ray_sets_the_variables_while_ray_starts_and_restores_them(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("FA_TEST_ONLY_WHILE_STARTING", raising=False)
    with inherited_by_ray({"OMP_NUM_THREADS": "1", "FA_TEST_ONLY_WHILE_STARTING": "x"}):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["FA_TEST_ONLY_WHILE_STARTING"] == "x"
    assert os.environ["OMP_NUM_THREADS"] == "4" and "FA_TEST_ONLY_WHILE_STARTING" not in os.environ
    try:
        with inherited_by_ray({"OMP_NUM_THREADS": "1"}):
            raise SystemExit(15)   # ray.init's own SIGTERM handler
    except SystemExit:
        pass
    assert os.environ["OMP_NUM_THREADS"] == "4"
