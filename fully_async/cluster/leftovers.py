"""What a driver killed with SIGKILL leaves behind, found and cleaned by the next run's start or by the doctor
(layer 2).

Why: a driver that exits any other way shuts its local Ray down and removes its token file (ray_utils: atexit).
SIGKILL runs none of that: Ray's GCS and raylet die with it (kernel fate-sharing), but the agents the raylet
started (dashboard agent, runtime-env agent) keep running for minutes, and the 0600 token file
(`ray_auth_token.<pid>.<hex>`) stays.  Both are recognisable: every local Ray of ours lives under the user's private
root (`private_temp_root`, `<root>/session_<date>_<driver pid>`), and the token file carries its driver's pid.  A
leftover is one whose driver pid no longer runs; a live driver's (another run of this user) is never touched.  The
session folders themselves (Ray's logs of the dead run) are kept.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import Callable, Iterator, Optional

logger = logging.getLogger(__name__)

SESSION = re.compile(r"session_\d{4}-\d{2}-\d{2}_[\d_-]+?_(\d+)(?=[/\s\x00]|$)")
TOKEN = re.compile(r"^ray_auth_token\.(\d+)\.[0-9a-f]+$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process: alive
    return True


def processes() -> Iterator[tuple[int, str]]:
    """(pid, command line) of this user's processes (Linux /proc; none elsewhere)."""
    uid, me = os.getuid(), os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\x00", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmd:
            yield int(name), cmd


def find(root: str, alive: Optional[Callable[[int], bool]] = None,
         procs: Optional[Callable[[], Iterator[tuple[int, str]]]] = None) -> tuple[list[str], list[tuple[int, int, str]]]:
    """The leftovers of dead drivers under `root` (private_temp_root()): token files beside it, and processes
    (pid, dead driver's pid, command) whose command line names one of root's sessions.  `alive`, `procs`:
    pid_alive and processes unless given."""
    alive, procs = alive or pid_alive, procs or processes
    parent = os.path.dirname(root)
    tokens = []
    try:
        for name in sorted(os.listdir(parent)):
            m = TOKEN.match(name)
            if m and not alive(int(m.group(1))):
                tokens.append(os.path.join(parent, name))
    except OSError:
        pass
    found = []
    prefix = os.path.join(root, "")
    for pid, cmd in procs():
        if prefix not in cmd:
            continue
        m = SESSION.search(cmd[cmd.index(prefix):])
        if m and not alive(int(m.group(1))):
            found.append((pid, int(m.group(1)), cmd))
    return tokens, found


def clean(root: str, alive: Optional[Callable[[int], bool]] = None,
          procs: Optional[Callable[[], Iterator[tuple[int, str]]]] = None, grace_s: float = 3.0,
          kill: Callable[[int, int], None] = os.kill) -> list[str]:
    """Remove the dead drivers' token files and stop their processes (SIGTERM, SIGKILL after `grace_s`); one line
    per thing cleaned, each logged."""
    tokens, found = find(root, alive, procs)
    done = []
    for path in tokens:
        try:
            os.remove(path)
        except OSError as exc:
            logger.warning("could not remove %s (left by a dead run): %s", path, exc)
            continue
        done.append(f"removed {path} (the Ray token file of driver pid {TOKEN.match(os.path.basename(path))[1]}, "
                    "no longer running)")
    for pid, driver, cmd in found:
        try:
            kill(pid, signal.SIGTERM)
        except OSError:
            continue
        done.append(f"stopped pid {pid} (Ray process of dead driver pid {driver}): {cmd[:160]}")
    deadline = time.monotonic() + grace_s
    left = [pid for pid, _, _ in found]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if _running(pid)]
    for pid in left:
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for line in done:
        logger.warning("cleaned a dead run's leftover: %s", line)
    return done


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of ours stays a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
    except IndexError:  # pragma: no cover - an unreadable stat line
        return pid_alive(pid)


def clean_dead_drivers(root: Optional[str] = None) -> list[str]:
    """`clean` under this user's private Ray root (the one every local run of ours starts its Ray in)."""
    from fully_async.cluster.ray_utils import private_temp_root

    return clean(root or private_temp_root())
