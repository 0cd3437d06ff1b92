"""The suite's time budget, recorded by every run (hooks re-exported by conftest.py).

Each module's time (setup + call + teardown of its tests, module-scoped fixtures such as a module's Ray included,
less what it waited for the machine: `module_share`, reported apart as `waited_s`) goes to a JSON file at the end of
the session, `.test_durations.json` in the repository root unless `FULLY_ASYNC_TEST_DURATIONS` names another path,
and the terminal summary lists the slowest modules against the budget: the whole suite in `SUITE_BUDGET_S` on the
2-core CPU CI runs on (docs/testing.md), no module over `MODULE_BUDGET_S` unless its docstring says why (a line
starting "Slow:"). A module over its budget without that line is named in the summary; nothing fails on time alone
(a noisy machine must not fail CI)."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time

import pytest

SUITE_BUDGET_S = 23 * 60      # pytest on the 2-core CPU: 25 minutes for CI less ~2 for the install
MODULE_BUDGET_S = 90.0        # one module; more needs a "Slow:" line in its docstring saying why

_module_s: dict[str, float] = collections.defaultdict(float)
_module_tests: dict[str, int] = collections.defaultdict(int)
_module_waited: dict[str, float] = collections.defaultdict(float)
_waited = [0.0]               # in a worker: seconds module_share waited, not yet put on a test report
WAIT_KEY = "machine_share_wait_s"
_started = [0.0]


def pytest_configure(config):
    _started[0] = time.time()


@contextlib.contextmanager
def machine_share(rootdir: str, alone: bool):
    """The suite's two workers share the machine module by module: a module marked `alone` (timing-sensitive: it
    measures real parallelism, or a race that load reorders) runs while the other worker waits; every other module
    holds the machine shared.  Two flock'ed files under the temp dir, per checkout: a turnstile every module passes
    (an `alone` one keeps it, so the other worker cannot start new modules meanwhile) and the room, shared or
    exclusive."""
    import fcntl
    import hashlib
    import tempfile

    base = os.path.join(tempfile.gettempdir(),
                        f"fully_async_suite_{hashlib.sha1(rootdir.encode()).hexdigest()[:12]}")
    with open(base + ".turnstile", "a+") as turnstile, open(base + ".room", "a+") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


def pytest_collection_modifyitems(session, config, items):
    """The modules marked `alone` first, then the Ray runs (tests/integration/), each module's tests together, the
    rest in their order: the suite's two workers take whole modules in this order (-n 2 --dist loadfile).  An `alone`
    module waits for the other worker's current module to end before it starts, its own worker idle meanwhile
    (test_elastic.py: 97 s in a suite, 45 s alone); first, there is no module to wait for.  Then the long modules
    start early and the run ends on short unit modules instead of one worker finishing a 3-minute module alone."""
    items.sort(key=lambda item: (0 if item.get_closest_marker("alone") is not None else
                                 1 if item.nodeid.startswith("tests/integration/") else 2))


@contextlib.contextmanager
def module_share(rootdir: str, alone: bool):
    """`machine_share` for a module of this worker, its wait for the machine noted for the module's first report."""
    asked = time.monotonic()
    with machine_share(rootdir, alone):
        _waited[0] += time.monotonic() - asked
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The module_share wait of a module (inside its first test's setup) goes on that setup's report, so the
    controller can tell a module's own time from its wait for the other worker (the report travels to it)."""
    outcome = yield
    if call.when == "setup" and _waited[0] > 0:
        outcome.get_result().user_properties.append((WAIT_KEY, _waited[0]))
        _waited[0] = 0.0


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::", 1)[0]
    waited = sum(v for k, v in report.user_properties if k == WAIT_KEY)
    _module_s[module] += report.duration - waited
    _module_waited[module] += waited
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _module_tests[module] += 1


def _says_why(rootdir: str, module: str) -> bool:
    """The module's docstring has a line starting "Slow:" (read as text: the module may not import here)."""
    import ast

    try:
        with open(os.path.join(rootdir, module), encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
    except (OSError, SyntaxError):
        return False
    return any(line.strip().startswith("Slow:") for line in doc.splitlines())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _module_s or hasattr(config, "workerinput"):   # nothing ran, or an xdist worker (the controller writes)
        return
    rootdir = str(config.rootpath)
    wall = time.time() - _started[0]
    rows = sorted(_module_s.items(), key=lambda kv: -kv[1])
    record = {"wall_s": round(wall, 1), "suite_budget_s": SUITE_BUDGET_S, "module_budget_s": MODULE_BUDGET_S,
              "python": sys.version.split()[0], "cpus": os.cpu_count(),
              "modules": {m: {"s": round(s, 2), "tests": _module_tests[m], "waited_s": round(_module_waited[m], 2)}
                          for m, s in rows}}
    path = os.environ.get("FULLY_ASYNC_TEST_DURATIONS") or os.path.join(rootdir, ".test_durations.json")
    try:
        with open(path, "w") as fh:
            json.dump(record, fh, indent=1)
    except OSError as exc:
        terminalreporter.write_line(f"suite budget: could not write {path}: {exc}")
    over = [(m, s) for m, s in rows if s > MODULE_BUDGET_S and not _says_why(rootdir, m)]
    tr = terminalreporter
    tr.section("suite budget")
    tr.write_line(f"wall {wall:.0f} s against a budget of {SUITE_BUDGET_S} s on the 2-core CPU "
                  f"({len(rows)} modules; per-module times in {path})")
    for m, s in rows[:10]:
        tr.write_line(f"  {s:7.1f} s  {m}" + (f" (and {_module_waited[m]:.0f} s waiting for the machine)"
                                               if _module_waited[m] >= 1 else ""))
    for m, s in over:
        tr.write_line(f"over budget: {m} took {s:.0f} s (> {MODULE_BUDGET_S:.0f} s) and its docstring has no "
                      "'Slow:' line saying why")
