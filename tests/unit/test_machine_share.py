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
