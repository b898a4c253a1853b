"""Token strings for logprobs: a token's raw bytes and its display text.

A byte-level BPE token is a run of *bytes* written in GPT-2's printable alphabet (byte 0x20
is "Ġ", and so on); a token in the middle of a multi-byte character is not valid UTF-8
alone. `TokenText` maps a token back to its bytes (the chat API's `bytes` field) and shows
undecodable bytes as `\\xNN` escapes, as the OpenAI API does, rather than as U+FFFD, which
would hide which bytes they were.
"""

from __future__ import annotations

from nanoserve.tokenizer import Tokenizer


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for themselves;
    the other 68 bytes (controls, space, 0x7f-0xa0, 0xad) are shifted up to U+0100 onward,
    in byte order, so every byte has a visible, unambiguous character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = sorted(set(range(256)) - set(printable))
    for i, b in enumerate(shifted):
        table[chr(0x100 + i)] = b
    return table


_ALPHABET = _byte_alphabet()


class TokenText:
    """Token id -> raw bytes and display string, cached (a stream asks for the same few
    thousand ids again and again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[bytes, str]] = {}

    def get(self, token_id: int) -> tuple[bytes, str]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self._tok.id_to_token(token_id) or ""
            if piece and all(ch in _ALPHABET for ch in piece):
                raw = bytes(_ALPHABET[ch] for ch in piece)
            else:  # special tokens and non-byte-level vocabularies: the text is the token
                raw = self._tok.decode([token_id], skip_special_tokens=False).encode()
            hit = (raw, raw.decode("utf-8", errors="backslashreplace"))
            self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]
