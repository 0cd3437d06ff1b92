"""Reference vectors of verl's own advantage estimators and policy losses, for tests/unit/algorithms/test_verl_parity.py.

verl is not installable here, so this script takes `verl/trainer/ppo/core_algos.py` (and the helpers it calls:
utils/groupwise.py, utils/device.py, utils/import_utils.py, and masked_sum/mean/var/whiten out of
utils/torch_functional.py) from the verl mirror at a pinned commit, puts them in a temporary `verl` package whose
other imports (AlgoConfig, ActorConfig) are minimal stand-ins, runs each estimator and loss mode on fixed random
inputs, and writes inputs and outputs (with the loss's gradient) to tests/fixtures/verl_algo_vectors.pt.

    python scripts/gen_verl_algo_vectors.py [--git-dir /work/.mirror/volcengine+verl/repo] [--commit b178a3cd5]
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "verl_algo_vectors.pt")
VERBATIM = ("verl/trainer/ppo/core_algos.py", "verl/utils/groupwise.py", "verl/utils/device.py",
            "verl/utils/import_utils.py")
TORCH_FUNCTIONAL = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")
ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
              "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")   # they read old log-probs and sum pi^2
LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # the pinned agg_loss's -norm is not 0.9's
ACTOR = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
             clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=5.0, kl_cov_ratio=0.1, ppo_kl_coef=0.1)
BEHAV_CAP = 2.0

STUBS = {
    "verl/__init__.py": "",
    "verl/trainer/__init__.py": "",
    "verl/trainer/ppo/__init__.py": "",
    "verl/utils/__init__.py": "from .groupwise import as_torch_index, group_mean_std\n",
    "verl/trainer/config/__init__.py": "class AlgoConfig(dict):\n    def __getattr__(self, k):\n        return self[k]\n",
    "verl/workers/__init__.py": "",
    "verl/workers/config/__init__.py": (
        "class ActorConfig:\n"
        "    def __init__(self, **kw):\n        self.__dict__.update(kw)\n"
        "    def get(self, k, default=None):\n        return self.__dict__.get(k, default)\n"),
}


def git_show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def functions_of(source: str, names: tuple[str, ...]) -> str:
    """The source of the named top-level functions of a module (verbatim), with `import torch` before them."""
    tree = ast.parse(source)
    lines = source.splitlines()
    parts = ["import torch\n"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            parts.append("\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n")
    return "\n".join(parts)


def build_package(git_dir: str, commit: str, where: str) -> None:
    for path, text in STUBS.items():
        _write(where, path, text)
    for path in VERBATIM:
        _write(where, path, git_show(git_dir, commit, path))
    _write(where, "verl/utils/torch_functional.py",
           functions_of(git_show(git_dir, commit, "verl/utils/torch_functional.py"), TORCH_FUNCTIONAL))


def _write(where: str, path: str, text: str) -> None:
    full = os.path.join(where, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------------- inputs
def advantage_inputs(g: torch.Generator, sizes: list[int], length: int = 9) -> dict:
    """Groups of `sizes` responses (response-only layout, verl's): scores mixing 0/1, equal and continuous groups;
    token rewards = the score on the last response token minus a small per-token penalty (in-reward KL)."""
    bsz = sum(sizes)
    group_ids = [f"p{k}" for k, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(bsz, generator=g).tolist()                       # groups interleaved, as in a batch
    group_ids = [group_ids[i] for i in perm]
    lengths = torch.randint(2, length + 1, (bsz,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    binary = (torch.rand(bsz, generator=g) > 0.5).float()
    continuous = torch.randn(bsz, generator=g)
    scores = torch.where(torch.arange(bsz) % 2 == 0, binary, continuous)
    first_group = [i for i, gid in enumerate(group_ids) if gid == "p0"]
    scores[first_group] = 1.0                                              # a group whose rewards all agree
    second_group = [i for i, gid in enumerate(group_ids) if gid == "p1"]
    scores[second_group] = 0.5 + 3e-4 * torch.arange(len(second_group))   # nearly agree: variance under eps
    rewards = torch.zeros(bsz, length)
    rewards[torch.arange(bsz), lengths - 1] = scores
    penalty = 0.01 * torch.rand(bsz, length, generator=g) * mask
    # remax: the reward of each prompt's greedy response, one value per group (no draw: the other vectors stay)
    baselines = torch.tensor([(int(gid[1:]) % 3) * 0.5 - 0.25 for gid in group_ids])
    return dict(group_ids=group_ids, mask=mask, scores=scores, token_rewards=rewards,
                token_rewards_kl=rewards - penalty, reward_baselines=baselines)


def loss_inputs(g: torch.Generator, rows: int = 8, length: int = 10) -> dict:
    """Rows whose mean log-ratio spreads both ways (one far out: GSPO's clamp at 10, the dual clip), one row with
    token-level advantages, one without response tokens."""
    mask = (torch.rand(rows, length, generator=g) > 0.25).float()
    mask[-1] = 0                                                           # a row without response tokens
    old = -torch.rand(rows, length, generator=g) * 3
    shift = 0.3 * torch.randn(rows, 1, generator=g)
    shift[1] = 10.5
    logp = old + shift + 0.3 * torch.randn(rows, length, generator=g)
    adv = (2 * torch.randn(rows, 1, generator=g)).expand(rows, length).contiguous()
    adv[0] = torch.randn(length, generator=g)                              # one row with token-level advantages
    behav = old + 0.4 * torch.randn(rows, length, generator=g)
    return dict(logp=logp, old_logp=old, advantages=adv, mask=mask, behav_logp=behav)


def otb_inputs(g: torch.Generator, base: dict, holes: bool) -> dict:
    """`base` plus the optimal-token-baseline estimators' inputs: old log-probs, sum_pi_squared in [exp(old)^2, 1]
    (a distribution holding that probability), rollout-correction weights; `holes`: response masks with holes
    inside (rejected tokens, or a multi-turn response's tool output)."""
    mask = base["mask"].clone()
    if holes:
        mask[::2, 1] = 0.0
    old = -3 * torch.rand(mask.shape, generator=g)
    pi = torch.exp(old)
    spp = pi ** 2 + (1 - pi) ** 2 * torch.rand(mask.shape, generator=g)
    weights = 0.5 + torch.rand(mask.shape, generator=g)
    return dict(base, mask=mask, old_log_probs=old, sum_pi_squared=spp, rollout_is_weights=weights)


# ----------------------------------------------------------------------------------- verl's outputs
def verl_advantage(core: object, name: str, inp: dict, norm: bool, gamma: float, kl: bool) -> torch.Tensor:
    from verl.trainer.config import AlgoConfig
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm, gamma=gamma)
    rewards = (inp["token_rewards_kl"] if kl else inp["token_rewards"]).clone()
    kwargs = dict(token_level_rewards=rewards, response_mask=inp["mask"], config=config,
                  index=np.array(inp["group_ids"], dtype=object))
    if name in ("grpo", "grpo_vectorized"):
        kwargs["norm_adv_by_std_in_grpo"] = norm
    if name == "remax":
        kwargs["reward_baselines"] = inp["reward_baselines"]
    return core.get_adv_estimator_fn(name)(**kwargs)[0]


def verl_loss(core: object, mode: str, inp: dict, agg: str, weighted: bool, seed: int) -> dict:
    from verl.workers.config import ActorConfig
    a = ACTOR
    config = ActorConfig(clip_ratio=a["clip_ratio"], clip_ratio_low=a["clip_ratio_low"],
                         clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"], tau_pos=a["tau_pos"],
                         tau_neg=a["tau_neg"], global_batch_info={},
                         policy_loss=SimpleNamespace(**{k: a[k] for k in ("clip_cov_ratio", "clip_cov_lb",
                                                                           "clip_cov_ub", "kl_cov_ratio",
                                                                           "ppo_kl_coef")}))
    logp = inp["logp"].clone().requires_grad_()
    weights = None
    if weighted:
        weights = torch.exp((inp["old_logp"] - inp["behav_logp"]).clamp(-20, 20)).clamp(max=BEHAV_CAP)
    torch.manual_seed(seed)
    loss, metrics = core.get_policy_loss_fn(mode)(old_log_prob=inp["old_logp"], log_prob=logp,
                                                  advantages=inp["advantages"], response_mask=inp["mask"],
                                                  loss_agg_mode=agg, config=config, rollout_is_weights=weights)
    loss.backward()
    return dict(loss=loss.detach(), grad=logp.grad.detach(), metrics={k: float(v) for k, v in metrics.items()})


def generate(core: object) -> dict:
    g = torch.Generator().manual_seed(20240611)
    adv_sets = {"with_singleton": advantage_inputs(g, [4, 4, 3, 1, 5]),
                "groups": advantage_inputs(g, [4, 4, 3, 2, 5])}
    advantages = []
    for set_name, inp in adv_sets.items():
        for name in ESTIMATORS:
            if name == "grpo_passk" and set_name == "with_singleton":
                continue                                               # verl refuses a group of one
            for norm in ((True, False) if name.startswith("grpo") else (True,)):
                for gamma in ((1.0, 0.9) if name == "reinforce_plus_plus" else (1.0,)):
                    for kl in (False, True):
                        out = verl_advantage(core, name, inp, norm, gamma, kl)
                        advantages.append(dict(inputs=set_name, estimator=name, norm=norm, gamma=gamma, kl=kl,
                                               advantages=out))
    loss_in = loss_inputs(g)
    losses = []
    for seed, (mode, agg, weighted) in enumerate((m, a, w) for m in LOSS_MODES for a in AGG_MODES
                                                 for w in (False, True)):
        losses.append(dict(mode=mode, agg=agg, weighted=weighted, seed=seed,
                           **verl_loss(core, mode, loss_in, agg, weighted, seed)))
    otb_sets = {"otb": otb_inputs(g, adv_sets["with_singleton"], holes=False),
                "otb_holes": otb_inputs(g, adv_sets["groups"], holes=True)}
    otb = []
    for set_name, inp in otb_sets.items():
        for name in OTB_ESTIMATORS:
            for weighted in (False, True):
                rewards = inp["token_rewards_kl"] * inp["mask"]
                out = core.get_adv_estimator_fn(name)(
                    token_level_rewards=rewards.clone(), response_mask=inp["mask"],
                    index=np.array(inp["group_ids"], dtype=object), old_log_probs=inp["old_log_probs"],
                    sum_pi_squared=inp["sum_pi_squared"],
                    rollout_is_weights=inp["rollout_is_weights"] if weighted else None)[0]
                otb.append(dict(inputs=set_name, estimator=name, weighted=weighted, advantages=out))
    return dict(advantage_inputs=adv_sets, advantages=advantages, loss_inputs=loss_in, losses=losses,
                actor=ACTOR, behav_cap=BEHAV_CAP, otb_inputs=otb_sets, otb=otb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--git-dir", default="/work/.mirror/volcengine+verl/repo")
    ap.add_argument("--commit", default="b178a3cd5")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    commit = subprocess.run(["git", f"--git-dir={args.git_dir}", "rev-parse", args.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as where:
        build_package(args.git_dir, commit, where)
        sys.path.insert(0, where)
        from verl.trainer.ppo import core_algos
        data = generate(core_algos)
    data["verl_commit"] = commit
    torch.save(data, args.out)
    print(f"wrote {len(data['advantages']) + len(data['otb'])} advantage and {len(data['losses'])} loss vectors of "
          f"verl {commit[:10]} to {args.out}")


if __name__ == "__main__":
    main()
