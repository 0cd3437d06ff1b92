"""The one training step both modes run: mini-batch count, metrics, and the same numbers from the same batch."""
import pytest
import torch

from fully_async.train.train_step import num_mini_batches, train_step
from fully_async.core.types import SampleGroup
from test_torch_backend import backend_for, make_samples


@pytest.mark.parametrize("groups,mini,expected", [(16, 16, 1), (17, 16, 2), (3, 16, 1), (32, 16, 2), (1, 1, 1)])
def test_mini_batch_count_is_one_rule(groups, mini, expected):
    assert num_mini_batches(groups, mini) == expected


def as_groups(samples, n=3):
    return [SampleGroup(samples[i].uid, i // n, 0, samples[i:i + n], 0) for i in range(0, len(samples), n)]


def test_same_batch_same_weights_same_step(random_model_dir, tmp_path):
    """The step is deterministic: the same batch on the same weights gives identical losses, grad norm and updated
    weights.  The async trainer and the sync loop both call train_step, so on one batch they agree."""
    results = []
    for _ in range(2):
        cfg, backend = backend_for(random_model_dir, f"trainer.default_local_dir={tmp_path}",
                                   "async_training.use_rollout_log_probs=false")
        metrics, samples = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
        results.append((metrics, {k: v.detach().clone() for k, v in backend.model.named_parameters()}))
    (m1, w1), (m2, w2) = results
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "perf/total_num_tokens"):
        assert m1[key] == m2[key], key
    assert all((w1[k] == w2[k]).all() for k in w1)
    assert len(samples) == 6 and m1["fully_async/count/current_param_version"] == 0
    assert {"timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor"} <= set(m1)


def test_mfu_reported_with_a_peak_override_and_absent_without(random_model_dir, tmp_path):
    """On cpu no peak is known: no perf/mfu/actor unless trainer.device_peak_tflops gives one; then it is the
    model FLOPs of ppo_epochs passes over the step's prompt + response tokens per update second per peak."""
    from transformers import AutoConfig

    from fully_async.core.flops import estimate_flops

    common = ["trainer.device=cpu", f"trainer.default_local_dir={tmp_path}"]
    cfg, backend = backend_for(random_model_dir, *common)
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    assert "perf/mfu/actor" not in metrics and "perf/max_memory_allocated_gb" not in metrics

    cfg, backend = backend_for(random_model_dir, *common, "trainer.device_peak_tflops=2e-6",
                               "actor_rollout_ref.actor.ppo_epochs=2")
    samples = make_samples()
    metrics, _ = train_step(backend, cfg, as_groups(samples), 0, step=1, version=0)
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    flops = estimate_flops(AutoConfig.from_pretrained(random_model_dir), lens, count_embedding=True)
    assert flops > 0
    expected = 2 * flops / metrics["timing_s/update_actor"] / (2e-6 * 1e12)
    assert metrics["perf/mfu/actor"] == pytest.approx(expected, rel=1e-9)


def test_verl_batch_metric_families_are_logged(random_model_dir):
    """verl's critic/rewards/*, critic/advantages/*, prompt_length/*, training/{global_step,epoch}."""
    import torch

    cfg, backend = backend_for(random_model_dir)
    samples = make_samples()
    groups = as_groups(samples)
    metrics, _ = train_step(backend, cfg, groups, 0, step=7, version=3)
    rewards = torch.tensor([s.reward for s in samples])
    assert metrics["critic/rewards/mean"] == pytest.approx(float(rewards.mean()))
    assert metrics["critic/rewards/max"] == pytest.approx(float(rewards.max()))
    assert metrics["critic/advantages/min"] <= metrics["critic/advantages/mean"] <= metrics["critic/advantages/max"]
    prompts = [len(s.prompt_ids) for s in samples]
    assert metrics["prompt_length/max"] == max(prompts) and metrics["prompt_length/min"] == min(prompts)
    assert metrics["prompt_length/clip_ratio"] == 0.0
    assert metrics["training/global_step"] == 7 and metrics["training/epoch"] == max(g.epoch for g in groups)


def test_rollout_correction_token_weights_are_decoupled_ppos(random_model_dir, tmp_path):
    """verl's decoupled-mode token weights truncated at 2 are decoupled PPO's with behav_imp_weight_cap=2: the same
    update, bit for bit; the step recomputes the old policy for them and logs verl's rollout_corr/* metrics."""
    common = [f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.actor.ppo_epochs=2"]
    runs = {}
    variants = {"rollout_is": ["algorithm.rollout_correction.rollout_is=token",
                               "algorithm.rollout_correction.rollout_is_threshold=2.0"],
                "decoupled": ["async_training.decoupled_ppo=true", "async_training.behav_imp_weight_cap=2.0"]}
    for name, extra in variants.items():
        cfg, backend = backend_for(random_model_dir, *common, *extra)
        metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
        runs[name] = metrics, {k: v.detach().clone() for k, v in backend.model.named_parameters()}
    (m_is, w_is), (m_dec, w_dec) = runs["rollout_is"], runs["decoupled"]
    assert all(torch.equal(w_is[k], w_dec[k]) for k in w_is)
    assert m_is["actor/pg_loss"] == m_dec["actor/pg_loss"]
    assert "timing_s/old_log_prob" in m_is and m_is["rollout_corr/rollout_is_max"] <= 2.0
    assert {"rollout_corr/kl", "rollout_corr/chi2_seq", "rollout_corr/rollout_is_eff_sample_size"} <= set(m_is)
    assert not any(k.startswith("rollout_corr/") for k in m_dec)


@pytest.mark.parametrize("bypass", [False, True])
def test_rollout_rejection_of_every_token_leaves_no_policy_gradient(random_model_dir, tmp_path, bypass):
    """The behaviour log-probs of make_samples (-1 per token) are far above a random model's (~ -log vocab): a ratio
    bound of [0.9, 1.1] rejects every token, once per step (decoupled) or in the loss (bypass)."""
    cfg, backend = backend_for(random_model_dir, f"trainer.default_local_dir={tmp_path}",
                               "algorithm.rollout_correction.rollout_rs=token_k1",
                               "algorithm.rollout_correction.rollout_rs_threshold='0.9_1.1'",
                               f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}")
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 1.0
    assert metrics["actor/pg_loss"] == 0.0
    # verl 0.9.1: bypass mode reports the rollout_corr/* diagnostics too (of the current policy, in the loss)
    assert "timing_s/old_log_prob" in metrics and "rollout_corr/kl" in metrics
    assert ("training/rollout_probs_diff_mean" in metrics) != bypass     # no recomputed old policy in bypass mode


def test_global_profiler_profiles_the_listed_steps_whole(random_model_dir, tmp_path, caplog):
    """verl's global_profiler.tool=torch / steps: a listed step runs under the device's profiler (here the CPU's) and
    leaves its Chrome trace and ops.txt, whose operators include the update's matrix products and the optimizer's
    step; an unlisted step leaves nothing."""
    import json

    out = tmp_path / "profile"
    cfg, backend = backend_for(random_model_dir, "trainer.device=cpu", f"trainer.default_local_dir={tmp_path}",
                               "global_profiler.tool=torch", "global_profiler.steps=[2]",
                               f"global_profiler.save_path={out}")
    caplog.set_level("INFO", logger="fully_async")
    train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    assert not out.exists()
    train_step(backend, cfg, as_groups(make_samples()), 0, step=2, version=0)
    traces = list((out / "step_2").glob("*.pt.trace.json"))
    assert len(traces) == 1, list((out / "step_2").iterdir())
    names = {e.get("name", "") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names and any("Optimizer.step" in n for n in names)
    table = (out / "step_2" / "ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table and table.startswith("step 2: wall ")
    summary = json.loads((out / "step_2" / "summary.json").read_text())
    assert summary["step"] == 2 and summary["wall_s"] > 0 and summary["device_kernels"] == 0   # the CPU has none
    assert f"profile of the trainer's step 2 (cpu profiler): {out / 'step_2'}" in caplog.text


def test_profile_summary_sums_kernels_and_finds_the_gaps_between_them():
    """A profiled step's device kernels against its wall time, and the stretches over 1 ms where no kernel ran
    (overlapping kernels, as on two streams, leave no gap)."""
    from types import SimpleNamespace as NS

    from fully_async.train.train_step import profile_summary

    def kernel(name, start, end, annotation=False):   # microseconds, as torch.profiler's events
        return NS(name=name, device_type=NS(name="CUDA"), time_range=NS(start=start, end=end),
                  device_time=end - start, is_user_annotation=annotation)

    host = NS(name="aten::mm", device_type=NS(name="CPU"), time_range=NS(start=0, end=50_000), device_time=0)
    events = [kernel("a", 0, 1000), kernel("b", 500, 2000), kernel("c", 2500, 3000), kernel("d", 6000, 7000), host,
              kernel("e", 9000, 10_000), kernel("## Call CompiledFxGraph", 0, 10_000, annotation=True)]
    summary = profile_summary(NS(events=lambda: events), wall=0.02, step=3)
    assert summary["device_kernels"] == 5   # an annotation on the device's track is no kernel: it spans others
    assert summary["device_kernels_s"] == 0.005 and summary["device_busy"] == 0.25
    assert summary["largest_gaps"] == [{"ms": 3.0, "after": "c", "before": "d"},
                                       {"ms": 2.0, "after": "d", "before": "e"}]
    assert summary["gaps_over_1ms_s"] == 0.005


def test_step_counters_report_each_steps_collections_and_allocator_deltas():
    """perf/host_gc_* count the collector's work inside the step only (a full collection forced inside it, none
    outside), and the device allocator's counts are this step's deltas."""
    import gc

    from fully_async.train.step_counters import StepCounters

    class Allocator:
        counts = {"device_mallocs": 5, "device_frees": 1, "device_alloc_retries": 0}

        def allocator_counts(self):
            return dict(self.counts)

    device = Allocator()
    counters = StepCounters(device)
    gc.collect()                       # before the step: not counted
    counters.start()
    gc.collect()
    device.counts = {"device_mallocs": 8, "device_frees": 3, "device_alloc_retries": 1}
    step = counters.metrics()
    assert step["perf/host_gc_full"] == 1 and step["perf/host_gc_s"] > 0
    assert (step["perf/device_mallocs"], step["perf/device_frees"], step["perf/device_alloc_retries"]) == (3, 2, 1)
    counters.start()
    assert counters.metrics()["perf/host_gc_full"] == 0


def test_a_training_step_reports_its_host_counters(random_model_dir, tmp_path):
    """train_step's metrics carry the step's perf/host_gc_* and perf/compiled_graphs (the CPU has no device
    allocator counts)."""
    cfg, backend = backend_for(random_model_dir, "trainer.device=cpu", f"trainer.default_local_dir={tmp_path}")
    metrics, _ = train_step(backend, cfg, as_groups(make_samples()), 0, step=1, version=0)
    assert {"perf/host_gc_s", "perf/host_gc_full", "perf/compiled_graphs"} <= set(metrics)
    assert metrics["perf/host_gc_s"] >= 0 and "perf/device_mallocs" not in metrics


@pytest.mark.parametrize("contents, shapes, memory", [((), False, False), (("shapes", "memory"), True, True)])
def test_the_profiler_records_what_contents_names(contents, shapes, memory):
    """verl's profiler contents: nothing named records the host's operators and the device's kernels without shapes
    or memory (as verl); named, each is recorded."""
    from fully_async.device import get_device

    prof = get_device("cpu").profiler("/tmp/unused", contents)
    assert (prof.record_shapes, prof.profile_memory, prof.with_stack) == (shapes, memory, False)


def test_verl_actor_profiler_contents_become_global_profiler_contents():
    """actor_rollout_ref.actor.profiler.tool_config.torch.contents (a verl script's) sets what the trainer's
    profiled steps record."""
    from fully_async.verl.compat import translate

    out = translate(["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cuda,shapes]"])
    assert out.overrides == ["++global_profiler.contents=[cuda,shapes]"]
