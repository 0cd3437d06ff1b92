"""One run per folder: the lock file of run_lock.py."""
import json
import os
import socket
import subprocess
import sys

import pytest

from fully_async.run import run_lock
from fully_async.run.run_lock import LOCK_NAME, RunLocked, acquire


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder, **info):
    os.makedirs(folder, exist_ok=True)
    data = {"pid": os.getpid(), "hostname": socket.gethostname(), "started": 0, "command": "python -m x"}
    data.update(info)
    (folder / LOCK_NAME).write_text(json.dumps(data))


def test_second_run_refused_while_the_first_holds_it_then_free_after_release(tmp_path):
    first = acquire(str(tmp_path))
    info = json.loads((tmp_path / LOCK_NAME).read_text())
    assert info["pid"] == os.getpid() and info["hostname"] == socket.gethostname()
    assert info["started"] > 0 and "command" in info
    with pytest.raises(RunLocked) as err:
        acquire(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "trainer.default_local_dir" in msg and "wait" in msg
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    acquire(str(tmp_path)).release()


def test_stale_lock_of_a_dead_pid_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    with caplog.at_level("WARNING", logger="fully_async"):
        lock = acquire(str(tmp_path))
    assert f"pid {pid}" in caplog.text and "stale" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_recycled_pid_is_stale(tmp_path):
    write_lock(tmp_path, proc_start="1")  # our pid, but a process that started at another time
    acquire(str(tmp_path)).release()


def test_lock_of_another_host_is_refused_naming_the_host(tmp_path):
    write_lock(tmp_path, pid=dead_pid(), hostname="other-node-7")
    with pytest.raises(RunLocked, match=r"other-node-7.*cannot be checked.*delete .*fully_async.lock"):
        acquire(str(tmp_path))


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    lock = acquire(str(tmp_path))
    write_lock(tmp_path, pid=1234567)
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_pid_alive():
    assert run_lock.pid_alive(os.getpid()) and not run_lock.pid_alive(dead_pid())
