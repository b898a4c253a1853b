"""The stub's scripts (`⟪say⟫...⟪/say⟫`) found without decoding every simulated prompt.

A prompt is decoded in full only when a run of its tokens can spell SAY_OPEN's first
character (model/stub_says.py, `Scripts._may_say`); these hold that the filter misses no script,
wherever the character's bytes fall between tokens, and that plain prompts skip the decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from nanoserve.model.base import ForwardBatch
from nanoserve.model.stub import StubModel
from nanoserve.model.stub_says import SAY_CLOSE, SAY_OPEN, Scripts
from nanoserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from nanoserve.model.loader import resolve_model

    return Tokenizer.from_folder(resolve_model("smollm2"))


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the histories decoded whole (single runs of a few
    tokens, the filter's own decodes, are not counted)."""

    def __init__(self, base: Tokenizer) -> None:
        self.__dict__.update(base.__dict__)
        self.long_decodes = 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self.long_decodes += len(ids) > 8
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("before", ["", "x", " ", "日本", "😀", "é", "\n\n", "⟫", "⟪"])
def test_a_script_is_found_whatever_precedes_it(tok: Tokenizer, before: str) -> None:
    hist = tok.encode(f"Please {before}{SAY_OPEN}café 👍🏽{SAY_CLOSE} thanks")
    scripts = Scripts(tok, 0)
    assert scripts._may_say(hist)
    assert scripts.next_token(hist, len(hist)) == tok.encode("café 👍🏽")[0]


def test_the_filter_agrees_with_a_full_decode_on_random_histories(tok: Tokenizer) -> None:
    # Random ids hold many byte fragments (a suspect every ~150 tokens); the opening
    # character's spellings and its fragments are spliced in at random places, so that
    # some histories spell it across token boundaries and some hold only parts of it.
    rng = np.random.default_rng(7)
    pieces = [tok.encode(t) for t in (SAY_OPEN, " ⟪", "⟪⟪", "👩‍💻")]
    frags = [f for p in pieces for f in p]
    scripts = Scripts(tok, 0)
    found = 0
    for _ in range(300):
        hist = rng.integers(2, tok.vocab_size, size=int(rng.integers(1, 400))).tolist()
        for _ in range(int(rng.integers(0, 4))):
            at = int(rng.integers(0, len(hist) + 1))
            if rng.random() < 0.3:  # a whole spelling of it
                hist[at:at] = pieces[int(rng.integers(0, len(pieces)))]
            else:  # one to three of its fragments, in any order
                pick = rng.integers(0, len(frags), size=int(rng.integers(1, 4)))
                hist[at:at] = [frags[int(i)] for i in pick]
        full = SAY_OPEN[0] in tok.decode(hist, skip_special_tokens=False)
        assert scripts._may_say(hist) == full, hist
        found += full
    assert 20 < found < 280  # both answers were exercised


def test_plain_prompts_are_never_decoded_whole(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    model = StubModel(counting)
    texts = ["The quick brown fox jumps over the lazy dog, again and again.",
             "Paged attention keeps the cache in blocks of sixteen tokens each.",
             f"Say it: {SAY_OPEN}ok{SAY_CLOSE} and nothing else, please."]
    hists = [tok.encode(t) for t in texts]
    n = len(hists)
    batch = ForwardBatch(input_ids=[h[-1] for h in hists], positions=[len(h) - 1 for h in hists],
                         slot_mapping=[0] * n, query_lens=[1] * n,
                         context_lens=[len(h) for h in hists], block_tables=[[0]] * n,
                         logits_indices=list(range(n)), histories=hists, seeds=[0] * n)
    for _ in range(3):  # three steps: each history is read once
        picks = model.pick_greedy(batch)
    assert picks[2] == tok.encode("ok")[0]
    assert counting.long_decodes == 1  # the scripted prompt only
