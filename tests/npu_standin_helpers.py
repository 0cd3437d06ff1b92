"""Running the package under the test-only NPU stand-in (tests/npu_standin): the environment a subprocess needs
and what the stand-in logged.  The stand-in is importable only where these helpers put it: on the PYTHONPATH of a
child process (the driver of `python -m fully_async.main` and, through it, every Ray worker the run starts), never
in the pytest process itself (registering torch.npu cannot be undone)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN_DIR = os.path.join(REPO, "tests", "npu_standin")


def standin_env(log_path: str, backend: str = "cpu", devices: int = 2, **extra: str) -> dict[str, str]:
    """os.environ plus the stand-in on PYTHONPATH (first, so `import torch_npu` and Ray's `import acl` find it)."""
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}   # the node's, unless given
    env.update(FA_NPU_STANDIN_BACKEND=backend, FA_NPU_STANDIN_DEVICES=str(devices), FA_NPU_STANDIN_LOG=log_path,
               **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN_DIR, REPO, os.environ.get("PYTHONPATH")) if p)
    return env


def ray_npu_count(env: dict[str, str]) -> Optional[int]:
    """The NPUs Ray detects on this node under `env` (its NPU accelerator manager asks `acl`), None when this Ray
    has no NPU support."""
    code = ("from ray._private.accelerators.npu import NPUAcceleratorManager as M; "
            "print(M.get_current_node_num_accelerators())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(r.stdout.split()[-1]) if r.returncode == 0 and r.stdout.split() else None


def read_log(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_main(env: dict[str, str], *overrides: str, timeout: int = 300,
             module: str = "fully_async.main") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
