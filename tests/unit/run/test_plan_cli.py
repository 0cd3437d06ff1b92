"""`python -m fully_async.plan`: same config path as the run, tables and --json, built-in shapes, refusals."""
import json
import os
import subprocess
import sys

import pytest

from fully_async.run.plan_cli import build_report, main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
BENCH = os.path.join(ROOT, "tests", "fixtures", "gpu_runs", "bench_1dev_h200.json")
SEVEN_B = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "trainer.device=npu",
           "data.max_prompt_length=1024", "data.max_response_length=2048",
           "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.dtype=bfloat16",
           "actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.name=vllm",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=8",
           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "data.train_batch_size=32",
           "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
           "trainer.n_gpus_per_node=4", "rollout.n_gpus_per_node=4", "plan.sim_steps=4"]


def test_shim_runs_as_a_module_and_prints_the_sections():
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "fully_async.plan", *SEVEN_B], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    for section in ("== memory per device", "== device plan", "== predicted throughput", "== recommendation",
                    "== assumptions"):
        assert section in r.stdout
    for row in ("split (r+t)", "elastic (r+t)", "colocated", "generating s", "switch s", "if elastic (an engine"):
        assert row in r.stdout
    assert "built-in shape table: Qwen2.5-7B" in r.stdout
    assert "Ascend 910B" in r.stdout


