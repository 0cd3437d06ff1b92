"""tests/fixtures/gae_verl.json is what verl's own functions give (scripts/make_gae_fixture.py), where a verl mirror
is at hand."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
VERL = os.environ.get("VERL_GIT_DIR", "/work/.mirror/volcengine+verl/repo")


@pytest.mark.skipif(not os.path.isdir(VERL), reason="no verl mirror (VERL_GIT_DIR)")
def test_the_committed_fixture_is_what_verls_functions_give(tmp_path):
    committed = json.load(open(os.path.join(ROOT, "tests", "fixtures", "gae_verl.json")))
    head = subprocess.run(["git", f"--git-dir={VERL}", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if head.strip() != committed["verl_commit"]:
        pytest.skip(f"the mirror is at {head.strip()[:12]}, the fixture at {committed['verl_commit'][:12]}")
    out = tmp_path / "gae.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_gae_fixture.py"), "--verl-git-dir", VERL,
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    assert json.load(open(out)) == committed
