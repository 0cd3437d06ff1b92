"""A driver killed with SIGKILL leaves Ray's agents running and its token file (issue 42): the next run's start or the
doctor finds them by the dead driver's pid (in the session folder's name and the token file's) and cleans them, and
never touches a live driver's.  A planted root, planted token files, a fake dead pid, and one real process."""
import os
import subprocess
import sys
import time

from fully_async.cluster import leftovers
from fully_async.run import doctor

DEAD, LIVE = 999_999_1, os.getpid()


def alive(pid):
    return pid != DEAD


def root_with_tokens(tmp_path):
    root = tmp_path / "fully_async-0" / "ray"
    root.mkdir(parents=True)
    (root.parent / f"ray_auth_token.{DEAD}.ab12cd34").write_text("t")
    (root.parent / f"ray_auth_token.{LIVE}.00ff00ff").write_text("t")
    (root / f"session_2026-11-29_09-01-36_035076_{DEAD}").mkdir()   # the dead run's logs: kept
    return str(root)


def test_the_dead_drivers_agents_and_token_file_are_found_and_a_live_drivers_are_not(tmp_path):
    root = root_with_tokens(tmp_path)
    procs = [(101, f"python dashboard/agent.py --temp-dir={root} --log-dir={root}/session_2026-11-29_09-01-36_035076_"
                   f"{DEAD}/logs"),
             (102, f"python runtime_env/agent/main.py --session-dir={root}/session_2026-11-29_09-01-36_035076_{DEAD}"),
             (103, f"raylet --session_dir={root}/session_2026-11-29_10-00-00_000001_{LIVE} --x"),   # a live run's
             (104, f"python other.py /elsewhere/session_2026-11-29_09-01-36_035076_{DEAD}")]       # not under root
    tokens, found = leftovers.find(root, alive=alive, procs=lambda: iter(procs))
    assert tokens == [os.path.join(os.path.dirname(root), f"ray_auth_token.{DEAD}.ab12cd34")]
    assert [(pid, driver) for pid, driver, _ in found] == [(101, DEAD), (102, DEAD)]


def test_clean_removes_the_token_stops_the_processes_and_says_so(tmp_path, caplog):
    root = root_with_tokens(tmp_path)
    procs = [(101, f"agent --log-dir={root}/session_2026-11-29_09-01-36_035076_{DEAD}/logs")]
    sent = []
    done = leftovers.clean(root, alive=alive, procs=lambda: iter(procs), grace_s=0.0,
                           kill=lambda pid, sig: sent.append((pid, sig)))
    parent = os.path.dirname(root)
    assert sorted(os.listdir(parent)) == ["ray", f"ray_auth_token.{LIVE}.00ff00ff"]   # the live run's token stays
    assert os.listdir(root) == [f"session_2026-11-29_09-01-36_035076_{DEAD}"]   # logs kept
    assert sent[0] == (101, 15)
    assert done[0].startswith(f"removed {parent}/ray_auth_token.{DEAD}.ab12cd34 (the Ray token file of driver pid "
                              f"{DEAD}, no longer running)")
    assert done[1].startswith(f"stopped pid 101 (Ray process of dead driver pid {DEAD}): agent --log-dir=")
    assert "cleaned a dead run's leftover: removed" in caplog.text


def test_a_real_leftover_process_is_stopped(tmp_path):
    root = root_with_tokens(tmp_path)
    session = f"{root}/session_2026-11-29_09-01-36_035076_{DEAD}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--session-dir={session}"])
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and not any(pid == proc.pid for pid, _ in leftovers.processes()):
            time.sleep(0.05)
        done = leftovers.clean(root, alive=alive, grace_s=2.0)
        assert any(line.startswith(f"stopped pid {proc.pid} ") for line in done), done
        assert proc.wait(timeout=5) == -15
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_doctor_cleans_and_reports(tmp_path, monkeypatch):
    root = root_with_tokens(tmp_path)
    monkeypatch.setattr(leftovers, "pid_alive", alive)
    monkeypatch.setattr(leftovers, "processes", lambda: iter([]))
    monkeypatch.setattr("fully_async.cluster.ray_utils.private_temp_root", lambda: root)
    check = doctor.check_leftovers()
    assert check.status == "PASS" and check.detail.startswith(f"cleaned 1: removed {os.path.dirname(root)}/"
                                                              f"ray_auth_token.{DEAD}.")
    assert doctor.check_leftovers().detail.startswith("none (no Ray process or token file")
