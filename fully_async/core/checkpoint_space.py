"""A checkpoint save that failed (layer 0: files only): its temporary folder removed, and a full disk named with the
space a checkpoint needs against the space free, instead of torch's "unexpected pos" or a bare ENOSPC."""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

from fully_async.core.checkpoint import dir_size_bytes, list_checkpoints, step_dir


_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "unexpected pos")  # the last: torch's zip writer


def _is_no_space(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps: a Ray task error's cause, a chained exception) is a full disk or quota."""
    import errno

    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is s for s in seen) or len(seen) > 16:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in _NO_SPACE_TEXT):
            return True
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return False


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def abandon_checkpoint(root: str, version: int, tmp: str, exc: BaseException) -> Optional[str]:
    """A save of checkpoint `version` into `tmp` failed with `exc`: remove `tmp` (a partial checkpoint only takes
    space) and, when the disk is full, return the message that says so: the folder, the space a checkpoint needs
    (the newest complete one's size, else at least what was written) against the space free."""
    written = dir_size_bytes(tmp) if os.path.isdir(tmp) else 0
    shutil.rmtree(tmp, ignore_errors=True)
    if not _is_no_space(exc):
        return None
    done = list_checkpoints(root)
    needed = (f"about {_human(dir_size_bytes(step_dir(root, done[-1])))} (the size of global_step_{done[-1]})"
              if done else f"more than the {_human(written)} written before the disk filled")
    try:
        free = _human(shutil.disk_usage(root).free)
    except OSError:
        free = "?"
    return (f"no space left on the device of {root} (trainer.default_local_dir) while saving checkpoint "
            f"global_step_{version}: a checkpoint needs {needed}, {free} is free there; the partial {tmp} was "
            f"removed.  Free space there, point trainer.default_local_dir at a larger disk, or keep fewer "
            f"checkpoints (trainer.max_ckpt_to_keep) ({type(exc).__name__}: {exc})")
