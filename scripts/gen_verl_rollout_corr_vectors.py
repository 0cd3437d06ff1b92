"""Writes tests/fixtures/verl_rollout_corr.json: verl's own rollout correction run on fixed inputs.

verl's `compute_rollout_correction_and_rejection_mask` (verl/trainer/ppo/rollout_corr_helper.py) is loaded from a
verl git checkout (a bare repository is enough) with the few verl modules it imports stubbed: masked_sum and
masked_mean are verl's own source (verl/utils/torch_functional.py, the two functions only), DataProto is a holder
of tensors, the config classes are dicts.  Each case's inputs (old and rollout log-probs, response mask, the
options) and verl's outputs (weights, mask, metrics) go to the fixture, which
tests/unit/algorithms/test_rollout_correction.py replays against fully_async/algorithms/rollout_correction.py.

    python scripts/gen_verl_rollout_corr_vectors.py [--verl-git-dir /work/.mirror/volcengine+verl/repo] [--commit HEAD]
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile

import torch

HELPER = "verl/trainer/ppo/rollout_corr_helper.py"
FUNCTIONAL = "verl/utils/torch_functional.py"
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "verl_rollout_corr.json")

STUBS = {
    "verl/__init__.py": "",
    "verl/utils/__init__.py": "",
    "verl/trainer/__init__.py": "",
    "verl/trainer/ppo/__init__.py": "",
    "verl/trainer/config/__init__.py": "",
    "verl/trainer/config/algorithm.py": "RolloutCorrectionConfig = dict\n",
    "verl/workers/__init__.py": "",
    "verl/workers/config/__init__.py": "",
    "verl/workers/config/actor.py": "PolicyLossConfig = dict\n",
    "verl/protocol.py": (
        "class DataProto:\n"
        "    def __init__(self, batch):\n"
        "        self.batch = batch\n\n"
        "    @classmethod\n"
        "    def from_dict(cls, tensors):\n"
        "        return cls(dict(tensors))\n"),
}

# (name, rollout_is, rollout_is_threshold, batch_normalize, rollout_rs, rollout_rs_threshold)
CASES = [
    ("token_is", "token", 2.0, False, None, None),
    ("token_is_normalized", "token", 1.5, True, None, None),
    ("sequence_is", "sequence", 3.0, False, None, None),
    ("sequence_is_normalized", "sequence", 5.0, True, None, None),
    ("rs_token_k1", None, 2.0, False, "token_k1", "0.8_1.25"),
    ("rs_token_k1_upper_only", None, 2.0, False, "token_k1", 1.3),
    ("rs_token_k2", None, 2.0, False, "token_k2", 0.02),
    ("rs_token_k3", None, 2.0, False, "token_k3", 0.02),
    ("rs_seq_sum_k1", None, 2.0, False, "seq_sum_k1", "0.5_2.0"),
    ("rs_seq_sum_k2", None, 2.0, False, "seq_sum_k2", 0.1),
    ("rs_seq_sum_k3", None, 2.0, False, "seq_sum_k3", 0.1),
    ("rs_seq_mean_k1", None, 2.0, False, "seq_mean_k1", "0.9_1.1"),
    ("rs_seq_mean_k2", None, 2.0, False, "seq_mean_k2", 0.01),
    ("rs_seq_mean_k3", None, 2.0, False, "seq_mean_k3", 0.01),
    ("rs_seq_max_k2", None, 2.0, False, "seq_max_k2", 0.05),
    ("rs_seq_max_k3", None, 2.0, False, "seq_max_k3", 0.05),
    ("rs_two_options", None, 2.0, False, "token_k1,seq_mean_k3", "0.7_1.4,0.02"),
    ("is_and_rs", "token", 2.0, False, "seq_max_k2,token_k3", "0.05"),
]


def git_show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def functional_source(git_dir: str, commit: str) -> str:
    """verl's masked_sum and masked_mean, and a distributed mean that is never reached (no process group)."""
    src = git_show(git_dir, commit, FUNCTIONAL)
    tree = ast.parse(src)
    funcs = [ast.get_source_segment(src, n) for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name in ("masked_sum", "masked_mean")]
    return ("import torch\n\n" + "\n\n".join(funcs) + "\n\n\ndef distributed_masked_mean(*a, **k):\n"
            "    raise RuntimeError('not distributed here')\n")


def load_helper(git_dir: str, commit: str, root: str):
    files = dict(STUBS, **{FUNCTIONAL: functional_source(git_dir, commit),
                           HELPER: git_show(git_dir, commit, HELPER)})
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    sys.path.insert(0, root)
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, rollout, mask) (6, 9) float64: ragged responses, log-ratios mostly small, some large."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    shift = torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.15
    shift[1, 2], shift[4, 0] = 1.2, -1.5          # outliers
    lengths = [9, 7, 4, 9, 1, 6]
    mask = torch.zeros(6, 9, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return rollout + shift, rollout, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verl-git-dir", default="/work/.mirror/volcengine+verl/repo")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    commit = subprocess.run(["git", f"--git-dir={args.verl_git_dir}", "rev-parse", args.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as root:
        helper = load_helper(args.verl_git_dir, commit, root)
        cases = []
        for i, (name, level, thr, norm, rs, rs_thr) in enumerate(CASES):
            old, rollout, mask = inputs(seed=i)
            weights, new_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
                old_log_prob=old, rollout_log_prob=rollout, response_mask=mask, rollout_is=level,
                rollout_is_threshold=thr, rollout_is_batch_normalize=norm, rollout_rs=rs, rollout_rs_threshold=rs_thr)
            cases.append({
                "name": name, "rollout_is": level, "rollout_is_threshold": thr, "rollout_is_batch_normalize": norm,
                "rollout_rs": rs, "rollout_rs_threshold": rs_thr,
                "old": old.tolist(), "rollout": rollout.tolist(), "mask": mask.tolist(),
                "weights": weights.batch["rollout_is_weights"].tolist() if weights is not None else None,
                "new_mask": new_mask.tolist(), "metrics": {k: float(v) for k, v in metrics.items()}})
    with open(args.out, "w") as fh:
        json.dump({"verl_commit": commit, "source": HELPER, "cases": cases}, fh)
        fh.write("\n")
    print(f"wrote {len(cases)} cases from verl {commit[:12]} to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
