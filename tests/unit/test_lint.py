"""The tree passes the lint rules of ruff.toml (pyflakes and syntax errors): `python -m ruff check`, as CI runs it."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def test_ruff_check_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in proc.stderr, "ruff is in the test extra: pip install -e '.[test]'"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_configuration_is_the_one_checked():
    """ruff reads ruff.toml at the root (setup.cfg is not a ruff configuration): pyflakes and E9, the house width."""
    with open(os.path.join(ROOT, "ruff.toml")) as fh:
        text = fh.read()
    assert "line-length = 120" in text
    assert 'select = ["F", "E9"' in text
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-settings", "README.md"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert "ruff.toml" in proc.stdout and "line_length = 120" in proc.stdout, proc.stdout[:2000]
