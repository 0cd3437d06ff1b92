"""Validation metrics carry verl's families: val-core/<ds>/reward/mean@N, and acc/mean@N when the scorer
returns an `acc` (DAPO-style sources)."""
from fully_async.actors.actor_setup import build_tokenizer
from fully_async.device import CPU
from fully_async.rewards import build_reward_manager
from fully_async.core.types import PromptRecord
from fully_async.rollout.engines import build_engine
from fully_async.rollout.generation import validate
from fully_async.run.hydra_setup import load_config


def test_validation_logs_acc_when_the_scorer_returns_it():
    cfg = load_config(["trainer.device=cpu", "data.max_response_length=4"])
    tok = build_tokenizer(cfg)
    engine = build_engine(cfg, CPU, [tok.eos_token_id], tok.pad_token_id or 0)
    ids = tok("1+1=", add_special_tokens=False)["input_ids"]
    records = [PromptRecord(index=0, prompt_ids=ids, data_source="math_dapo", ground_truth="2", extra_info={},
                            raw_prompt="1+1="),
               PromptRecord(index=1, prompt_ids=ids, data_source="arithmetic", ground_truth="2", extra_info={},
                            raw_prompt="1+1=")]
    m = validate(engine, tok, build_reward_manager(cfg), records, cfg, version=0)
    assert "val-core/math_dapo/reward/mean@1" in m and "val-core/arithmetic/reward/mean@1" in m
    assert 0.0 <= m["val-core/math_dapo/acc/mean@1"] <= 1.0
    assert "val-core/arithmetic/acc/mean@1" not in m        # that scorer returns no acc
