"""`python -m fully_async.plan --help` and `python -m fully_async.doctor --help`: a short usage of their own that names
the plan.* keys (each one real) and the other commands; the planner says which cards it priced and why."""
import re
from dataclasses import fields
from types import SimpleNamespace

import pytest

from fully_async.run import doctor, plan_cli
from fully_async.run.plan_options import PlanOptions


def help_of(main, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_plan_help_names_every_plan_key_and_the_other_commands(capsys):
    text = help_of(plan_cli.main, capsys)
    assert text.startswith("usage: python -m fully_async.plan [plan.KEY=VALUE ...]")
    named = set(re.findall(r"plan\.([a-z_]+)", text))
    assert named == {f.name for f in fields(PlanOptions)}              # every key named, and only real ones
    for command in ("python -m fully_async.main", "python -m fully_async.compare", "python -m fully_async.doctor"):
        assert command in text
    assert len(text.splitlines()) <= 40 and max(len(line) for line in text.splitlines()) <= 120


def test_doctor_help_is_its_own_usage_naming_the_other_commands(capsys):
    text = help_of(doctor.main, capsys)
    assert text.startswith("usage: python -m fully_async.doctor [KEY=VALUE ...] [--no-ray]")
    for command in ("python -m fully_async.main", "python -m fully_async.plan", "python -m fully_async.compare"):
        assert command in text
    assert len(text.splitlines()) <= 30 and max(len(line) for line in text.splitlines()) <= 120


def cfg(device):
    return SimpleNamespace(trainer=SimpleNamespace(device=device))


def test_the_planner_says_which_cards_it_assumed_and_why():
    key, why = plan_cli.assumed_device(cfg("auto"), PlanOptions(), detect=lambda: "cpu")
    assert key == "ascend910b" and "this machine has no NPU or GPU" in why and "plan.device=" in why
    key, why = plan_cli.assumed_device(cfg("auto"), PlanOptions(), detect=lambda: "cuda")
    assert key == "h100" and why.startswith("trainer.device=auto is cuda on this machine")
    assert plan_cli.assumed_device(cfg("npu"), PlanOptions())[0] == "ascend910b"
    assert plan_cli.assumed_device(cfg("auto"), PlanOptions(device="h200"), detect=lambda: "cpu") == (
        "h200", "plan.device=h200")
    assert plan_cli.assumed_device(cfg("cpu"), PlanOptions()) == (None, "trainer.device=cpu: no table row")
