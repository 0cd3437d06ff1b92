"""reward_model.enable (verl's model-based reward): the backend's score is the reward model's output at the last
token (what a sequence classifier pools), packed or padded; the inputs are re-templated with the reward model's chat
template or read as the policy's tokens; what cannot run is refused before Ray; a sync run's rewards and validation
come from the reward model."""
import shutil

import pytest
import torch

from fully_async.core.batch import token_rows
from fully_async.core.config import ConfigError, asset_path
from fully_async.core.config_checks import validate
from fully_async.core.types import PromptRecord, Sample
from fully_async.device import CPU
from fully_async.run.hydra_setup import load_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_reward_model(folder, kind="sequence", bias=None, seed=0):
    """A tiny reward model beside the bundled policy: its config, a one-label head, its tokenizer and chat template.
    kind=sequence: a ...ForSequenceClassification checkpoint (as real reward models); token: a token classifier whose
    head is zero with bias `bias` (every score is `bias`)."""
    from transformers import AutoConfig, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(asset_path("tiny_arithmetic/model"))
    config.num_labels = 1
    model = (Qwen2ForSequenceClassification if kind == "sequence" else Qwen2ForTokenClassification)(config)
    if bias is not None:
        with torch.no_grad():
            model.score.weight.zero_()
            model.score.bias.fill_(bias)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{asset_path('tiny_arithmetic/model')}/{name}", folder / name)
    return str(folder)


@pytest.mark.parametrize("packed", [False, True])
def test_scores_are_what_the_sequence_classifier_pools_at_the_last_token(tmp_path, packed):
    from transformers import AutoModelForSequenceClassification

    from fully_async.train.backends.torch_backend import TorchBackend

    path = make_reward_model(tmp_path / "rm")
    cfg = load_config(["reward_model.enable=true", f"reward_model.model.path={path}", "mode=sync",
                       f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
                       "reward_model.micro_batch_size_per_gpu=2"])
    backend = TorchBackend(cfg, CPU, 10)
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]
    got = backend.compute_rm_scores(token_rows(rows))
    ref_model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    want = torch.stack([ref_model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows]).detach()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert backend.reward_model.model in backend._models()     # offloaded and onloaded with the trainer


def test_inputs_are_retemplated_with_the_reward_models_chat_template_or_the_policys_tokens(tmp_path):
    from transformers import AutoTokenizer

    from fully_async.rewards.reward_model import RewardModelInputs

    path = make_reward_model(tmp_path / "rm")
    policy = AutoTokenizer.from_pretrained(asset_path("tiny_arithmetic/model"))
    messages = [{"role": "user", "content": "2+3="}]
    prompt = policy.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    record = PromptRecord(0, policy(prompt, add_special_tokens=False)["input_ids"], "arithmetic", "5",
                          messages=messages)
    response = policy("5", add_special_tokens=False)["input_ids"] + [policy.eos_token_id]
    sample = Sample(uid="g", sample_id="g-0", prompt_ids=record.prompt_ids, response_ids=response,
                    rollout_log_probs=[0.0] * len(response), versions=[0] * len(response))
    switched = RewardModelInputs(load_config(["reward_model.enable=true", f"reward_model.model.path={path}"]), policy)
    text = policy.apply_chat_template(messages + [{"role": "assistant", "content": "5"}], add_generation_prompt=False,
                                      tokenize=False)
    assert switched.ids(record, sample) == policy(text, add_special_tokens=False)["input_ids"]
    plain = RewardModelInputs(load_config(["reward_model.enable=true", f"reward_model.model.path={path}",
                                           "reward_model.model.input_tokenizer=null",
                                           "reward_model.max_length=4"]), policy)
    assert plain.ids(record, sample) == (record.prompt_ids + response)[:4]


@pytest.mark.parametrize("overrides,key,message", [
    (["reward_model.enable=true"], "reward_model.model.path", "is required"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "mode=async", "algorithm.filter_groups.enable=true",
      "algorithm.filter_groups.metric=acc"],
     "algorithm.filter_groups.enable", "before the queue"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "mode=async", "algorithm.adv_estimator=remax"],
     "algorithm.adv_estimator", "greedy baseline"),
])
def test_a_reward_model_that_cannot_run_is_refused_naming_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(load_config(overrides))
    assert err.value.key == key


