"""The README is a front page: short, no line over 120 characters, what the package is first, and the two commands
a fresh machine needs, the second of them exactly what CI (.ci/run) runs."""
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as fh:
        return fh.read()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_short_and_narrow():
    lines = readme().split("\n")
    assert len(lines) <= 250, len(lines)
    wide = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 120]
    assert not wide, wide


def test_what_it_is_comes_first_then_the_two_commands():
    text = readme()
    head = " ".join(text.split("\n")[:10])
    assert "RL post-training" in head and "verl" in head
    blocks = bash_blocks(text)
    assert "python -m fully_async.main" in blocks[0] and "pip install" in blocks[0]
    assert blocks[1].rstrip().endswith("python -m pytest -q -n 2 --dist loadfile tests")


def test_the_test_command_is_byte_for_byte_what_ci_runs():
    command = bash_blocks(readme())[1]
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    assert command in ci, "README's test command and .ci/run differ"
    assert "\n" + command in ci   # whole lines, not a tail of another command


def test_the_headline_figures_say_which_set_free_cache_engine_false():
    """verl's default frees the engine's cache where the trainer needs it; every figure says whether it ran with every
    default or which free_cache_engine keys it set, and the every-default one comes first."""
    rows = [line for line in readme().split("\n") if line.startswith("| 1x H200") or line.startswith("| 2x H200")
            or line.startswith("| 4x H200")]
    assert rows
    for row in rows:
        assert "every default" in row or "free_cache_engine=false" in row or "free_cache_engine_force" in row, row
    assert "every default" in rows[0] and "free_cache_engine=false" not in rows[0]
    assert any("every default" in r and "free_cache_engine=true" in r for r in rows)