def test_json_report_numbers_are_consistent(capsys):
    assert main(["--json", *SEVEN_B, "plan.devices=[8,16]"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["params"] == 7_615_616_512
    results = report["throughput"]["results"]
    assert [r["devices"] for r in results] == [8, 16]
    for r in results:
        best = max(r["candidates"], key=lambda c: c["steady_tokens_per_s"])
        assert r["best"] == best
        assert r["speedup"] == pytest.approx(best["steady_tokens_per_s"] / r["sync"]["steady_tokens_per_s"])
        assert best["rollout_devices"] + best["trainer_devices"] == r["devices"]
        modes = r["modes"]
        assert set(modes) == {"sync", "split", "elastic", "colocated"} and modes["split"] == r["best"]
        assert modes["elastic"]["trainer_engines"] == modes["elastic"]["trainer_devices"]   # rollout tp 1
        rates = {m: v["steady_tokens_per_s"] for m, v in modes.items()}
        assert r["recommended"] == max(rates, key=rates.get)
        assert r["recommended_speedup"] == pytest.approx(max(rates.values()) / rates["sync"])
    assert set(report["memory"]["mode_fits"]) == {"sync", "split", "elastic", "colocated"}
    roles = {x["role"]: x for x in report["memory"]["roles"]}
    assert roles["trainer"]["verdict"] == "fits"
    assert roles["engine"]["total_gib"] == pytest.approx(0.6 * 64 + 1.5)


def test_measured_stage_costs_from_a_bench_json():
    report = build_report([*SEVEN_B, f"plan.stage_costs={BENCH}", "plan.weight_sync_s=0.5"])
    costs = report["throughput"]["costs"]
    assert costs["source"].startswith("measured:")
    assert costs["weight_sync_s"] == 0.5
    assert costs["decode_step_s"] == pytest.approx(1.7895027800000207 / report["throughput"]["derived"]
                                                   ["measured"]["decode_steps"])


def test_a_config_that_cannot_fit_is_refused(capsys):
    rc = main([*SEVEN_B, "actor_rollout_ref.actor.strategy=torch", "trainer.n_gpus_per_node=1", "plan.sim_steps=2",
               "plan.devices=4"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "DOES NOT FIT" in out and "REFUSED" in out


@pytest.mark.parametrize("arg,key", [
    ("plan.devices=[0]", "plan.devices"), ("plan.nope=1", "plan.nope"), ("plan.device=tpu", "plan.device"),
    ("plan.sim_steps=1", "plan.sim_steps"), ("plan.train_mfu=1.5", "plan.train_mfu"),
    ("plan.stage_costs=/nonexistent.json", "plan.stage_costs"),
    ("actor_rollout_ref.model.path=/nowhere/llama", "actor_rollout_ref.model.path"),
    ("plan.response_lengths=uniform", "plan.response_lengths"),
])
def test_bad_input_names_the_key(arg, key, capsys):
    assert main([*SEVEN_B, arg]) == 1
    assert key in capsys.readouterr().err


def test_run_config_validation_applies(capsys):
    assert main([*SEVEN_B, "actor_rollout_ref.rollout.n=1"]) == 1
    assert "actor_rollout_ref.rollout.n" in capsys.readouterr().err


def test_measured_stage_costs_from_a_run_log_dir(tmp_path):
    """plan.stage_costs=<TensorBoard dir>: the run's own engine ms per step, trainer busy time and weight push."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as w:
        for step in range(1, 4):
            w.add_scalar("fully_async/rollouter/engine_0/ms_per_step", 4.0, step)
            w.add_scalar("timing_s/step", 1.0, step)
            w.add_scalar("timing_s/gen", 0.4, step)
            w.add_scalar("timing_s/param_sync", 0.1, step)
            w.add_scalar("perf/total_num_tokens", 1000.0, step)
            w.add_scalar("prompt_length/mean", 40.0, step)
            if step > 1:   # the object store's push: the engines' load of the previous one, and the wait for it
                w.add_scalar("timing_s/param_sync/load", 0.05, step)
                w.add_scalar("timing_s/param_sync/wait", 0.0, step)
    (tmp_path / "config.json").write_text(json.dumps({"mode": "async", "trainer": {"nnodes": 1, "n_gpus_per_node": 2}}))
    report = build_report([*SEVEN_B, f"plan.stage_costs={tmp_path}"])
    costs = report["throughput"]["costs"]
    assert costs["decode_step_s"] == pytest.approx(0.004)
    # busy 0.5 s/step on 2 devices; one device's cost is that per device-token times the assumed data-parallel
    # efficiency (0.9), so 2 devices are predicted to train as the run did
    assert costs["train_token_s"] == pytest.approx(3 * 0.5 * 2 / 3000 * 0.9)
    assert costs["dp_efficiency"] == 0.9
    assert costs["weight_sync_s"] == pytest.approx(0.1) and costs["weight_load_s"] == pytest.approx(0.05)
    assert any("then the engines' load 0.050 s" in a for a in report["throughput"]["assumptions"])
    assert report["throughput"]["prompt_length"] == 40
    assert any("measured by the run" in a for a in report["throughput"]["assumptions"])


def test_a_log_dir_without_the_scalars_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"mode": "sync", "trainer": {"nnodes": 1, "n_gpus_per_node": 1}}))
    assert main([*SEVEN_B, f"plan.stage_costs={tmp_path}"]) == 1
    assert "plan.stage_costs" in capsys.readouterr().err


def test_response_lengths_from_a_run_log_dir(tmp_path, capsys):
    """plan.response_lengths=<TensorBoard dir>: the lengths the run's trained responses had (response_lengths.json,
    written by the launcher); a dir without the file is refused naming the key."""
    from fully_async.core.workload import RESPONSE_LENGTHS, length_histogram

    assert main([*SEVEN_B, f"plan.response_lengths={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "plan.response_lengths" in err and RESPONSE_LENGTHS in err
    (tmp_path / RESPONSE_LENGTHS).write_text(json.dumps(length_histogram({100: 3, 900: 1})))
    report = build_report([*SEVEN_B, f"plan.response_lengths={tmp_path}", "plan.sim_steps=2", "plan.devices=8"])
    assert any(RESPONSE_LENGTHS in a and "100..900" in a for a in report["throughput"]["assumptions"])


def test_one_device_plans_sync_and_colocated_only():
    """plan.devices=1: no split exists; sync and colocated async are simulated and one of them recommended."""
    report = build_report([*SEVEN_B, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "plan.devices=1",
                           "plan.sim_steps=3"])
    res = report["throughput"]["results"][0]
    assert res["best"] is None and res["modes"]["elastic"] is None and "no async split" in res["reason"]
    assert res["modes"]["sync"] and res["modes"]["colocated"]
    assert res["recommended"] in ("sync", "colocated")
    from fully_async.run.plan_format import format_text
    text = format_text(report)
    assert "\n  1 devices: " in text.split("== recommendation")[1]


def test_a_mode_that_does_not_fit_is_not_recommended():
    from fully_async.run.plan_format import _recommendation

    res = {"devices": 8, "modes": {"sync": {"steady_tokens_per_s": 100.0}, "colocated": {"steady_tokens_per_s": 150.0},
                                   "split": {"steady_tokens_per_s": 120.0, "rollout_devices": 4, "trainer_devices": 4},
                                   "elastic": None}}
    report = {"memory": {"mode_fits": {"sync": True, "split": True, "elastic": True, "colocated": False}},
              "throughput": {"results": [res]}}
    line, = _recommendation(report)
    assert line.startswith("  8 devices: split (4+4) predicted 1.20x") and "colocated 1.50x" in line
    assert "colocated would be faster but does not fit" in line
    report["memory"]["mode_fits"]["colocated"] = True
    assert _recommendation(report)[0].startswith("  8 devices: colocated (8) predicted 1.50x")


def test_a_placement_the_run_would_refuse_is_never_recommended():
    """vLLM engines cannot be lent (elastic) and tensor-parallel engines cannot sit beside one trainer rank each
    (colocated): the planner simulates them but recommends only what the run takes, saying why."""
    from fully_async.core.placement_checks import placement_refusal
    from fully_async.run.hydra_setup import load_config

    vllm_tp2 = load_config(["mode=async", "actor_rollout_ref.rollout.name=vllm",
                            "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert "rollout.name" in placement_refusal(vllm_tp2, "elastic")
    assert "tensor_model_parallel_size" in placement_refusal(vllm_tp2, "colocated")
    assert placement_refusal(load_config(["mode=async"]), "elastic") is None
    assert placement_refusal(load_config(["mode=async"]), "colocated") is None


def test_the_recommendation_skips_refused_placements():
    from fully_async.run.plan_format import _recommendation

    split = {"rollout_devices": 2, "trainer_devices": 6}
    res = {"devices": 8,
           "modes": {"sync": {"steady_tokens_per_s": 100.0}, "split": dict(split, steady_tokens_per_s=120.0),
                     "elastic": dict(split, steady_tokens_per_s=150.0), "colocated": {"steady_tokens_per_s": 90.0}}}
    report = {"memory": {"mode_fits": {"sync": True, "colocated": True, "elastic": True, "split": True},
                         "mode_refusals": {"elastic": "vllm engines cannot be lent"}},
              "throughput": {"results": [res]}}
    [line] = _recommendation(report)
    assert line.startswith("  8 devices: split") and "elastic would be faster but the run refuses it" in line


@pytest.mark.parametrize("eff", [0.9, 0.6])
def test_a_run_on_several_trainer_devices_is_predicted_at_its_own_count_as_measured(eff):
    """The 4x H200 sync run (tests/fixtures/gpu_runs/h200_4dev_seed003/sync): whatever data-parallel efficiency is
    assumed, the planner's training time for its own 4 devices is the run's (only other counts depend on it)."""
    from fully_async.planner.sim_engine import StageCosts
    from fully_async.run.plan_cli import run_stage_costs

    run = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "fixtures", "gpu_runs", "h200_4dev_seed003",
                       "sync")
    raw, _, devices = run_stage_costs(run)   # seconds per token and trainer device, as the run spent them
    assert devices == 4
    costs = StageCosts(**build_report([*SEVEN_B, f"plan.stage_costs={run}",
                                       f"plan.dp_efficiency={eff}"])["throughput"]["costs"])
    assert costs.train_time(2_000_000, 4) == pytest.approx(2_000_000 * raw.train_token_s / 4)
    # 4 devices are two doublings from one: one device costs the run's per-device-token cost times eff^2
    assert costs.train_time(2_000_000, 1) == pytest.approx(2_000_000 * raw.train_token_s * eff ** 2)
    assert costs.train_time(2_000_000, 2) == pytest.approx(2_000_000 * raw.train_token_s * eff / 2)


def test_the_switch_prices_the_engine_weights_only_where_the_engine_frees_its_memory():
    """free_cache_engine=true keeps the engine resident where trainer and engine fit (the runtime's rule): the
    planned sync switch moves no engine weights; the force key, or a device too small for both, moves them."""
    import dataclasses

    from fully_async.planner.hardware import DEVICES
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.plan_cli import engine_stays_resident, model_shape

    cfg = load_config(["mode=sync"])
    shape, _ = model_shape(cfg)
    big = next(iter(DEVICES.values()))
    assert engine_stays_resident(cfg, shape, big)[0]
    tiny = dataclasses.replace(big, memory_gib=0.01)
    fits, why = engine_stays_resident(cfg, shape, tiny)
    assert not fits and "frees its memory" in why
    forced = load_config(["mode=sync", "actor_rollout_ref.rollout.free_cache_engine_force=true"])
    assert engine_stays_resident(forced, shape, big) == (False, "actor_rollout_ref.rollout.free_cache_engine_force=true")
    kept = load_config(["mode=sync", "actor_rollout_ref.rollout.free_cache_engine=false"])
    assert engine_stays_resident(kept, shape, tiny)[0]


def test_a_pool_job_with_co_tenancy_is_planned_resident_where_its_estimate_fits():
    """multi_job.pool with co-tenancy: the job declares the memory model's estimate (20% over); where it fits the
    pool's share of the device, leases switch nothing and the plan prices no engine weights at the switch; where it
    does not, or with co-tenancy off, each switch frees."""
    import dataclasses

    from fully_async.planner.hardware import DEVICES
    from fully_async.planner.memory_model import co_tenant_need_gib
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.plan_cli import engine_stays_resident, model_shape

    pool = ["mode=sync", "multi_job.pool=p", "multi_job.ray_address=127.0.0.1:1"]
    cfg = load_config(pool)
    shape, _ = model_shape(cfg)
    big = next(iter(DEVICES.values()))
    need = co_tenant_need_gib(cfg, shape, 1, big.memory_gib * 2**30)
    fits, why = engine_stays_resident(cfg, shape, big)
    assert fits and f"declares {need:.1f} GiB" in why and "hold the device at once" in why
    tiny = dataclasses.replace(big, memory_gib=need)      # the margin leaves less than the need
    fits, why = engine_stays_resident(cfg, shape, tiny)
    assert not fits and "does not fit even alone" in why
    off = load_config([*pool, "multi_job.co_tenancy=false"])
    assert engine_stays_resident(off, shape, big) == (False, "multi_job.pool=p: other jobs lease these devices")


def test_a_colocated_switch_that_frees_prices_the_kv_swap_of_the_responses_in_flight():
    """Colocated async whose engine frees at each switch (the force key here) swaps the KV of every slot at the
    mean context in flight out and back: priced in its simulation's switch, not in sync's."""
    base = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "trainer.device=cuda", "plan.device=h200",
            "plan.devices=1", "plan.sim_steps=3", "mode=async", "async_training.placement=colocated",
            "rollout.n_gpus_per_node=0", "actor_rollout_ref.rollout.max_num_seqs=256", "data.max_prompt_length=16",
            "data.max_response_length=3072", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768", "actor_rollout_ref.model.use_remove_padding=true"]
    forced = build_report([*base, "actor_rollout_ref.rollout.free_cache_engine_force=true"])["throughput"]
    kept = build_report(base)["throughput"]
    assert "stays resident" in kept["derived"]["engine_resident"]
    assert kept["derived"]["kv_swap_bytes_per_switch"] == 0 and kept["costs"]["swap_s"] == 0
    swap, costs = forced["derived"]["kv_swap_bytes_per_switch"], forced["costs"]
    assert swap / (256 * 12288) > forced["prompt_length"]          # every slot at the mean context in flight (bf16)
    assert costs["swap_s"] == pytest.approx(2 * swap / 25e9)      # out and back at host_gbs
    modes = forced["results"][0]["modes"]
    assert modes["sync"]["switch_s_per_step"] == pytest.approx(costs["sync_step_s"])          # sync: nothing swapped
    assert modes["colocated"]["switch_s_per_step"] >= costs["sync_step_s"] + costs["swap_s"] - 1e-9
    assert "of KV of the responses in flight" in " ".join(forced["assumptions"])


def test_checkpointing_the_memory_does_not_need_is_pointed_out():
    """enable_gradient_checkpointing=true where the trainer fits without it (0.5B, 910B): the plan says so with the
    peak without it; a micro-batch whose activations do not fit without it (7B, 64k tokens), or checkpointing off:
    nothing said."""
    from fully_async.run.plan_format import format_text

    small = build_report([*SEVEN_B, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    note = small["memory"]["checkpointing_not_needed"]
    assert note and 0 < note["without_gib"] < 0.9 * note["capacity_gib"] and note["role"] == "trainer"
    trainer = next(r for r in small["memory"]["roles"] if r["role"] == "trainer")
    assert note["without_gib"] > trainer["total_gib"]               # the activations of every layer kept
    assert "is not needed for memory here: without it a trainer device peaks at" in format_text(small)
    colo = build_report([*SEVEN_B, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
                         "async_training.placement=colocated", "rollout.n_gpus_per_node=0"])
    assert colo["memory"]["checkpointing_not_needed"]["role"].startswith("if sync or colocated async")  # with engine
    big = build_report([*SEVEN_B, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536"])
    assert big["memory"]["checkpointing_not_needed"] is None and big["memory"]["fits"]
    off = build_report([*SEVEN_B, "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
                        "actor_rollout_ref.model.enable_gradient_checkpointing=false"])
    assert off["memory"]["checkpointing_not_needed"] is None
    assert "is not needed for memory here" not in format_text(off)


def test_the_plan_sizes_the_embedded_engines_slots_as_the_run_does(monkeypatch):
    """max_num_seqs unset: the plan prices the slots the run's start-up gives each engine on the priced card
    (run/prepare.engine_slots), and says so."""
    from fully_async.device import CUDA
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.plan_format import format_text
    from fully_async.run.prepare import engine_slots

    seed = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B", "trainer.device=cuda", "data.max_prompt_length=16",
            "data.max_response_length=3072", "actor_rollout_ref.rollout.dtype=bfloat16",
            "actor_rollout_ref.rollout.n=8", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0",
            "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768",
            "actor_rollout_ref.rollout.max_num_seqs=null", "plan.sim_steps=4"]
    # async: what the staleness bound lets a version admit, at its defaults 64 x (1 + 0.5) x 1 groups of 8
    report = build_report([*seed, "plan.device=h200"])
    assert report["engine_slots"]["max_num_seqs"] == 768
    assert "slot KV cache of 768 x 3088" in json.dumps(report["memory"])
    assert "max_num_seqs=null -> 768 per engine" in format_text(report)
    set_ = build_report([*seed[:-2], "actor_rollout_ref.rollout.max_num_seqs=256", "plan.sim_steps=4",
                         "plan.device=h200"])
    assert "engine_slots" not in set_
    # the run's start-up: the same pick from the device the driver sees; verl's 256 where it sees no accelerator
    from transformers import Qwen2Config

    conf = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
    run_keys = [s for s in seed if not s.startswith("plan.")]
    cfg = load_config(run_keys)
    monkeypatch.setattr(type(CUDA), "total_memory", lambda self, index=0: 141 * 2 ** 30 if self is CUDA else None)
    assert engine_slots(cfg, conf) == 768
    assert engine_slots(load_config([s.replace("mode=async", "mode=sync") for s in run_keys]), conf) == 512
    assert engine_slots(load_config(run_keys[:-1] + ["actor_rollout_ref.rollout.max_num_seqs=300"]), conf) == 300
    cpu = load_config([s.replace("trainer.device=cuda", "trainer.device=cpu") for s in run_keys])
    assert engine_slots(cpu, conf) == 256