def test_the_folder_and_the_prompts_are_checked_before_ray(tmp_path):
    from fully_async.run.prepare import check_reward_model

    path = make_reward_model(tmp_path / "rm")
    cfg = load_config(["reward_model.enable=true", f"reward_model.model.path={path}", "mode=sync"])
    chat = PromptRecord(0, [1], "arithmetic", "1", messages=[{"role": "user", "content": "1"}])
    check_reward_model(cfg, [chat])
    with pytest.raises(ConfigError, match="prompt 1 .* is a plain string"):
        check_reward_model(cfg, [chat, PromptRecord(1, [1], "arithmetic", "1")])
    (tmp_path / "rm" / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="no chat template"):
        check_reward_model(cfg, [chat])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="not a loadable Hugging Face config") as err:
        check_reward_model(load_config(["reward_model.enable=true", f"reward_model.model.path={empty}"]), [chat])
    assert err.value.key == "reward_model.model.path"


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the four runs and the rank groups (tests_helpers.cpu_group asks for the same one)."""
    import tests_helpers

    yield from tests_helpers.ray_session(num_cpus=3)


@pytest.fixture(scope="module")
def small_val(tmp_path_factory):
    """The bundled validation set's first 16 prompts: each validation scores what it generates with the reward model,
    and what these runs check (every score is the reward model's 0.375, at every validation step) needs no more."""
    import pandas as pd

    path = tmp_path_factory.mktemp("rm_val") / "val.parquet"
    pd.read_parquet(asset_path("tiny_arithmetic/data/val.parquet")).head(16).to_parquet(path)
    return str(path)


@pytest.mark.integration
@pytest.mark.parametrize("mode", [["mode=sync"], ["mode=async"],
                                  ["mode=async", "async_training.placement=colocated", "rollout.n_gpus_per_node=0"],
                                  ["mode=async", "async_training.placement=elastic",
                                   "actor_rollout_ref.rollout.max_num_seqs=8"]],
                         ids=["sync", "async", "colocated", "elastic"])
def test_a_runs_rewards_and_validation_are_the_reward_models(tmp_path, monkeypatch, ray_session, small_val, mode):
    """Every mode: the training rewards and every validation (before training, at test_freq, the driver's final one)
    are the reward model's; in async modes the rollouter attaches its tokens and the trainer scores them."""
    from fully_async.run.main import run
    from tests_helpers import read_scalars

    path = make_reward_model(tmp_path / "rm", kind="token", bias=0.375)   # every response scores 0.375
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    summary = run(load_config([*mode, "reward_model.enable=true", f"reward_model.model.path={path}",
                               "trainer.total_training_steps=2", "trainer.test_freq=1", f"data.val_files={small_val}",
                               "trainer.progress_bar=false",
                               f"trainer.default_local_dir={tmp_path}/ck", "trainer.resume_mode=disable"]))
    assert summary["steps"] == 2
    scalars = read_scalars(str(tmp_path / "tb"))
    assert [round(v, 4) for _, v in scalars["critic/score/mean"]] == [0.375] * 2   # not the rule's 0/1
    val = scalars["val-core/arithmetic/reward/mean@1"]
    assert sorted({s for s, _ in val}) == [0, 1, 2] and {round(v, 4) for _, v in val} == {0.375}, val


@pytest.mark.parametrize("sp", [1, 2])
def test_two_fsdp2_ranks_score_as_one_device(tmp_path, ray_session, sp):
    from fully_async.train.backends.torch_backend import TorchBackend
    import tests_helpers

    path = make_reward_model(tmp_path / "rm")
    common = ["reward_model.enable=true", f"reward_model.model.path={path}", "mode=sync",
              "actor_rollout_ref.model.use_remove_padding=true", "reward_model.micro_batch_size_per_gpu=2"]
    rows = token_rows([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13], [14, 15, 16]])
    want = TorchBackend(load_config(common), CPU, 10).compute_rm_scores(rows)
    cfg = load_config(common + ["actor_rollout_ref.actor.strategy=fsdp2", "trainer.n_gpus_per_node=2",
                                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}"])
    with tests_helpers.cpu_group(cfg) as group:
        torch.testing.assert_close(group.compute_rm_scores(rows), want, atol=1e-5, rtol=1e-5)
