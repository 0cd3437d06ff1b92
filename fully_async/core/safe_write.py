"""Every file a run writes goes through here (layer 0: files only): never through a link planted in its folder.

Why: a run's folders (checkpoints, TensorBoard run dir, Hydra's output dir) may be writable by someone else -- the
checkpoint manifest's threat model is exactly "someone who can write into the checkpoint folder".  A plain
`open(path + ".tmp", "w")` follows a symbolic link planted at that name and overwrites whatever it points at (the
signing key, a user's file).  Here a file is written to `<path>.tmp` created with O_CREAT|O_EXCL|O_NOFOLLOW (a name
that already exists -- a link, a temporary an interrupted write left -- is removed, never opened: a link is reported),
flushed and fsynced, then renamed over `path` (rename replaces a name, it never follows one), and the folder fsynced.
A `path` that is itself a symbolic link is refused (`PlantedLinkError`, naming it and its target): the run would
otherwise silently replace the link with its own file, and the user should know someone planted it.

A write that fails (a full disk included) removes its temporary and re-raises.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import IO, Any, Iterator

logger = logging.getLogger("fully_async")

_CREATE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
TMP_SUFFIX = ".tmp"


class PlantedLinkError(RuntimeError):
    """The name a run writes is a symbolic link: refused rather than followed or silently replaced."""


def _target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def refuse_link(path: str) -> None:
    """PlantedLinkError when `path` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise PlantedLinkError(
            f"{path} is a symbolic link (to {_target(path)!r}) where this run writes its own file: refusing to write "
            f"through it or over it (whoever can write into {os.path.dirname(path) or '.'} planted it).  Remove the "
            "link (and check the file it points at), then run again")


def _create_temp(tmp: str, perm: int) -> int:
    """A new file at `tmp`, opened for writing; whatever already has that name is removed first, never opened."""
    for _ in range(5):
        try:
            return os.open(tmp, _CREATE, perm)
        except FileExistsError:
            if os.path.islink(tmp):
                logger.warning("removed a symbolic link planted at %s (to %r), where this run writes a temporary "
                               "file; it was not followed (check who can write into %s)", tmp, _target(tmp),
                               os.path.dirname(tmp) or ".")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # unlink removes the name (the link itself), never what it points at
    raise PlantedLinkError(f"could not create the temporary {tmp}: something keeps putting a file at that name")


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a folder; the rename is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = "utf-8", perm: int = 0o666,
                fsync: bool = True) -> Iterator[IO[Any]]:
    """`with atomic_open(path) as fh: fh.write(...)`: `path` appears complete or not at all, never written through a
    link (module docstring).  `mode` is "w" (text, `encoding`) or "wb"; `perm` is masked by the umask as open()'s."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode must be 'w' or 'wb', not {mode!r}")
    refuse_link(path)
    tmp = path + TMP_SUFFIX
    fd = _create_temp(tmp, perm)
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": encoding})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        refuse_link(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(os.path.dirname(path))


def write_text(path: str, text: str, **kwargs: Any) -> None:
    with atomic_open(path, "w", **kwargs) as fh:
        fh.write(text)


def write_bytes(path: str, data: bytes, **kwargs: Any) -> None:
    with atomic_open(path, "wb", **kwargs) as fh:
        fh.write(data)


def write_json(path: str, data: Any, *, perm: int = 0o666, fsync: bool = True, **dump_kwargs: Any) -> None:
    """`json.dump(data, fh, **dump_kwargs)` through atomic_open."""
    with atomic_open(path, "w", perm=perm, fsync=fsync) as fh:
        json.dump(data, fh, **dump_kwargs)


def torch_save(obj: Any, path: str) -> None:
    """`torch.save(obj, path)` through atomic_open."""
    import torch

    with atomic_open(path, "wb") as fh:
        torch.save(obj, fh)
