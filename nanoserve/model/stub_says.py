"""What the stub model is told to say (model/stub.py): a prompt's script, a recorded output,
and the copying rule of a plan's stub. Each is a function of the row's history alone, so the
stub stays a pure function of (seed, history) and a replay or a plan runs the same tokens
every time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nanoserve.tokenizer import Tokenizer

# A prompt holding `⟪say⟫TEXT⟪/say⟫` makes the stub say TEXT (its tokens, then EOS; the last
# such script where there are several): the tests' scripted outputs (tool-call markup,
# reasoning), replayable from a trace.
SAY_OPEN, SAY_CLOSE = "⟪say⟫", "⟪/say⟫"
_SCRIPTS_KEPT = 1024  # sequences whose script (or its absence) is remembered
_COPY_SPAN = 4  # the longest ending `copied` looks up: the n-gram proposer's default most


def copied(hist: Sequence[int], upto: int) -> int:
    """What copying says after hist[:upto]: the token that followed the last earlier
    occurrence of its longest ending of at most _COPY_SPAN tokens; where its last token
    never occurred before (the stub's own words between copies), the history's first, so
    copying starts again from the top of the prompt."""
    seq = np.asarray(hist[:upto], dtype=np.int64)
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    if ends.size == 0:
        return int(seq[0])
    best = ends
    for back in range(1, min(_COPY_SPAN, upto - 1)):
        longer = best[best >= back]
        longer = longer[seq[longer - back] == seq[upto - 1 - back]]
        if longer.size == 0:
            break
        best = longer
    return int(seq[best[-1] + 1])


class Scripts:
    """What prompts tell the stub to say (`SAY_OPEN`...`SAY_CLOSE`), each sequence's prompt
    read once: id(history) -> (the history list itself, its script's tokens or None), the
    last `_SCRIPTS_KEPT` sequences first seen (one forgotten is only read again)."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        self._tokenizer = tokenizer
        self._eos = eos
        self._seen: dict[int, tuple[Sequence[int], list[int] | None]] = {}
        self._suspects: frozenset[int] | None = None

    def _script(self, hist: Sequence[int]) -> list[int] | None:
        """The tokens the prompt in `hist` tells the stub to say, if it does."""
        got = self._seen.get(id(hist))
        if got is not None and got[0] is hist:
            return got[1]
        script = self._read(hist) if self._may_say(hist) else None
        self._seen[id(hist)] = (hist, script)
        if len(self._seen) > _SCRIPTS_KEPT:
            del self._seen[next(iter(self._seen))]
        return script

    def _read(self, hist: Sequence[int]) -> list[int] | None:
        text = self._tokenizer.decode(list(hist), skip_special_tokens=False)
        start = text.rfind(SAY_OPEN)  # the last: a tool result may script the next turn
        end = text.find(SAY_CLOSE, start)
        return (self._tokenizer.encode(text[start + len(SAY_OPEN):end])
                if start >= 0 and end > start else None)

    def _may_say(self, hist: Sequence[int]) -> bool:
        """Whether `hist`'s text can hold SAY_OPEN's first character, found without decoding
        it all (a simulated prompt is thousands of tokens, a decode of it a third of a
        millisecond): that character is in the text only inside one token, or split over a
        run of consecutive tokens each of which holds part of a multi-byte character, and
        both kinds are `suspects`; so only the runs of suspects are decoded."""
        if self._suspects is None:
            mark = SAY_OPEN[0]
            self._suspects = frozenset(i for i, t in enumerate(self._tokenizer.token_texts())
                                       if mark in t or "\ufffd" in t)
        suspects = self._suspects
        if suspects.isdisjoint(hist):
            return False
        at = [i for i, t in enumerate(hist) if t in suspects]
        first = 0
        for k in range(1, len(at) + 1):
            if k == len(at) or at[k] != at[k - 1] + 1:  # the end of a run
                run = hist[at[first]:at[k - 1] + 1]
                if SAY_OPEN[0] in self._tokenizer.decode(list(run), skip_special_tokens=False):
                    return True
                first = k
        return False

    def next_token(self, hist: Sequence[int], upto: int) -> int | None:
        """The scripted next token after hist[:upto] (EOS once it is all said), or None:
        the output so far is the longest suffix of the history that begins the script."""
        script = self._script(hist)
        if script is None:
            return None
        for k in range(min(len(script), upto), 0, -1):
            if list(hist[upto - k:upto]) == script[:k]:
                return script[k] if k < len(script) else self._eos
        return script[0] if script else self._eos

    def said(self, histories: Sequence[Sequence[int]],
             rows: Sequence[tuple[int, int]]) -> list[int | None] | None:
        """`next_token` for each (row, upto), or None when no row's prompt scripts anything
        (the common case, found with one look-up a row)."""
        if all(self._script(histories[row]) is None for row, _ in rows):
            return None
        return [self.next_token(histories[r], upto) for r, upto in rows]


class Recorded:
    """What the stub says after given prompts: each one's recorded output tokens (a trace's,
    or a measured run's), so that speculation's proposals are kept or refused token for
    token as on the model that said them; past a recording's end, and after any other
    prompt, the stub's own tokens. A history is matched to its prompt once (by the list
    object, as Scripts does; a proposal's rows bring a new list each step)."""

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]]) -> None:
        self._outputs = {p: tuple(o) for p, o in outputs.items() if p}
        # Prompts by their length and first token, each length's longest first: a row's
        # history is tried against each length it can hold.
        self._keys: dict[int, set[int]] = {}
        for p in self._outputs:
            self._keys.setdefault(len(p), set()).add(p[0])
        self._lengths = sorted(self._keys, reverse=True)
        self._seen: dict[int, tuple[Sequence[int], tuple[int, tuple[int, ...]] | None]] = {}

    def _match(self, hist: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
        """(the prompt's length, its recorded output) for the prompt `hist` begins with."""
        got = self._seen.get(id(hist))
        if got is not None and got[0] is hist:
            return got[1]
        found = None
        for n in self._lengths:
            if n <= len(hist) and hist[0] in self._keys[n]:
                out = self._outputs.get(tuple(hist[:n]))
                if out is not None:
                    found = (n, out)
                    break
        self._seen[id(hist)] = (hist, found)
        if len(self._seen) > _SCRIPTS_KEPT:
            del self._seen[next(iter(self._seen))]
        return found

    def next_token(self, hist: Sequence[int], upto: int) -> int | None:
        """The recorded token after hist[:upto], or None (no recording, or past its end)."""
        found = self._match(hist)
        if found is None:
            return None
        n, out = found
        i = upto - n
        return out[i] if 0 <= i < len(out) else None
