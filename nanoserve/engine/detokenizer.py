"""Incremental detokenization with stop strings: one per request, owned by the engine.

Byte-level BPE splits characters across tokens: with SmolLM2, "😀" is three tokens and each
decodes alone to U+FFFD, so decoding token by token and joining the pieces is wrong. Instead
we decode a short *window* of ids twice, without and with the newest tokens, and take the
difference (the prefix_offset/read_offset idea of TGI and vLLM). `_prefix` is where the window
starts and `_read` is where the text already accounted for ends. `_read` is always a token
boundary that is also a character boundary, so the shorter decode is a string prefix of the
longer one; the window slides forward to the next such boundary as soon as one arrives.

A lossy UTF-8 decoder writes a character whose bytes are still incomplete as U+FFFD, and the
next token may turn it into the real character. So a trailing run of U+FFFD is held back;
everything before it is final and is released at once. A character spans at most 4 bytes and a
token carries at least one, so a split character is released at most 3 tokens late.

The first window starts inside the prompt, at a character boundary, and ends at the last
character boundary of the prompt. A prompt that ends inside a character leaves those bytes out
of the window: the output's first bytes then decode the way `decode(output_ids)` shows them
(as U+FFFD) instead of completing a character whose start the client already has, and no
prompt text can leak into the first delta (vLLM issue 48853).

Stop strings are matched on the released-or-releasable text, across token boundaries and
inside a token. While one could still be forming, the text that could be its start is held
back, so a released character is never taken back. For every token sequence,
`"".join(pop_delta() results) + finish()` equals `decode(output_ids)`, cut at the stop string
when one matched.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens the first window may start with. One would do for a decoder that treats only
# the window's first token specially (SentencePiece strips its leading space); a few more leave
# room to find a start that is a character boundary, since one character spans at most 4 tokens.
_LEAD_IN_TOKENS = 5
# The most tokens a character can span (UTF-8 is at most 4 bytes, a token at least one byte).
_MAX_CHAR_TOKENS = 4


def _lead_in(tokenizer: Tokenizer, prompt_ids: Sequence[int], skip: bool) -> list[int]:
    """The prompt tokens the first window starts with: whole characters, ending as late as
    possible. Empty when the prompt has no character boundary near its end."""

    def clean_end(end: int) -> bool:
        # The text before `end` ends with a whole character iff decoding the last few tokens
        # does not end with U+FFFD: that character's lead byte is within 4 tokens of `end`, and
        # a valid character is never the continuation of anything earlier.
        window = prompt_ids[max(0, end - _MAX_CHAR_TOKENS) : end]
        return not tokenizer.decode(window, skip_special_tokens=skip).endswith(_REPLACEMENT)

    n = len(prompt_ids)
    # An unfinished character at the end of the prompt has at most 3 of its tokens there.
    ends = [e for e in range(n, n - _MAX_CHAR_TOKENS, -1) if e > 0 and clean_end(e)]
    if not ends:
        return []
    end = ends[0]
    for start in range(max(0, end - _LEAD_IN_TOKENS), end):
        text = tokenizer.decode(prompt_ids[start:end], skip_special_tokens=skip)
        if not text.startswith(_REPLACEMENT):
            return list(prompt_ids[start:end])
    return []


def _forming_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string: the
    characters a stop string could still grow out of (at most max(len(stop)) - 1)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas that are never taken back."""

    __slots__ = (
        "_tokenizer",
        "_skip",
        "_stop",
        "_include_stop",
        "_ids",
        "_prefix",
        "_read",
        "_prefix_text",
        "_tail_done",
        "_stable",
        "_pending",
        "_released",
        "_stop_reason",
        "_finished",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            # SamplingParams refuses these already; an empty stop would match before any text.
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids = _lead_in(tokenizer, prompt_ids, skip_special_tokens)  # lead-in + output
        self._prefix = 0  # window start, an index into _ids
        self._read = len(self._ids)  # end of the text accounted for; a character boundary
        self._prefix_text = self._decode(self._prefix, self._read)
        self._tail_done = 0  # characters of the window's tail (past _prefix_text) in _stable
        self._stable = ""  # output text no later token can change (cut at a matched stop)
        self._pending = ""  # trailing U+FFFD run a later token may turn into a character
        self._released = 0  # characters handed out by pop_delta()/finish()
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """The output text in its final form so far: what the request's whole text would be
        if it ended now (cut at the stop string when one matched)."""
        return self._stable + self._pending

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completed, if any; the
        request must then finish with finish_reason "stop" and that string as stop_reason."""
        if self._finished or self._stop_reason is not None:
            raise RuntimeError("add_token() after the request ended")
        self._ids.append(token_id)
        window = self._decode(self._prefix, len(self._ids))
        # _read is a character boundary, so the window decode extends _prefix_text.
        tail = window[len(self._prefix_text) :]
        settled = tail.rstrip(_REPLACEMENT)
        self._pending = tail[len(settled) :]
        grown_from = len(self._stable)
        if len(settled) > self._tail_done:
            self._stable += settled[self._tail_done :]
            self._tail_done = len(settled)
        if not self._pending:
            # The newest token ends on a character boundary: slide the window up to it, so
            # each decode covers only the tokens since the previous boundary.
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
            self._tail_done = 0
        return self._match_stop(grown_from) if self._stop else None

    def pop_delta(self) -> str:
        """The text that may be released now; "" when nothing (an empty delta is no frame)."""
        if self._finished:
            return ""
        upto = self._releasable()
        delta = self._stable[self._released : upto]
        self._released = upto
        return delta

    def finish(self) -> str:
        """The request ended (length, eos, abort...): release everything still held back."""
        if self._finished:
            return ""
        self._finished = True
        rest = self.text[self._released :]
        self._released += len(rest)
        return rest

    # -- helpers ---------------------------------------------------------------------------------

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _match_stop(self, grown_from: int) -> str | None:
        """Look for a stop string ending in the text added since `grown_from`.

        The rule when several match: the one that ends first wins, and of those ending at the
        same character the one that starts first (the longest). That is the stop a reader
        would have seen complete first had the text arrived one character at a time, so the
        outcome depends neither on where the tokens split the text nor on the order of `stop`.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            # Every match ending before `grown_from` was looked for at an earlier token.
            start = self._stable.find(stop, max(0, grown_from - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self._stable = self._stable[: end if self._include_stop else start]
        self._pending = ""  # what followed the stop string is cut
        self._stop_reason = stop
        return stop

    def _releasable(self) -> int:
        """How many characters of _stable can be released without ever taking one back."""
        if self._stop_reason is not None or not self._stop or self._include_stop:
            # With the stop string kept in the output, a later match ends after everything
            # decoded so far, so no cut can reach text we already have.
            return len(self._stable)
        return len(self._stable) - _forming_stop_len(self._stable, self._stop)
