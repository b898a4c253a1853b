"""How deep a JSON text nests, found without parsing it and without recursion.

Python's JSON parser and encoder, pydantic and the grammar compiler all recurse once per
level: a body nested ~1,000 deep ends in RecursionError somewhere past the parser (a 500),
and one nested 100,000 deep costs a parse before it fails. So every body is measured
first, as web servers and serde_json (128) bound it: no request field needs more than
`MAX_DEPTH` levels (a JSON schema of 40 nested objects is ~85). The measure is C-speed
byte work in numpy: a bracket inside a string is text, and the depth is the running sum of
+1 per `[`/`{` and -1 per `]`/`}` over the rest. Only a body that is too deep is scanned
again, token by token and for a bounded number of tokens, to name its field.

Why numpy and not a regular expression cutting the strings out (as this once did): `re`
holds the GIL for the whole of one call, so the measure, though run in a worker thread
(offload.py), stalled the event loop and the engine's step thread for as long as it ran:
53 ms on the 2.5 MB body of 10,000 tools. numpy lets the GIL go inside its passes: on that
body another thread's worst wait is 4 ms.
"""

from __future__ import annotations

import json
import re

import numpy as np

MAX_DEPTH = 100
_SCAN_TOKENS = 100_000  # naming the field of a too-deep body gives up past this many

_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def too_deep(text: bytes) -> bool:
    """Whether the JSON `text` nests more than MAX_DEPTH arrays and objects deep. Malformed
    text gets an answer too (the parser then says what is wrong with it)."""
    if text.count(b"[") + text.count(b"{") <= MAX_DEPTH:  # most bodies stop here
        return False
    data = np.frombuffer(text, np.uint8)
    at = np.flatnonzero(_STEP[data])  # where the brackets are
    quotes = _string_quotes(data)
    # A bracket is text when an odd number of a string's quotes come before it.
    outside = np.searchsorted(quotes, at) % 2 == 0
    steps = _STEP[data[at[outside]]]
    return bool(steps.size) and int(np.cumsum(steps, dtype=np.int64).max()) > MAX_DEPTH


def _string_quotes(data: np.ndarray) -> np.ndarray:
    r"""The positions of the quotes that open or close a string, in order: every `"` but
    those escaped, i.e. right after a run of backslashes of odd length (`\\` is one
    escaped backslash, so `\\"` ends a string and `\\\"` does not)."""
    quotes = np.flatnonzero(data == ord('"'))
    slashes = np.flatnonzero(data == ord("\\"))
    if not slashes.size or not quotes.size:
        return quotes
    # Runs of consecutive backslashes: where each ends, and how long it is.
    breaks = np.flatnonzero(np.diff(slashes) != 1)
    ends = slashes[np.append(breaks, slashes.size - 1)]
    lengths = ends - slashes[np.insert(breaks + 1, 0, 0)] + 1
    run = np.minimum(np.searchsorted(ends, quotes - 1), ends.size - 1)
    escaped = (ends[run] == quotes - 1) & (lengths[run] % 2 == 1)
    return quotes[~escaped]


def deep_field(text: bytes) -> str | None:
    """The top-level key under which a too-deep object `text` first passes MAX_DEPTH, or
    None (not an object, not found within the scan's budget, or a key that is no text)."""
    if not text.lstrip().startswith(b"{"):
        return None
    depth = 0
    key: bytes | None = None
    for i, m in enumerate(_TOKEN.finditer(text)):
        if i == _SCAN_TOKENS:
            return None
        token = m.group()
        if token[0] == ord('"'):
            if depth == 1:
                key = token  # the last string at the top level: a key, or the value of one
            continue
        depth += 1 if token in (b"[", b"{") else -1
        if depth > MAX_DEPTH:
            break
    else:
        return None
    try:
        name = json.loads(key) if key is not None else None
    except ValueError:
        return None
    return name if isinstance(name, str) else None
