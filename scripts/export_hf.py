"""Export a checkpoint's trainer weights as a Hugging Face model folder (weights + config + tokenizer).

    python scripts/export_hf.py checkpoints/fully_async/default/global_step_40 /models/my_policy

The checkpoint's `actor/` folder already is a `save_pretrained` folder; this copies it and adds the
tokenizer files of the model the run started from (recorded in trainer_state.json, or --tokenizer),
then loads the result once with transformers to prove it is usable.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def export(checkpoint: str, out: str, tokenizer_path: str | None = None) -> str:
    actor = os.path.join(checkpoint, "actor")
    state_file = os.path.join(checkpoint, "trainer_state.json")
    if not os.path.isdir(actor) or not os.path.isfile(state_file):
        raise SystemExit(f"error: {checkpoint} is not a checkpoint folder (needs actor/ and trainer_state.json)")
    with open(state_file) as fh:
        state = json.load(fh)
    tokenizer_path = tokenizer_path or state["model_path"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(actor):
        shutil.copy2(os.path.join(actor, name), os.path.join(out, name))
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out)  # fails loudly if the folder is not usable
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a global_step_<v> folder")
    p.add_argument("out", help="destination folder")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the run's actor_rollout_ref.model.path)")
    args = p.parse_args(argv)
    print(f"exported {export(args.checkpoint, args.out, args.tokenizer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
