"""Trace format v1: what a trace holds, as typed records (loader.py reads a trace into them,
strictly; write.py writes them back).

A trace is the contract between the recorder, `sim replay`, `sim load` and the tests: JSON
Lines, a header on line 1, then request lines, then expectation lines, each read into one of
the records below. The records are apart from the loader because everything that builds or
consumes a trace (the recorder, the load generators, replay, the writer) needs them, and only
what reads a file needs the loader.

What this implementation adds to the original v1 (the format allows added fields): a third
reading pattern, `client.read: {"frames_by_step": [[step, frames], ...]}`, which the
recorder writes for slow readers and hang-ups (`FramesByStep`); and, on expectation lines,
`error`, `frames`, `aborted`, `hangup_step` and, for n > 1, `choices` (sim/trace/expect.py).

A request line may give `body_base64` (the exact bytes, base64) in place of `body`, for a body
strict JSON cannot hold (a NaN, a lone surrogate, no object at all): replay sends those bytes
as they are. A file whose header carries `"incomplete"` is a recording that has not finished
(sim/trace/journal.py); the loader puts it in trace order first.

Faults (issue 9), all optional, so every v1 trace without them reads and replays as before:

- header `"faults": [{"kind": ..., ...}, ...]`: faults the replay injects through wrappers
  around the model, tokenizer and scheduler (sim/replay/faults.py names the kinds):
  `{"kind": "step_raises", "at_step": K}`, `{"kind": "schedule_raises", "at_step": K}`,
  `{"kind": "encode_raises", "text": T}`, `{"kind": "detokenize_raises", "token_id": I}`;
- header `"body_timeout": X`: the server's request-body timeout in seconds (a 408 after it);
  absent, a replay's server waits for a body for ever;
- `client.read: "never"`: the client takes no frame at all; it closes the connection at
  `hangup_at_step` if it gives one, else once the server is idle for good (nothing it has
  not read will change then);
- `client.send_body_bytes: N` with `client.then: "stall"`: the client announces its whole
  body (Content-Length) but sends only its first N bytes, then nothing, and waits; the
  server must answer 408 after `body_timeout` without queueing anything. Under the step clock
  seconds pass only while nothing else can happen, so the 408 comes once the engine is idle;
- on the `end` expectation, `loop_failed: true` when the engine loop died (a
  `schedule_raises` fault); absent, none is expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TRACE_VERSION = 1
PATHS = ("/v1/completions", "/v1/chat/completions")
ClockKind = Literal["step", "virtual"]


@dataclass(frozen=True, slots=True)
class EverySteps:
    """The client reads one SSE frame every `n` steps."""

    n: int


@dataclass(frozen=True, slots=True)
class EverySeconds:
    """The client reads one SSE frame every `s` seconds (virtual clock only)."""

    s: float


@dataclass(frozen=True, slots=True)
class FramesByStep:
    """A recorded reading pattern (`serve --record`, a slow reader or a hang-up): by the
    boundary after step `s` the client had taken `f` SSE frames, for each `(s, f)`; steps
    increase. Before the first pair it has taken none; after the last it reads eagerly."""

    pairs: tuple[tuple[int, int], ...]

    def allowed(self, step: int) -> int | None:
        """Frames the client may have taken by the boundary after `step`; None: no limit."""
        if step > self.pairs[-1][0]:
            return None
        taken = 0
        for s, f in self.pairs:
            if s > step:
                break
            taken = f
        return taken


Read = Literal["eager", "never"] | EverySteps | EverySeconds | FramesByStep


@dataclass(frozen=True, slots=True)
class ClientSpec:
    read: Read = "eager"
    hangup_after_frames: int | None = None  # close after this many SSE frames
    hangup_at_step: int | None = None  # close at this step, whatever was read
    extra: dict[str, Any] = field(default_factory=dict)
    send_body_bytes: int | None = None  # send only this much of the body, then `then`
    then: Literal["stall"] | None = None


@dataclass(frozen=True, slots=True)
class TraceHeader:
    clock: ClockKind
    model: str
    # Every engine setting that changes the schedule. Required: block_size, num_blocks,
    # max_num_seqs, max_num_batched_tokens, seed. Optional: max_model_len, prefix_caching,
    # max_queue, stub_eos_prob, model_sha256. Unknown keys are kept for replay to refuse.
    engine: dict[str, Any]
    note: str | None = None
    cost_model: str | dict[str, Any] | None = None  # a path or an inline object; virtual only
    extra: dict[str, Any] = field(default_factory=dict)
    faults: tuple[dict[str, Any], ...] = ()  # injected by the replay (sim/replay/faults.py)
    body_timeout: float | None = None  # the server's body timeout, seconds; None: none
    # The server's reading of chat answers (check.SERVER_KEYS): chat_template (a template or
    # a built-in's name), tool_call_parser, enable_auto_tool_choice, reasoning_parser
    server: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    path: str
    body: dict[str, Any]  # exactly what the client sent, in its key order
    client: ClientSpec = field(default_factory=ClientSpec)
    at_step: int | None = None  # step clock: admitted after this many steps
    at_s: float | None = None  # virtual clock: arrival in seconds
    extra: dict[str, Any] = field(default_factory=dict)
    # The exact bytes the client sent, where strict JSON cannot hold its body (a NaN, a lone
    # surrogate, not an object at all): `body_base64` in the file, sent as they are; `body`
    # is then what a lenient parse makes of them ({} if not an object), for reading only.
    raw_body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Expectation:
    """`{"expect": id, ...}`. For a request id the known fields are status, finish_reason,
    completion_tokens, token_ids, text, first_token_step, last_step; for `"end"` they are
    steps, free_blocks, peak_used_blocks, preemptions. Unknown fields are kept as they are."""

    id: str  # a request id, or "end"
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Trace:
    header: TraceHeader
    requests: tuple[TraceRequest, ...]
    expectations: tuple[Expectation, ...] = ()
