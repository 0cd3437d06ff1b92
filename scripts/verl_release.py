"""verl's own algorithm code, from a release's wheel, importable without verl's dependencies (for the generators of
the reference vectors: scripts/gen_verl_algo_vectors.py).

`pip download --no-deps verl==<version>` fetches the wheel (or `--wheel` names one already downloaded); the files the
algorithm modules need (core_algos.py, rollout_corr_helper.py, utils/groupwise.py, utils/import_utils.py and
masked_sum/mean/var/whiten out of utils/torch_functional.py) are copied verbatim from it into a temporary `verl`
package whose other imports (AlgoConfig, ActorConfig, DataProto, the device helper) are minimal stand-ins.  Nothing
of verl is kept in this repository: only the vectors its functions produce.
"""
from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from types import ModuleType

VERBATIM = ("verl/trainer/ppo/core_algos.py", "verl/trainer/ppo/rollout_corr_helper.py", "verl/utils/groupwise.py",
            "verl/utils/import_utils.py")
TORCH_FUNCTIONAL = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")
STUBS = {
    "verl/__init__.py": "",
    "verl/trainer/__init__.py": "",
    "verl/trainer/ppo/__init__.py": "",
    "verl/utils/__init__.py": "from .groupwise import as_torch_index, group_mean_std\n",
    "verl/utils/device.py": "def get_device_name():\n    return 'cpu'\n",
    "verl/trainer/config/__init__.py": "class AlgoConfig(dict):\n    def __getattr__(self, k):\n        return self[k]\n",
    "verl/trainer/config/algorithm.py": "RolloutCorrectionConfig = dict\n",
    "verl/workers/__init__.py": "",
    "verl/workers/config/__init__.py": (
        "class ActorConfig:\n"
        "    def __init__(self, **kw):\n        self.__dict__.update(kw)\n"
        "    def get(self, k, default=None):\n        return self.__dict__.get(k, default)\n"),
    "verl/workers/config/actor.py": "PolicyLossConfig = dict\n",
    "verl/protocol.py": (
        "class DataProto:\n"
        "    def __init__(self, batch):\n        self.batch = batch\n\n"
        "    @classmethod\n"
        "    def from_dict(cls, tensors):\n        return cls(dict(tensors))\n"),
}


def download_wheel(version: str, where: str) -> str:
    """The path of verl==`version`'s wheel, downloaded (no dependencies) into `where`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"verl=={version}", "-d", where],
                   check=True)
    found = glob.glob(os.path.join(where, f"verl-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip download left no verl-{version} wheel in {where}")
    return found[0]


def functions_of(source: str, names: tuple[str, ...]) -> str:
    """The source of the named top-level functions of a module (verbatim), with `import torch` before them, and a
    distributed mean that is never reached (no process group)."""
    tree = ast.parse(source)
    parts = ["import torch\n"]
    parts += [ast.get_source_segment(source, n) + "\n" for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name in names]
    parts.append("def distributed_masked_mean(*a, **k):\n    raise RuntimeError('not distributed here')\n")
    return "\n\n".join(parts)


def build_package(wheel: str, where: str) -> None:
    files = dict(STUBS)
    with zipfile.ZipFile(wheel) as zf:
        for path in VERBATIM:
            files[path] = zf.read(path).decode()
        files["verl/utils/torch_functional.py"] = functions_of(zf.read("verl/utils/torch_functional.py").decode(),
                                                               TORCH_FUNCTIONAL)
    for path, text in files.items():
        full = os.path.join(where, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def load(version: str, wheel: str | None, where: str) -> tuple[ModuleType, ModuleType]:
    """(core_algos, rollout_corr_helper) of the release, built under `where` (a temporary folder)."""
    if wheel is None:
        wheel = download_wheel(version, tempfile.mkdtemp(dir=where))
    build_package(wheel, os.path.join(where, "pkg"))
    sys.path.insert(0, os.path.join(where, "pkg"))
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    return core_algos, rollout_corr_helper
