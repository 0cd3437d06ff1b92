"""Reference vectors for GAE and the clipped value loss from verl's own functions (tests/fixtures/gae_verl.json).

verl's `compute_gae_advantage_return`, `compute_value_loss` and `agg_loss` (verl/trainer/ppo/core_algos.py) and the
masked helpers they call (verl/utils/torch_functional.py) are read from a verl checkout and executed as they are,
lifted out of their modules by `ast` so that nothing else of verl (Ray, its config classes) has to import.  The
inputs use verl's (B, response_length) layout, right-padded responses.

    python scripts/make_gae_fixture.py --verl-git-dir /work/.mirror/volcengine+verl/repo \
        [--out tests/fixtures/gae_verl.json]
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import types

import torch

HELPERS = ("masked_sum", "masked_mean", "masked_var", "masked_whiten", "clip_by_value")
ALGOS = ("compute_gae_advantage_return", "agg_loss", "compute_value_loss")


def verl_source(git_dir: str, path: str) -> tuple[str, str]:
    """(source of `path` at HEAD, the commit) of the verl checkout."""
    src = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], check=True, capture_output=True,
                         text=True).stdout
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    return src, commit


def lift(source: str, names: tuple[str, ...], namespace: dict) -> None:
    """Execute the top-level functions `names` of `source` (decorators dropped) in `namespace`."""
    tree = ast.parse(source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {f.name for f in found}
    if missing:
        raise SystemExit(f"verl's source has no {sorted(missing)}")
    for fn in found:
        fn.decorator_list = []
    exec(compile(ast.Module(body=found, type_ignores=[]), "<verl>", "exec"), namespace)


def verl_functions(git_dir: str) -> tuple[dict, str]:
    from typing import Optional

    helpers_src, commit = verl_source(git_dir, "verl/utils/torch_functional.py")
    verl_f: dict = {"torch": torch}
    lift(helpers_src, HELPERS, verl_f)
    algos_src, _ = verl_source(git_dir, "verl/trainer/ppo/core_algos.py")
    ns: dict = {"torch": torch, "Optional": Optional, "verl_F": types.SimpleNamespace(**verl_f)}
    lift(algos_src, ALGOS, ns)
    return ns, commit


def case(gen: torch.Generator, batch: int, length: int) -> dict:
    """Random right-padded responses: rewards on the last token (plus small per-token terms), values, a mask."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.rand(batch, generator=gen)
    rewards = rewards - 0.01 * torch.rand(batch, length, generator=gen) * mask
    values = torch.randn(batch, length, generator=gen) * mask
    return {"rewards": rewards, "values": values, "mask": mask,
            "vpreds": values + 0.8 * torch.randn(batch, length, generator=gen),
            "returns": torch.randn(batch, length, generator=gen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verl-git-dir", required=True)
    ap.add_argument("--out", default="tests/fixtures/gae_verl.json")
    args = ap.parse_args()
    ns, commit = verl_functions(args.verl_git_dir)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for batch, length, gamma, lam, clip, mode in [(4, 7, 1.0, 1.0, 0.5, "token-mean"),
                                                  (5, 9, 0.99, 0.95, 0.2, "seq-mean-token-mean"),
                                                  (3, 6, 0.9, 0.8, 0.1, "seq-mean-token-sum")]:
        x = case(gen, batch, length)
        adv, ret = ns["compute_gae_advantage_return"](x["rewards"], x["values"], x["mask"], gamma, lam)
        vf_loss, vf_clipfrac = ns["compute_value_loss"](x["vpreds"], x["returns"], x["values"], x["mask"], clip, mode)
        cases.append({"gamma": gamma, "lam": lam, "cliprange_value": clip, "loss_agg_mode": mode,
                      **{k: v.tolist() for k, v in x.items()},
                      "advantages": adv.tolist(), "gae_returns": ret.tolist(),
                      "vf_loss": float(vf_loss), "vf_clipfrac": float(vf_clipfrac)})
    with open(args.out, "w") as fh:
        json.dump({"verl_commit": commit, "cases": cases}, fh, indent=1)
        fh.write("\n")
    print(f"{len(cases)} cases from verl {commit[:12]} -> {args.out}")


if __name__ == "__main__":
    main()
