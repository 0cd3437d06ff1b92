"""Shared fixtures: a tiny random Qwen2 model + character tokenizer built in a temp dir (no downloads)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# checkpoint manifests are signed with a per-user key (core/checkpoint.py): the tests' own, not the user's
os.environ.setdefault("FULLY_ASYNC_CHECKPOINT_KEY", os.path.join(
    __import__("tempfile").gettempdir(), f"fully_async_test_checkpoint_{os.getuid()}.key"))


def build_random_model(path: str, seed: int = 0, vocab: int = 48, layers: int = 2) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, initializer_range=0.3, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    return build_random_model(str(tmp_path_factory.mktemp("random_qwen2")))


import sys as _sys  # noqa: E402

_sys.path.insert(0, os.path.dirname(__file__))  # tests_helpers, fakes


@pytest.fixture(scope="module", autouse=True)
def _machine_share(request):
    """Under the suite's workers (-n 2): a module marked `alone` runs while the other worker waits
    (suite_budget.machine_share); in one process nothing is shared."""
    if not hasattr(request.config, "workerinput"):
        yield
        return
    from suite_budget import module_share

    with module_share(str(request.config.rootpath), request.node.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_asked(request):
    """tests_helpers.ray_session leaves its Ray up for the next module that asks for the same one: a module none of
    whose tests use the `ray_session` fixture starts with no Ray in this process (it may start its own, or run code
    that would join one), and the session ends with none."""
    import tests_helpers

    if not any("ray_session" in getattr(item, "fixturenames", ()) for item in request.session.items
               if item.module is request.module):
        tests_helpers.shutdown_shared_ray()
    yield


@pytest.fixture(scope="session")
def sync_learning_run(tmp_path_factory):
    """The bundled task in sync mode, tests_helpers.SYNC_LEARNING (10 steps, validation every 5), once a session on
    the shared Ray: the placements' "learns as sync does at equal steps" tests compare with it.  (summary, (first, last)
    validation reward)."""
    import tests_helpers
    from fully_async.run.hydra_setup import load_config
    from fully_async.run.main import run

    next(tests_helpers.ray_session(num_cpus=3))
    tmp = tmp_path_factory.mktemp("sync_learning")
    saved = os.environ.get("TENSORBOARD_DIR")
    os.environ["TENSORBOARD_DIR"] = str(tmp / "tb")
    try:
        summary = run(load_config([*tests_helpers.SYNC_LEARNING, "mode=sync", f"trainer.default_local_dir={tmp}/ck"]))
    finally:
        if saved is None:
            os.environ.pop("TENSORBOARD_DIR", None)
        else:
            os.environ["TENSORBOARD_DIR"] = saved
    return summary, tests_helpers.first_and_last_val(str(tmp / "tb"))


def pytest_sessionfinish(session, exitstatus):
    import tests_helpers

    tests_helpers.shutdown_shared_ray()


from suite_budget import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport,  # noqa: E402,F401
                          pytest_runtest_makereport, pytest_terminal_summary)
