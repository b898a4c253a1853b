"""Replay outcomes: what one run of a trace observed, as expectation lines, compared, digested.

An `Outcome` is the whole observable result of a trace: per request what its client saw
(status, error code, text, frames) together with what the engine did for it (token ids, the
steps of its first and last token, whether it was aborted), and at the end the engine's
totals. It is built by the replay driver and, from live traffic, by the recorder; both write
it with `expectation_lines`, so the two produce identical lines for identical traffic.

Expectation fields of a request (the format's own, plus additive ones):

- `status` (absent when the client hung up before the status line), `error` (the error code
  of a 4xx/5xx body or of a stream's error frame, absent when none),
- with one choice (n = 1 and one prompt, or no choice at all for an error): `finish_reason`,
  `completion_tokens`, `token_ids`, `text` at the top level, and `tool_calls` (a list of
  `[name, arguments]`) where the client read any;
- with several choices (n > 1, or a list of prompts, in the response's `index` order, which
  is prompt-major): `completion_tokens` is their total (what `usage` reports) and `choices`
  is a list of `{"finish_reason", "completion_tokens", "token_ids", "text"}`;
- `first_token_step`, `last_step` (over all choices; null when no token was produced),
- `frames` (SSE data frames the client read, `[DONE]` not counted; 0 for a unary request),
  `aborted` (the engine ended it by an abort, not by finishing), `hangup_step` (the step
  boundary at which the client hung up; absent when it did not). An expectation line
  without `error` or `hangup_step` expects none, so a new error or hang-up is a mismatch.

`finish_reason` is the engine's (a step's final update) where there is one, else the one on
the wire (an error the bridge wrote), else "abort" for a client that hung up. Token ids are
the engine's: the wire carries text, not ids. Text is the client's: what it read.

End fields: `steps`, `free_blocks`, `peak_used_blocks`, `preemptions` (the format's), plus
`num_blocks` and `aborted` (requests whose engine work ended by an abort), and
`loop_failed: true` only when the engine loop died (an injected `schedule_raises` fault).

The digest is the sha256 of the outcome's canonical JSON (sorted keys, no spaces, ASCII), so
two runs agree on it exactly when they agree on every observed fact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sim.trace.format import Expectation

__all__ = [
    "CallsRead", "ChoiceOutcome", "EndOutcome", "Outcome", "RequestOutcome", "compare",
    "diff_value",
    "expectation_lines",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class ChoiceOutcome:
    finish_reason: str | None
    token_ids: tuple[int, ...]
    text: str
    # (name, arguments) of each tool call the client read, in order; written only when
    # there are some, so a trace without tools keeps its lines and digest
    tool_calls: tuple[tuple[str, str], ...] = ()

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "finish_reason": self.finish_reason, "completion_tokens": len(self.token_ids),
            "token_ids": list(self.token_ids), "text": self.text}
        if self.tool_calls:
            out["tool_calls"] = [list(c) for c in self.tool_calls]
        return out


class CallsRead:
    """The tool calls of each choice as a client reads them: a unary message's
    `tool_calls`, or a stream's `delta.tool_calls` pieces joined by index."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[int, list[str]]] = {}

    def add(self, choice: Mapping[str, Any], holder: str) -> None:
        part = choice.get(holder)
        calls = part.get("tool_calls") if isinstance(part, Mapping) else None
        for k, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
                continue
            fn = call["function"]
            slot = self._calls.setdefault(choice.get("index", 0), {}).setdefault(
                call.get("index", k), ["", ""])
            slot[0] += str(fn.get("name") or "")
            slot[1] += str(fn.get("arguments") or "")

    def of(self, index: int) -> tuple[tuple[str, str], ...]:
        calls = self._calls.get(index, {})
        return tuple((c[0], c[1]) for _, c in sorted(calls.items()))


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    id: str
    status: int | None  # None: the client hung up before the status line
    error: str | None
    choices: tuple[ChoiceOutcome, ...]  # () for a request refused before it ran
    first_token_step: int | None
    last_step: int | None
    frames: int
    aborted: bool
    hangup_step: int | None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def fields(self) -> dict[str, Any]:
        """The expectation fields, in a fixed order (see the module docstring)."""
        out: dict[str, Any] = {}
        if self.status is not None:
            out["status"] = self.status
        if self.error is not None:
            out["error"] = self.error
        if len(self.choices) <= 1:
            c = self.choices[0] if self.choices else ChoiceOutcome(None, (), "")
            out.update(c.fields())
        else:
            out["completion_tokens"] = self.completion_tokens
            out["choices"] = [c.fields() for c in self.choices]
        out["first_token_step"] = self.first_token_step
        out["last_step"] = self.last_step
        out["frames"] = self.frames
        out["aborted"] = self.aborted
        if self.hangup_step is not None:
            out["hangup_step"] = self.hangup_step
        return out


