"""docs/verl_compat.md is what scripts/gen_verl_compat.py generates from the rules."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

import gen_verl_compat  # noqa: E402


def test_the_committed_doc_is_the_generated_one():
    with open(gen_verl_compat.DOC) as f:
        committed = f.read()
    assert committed == gen_verl_compat.render(), "run: python scripts/gen_verl_compat.py"


def test_the_doc_lists_every_key_once_with_its_status():
    text = gen_verl_compat.render()
    table = text[text.index("## Every key"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 733
    assert all(line.split(" | ")[2] in ("honoured", "warned", "refused") for line in rows)
    assert "| `actor_rollout_ref.hybrid_engine` | `true` | warned | async mode puts" in table
