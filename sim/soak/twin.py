"""Streams and their unary twins, reduced to one comparable shape.

A stream is a delivery schedule, not a different model (docs/ARCHITECTURE.md), so a
completed stream's choices must equal the unary response to the same body: per choice index
its text, its finish reason and, when logprobs were asked for, every token's logprobs entry
(which names the token, so this compares token ids too); and the usage, when the stream
asked for it. Completions and chat carry these in different places; `Choices` is what both
reduce to.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sim.http.sse import DONE

Choices = dict[int, dict[str, Any]]  # index -> {"text", "finish_reason", "logprobs"}
_LP_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def from_stream(events: Sequence[str]) -> tuple[Choices, Any]:
    """(choices, usage or None) from a stream's SSE payloads; an error frame raises."""
    out: Choices = {}
    usage = None
    for data in events:
        if data == DONE:
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error frame: {chunk['error']}")
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            acc = out.setdefault(c["index"], {"text": "", "finish_reason": None,
                                              "logprobs": None})
            if acc["finish_reason"] is not None:
                raise ValueError(f"choice {c['index']}: a chunk after its finish")
            delta = c.get("delta")
            acc["text"] += (delta.get("content") or "") if delta is not None else c["text"]
            acc["finish_reason"] = c.get("finish_reason")
            acc["logprobs"] = _join(acc["logprobs"], c.get("logprobs"))
    return out, usage


def from_unary(obj: Any) -> tuple[Choices, Any]:
    out: Choices = {}
    for c in obj["choices"]:
        msg = c.get("message")
        text = (msg.get("content") or "") if msg is not None else c["text"]
        out[c["index"]] = {"text": text, "finish_reason": c["finish_reason"],
                           "logprobs": _join(None, c.get("logprobs"))}
    return out, obj.get("usage")


def _join(acc: Any, lp: Any) -> Any:
    """Append one chunk's logprobs to what a choice has so far (None: none asked for)."""
    if lp is None:
        return acc
    if "content" in lp:  # chat: a list of per-token entries
        return (acc or []) + list(lp["content"] or [])
    acc = acc or {k: [] for k in _LP_KEYS}  # completions: parallel lists
    return {k: acc[k] + list(lp.get(k) or []) for k in _LP_KEYS}


def differences(stream: tuple[Choices, Any], unary: tuple[Choices, Any],
                with_usage: bool) -> list[str]:
    """What differs between a stream and its twin, one phrase each; [] when they agree."""
    (s, s_usage), (u, u_usage) = stream, unary
    out = []
    if sorted(s) != sorted(u):
        out.append(f"choice indices {sorted(s)} vs {sorted(u)}")
    for i in sorted(set(s) & set(u)):
        for key in ("text", "finish_reason", "logprobs"):
            if s[i][key] != u[i][key]:
                out.append(f"choice {i} {key}: {_short(s[i][key])} vs {_short(u[i][key])}")
    if with_usage and s_usage != u_usage:
        out.append(f"usage {s_usage} vs {u_usage}")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
