"""scripts/build_shaped_model.py --vocab: the embedding rows each choice gives, and the choices refused."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "scripts"))

from build_shaped_model import REAL_VOCAB, vocab_rows  # noqa: E402


def test_the_vocab_choices():
    assert vocab_rows("tokenizer", 21) == 64 and vocab_rows("tokenizer", 64) == 64 and vocab_rows("tokenizer", 65) == 128
    assert vocab_rows("real", 21) == REAL_VOCAB == 151936
    assert vocab_rows("1000", 21) == 1000


@pytest.mark.parametrize("bad", ["20", "big", ""])
def test_a_vocab_that_cannot_hold_the_tokenizer_or_is_no_choice_is_refused(bad):
    with pytest.raises(SystemExit, match="--vocab"):
        vocab_rows(bad, 21)
