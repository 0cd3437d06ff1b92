"""verl's actor_rollout_ref.model.custom_chat_template, tokenizer_path and external_lib, before any run: the tokenizer
every process builds comes from tokenizer_path and takes the template, and the prompts are templated with it; the module is imported before the model folder is
read, so an architecture it registers loads, and a module that does not import is refused naming the key.  (A run
with both: tests/integration/test_verl_keys_run.py.)"""
import json
import shutil
import sys
import textwrap

import pytest

from fully_async.actors.actor_setup import build_tokenizer
from fully_async.core.config import ConfigError, asset_path
from fully_async.run.hydra_setup import load_config
from fully_async.run.prepare import check_model_folder, load_datasets, load_tokenizer

PARENS = "{% for message in messages %}({{ message['content'] }}){% endfor %}"


def test_the_custom_chat_template_replaces_the_tokenizers_and_templates_the_prompts():
    plain = build_tokenizer(load_config([]))
    cfg = load_config([f"actor_rollout_ref.model.custom_chat_template={json.dumps(PARENS)}"])
    tokenizer = build_tokenizer(cfg)
    chat = [{"role": "user", "content": "35+8="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "(35+8=)"
    assert plain.apply_chat_template(chat, tokenize=False) == "35+8="
    train, _ = load_datasets(cfg, tokenizer)
    assert train[0].raw_prompt == "(35+8=)" and tokenizer.decode(train[0].prompt_ids) == "(35+8=)"


def test_the_tokenizer_comes_from_tokenizer_path(tmp_path):
    """A tokenizer folder of its own (here the bundled one with another template); one that does not load is refused
    naming tokenizer_path."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{asset_path('tiny_arithmetic/model')}/{name}", tok_dir / name)
    (tok_dir / "chat_template.jinja").write_text(PARENS)
    tokenizer = build_tokenizer(load_config([f"actor_rollout_ref.model.tokenizer_path={tok_dir}"]))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False) == "(1+1=)"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.tokenizer_path.*the tokenizer does not load"):
        load_tokenizer(load_config([f"actor_rollout_ref.model.tokenizer_path={tmp_path}/none"]))


def registering_module(folder, name: str, model_type: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(f"""
        from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

        class Conf(Qwen2Config):
            model_type = {model_type!r}

        class Model(Qwen2ForCausalLM):
            config_class = Conf

        AutoConfig.register({model_type!r}, Conf)
        AutoModelForCausalLM.register(Conf, Model)
    """))


def test_the_external_lib_is_imported_before_the_model_folder_is_read(tmp_path, monkeypatch):
    """A module of this test's own (a model type no other test registers): the folder of that type is refused without
    it and loads with it; a module that does not import is named."""
    name, model_type = f"fa_ext_{tmp_path.name.replace('-', '_')}", f"fa_ext_{abs(hash(str(tmp_path)))}"
    registering_module(tmp_path, name, model_type)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tmp_path / "model"
    shutil.copytree(asset_path("tiny_arithmetic/model"), model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(conf, model_type=model_type, architectures=["Model"])))
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path"):
        check_model_folder(load_config([f"actor_rollout_ref.model.path={model}"]))
    assert name not in sys.modules
    conf = check_model_folder(load_config([f"actor_rollout_ref.model.path={model}",
                                           f"actor_rollout_ref.model.external_lib={name}"]))
    assert conf.model_type == model_type and name in sys.modules
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.external_lib.*'no_such_lib_here' does not import"):
        check_model_folder(load_config(["actor_rollout_ref.model.external_lib=no_such_lib_here"]))
