"""One run per folder (layer 7 helper): a lock file in trainer.default_local_dir and the TensorBoard run dir.

`acquire(folder)` creates `<folder>/fully_async.lock` atomically (os.open with O_CREAT|O_EXCL) holding the
pid, hostname, start time and command of this run; a second run with the same folder is refused with
RunLocked naming the folder, the pid and the host.  A lock whose pid is no longer alive on this host (a run
that was SIGKILLed, a crashed machine) is stale: it is taken over with a warning naming the dead pid.

Caveats: a lock written on another host cannot be checked for liveness (its pid means nothing here), so it
is always refused, naming that host: delete the file when you know that run is over.  O_EXCL is atomic on
local filesystems and on NFSv3+; older NFS clients may not honour it.  Two hosts in one container network
that share a hostname look like one host.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Optional

logger = logging.getLogger("fully_async")

LOCK_NAME = "fully_async.lock"


class RunLocked(RuntimeError):
    """Another live run holds the folder."""


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), which tells a recycled pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int, start: Optional[str] = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return not (start and _proc_start(pid) not in (None, start))  # the pid now belongs to another process


def _describe(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return (f"pid {info.get('pid')} on host {info.get('hostname')} (started {started}: "
            f"{info.get('command', '?')})")


class RunLock:
    def __init__(self, path: str, text: str, created: Optional[list[str]] = None):
        self.path, self.text = path, text
        self.created = created or []   # the folders acquire() made, deepest first

    def release(self) -> None:
        """Remove the lock file if it is still ours, and the folders acquire() made that stayed empty (a run refused
        before it wrote anything leaves no empty checkpoint or TensorBoard folder behind)."""
        try:
            with open(self.path) as fh:
                if fh.read() != self.text:
                    return
            os.remove(self.path)
        except OSError:
            return
        for folder in self.created:
            try:
                os.rmdir(folder)   # only when empty
            except OSError:
                return


def _missing(folder: str) -> list[str]:
    """`folder` and the parents of it that do not exist yet, deepest first."""
    out, current = [], os.path.abspath(folder)
    while not os.path.exists(current):
        out.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return out


def _read(path: str) -> Optional[str]:
    """The lock's text; a lock being written right now is given a moment to be complete."""
    text = ""
    for _ in range(10):
        try:
            with open(path) as fh:
                text = fh.read()
        except FileNotFoundError:
            return None
        try:
            json.loads(text)
            return text
        except ValueError:
            time.sleep(0.1)
    return text


def _take_over(path: str, stale_text: str) -> None:
    """Move the stale lock out of the way; if it changed meanwhile (another run took it over first), put it
    back.  Then the caller tries the atomic create again."""
    grave = f"{path}.stale-{os.getpid()}"
    try:
        os.rename(path, grave)
    except FileNotFoundError:
        return
    with open(grave) as fh:
        taken = fh.read()
    if taken != stale_text:
        try:
            os.link(grave, path)  # fails if a lock exists again: then that one stands
        except OSError:
            pass
    os.remove(grave)


def _writable_folder(folder: str, what: str) -> None:
    """`folder` exists (made if needed) as a folder this user can write, else ConfigError naming the key."""
    from fully_async.core.config import ConfigError

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(what, f"{folder} is a file, not a folder: this run writes its files into it; name a "
                          "folder (or move the file away)")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(what, f"cannot create the folder {folder} ({exc.strerror}): name a folder this user "
                          "can write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(what, f"{folder} is not writable by this user (this run writes its checkpoints, logs "
                          "and lock there): name a writable folder, or fix its permissions")


def acquire(folder: str, what: str = "trainer.default_local_dir") -> RunLock:
    """Take the lock of `folder` (created if needed) or raise RunLocked; `what` names the config key that
    chose the folder, for the message."""
    created = _missing(folder)
    _writable_folder(folder, what)
    path = os.path.join(folder, LOCK_NAME)
    host = socket.gethostname()
    info = {"pid": os.getpid(), "hostname": host, "started": time.time(), "command": " ".join(sys.argv),
            "proc_start": _proc_start(os.getpid())}
    text = json.dumps(info)
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            if os.path.islink(path):   # never read or followed: whoever planted it may read this run's log
                logger.warning("removed a symbolic link planted at %s (this run's lock file); it was not followed "
                               "(check who can write into %s)", path, folder)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            held = _read(path)
            if held is None:
                continue  # released meanwhile
            try:
                other = json.loads(held)
                pid = int(other["pid"])
            except (ValueError, KeyError, TypeError):
                logger.warning("the lock %s is unreadable (%r): taking it over", path, held[:200])
                _take_over(path, held)
                continue
            if other.get("hostname") != host:
                raise RunLocked(
                    f"{folder} ({what}) is in use by another run: {_describe(other)}.  Its liveness cannot be "
                    f"checked from {host}.  Use another {what} (or trainer.experiment_name), or, if that run "
                    f"is over, delete {path}")
            if pid_alive(pid, other.get("proc_start")):
                raise RunLocked(
                    f"{folder} ({what}) is in use by another run: {_describe(other)}.  Use another {what} "
                    f"(or trainer.experiment_name), or wait for that run to finish")
            logger.warning("taking over the stale lock %s of pid %d on %s, which is no longer running", path, pid,
                           host)
            _take_over(path, held)
            continue
        try:
            os.write(fd, text.encode())
        except BaseException:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        return RunLock(path, text, created)
    raise RunLocked(f"could not take the lock {path}: other runs keep taking it")
