"""Generation helpers shared by the rollouter and the sync loop (layer 5).

Both modes turn prompts into scored groups the same way: n pending responses per prompt, run
on an engine, decoded, scored by the reward manager.  Validation is the same in both modes too,
so its numbers are comparable across modes.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from fully_async.rollout.engines.base import run_requests
from fully_async.core.partial import PendingResponse
from fully_async.core.types import PromptRecord, Sample, SampleGroup, SamplingParams
from fully_async.telemetry import generations


def run_to_completion(engine: Any, pendings: Sequence[PendingResponse], tools: Any = None) -> None:
    """Generate every pending response to the end (engine must hold nothing else); with `tools`
    (rollout/tools.ToolLoop, multi-turn), tool steps between the turns included."""
    if tools is not None:
        tools.drive(engine, pendings)
        return
    by_id = {p.sample_id: p for p in pendings}
    for request_id, out in run_requests(engine, [p.request() for p in pendings]).items():
        by_id[request_id].extend(out)


def score_samples(tokenizer: Any, reward: Any, record: PromptRecord, samples: Sequence[Sample]) -> None:
    """Each response scored on its decoded text (a multi-turn one with its tool answers, whose extra_info also
    carries verl's `num_turns`: the user prompt, the assistant turns and the tool answers)."""
    for s in samples:
        text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        extra = record.extra_info if not s.num_turns else dict(record.extra_info or {}, num_turns=s.verl_num_turns)
        s.reward, s.reward_extra = reward.score(record.data_source, text, record.ground_truth, extra,
                                                len(s.response_ids),
                                                sample=f"sample {s.sample_id} (prompt index {record.index})")
        s.data_source, s.ground_truth = record.data_source, record.ground_truth


def attach_reward_model_inputs(inputs: Any, pairs: Sequence[tuple[PromptRecord, Sequence[Sample]]]) -> None:
    """reward_model.enable: each sample carries the reward model's tokens for it (`inputs`:
    rewards/reward_model.RewardModelInputs) and its record's data source, until the trainer scores it."""
    for rec, samples in pairs:
        for s in samples:
            s.rm_input_ids, s.data_source, s.ground_truth = inputs.ids(rec, s), rec.data_source, rec.ground_truth


def score_attached(samples: Sequence[Sample], scorer: Callable[[Any], Any]) -> None:
    """The samples that carry reward-model tokens get the reward model's score as their reward, replacing the
    rule/custom function as verl's reward managers do (`scorer` runs the rows on the trainer's backend and returns
    (B,) scores); the tokens are dropped."""
    from fully_async.core.batch import token_rows

    rows = [s for s in samples if s.rm_input_ids is not None]
    if not rows:
        return
    scores = scorer(token_rows([s.rm_input_ids for s in rows]))
    for s, score in zip(rows, scores.tolist()):
        s.reward, s.reward_extra, s.rm_input_ids = float(score), {}, None


def score_with_reward_model(inputs: Any, pairs: Sequence[tuple[PromptRecord, Sequence[Sample]]],
                            scorer: Callable[[Any], Any]) -> None:
    """reward_model.enable in one process (sync mode): attach the reward model's tokens and score them at once."""
    attach_reward_model_inputs(inputs, pairs)
    score_attached([s for _, samples in pairs for s in samples], scorer)


BASELINE = "-b"   # the sample id suffix of a group's greedy baseline response (remax)


def make_group(uid: str, record: PromptRecord, epoch: int, version: int, samples: list[Sample]) -> SampleGroup:
    """The scored responses of one prompt as a group; a greedy baseline response (remax) leaves the group and its
    reward becomes every response's `reward_baseline` (verl's reward_baselines)."""
    baseline = [s for s in samples if s.sample_id.endswith(BASELINE)]
    samples = [s for s in samples if not s.sample_id.endswith(BASELINE)]
    for s in samples:
        s.reward_baseline = baseline[0].reward if baseline else None
    return SampleGroup(uid, record.index, epoch, sorted(samples, key=lambda s: s.sample_id), version)


def group_pendings(uid: str, record: PromptRecord, n: int, params: SamplingParams,
                   lengths: Optional[Any] = None, baseline: bool = False) -> list[PendingResponse]:
    """The n responses of one prompt, and with `baseline` (remax) one greedy response more, whose reward is the
    prompt's baseline (verl generates it with do_sample=False beside the n sampled ones); `lengths`
    (fully_async.core.workload.LengthProfile, benchmarks only) gives each response a synthetic target length."""
    ids = [f"{uid}-s{j}" for j in range(n)]
    out = [PendingResponse(uid, sid, record.prompt_ids, params,
                           target_len=lengths.target(sid) if lengths is not None else None) for sid in ids]
    if baseline:
        sid = uid + BASELINE
        out.append(PendingResponse(uid, sid, record.prompt_ids, replace(params, temperature=0.0),
                                   target_len=lengths.target(sid) if lengths is not None else None))
    return out


def validate(engine: Any, tokenizer: Any, reward: Any, records: Sequence[PromptRecord], cfg: Any,
             version: int, tools: Any = None) -> dict[str, Any]:
    """`val-core/<data_source>/reward/mean@<n>` with val_kwargs sampling (greedy by default); with
    trainer.log_val_generations / validation_data_dir, the responses too (validation_metrics)."""
    start = time.perf_counter()
    pairs = validation_samples(engine, records, cfg, version, tools)
    for rec, samples in pairs:
        score_samples(tokenizer, reward, rec, samples)
    return validation_metrics(pairs, cfg.actor_rollout_ref.rollout.val_kwargs.n, time.perf_counter() - start,
                              validation_texts(tokenizer, pairs, cfg))


def validation_texts(tokenizer: Any, pairs: Sequence[tuple[PromptRecord, Sequence[Sample]]],
                     cfg: Any) -> Optional[list[tuple[str, str, Any]]]:
    """(input, output, ground truth) of every response in `pairs` order, prompt and response decoded without special
    tokens as verl's dumps; None unless trainer.log_val_generations or trainer.validation_data_dir asks for them."""
    if not generations.wanted(cfg.trainer):
        return None
    return generations.decoded(tokenizer, ((rec.index, rec.prompt_ids, s.response_ids, rec.ground_truth)
                                           for rec, samples in pairs for s in samples))


def validation_samples(engine: Any, records: Sequence[PromptRecord], cfg: Any, version: int,
                       tools: Any = None) -> list[tuple[PromptRecord, list[Sample]]]:
    """The validation responses (val_kwargs sampling, greedy by default), unscored, per record."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    params = SamplingParams(vk.temperature if vk.do_sample else 0.0, vk.top_p, vk.top_k,
                            cfg.data.max_response_length)
    pendings = [(rec, group_pendings(f"val-v{version}-{rec.index}", rec, vk.n, params)) for rec in records]
    run_to_completion(engine, [p for _, ps in pendings for p in ps], tools)
    return [(rec, [p.to_sample() for p in ps]) for rec, ps in pendings]


def rm_validation_metrics(item: dict, scorer: Callable[[Any], Any]) -> dict[str, float]:
    """The metrics of a validation generated elsewhere with the reward model's tokens attached (the rollouter's, in
    async mode: {pairs, n, seconds}), scored now by `scorer` (the trainer's backend)."""
    start = time.perf_counter()
    score_attached([s for _, samples in item["pairs"] for s in samples], scorer)
    metrics = validation_metrics(item["pairs"], item["n"], item["seconds"] + time.perf_counter() - start,
                                 item.get("texts"))
    metrics["rollouter/validate_time"] = item["seconds"]
    return metrics


def validation_metrics(pairs: Sequence[tuple[PromptRecord, list[Sample]]], n: int, seconds: float,
                       texts: Optional[Sequence[tuple[str, str, Any]]] = None) -> dict[str, Any]:
    """val-core/<data_source>/reward|acc/mean@<n> and the mean response length of scored validation samples; with
    `texts` (validation_texts) the rows of every response under generations.VAL_GENERATIONS, for the driver."""
    scores: dict[str, list[float]] = {}
    accs: dict[str, list[float]] = {}
    lengths = []
    for rec, samples in pairs:
        scores.setdefault(rec.data_source, []).extend(s.reward for s in samples)
        # verl logs val-core/<ds>/acc/mean@N when the scorer returns an `acc` (DAPO, aime...)
        accs.setdefault(rec.data_source, []).extend(float(s.reward_extra["acc"]) for s in samples
                                                    if isinstance(s.reward_extra.get("acc"), (bool, int, float)))
        lengths.extend(len(s.response_ids) for s in samples)
    metrics = {f"val-core/{ds}/reward/mean@{n}": sum(v) / len(v) for ds, v in scores.items()}
    metrics.update({f"val-core/{ds}/acc/mean@{n}": sum(v) / len(v) for ds, v in accs.items() if v})
    metrics["val-aux/response_length/mean"] = sum(lengths) / max(len(lengths), 1)
    metrics["timing_s/testing"] = seconds
    if texts is not None:
        metrics[generations.VAL_GENERATIONS] = generations.rows_of(texts, (s for _, ss in pairs for s in ss))
    return metrics
