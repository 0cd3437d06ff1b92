"""The rollouter's and the queue's part of a checkpoint, as JSON (layer 0: files only).

Why not pickle: reading a checkpoint must never run code (a checkpoint folder may come from someone else).  These
files are JSON whose only non-JSON values are the records of core.types / core.partial (rebuilt field by field),
tuples, dicts with non-string keys and numpy arrays.  Older checkpoints kept them as pickles (`*.pkl`); those are
read through an unpickler that can build nothing but the same records and refuses anything else, naming the file.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any

from fully_async.core import safe_write


class CheckpointError(RuntimeError):
    """No checkpoint can be resumed from as asked (broken files, a config change that breaks saved state)."""


def _state_classes() -> dict[str, type]:
    from fully_async.core.partial import PendingResponse
    from fully_async.core.types import GenOutput, GenRequest, PromptRecord, Sample, SampleGroup, SamplingParams

    return {c.__name__: c for c in (PromptRecord, SamplingParams, GenRequest, GenOutput, Sample, SampleGroup,
                                    PendingResponse)}


def _encode(value: Any) -> Any:
    import dataclasses

    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if _state_classes().get(name) is not type(value):
            raise TypeError(f"{type(value).__qualname__} is not a record a checkpoint may hold")
        return {"__record__": name, "fields": {f.name: _encode(getattr(value, f.name))
                                                for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray):
            return {"__ndarray__": _encode(value.tolist()), "dtype": str(value.dtype)}
        return value.item()  # a numpy scalar
    raise TypeError(f"a {type(value).__qualname__} cannot be written to a checkpoint's state file")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__record__" in value:
        cls = _state_classes()[value["__record__"]]
        return cls(**{k: _decode(v) for k, v in value["fields"].items()})
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k): _decode(v) for k, v in value["__items__"]}
    if "__ndarray__" in value:
        import numpy as np

        return np.array(_decode(value["__ndarray__"]), dtype=value["dtype"] if value["dtype"] != "object" else object)
    return {k: _decode(v) for k, v in value.items()}


def write_state(path: str, data: Any) -> None:
    """`data` (dicts, lists, tuples, numbers, strings, numpy arrays and the records of core.types / core.partial)
    as JSON at `path`."""
    safe_write.write_json(path, _encode(data), separators=(",", ":"))


def read_state(path: str) -> Any:
    """What write_state wrote at `path`; when only the pickle an older version wrote beside it exists
    (`<name>.pkl`), that one, through an unpickler that builds only the same records (never runs code)."""
    if path.endswith(".pkl"):
        return _read_legacy_pickle(path)
    if not os.path.isfile(path) and path.endswith(".json") and os.path.isfile(path[:-5] + ".pkl"):
        return _read_legacy_pickle(path[:-5] + ".pkl")
    try:
        with open(path) as fh:
            return _decode(json.load(fh))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint state file ({type(exc).__name__}: {exc}); "
                              "resume from an earlier checkpoint (trainer.resume_from_path) or start fresh") from None


# where pickled classes lived before the package was split into layers (checkpoints written then still resume)
LEGACY_MODULES = {f"fully_async.{name}": f"fully_async.{layer}.{name}" for layer, names in {
    "core": ("config", "types", "staleness", "data", "batch", "workload", "flops", "partial", "checkpoint"),
    "telemetry": ("metrics", "timeline"),
    "cluster": ("placement", "ray_utils"), "rollout": ("scheduler", "generation", "engines"),
    "train": ("train_step", "backends"),
    "actors": ("queue", "rollouter", "trainer", "sync_loop", "actor_setup"),
    "run": ("launcher", "prepare", "hydra_setup", "run_logging")}.items() for name in names}
# and where modules of core/ went when it was split by domain (algorithms, rewards, verl, planner, pool, telemetry)
LEGACY_MODULES.update({"fully_async.core.algorithms": "fully_async.algorithms", "fully_async.core.rewards":
                       "fully_async.rewards", "fully_async.core.metrics": "fully_async.telemetry.metrics",
                       "fully_async.core.timeline": "fully_async.telemetry.timeline"})
# what else an older state pickle may name: numpy arrays (a dataset's list columns) and their dtypes
_LEGACY_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                   ("numpy", "ndarray"), ("numpy", "dtype"), ("collections", "OrderedDict"),
                   # protocols 0-1 build a record as copyreg._reconstructor(cls, object, None)
                   ("copyreg", "_reconstructor"), ("builtins", "object"), ("copy_reg", "_reconstructor"),
                   ("__builtin__", "object")}


class _RecordsOnlyUnpickler(pickle.Unpickler):
    """Builds the records of core.types / core.partial (moved modules mapped) and numpy arrays; any other global a
    pickle names -- the way a planted file runs code -- is refused."""

    def __init__(self, fh: Any, path: str):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        for depth in (3, 2):
            top = ".".join(module.split(".")[:depth])
            if top in LEGACY_MODULES:
                module = LEGACY_MODULES[top] + module[len(top):]
                break
        cls = _state_classes().get(name)
        if cls is not None and module == cls.__module__:
            return cls
        if (module, name) in _LEGACY_GLOBALS or (module.startswith("numpy") and name.endswith("DType")):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path} (a state file an older version pickled) names {module}.{name}, which a "
                              "checkpoint's state never holds: refusing to load it (unpickling it could run code).  "
                              "Resume from a checkpoint this version wrote, or start fresh "
                              "(trainer.resume_mode=disable)")


def _read_legacy_pickle(path: str) -> Any:
    with open(path, "rb") as fh:
        try:
            return _RecordsOnlyUnpickler(fh, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
            raise CheckpointError(f"{path} is not a readable state pickle ({type(exc).__name__}: {exc}); resume "
                                  "from an earlier checkpoint or start fresh") from None
