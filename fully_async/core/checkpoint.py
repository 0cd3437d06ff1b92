"""Checkpoint folders: atomic writes, discovery for resume, retention (layer 0: files only).

A checkpoint is `<default_local_dir>/global_step_<v>/` where v is the param version; each actor writes
its own part and reads it back on resume:
  actor/                 trainer: the model as a Hugging Face folder (save_pretrained)
  actor_optim.pt         trainer: optimizer, LR scheduler, RNG states (FSDP2: per-rank shard files)
  trainer_state.json     trainer: step, version, ids of every sample trained so far
  rollout_state.pkl      rollouter: data-stream position, staleness counters, in-flight groups with
                         their partial responses (tokens, log-probs, versions); sync mode: the stream
  queue_state.pkl        queue: the groups generated but not yet trained
The driver orchestrates it (launcher.take_checkpoint): every part goes into `.tmp_global_step_<v>`
(`begin_checkpoint`), which is renamed when all are in (`commit_checkpoint`), so a crash mid-save never
leaves a folder that looks finished; `latest_checkpointed_iteration.txt` (verl's name) names the
newest complete one.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from typing import Any, Callable, Optional

LATEST = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
ROLLOUT_STATE = "rollout_state.pkl"
QUEUE_STATE = "queue_state.pkl"
_STEP_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, version: int) -> str:
    return os.path.join(root, f"global_step_{version}")


def begin_checkpoint(root: str, version: int) -> str:
    """A fresh, empty temporary folder for the parts of checkpoint `version` (invisible to resume)."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp_global_step_{version}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def atomic_save(root: str, version: int, write: Callable[[str], None], keep: Optional[int] = None) -> str:
    """Call `write(tmp_dir)`, then make it global_step_<version> (commit_checkpoint)."""
    tmp = begin_checkpoint(root, version)
    write(tmp)
    return commit_checkpoint(root, version, tmp, keep)


def commit_checkpoint(root: str, version: int, tmp: str, keep: Optional[int] = None) -> str:
    """Every part is in `tmp`: rename it to global_step_<version> (one step: the folder appears complete or
    not at all), point the latest marker at it, and drop all but the newest `keep` checkpoints."""
    if not os.path.isfile(os.path.join(tmp, TRAINER_STATE)):
        raise RuntimeError(f"checkpoint folder {tmp} has no {TRAINER_STATE}: not committed")
    final = step_dir(root, version)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    marker_tmp = os.path.join(root, LATEST + ".tmp")
    with open(marker_tmp, "w") as fh:
        fh.write(str(version))
    os.replace(marker_tmp, os.path.join(root, LATEST))
    if keep is not None:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    return final


def list_checkpoints(root: str) -> list[int]:
    """Versions of the complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, TRAINER_STATE)):
            found.append(int(m.group(1)))
    return sorted(found)


def find_resume_path(trainer_cfg: Any) -> Optional[str]:
    """The checkpoint to resume from according to trainer.resume_mode (None: start fresh)."""
    mode = trainer_cfg.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        return trainer_cfg.resume_from_path
    versions = list_checkpoints(trainer_cfg.default_local_dir)
    return step_dir(trainer_cfg.default_local_dir, versions[-1]) if versions else None


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh)


def read_json(path: str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def write_pickle(path: str, data: Any) -> None:
    with open(path, "wb") as fh:
        pickle.dump(data, fh, protocol=pickle.HIGHEST_PROTOCOL)


# where pickled classes lived before the package was split into layers (checkpoints written then still resume)
LEGACY_MODULES = {f"fully_async.{name}": f"fully_async.{layer}.{name}" for layer, names in {
    "core": ("config", "types", "device", "staleness", "data", "batch", "metrics", "timeline", "workload", "flops",
             "partial", "checkpoint", "algorithms", "rewards"),
    "cluster": ("placement", "ray_utils"), "rollout": ("scheduler", "generation", "engines"),
    "train": ("train_step", "backends"),
    "actors": ("queue", "rollouter", "trainer", "sync_loop", "train_group", "actor_setup"),
    "run": ("launcher", "prepare", "hydra_setup", "run_logging")}.items() for name in names}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        top = ".".join(module.split(".")[:2])
        if top in LEGACY_MODULES:
            module = LEGACY_MODULES[top] + module[len(top):]
        return super().find_class(module, name)


def read_pickle(path: str) -> Any:
    with open(path, "rb") as fh:
        return _Unpickler(fh).load()  # our own checkpoint files only


def dir_size_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
