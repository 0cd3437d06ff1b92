"""The suite's two workers share the machine module by module (tests/suite_budget.machine_share): a module marked
`alone` waits for the other worker's module to end, and the other worker's next module waits for it."""
import subprocess
import sys
import textwrap
import time

from suite_budget import machine_share, pytest_collection_modifyitems

HOLD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from suite_budget import machine_share
    with machine_share(sys.argv[2], alone=sys.argv[3] == "1"):
        print("in", flush=True)
        time.sleep(float(sys.argv[4]))
""")


def hold(tests_dir, root, alone, seconds):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, tests_dir, root, "1" if alone else "0", str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    import select

    ready, _, _ = select.select([proc.stdout], [], [], 15)
    if not ready:
        proc.kill()
        raise AssertionError("the holder never got in (a lock left held?)")
    assert proc.stdout.readline().strip() == "in"
    return proc


def test_alone_waits_for_a_shared_module_and_shared_ones_wait_for_alone(tmp_path):
    import os

    tests_dir, root = os.path.dirname(os.path.dirname(__file__)), str(tmp_path)
    other = hold(tests_dir, root, alone=False, seconds=1.0)      # the other worker's module
    start = time.monotonic()
    with machine_share(root, alone=True):
        waited = time.monotonic() - start
    other.wait(10)
    assert waited > 0.5, waited
    with machine_share(root, alone=False):                        # two shared modules: no wait
        other = hold(tests_dir, root, alone=False, seconds=0.1)
        other.wait(10)
    other = hold(tests_dir, root, alone=True, seconds=1.0)
    start = time.monotonic()
    with machine_share(root, alone=False):
        waited = time.monotonic() - start
    other.wait(10)
    assert waited > 0.5, waited


class Item:
    def __init__(self, nodeid: str, alone: bool = False):
        self.nodeid, self.alone = nodeid, alone

    def get_closest_marker(self, name):
        return object() if name == "alone" and self.alone else None


def test_the_alone_modules_come_first_then_the_ray_runs_then_the_rest_each_in_its_order():
    items = [Item("tests/unit/a.py::t"), Item("tests/integration/b.py::t"), Item("tests/integration/c.py::t", True),
             Item("tests/unit/d.py::t"), Item("tests/integration/e.py::t"), Item("tests/integration/c.py::u", True)]
    pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["tests/integration/c.py::t", "tests/integration/c.py::u",
                                         "tests/integration/b.py::t", "tests/integration/e.py::t",
                                         "tests/unit/a.py::t", "tests/unit/d.py::t"]


SESSION_CONFTEST = textwrap.dedent("""
    import sys
    import pytest
    sys.path.insert(0, {tests!r})
    from suite_budget import (module_share, pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                              pytest_runtest_logreport, pytest_runtest_makereport, pytest_terminal_summary)

    @pytest.fixture(scope="module", autouse=True)
    def _machine_share(request):
        with module_share(str(request.config.rootpath), request.node.get_closest_marker("alone") is not None):
            yield
""")
ALONE_MODULE = "import time\nimport pytest\npytestmark = pytest.mark.alone\n\ndef test_it():\n    time.sleep(1)\n"


def test_a_modules_time_leaves_out_its_wait_for_the_other_worker(tmp_path):
    """Two `alone` modules on the suite's two workers: one waits ~1 s for the other; the durations file reports that
    wait apart (`waited_s`) and each module's own ~1 s, not ~2 s for the one that waited."""
    import json
    import os

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "conftest.py").write_text(SESSION_CONFTEST.format(tests=tests_dir))
    (tmp_path / "test_a.py").write_text(ALONE_MODULE)
    (tmp_path / "test_b.py").write_text(ALONE_MODULE)
    out = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "-W", "ignore", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "FULLY_ASYNC_TEST_DURATIONS": str(out)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = json.loads(out.read_text())["modules"]
    assert sorted(modules) == ["test_a.py", "test_b.py"]
    assert all(0.95 < m["s"] < 1.8 for m in modules.values()), modules
    assert max(m["waited_s"] for m in modules.values()) > 0.7, modules
    assert "waiting for the machine" in proc.stdout
