"""Reference vectors of a verl release's own algorithm functions, for the parity tests
(tests/unit/algorithms/test_verl_parity.py, test_rollout_correction.py): one command per release.

    python scripts/gen_verl_algo_vectors.py --version 0.9.1 [--wheel verl-0.9.1-py3-none-any.whl] [--out ...]

The release's wheel is fetched with `pip download --no-deps` (or `--wheel` names one); its core_algos.py and
rollout_corr_helper.py run from a temporary package with minimal stand-ins for their other imports
(scripts/verl_release.py).  Each advantage estimator (advantages and returns), policy-loss mode (loss, its gradient
with respect to the current log-probs, the metrics verl reports) under every loss_agg_mode, the rollout-correction
cases and the bypass-mode loss cases (scripts/verl_corr_cases.py) run on fixed random inputs; inputs and outputs go
to tests/fixtures/verl_algo_vectors.pt (about 0.5 MB), with the release's version.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import torch

import verl_corr_cases
import verl_release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "verl_algo_vectors.pt")
ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
              "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")   # they read old log-probs and sum pi^2
LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ACTOR = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
             clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=5.0, kl_cov_ratio=0.1, ppo_kl_coef=0.1, dro_beta=0.3)
BEHAV_CAP = 2.0
GPG_F_NORMS = (1.0, 2.5)
GDPO_WEIGHTS = (None, [0.7, 1.3])


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
def verl_advantage(core: object, name: str, inp: dict, norm: bool, gamma: float, kl: bool,
                   f_norm: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    from verl.trainer.config import AlgoConfig
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm, gamma=gamma)
    rewards = (inp["token_rewards_kl"] if kl else inp["token_rewards"]).clone()
    kwargs = dict(token_level_rewards=rewards, response_mask=inp["mask"], config=config,
                  index=np.array(inp["group_ids"], dtype=object))
    if name in ("grpo", "grpo_vectorized"):
        kwargs["norm_adv_by_std_in_grpo"] = norm
    if name == "remax":
        kwargs["reward_baselines"] = inp["reward_baselines"]
    if name == "gpg":
        kwargs["f_norm"] = f_norm
    return core.get_adv_estimator_fn(name)(**kwargs)


def verl_loss(core: object, mode: str, inp: dict, agg: str, weighted: bool, seed: int) -> dict:
    from verl.workers.config import ActorConfig
    a = ACTOR
    config = ActorConfig(clip_ratio=a["clip_ratio"], clip_ratio_low=a["clip_ratio_low"],
                         clip_ratio_high=a["clip_ratio_high"], clip_ratio_c=a["clip_ratio_c"], tau_pos=a["tau_pos"],
                         tau_neg=a["tau_neg"], global_batch_info={},
                         policy_loss=SimpleNamespace(**{k: a[k] for k in ("clip_cov_ratio", "clip_cov_lb",
                                                                           "clip_cov_ub", "kl_cov_ratio",
                                                                           "ppo_kl_coef", "dro_beta")}))
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


def gdpo_case(core: object, inp: dict, weights: list | None, norm: bool) -> torch.Tensor:
    """verl's gdpo on two reward components (the score and a second draw), as its trainer calls it: the components
    from the reward function's dict (non_tensor_batch), placed on the last response token (batch's masks)."""
    from verl.trainer.config import AlgoConfig
    mask = inp["mask"]
    prompt = torch.ones(mask.shape[0], 2, dtype=torch.long)
    config = AlgoConfig(norm_adv_by_std_in_grpo=norm, gdpo_reward_keys=["acc", "fmt"], gdpo_reward_weights=weights)
    return core.get_adv_estimator_fn("gdpo")(
        token_level_rewards=inp["token_rewards"], response_mask=mask, index=np.array(inp["group_ids"], dtype=object),
        config=config, norm_adv_by_std_in_grpo=norm,
        non_tensor_batch={"acc": inp["components"][:, 0].numpy(), "fmt": inp["components"][:, 1].numpy()},
        batch={"prompts": prompt, "attention_mask": torch.cat([prompt, mask.long()], -1)})[0]


def advantage_cases(core: object, adv_sets: dict) -> list[dict]:
    out = []
    for set_name, inp in adv_sets.items():
        for name in ESTIMATORS:
            if name == "grpo_passk" and set_name == "with_singleton":
                continue                                               # verl refuses a group of one
            for norm in ((True, False) if name.startswith("grpo") else (True,)):
                for gamma in ((1.0, 0.9) if name == "reinforce_plus_plus" else (1.0,)):
                    for f_norm in (GPG_F_NORMS if name == "gpg" else (1.0,)):
                        for kl in (False, True):
                            adv, ret = verl_advantage(core, name, inp, norm, gamma, kl, f_norm)
                            out.append(dict(inputs=set_name, estimator=name, norm=norm, gamma=gamma, kl=kl,
                                            f_norm=f_norm, advantages=adv, returns=ret))
    return out


def generate(core: object, helper: object) -> dict:
    g = torch.Generator().manual_seed(20240611)
    adv_sets = {"with_singleton": advantage_inputs(g, [4, 4, 3, 1, 5]),
                "groups": advantage_inputs(g, [4, 4, 3, 2, 5])}
    holes = dict(adv_sets["groups"], mask=adv_sets["groups"]["mask"].clone())
    holes["mask"][::3, 1] = 0.0                                        # tool tokens inside multi-turn responses
    adv_sets["groups_holes"] = holes
    for inp in adv_sets.values():
        inp["components"] = torch.stack([inp["scores"], (torch.rand(len(inp["scores"]), generator=g) > 0.4).float()],
                                        -1)
    advantages = advantage_cases(core, adv_sets)
    gdpo = [dict(inputs=set_name, weights=w, norm=norm, advantages=gdpo_case(core, adv_sets[set_name], w, norm))
            for set_name in ("with_singleton", "groups") for w in GDPO_WEIGHTS for norm in (True, False)]
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
                for zero_tail in (True, False):
                    rewards = inp["token_rewards_kl"] * inp["mask"]
                    adv, ret = core.get_adv_estimator_fn(name)(
                        token_level_rewards=rewards.clone(), response_mask=inp["mask"],
                        index=np.array(inp["group_ids"], dtype=object), old_log_probs=inp["old_log_probs"],
                        sum_pi_squared=inp["sum_pi_squared"], handle_zero_tail=zero_tail,
                        rollout_is_weights=inp["rollout_is_weights"] if weighted else None)
                    otb.append(dict(inputs=set_name, estimator=name, weighted=weighted, zero_tail=zero_tail,
                                    advantages=adv, returns=ret))
    corr, bypass = verl_corr_cases.generate(helper, core, ACTOR)
    return dict(advantage_inputs=adv_sets, advantages=advantages, gdpo=gdpo, loss_inputs=loss_in, losses=losses,
                actor=ACTOR, behav_cap=BEHAV_CAP, otb_inputs=otb_sets, otb=otb, rollout_corr=corr, bypass=bypass)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.9.1", help="the verl release (PyPI version)")
    ap.add_argument("--wheel", default=None, help="that release's wheel, already downloaded (else pip downloads it)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as where:
        core, helper = verl_release.load(args.version, args.wheel, where)
        data = generate(core, helper)
    data["verl_version"] = args.version
    torch.save(data, args.out)
    print(f"wrote {len(data['advantages']) + len(data['otb']) + len(data['gdpo'])} advantage, {len(data['losses'])} "
          f"loss, {len(data['rollout_corr'])} rollout-correction and {len(data['bypass'])} bypass vectors of verl "
          f"{args.version} to {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
