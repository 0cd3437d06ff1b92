"""A model architecture transformers does not know, registered with its Auto classes when imported: the tests'
actor_rollout_ref.model.external_lib (verl's key).  It is Qwen2 under another model_type, so a folder of the bundled
model with config.json's model_type and architectures changed (`as_custom_arch`) loads only after this import."""
import json
import os
import shutil

from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

MODEL_TYPE = "fa_custom_qwen2"


class FaCustomConfig(Qwen2Config):
    model_type = MODEL_TYPE


class FaCustomForCausalLM(Qwen2ForCausalLM):
    config_class = FaCustomConfig


AutoConfig.register(MODEL_TYPE, FaCustomConfig)
AutoModelForCausalLM.register(FaCustomConfig, FaCustomForCausalLM)


def as_custom_arch(model_dir: str, out: str) -> str:
    """A copy of the model folder `model_dir` whose config names this architecture."""
    shutil.copytree(model_dir, out)
    path = os.path.join(out, "config.json")
    with open(path) as fh:
        conf = json.load(fh)
    conf.update(model_type=MODEL_TYPE, architectures=["FaCustomForCausalLM"])
    with open(path, "w") as fh:
        json.dump(conf, fh)
    return out
