"""End to end on Ray: rollout.name=vllm with weight_sync=collective, the vLLM workers joining the trainer's
gloo broadcast group themselves (no copy through the rollouter), pause_mode=keep."""
import pytest

from fully_async.hydra_setup import load_config
from tests_helpers import read_scalars

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "VLLM_CPU_KVCACHE_SPACE": "1"}})
    yield
    ray.shutdown()


def test_async_run_on_vllm_with_weights_broadcast_to_the_workers(ray_session, tmp_path, monkeypatch):
    from fully_async.device import CPU
    from fully_async.engines.hf_engine import HFEngine
    from fully_async.generation import validate
    from fully_async.main import run_async
    from fully_async.prepare import load_tokenizer, prepare
    from fully_async.rewards import build_reward_manager

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    # load_format=dummy: vLLM starts from random weights, so version 0 must arrive by broadcast
    cfg = load_config([f"trainer.default_local_dir={tmp_path}/ckpt", "actor_rollout_ref.rollout.name=vllm",
                       "actor_rollout_ref.rollout.weight_sync=collective", "actor_rollout_ref.rollout.pause_mode=keep",
                       "actor_rollout_ref.rollout.load_format=dummy",
                       "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1",
                       "trainer.total_training_steps=3", "trainer.progress_bar=false",
                       "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       "actor_rollout_ref.rollout.max_num_seqs=32"])
    prep = prepare(cfg)
    hf = HFEngine(cfg.actor_rollout_ref.model.path, CPU, eos_token_ids=prep.eos_token_ids,
                  pad_token_id=prep.pad_token_id)
    reference = validate(hf, load_tokenizer(cfg), build_reward_manager(cfg), prep.val, cfg, 0)
    reference = reference["val-core/arithmetic/reward/mean@1"]

    summary = run_async(cfg)
    assert summary["steps"] == 3
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [s for s, _ in scalars["actor/pg_loss"]] == [1, 2, 3]
    assert all(0.0 <= v <= 1.0 for _, v in scalars["critic/score/mean"])
    assert [v for _, v in scalars["fully_async/count/current_param_version"]] == [0, 1, 2]
    # every push went through the bucketed broadcast (1.5 MiB of float32 weights: two 1 MiB buckets)
    assert [v for _, v in scalars["perf/param_sync_buckets"]] == [2, 2, 2]
    assert all(v > 0 for _, v in scalars["perf/param_sync_gbps"])
    # keep mode reports the engine's own timings: pause/load/resume, and no `serialize` (no host re-copy)
    assert "timing_s/param_sync/load" in scalars and "timing_s/param_sync/serialize" not in scalars
    # greedy on the broadcast version-0 weights scores what the embedded engine scores on the checkpoint
    val = dict(scalars["val-core/arithmetic/reward/mean@1"])
    assert abs(val[0] - reference) <= 1.0 / len(prep.val) + 1e-6, (val[0], reference)