@dataclass(frozen=True, slots=True)
class EndOutcome:
    steps: int
    num_blocks: int
    free_blocks: int
    peak_used_blocks: int
    preemptions: int
    aborted: int
    loop_failed: bool = False  # the engine loop died (an injected fault outside a step)

    def fields(self) -> dict[str, Any]:
        out = {"steps": self.steps, "free_blocks": self.free_blocks,
               "peak_used_blocks": self.peak_used_blocks, "preemptions": self.preemptions,
               "num_blocks": self.num_blocks, "aborted": self.aborted}
        if self.loop_failed:  # written only when it happens, as `error` and `hangup_step`
            out["loop_failed"] = True
        return out


@dataclass(frozen=True, slots=True)
class Outcome:
    requests: tuple[RequestOutcome, ...]
    end: EndOutcome

    def to_json(self) -> dict[str, Any]:
        return {"requests": [{"id": r.id, **r.fields()} for r in self.requests],
                "end": self.end.fields()}

    def digest(self) -> str:
        canon = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True, allow_nan=False)
        return hashlib.sha256(canon.encode()).hexdigest()

    def by_id(self) -> dict[str, RequestOutcome]:
        return {r.id: r for r in self.requests}


def expectation_lines(outcome: Outcome) -> list[Expectation]:
    """The outcome as expectation lines: one per request in trace order, then `end`."""
    return [*(Expectation(r.id, r.fields()) for r in outcome.requests),
            Expectation("end", outcome.end.fields())]


def compare(expectations: Iterable[Expectation], outcome: Outcome) -> list[str]:
    """One line per expected field the outcome does not match, in the trace's order.
    Fields this replay does not observe are left alone (later readers may add some)."""
    requests = outcome.by_id()
    out: list[str] = []
    for e in expectations:
        if e.id == "end":
            observed = outcome.end.fields()
        elif e.id in requests:
            observed = requests[e.id].fields()
        else:
            out.append(f"{e.id}: expected an outcome, the replay has none")
            continue
        out += _compare_fields(e.id, e.fields, observed)
    return out


def _compare_fields(where: str, expected: Mapping[str, Any],
                    observed: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, want in expected.items():
        if key == "choices" and isinstance(want, list):
            got = observed.get("choices")
            if not isinstance(got, list) or len(got) != len(want):
                n = len(got) if isinstance(got, list) else "no"
                out.append(f"{where} choices: expected {len(want)}, got {n}")
                continue
            for i, (w, g) in enumerate(zip(want, got, strict=True)):
                if isinstance(w, dict):
                    out += _compare_fields(f"{where} choices[{i}]", w, g)
            continue
        if key not in _KNOWN:
            continue
        line = diff_value(key, want, observed.get(key))
        if line is not None:
            out.append(f"{where} {key}: {line}")
    # Written only when they happen, so an expectation without them expects none: an error
    # or a hang-up that was not there before is a change, whoever wrote the line.
    for key in _ABSENT_MEANS_NONE:
        if key not in expected and observed.get(key) is not None:
            out.append(f"{where} {key}: expected none, got {_show(observed[key])}")
    return out


_ABSENT_MEANS_NONE = ("error", "hangup_step", "loop_failed")


_KNOWN = {"status", "error", "finish_reason", "completion_tokens", "token_ids", "text",
          "tool_calls",
          "first_token_step", "last_step", "frames", "aborted", "hangup_step", "steps",
          "free_blocks", "peak_used_blocks", "preemptions", "num_blocks", "loop_failed"}


def diff_value(key: str, want: Any, got: Any) -> str | None:
    """None when equal, else what differs: for token ids and text, where they diverge."""
    if want == got and type(want) is type(got):
        return None
    if isinstance(want, list) and isinstance(got, list):
        return _diverge(want, got, "index", "ids")
    if isinstance(want, str) and isinstance(got, str) and key == "text":
        return _diverge(want, got, "character", "characters")
    return f"expected {_show(want)}, got {_show(got)}"


def _diverge(want: Any, got: Any, unit: str, units: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
             min(len(want), len(got)))
    if isinstance(want, str):
        w, g = want[i:i + 12], got[i:i + 12]
    else:
        w = want[i] if i < len(want) else "the end"
        g = got[i] if i < len(got) else "the end"
    return (f"first differ at {unit} {i}: expected {_show(w)}, got {_show(g)} "
            f"({len(want)} {units} expected, {len(got)} got)")


def _show(value: Any) -> str:
    if isinstance(value, str) and value != "the end":
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)
