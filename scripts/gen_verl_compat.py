"""Write docs/verl_compat.md: every key of verl's trainer configs (docs/verl_config_keys.tsv) with what
fully_async does with it (honoured, mapped, warned, refused) and why, from fully_async/verl/compat.py.

    python scripts/gen_verl_compat.py            # rewrite the doc
    python scripts/gen_verl_compat.py --check    # exit 1 when the committed doc is stale

tests/unit/scripts/test_gen_verl_compat.py checks that the committed doc is this script's output.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

NEWEST = "0.9.1"   # the verl release the key table follows (docs/verl_config_keys.tsv's first version)
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
TSV = os.path.join(ROOT, "docs", "verl_config_keys.tsv")
DOC = os.path.join(ROOT, "docs", "verl_compat.md")

# what the RL math follows, and what changed for a user of the older verl (docs/verl_compat.md's second section)
FOLLOWED = (
    "The RL math (advantage estimators and their returns, policy losses, rollout correction) follows verl **0.9.1**, "
    "the release on PyPI: `tests/fixtures/verl_algo_vectors.pt` holds the vectors of 0.9.1's own functions and "
    "`tests/unit/algorithms/test_verl_parity.py` and `test_rollout_correction.py` check ours against them "
    "(`python scripts/gen_verl_algo_vectors.py --version <release>` regenerates them from another release's wheel, "
    "installed with `--no-deps` into a temporary folder).  The key table below holds every key of verl 0.9.1's "
    "trainer configs and those of the older verl commit b178a3cd that 0.9.1 removed (marked *b178a3cd only*: a "
    "script for the older release may still pass them); `python scripts/verl_config_keys.py 0.9.1=pypi "
    "b178a3cd=<verl git dir>@b178a3cd -o docs/verl_config_keys.tsv` rebuilds it from the releases' own YAML.  The "
    "launch scripts are tested from both b178a3cd and verl 0.9 (below).  What a user of that older verl sees "
    "change:")
CHANGES = (
    "`rollout_corr/rollout_is_mean`, `_max`, `_min`, `_std`, `_eff_sample_size` and `_seq_mean/std/max/min/"
    "max_deviation` are computed on the applied (truncated) weights, std and ESS with the weights clamped to "
    "[0, rollout_is_threshold] (before: the weights before truncation, clamped to [1/threshold, threshold]); "
    "`_seq_fraction_high/low` compare each response's mean raw weight with the bounds.  Dashboards show other "
    "numbers for the same run; the weights applied to the loss are unchanged.",
    "`algorithm.rollout_correction.rollout_is_threshold` also takes `\"lower_upper\"` (IcePop: a weight outside "
    "[lower, upper] becomes 0 instead of being truncated; `rollout_corr/rollout_is_oob_ratio`); a lower bound above "
    "the upper one is refused.",
    "Bypass mode (`rollout_correction.bypass_mode=true`) reports every `rollout_corr/*` metric of the current policy "
    "against the behaviour one, per micro-batch (before: only the rejected fraction).",
    "`loss_mode=gspo` is aggregated by `actor.loss_agg_mode` (before: always seq-mean-token-mean; set "
    "`loss_agg_mode=seq-mean-token-mean` for the old loss).",
    "The returns of `reinforce_plus_plus`, `remax`, `optimal_token_baseline` and `tir_optimal_token_baseline` are the "
    "reward-to-go (discounted by `algorithm.gamma` for reinforce_plus_plus), which a critic trained beside them "
    "(`critic.enable=true`) learns (before: the advantages).",
    "`reinforce_plus_plus` carries the running return unchanged through tokens outside the response mask (a multi-turn "
    "response's tool output) instead of restarting it there.",
    "`grpo_vectorized` takes a two-pass float32 variance without a floor (before: one pass, floored at 1e-6); groups "
    "whose scores nearly agree get different advantages.",
    "`optimal_token_baseline` gives the group's single longest response no baseline past the second longest, as "
    "`tir_optimal_token_baseline` did (verl 0.9.1's default); `algorithm.handle_zero_tail=false` turns it off for "
    "both (verl has no key for it: its function argument).",
    "New: policy-loss modes `dppo_tv`, `dppo_kl` (clip_ratio_low/high are the divergence bounds, clip_ratio_c the "
    "ratio truncation) and `dro` (`actor_rollout_ref.actor.policy_loss.dro_beta`, required); the `gdpo` estimator "
    "(`algorithm.gdpo_reward_keys`: keys of the reward function's dict, `score` being the score; "
    "`algorithm.gdpo_reward_weights`); `algorithm.gpg_f_norm` (gpg's f_norm, a function argument in verl).",
)

# tests/unit/run/test_verl_scripts_0_9.py checks this line against both script tables (runs every script)
SCRIPT_COUNTS = ("171 of 250 verl launch scripts translate (3 without a warning, 168 with warnings) and 79 are "
                 "refused for a documented reason: b178a3cd 1/105/16, verl 0.9 2/63/63 (translated / warned / "
                 "refused)")
V1_SECTION = (
    "`tests/fixtures/verl_scripts_0_9.tsv` holds verl 0.9's scripts: every folder of `examples/`, the fully-async and "
    "one-step-off recipes and the V1 async trainer's recipes (`tests/special_e2e/run_v1_*.sh`), at "
    "verl-project/verl 1dda039b (2026-08-22), the newest verl commit stored here.  verl 0.9.1's wheel and sdist on "
    "PyPI ship no scripts; its Python and YAML files are this commit's in 324 of 417 files (0.9.1 was built on "
    "2026-09-20), and the V1 keys below are read from 0.9.1's own code.  `scripts/extract_verl_scripts.py --set 0.9` "
    "regenerates the table from a newer commit.  " + SCRIPT_COUNTS + ".",
    "verl 0.9's V1 trainer (`trainer.use_v1`, default true there; `trainer.v1.trainer_mode`) is translated by "
    "`fully_async/verl/v1.py`, before the one-key rules, because one key sets several of ours:",
    "- `trainer_mode=sync` is `mode=sync`.",
    "- `trainer_mode=colocate_async` (verl: replicas on the trainer's GPUs; each step submits a train batch of "
    "prompts, "
    "`colocate_async.num_warmup_batches` batches are submitted ahead; once a batch of groups is complete the "
    "unfinished requests are aborted, the replicas sleep, the trainer trains, pushes, and the aborted requests resume "
    "on the new weights) is `mode=async async_training.placement=colocated rollout.n_gpus_per_node=0`, "
    "`trigger_parameter_sync_step=1`, `require_batches=train_batch_size/ppo_mini_batch_size`, `partial_rollout=true` "
    "and `staleness_threshold=num_warmup_batches` (extra train batches admitted ahead of the current version; verl "
    "rounds a fraction down to whole gen_batch_size chunks, here it is exact).",
    "- `trainer_mode=separate_async` (a standalone rollout pool `actor_rollout_ref.rollout.nnodes x n_gpus_per_node`, "
    "mapped onto `rollout.nnodes` / `rollout.n_gpus_per_node`; `parameter_sync_step` mini-batch updates per push; "
    "verl asserts train_batch_size = parameter_sync_step x ppo_mini_batch_size, refused here too) is split async "
    "with `trigger_parameter_sync_step=parameter_sync_step`, `require_batches=1` and the same admission window; "
    "`separate_async.hybrid_rollout.enable_switch=true` (idle trainer GPUs lent to generation) is "
    "`async_training.placement=elastic`; its threshold tuning keys are warned (the lent engines are reclaimed as "
    "soon as a step's groups are queued).",
    "- `sampler.max_off_policy_threshold` T: verl drops finished groups spanning more than T versions (`drop`) or "
    "stops sampling while an in-flight group has reached T (`wait`).  Nothing is dropped here and no group's age is "
    "capped in versions: the bound is on admission.  T=1 (every trained group from one version) is "
    "`staleness_threshold=0 partial_rollout=false`; null (no cap) is warned; T >= 2 is refused, naming "
    "`async_training.staleness_threshold` and `fully_async/staleness/max`.",
    "- `model_engine=megatron` is `actor_rollout_ref.actor.strategy=megatron`, `dp` is warned (the strategy "
    "decides), `veomni` / `torchtitan` are refused; `transfer_queue.enable` is warned (verl's V1 data plane).",
    "- `trainer.v1.sync` and the sampler's `custom_sampler.*`, `sampler_kwargs` and `sync_refill_failed_groups` "
    "are warned at verl 0.9.1's defaults and refused otherwise; a key of the `colocate_async` or `separate_async` "
    "section under another trainer_mode is warned (only that mode's trainer reads it).",
)

PLUS_FORMS = [
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.<field>", "reward_model.reward_kwargs.overlong_buffer_cfg.len"),
    ("+reward_model.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len"),
    ("+reward_model.reward_kwargs.<other>", "reward_model.reward_kwargs.other"),
    ("+custom_reward_function.reward_kwargs.<name>", "custom_reward_function.reward_kwargs.name"),
    ("+actor_rollout_ref.model.override_config.<hf field>", "actor_rollout_ref.model.override_config.x"),
    ("+actor_rollout_ref.model.override_config.model_config.<hf field>",
     "actor_rollout_ref.model.override_config.model_config.x"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.<field>",
     "actor_rollout_ref.actor.megatron.override_transformer_config.x"),
    ("+actor_rollout_ref.actor.optim.override_optimizer_config.<field>",
     "actor_rollout_ref.actor.optim.override_optimizer_config.x"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.<field>", "actor_rollout_ref.rollout.engine_kwargs.vllm.x"),
    ("+trainer.<anything else> (a typo)", "trainer.typo"),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(default: str, limit: int = 48) -> str:
    return default if len(default) <= limit else default[:limit - 3] + "..."


def render() -> str:
    from fully_async.verl.compat import DEFAULT_DIFFERENCES, HONOURED, MAPPED, classify, read_tsv, read_versions

    rows = [(key, default, *classify(key)) for key, default in read_tsv(TSV)]
    versions = read_versions(TSV)
    older = {key for key, v in versions.items() if NEWEST not in v}
    counts = collections.Counter(HONOURED if status == MAPPED else status for _, _, status, _ in rows)
    mapped = sum(1 for row in rows if row[2] == MAPPED)
    guarded = sum(1 for row in rows if row[2] == "warned" and "are refused" in row[3])
    out = ["# verl config keys in fully_async", "",
           "Generated by `scripts/gen_verl_compat.py` from `docs/verl_config_keys.tsv` (every leaf key of verl's "
           f"resolved `ppo_trainer`, `ppo_megatron_trainer` and fully-async configs, of verl {NEWEST} and of the "
           "older commit b178a3cd, written by `scripts/verl_config_keys.py`) and the rules in "
           "`fully_async/verl/compat.py`; do not edit by hand.", "",
           "Every verl key is **honoured** (our schema has it with verl's meaning, or it is mapped onto ours), "
           "**warned** (accepted with one warning saying why it has no effect here, then dropped; some values "
           "of a warned key are refused) or **refused** (a `ConfigError` naming the key and what to use instead, "
           "before Ray starts).  The rules apply to the command line's overrides before Hydra composes the "
           "config, so `python -m fully_async.main --cfg job`, `python -m fully_async.doctor` and the run see the "
           "same config.  A key that neither our schema nor verl has (`+trainer.typo=3`) is refused, naming the "
           "nearest valid keys.", "",
           f"**{len(rows)} keys ({len(rows) - len(older)} of verl {NEWEST}, {len(older)} of b178a3cd only): "
           f"{counts[HONOURED]} honoured ({counts[HONOURED] - mapped} by name, {mapped} mapped "
           f"onto our keys), {counts['warned']} warned ({guarded} of them refuse values they cannot honour, e.g. "
           f"`actor_rollout_ref.rollout.data_parallel_size=2`), {counts['refused']} refused at verl's default value.**",
           "", "## The verl version followed", "", FOLLOWED, ""] + [f"- {c}" for c in CHANGES] + [
           "",
           "## Defaults that differ from verl's", "",
           "The schema's defaults are verl's, so a ported script that leaves a key unset gets verl's value, except "
           "for these (each deliberate).  `python -m fully_async.main` without `data.train_files` runs the bundled "
           "tiny task with its own preset on top (`BUNDLED_TASK_OVERRIDES` in `fully_async/run/prepare.py`: "
           "lengths 16/8, lr 1e-4, mini-batch 16, n 8, float32 rollout, no gradient checkpointing, trigger 1, "
           "staleness 0.5, 40 steps), under the command line's own overrides.", "",
           "| key | verl | ours | why |", "| --- | --- | --- | --- |"]
    from fully_async.verl.compat import schema_default
    tsv = dict(read_tsv(TSV))
    for key, why in sorted(DEFAULT_DIFFERENCES.items()):
        out.append(f"| `{key}` | `{_cell(_short(tsv[key]))}` | `{_cell(_short(json.dumps(schema_default(key))))}` "
                   f"| {_cell(why)} |")
    from fully_async.verl.rules import VALUE_MAPS
    out += ["", "## verl values served by another value (warned)", "", "| key | verl's value | runs as | why |",
            "| --- | --- | --- | --- |"]
    for key, values in VALUE_MAPS.items():
        for value, (ours, why) in values.items():
            out.append(f"| `{key}` | `{value}` | `{ours}` | {_cell(why)} |")
    out += ["", "## Keys verl scripts add with `+`", "", "| override | status | note |", "| --- | --- | --- |"]
    for shown, key in PLUS_FORMS:
        status, note = classify(key)
        out.append(f"| `{_cell(shown)}` | {status if status != 'unknown' else 'refused'} | "
                   f"{_cell(note or 'not a key of our schema nor of verl: refused, naming the nearest keys')} |")
    from fully_async.verl.rules import SCRIPT_REFUSALS
    out += ["", "## verl's example scripts", "",
            "`tests/fixtures/verl_scripts.tsv` holds the overrides of verl's example launch scripts "
            "(`examples/grpo_trainer`, `examples/ppo_trainer`, the fully-async and one-step-off recipes, and the "
            "DAPO recipe; `scripts/extract_verl_scripts.py` reads them at a pinned commit).  verl's config names "
            "resolve here: `ppo_trainer`, `ppo_megatron_trainer` (sync), `fully_async_ppo_trainer`, "
            "`fully_async_ppo_megatron_trainer` (async), `one_step_off_ppo_trainer`, "
            "`one_step_off_ppo_megatron_trainer` (async, one step ahead, a step is data.train_batch_size), "
            "`dapo_trainer`, `dapo_megatron_trainer` (sync, DAPO reward).  `tests/unit/run/test_verl_scripts.py` "
            "checks that every script, with its paths changed, translates, composes and passes validation, or is "
            "refused for one of these reasons (the first refused key decides):", ""]
    out += [f"- {reason}" for reason, _ in SCRIPT_REFUSALS]
    out += ["", "## verl 0.9's scripts and the V1 trainer", "", V1_SECTION[0], "", V1_SECTION[1], ""]
    out += list(V1_SECTION[2:])
    out += ["", "## Every key", "", f"The default is verl {NEWEST}'s (b178a3cd's for a key that {NEWEST} removed).", "",
            "| key | verl default | status | note |", "| --- | --- | --- | --- |"]
    for key, default, status, note in rows:
        shown = HONOURED if status == MAPPED else status
        note = ("*b178a3cd only.* " if key in older else "") + note
        out.append(f"| `{key}` | `{_cell(_short(default))}` | {shown} | {_cell(note)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/verl_compat.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(DOC) as f:
            stale = f.read() != text
        print("docs/verl_compat.md is stale: run scripts/gen_verl_compat.py" if stale else "up to date")
        return int(stale)
    with open(DOC, "w") as f:
        f.write(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
