"""What the GPU tests share: the 0.5B-shaped Qwen2 (random weights, the tiny tokenizer), built once per session."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


@pytest.fixture(scope="session")
def shaped_dir(tmp_path_factory):
    """The folder of scripts/build_shaped_model.py --shape 0.5b."""
    out = str(tmp_path_factory.mktemp("m05"))
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_shaped_model.py"), "--shape", "0.5b",
                    "--out", out], check=True, capture_output=True)
    return out
