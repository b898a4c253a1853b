"""One trace request's client during a replay: when it reads, what it read, when it hangs up.

A client acts only when the driver calls it at a step boundary (after
`wait_all_tasks_blocked()`), never from a task of its own, so what it reads and when it hangs
up follow from the trace alone. Reading is what an HTTP client does with a socket:

- `"eager"` takes every frame the app has sent;
- `{"every_steps": N}` takes one frame, then waits N steps before the next read (a read
  that finds nothing waits for the next frame, as a blocking socket read would);
- `{"every_s": X}` the same in virtual seconds;
- a recorded `FramesByStep` (`serve --record`) takes, by each boundary, the frames the live
  client had taken by then, and reads eagerly after its last entry;
- `"never"` takes nothing (status line included: its status is what the server sent), and
  closes the connection at `hangup_at_step`, or once the engine is idle for good.

A client with `send_body_bytes` (`then: "stall"`) sent only part of its body; it reads its
answer (a 408) whenever one comes, which the driver waits for once the engine is idle.

`[DONE]` rides along with the frame before it (it costs no read). `hangup_after_frames: K`
hangs up after the K-th data frame unless the response is over by then; `hangup_at_step: S`
hangs up at boundary S (after S steps) unless the whole response has been read. A unary
client reads its body once it is complete.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sim.http.asgi_client import DONE, Exchange
from sim.trace.expect import CallsRead
from sim.trace.format import EverySeconds, EverySteps, FramesByStep, TraceRequest


@dataclass(slots=True, eq=False)
class Client:
    number: int  # position in the trace: also the core of the app's response id
    req: TraceRequest
    ex: Exchange | None = None
    start_step: int = 0
    start_s: float = 0.0
    next_read: float = 0.0  # the step (or second) of the next paced read
    frames: int = 0  # data frames read, [DONE] not counted
    texts: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    calls: CallsRead = field(default_factory=CallsRead)  # tool calls read, per choice
    wire_finish: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    usage_tokens: int | None = None  # completion tokens the wire reported, if any
    saw_done: bool = False
    hangup_step: int | None = None
    done: bool = False  # nothing more to do: the response is read, or the client hung up

    @property
    def stream(self) -> bool:
        return self.req.body.get("stream") is True

    @property
    def stalled(self) -> bool:
        """Sent part of its body and waits: its answer needs time to pass (a 408)."""
        return self.req.client.then == "stall"

    @property
    def status(self) -> int | None:
        return self.ex.status if self.ex is not None else None

    def started(self, ex: Exchange, step: int, now: float) -> None:
        self.ex, self.start_step, self.start_s = ex, step, now
        read = self.req.client.read
        self.next_read = (step + read.n if isinstance(read, EverySteps)
                          else now + read.s if isinstance(read, EverySeconds) else 0.0)

    def react(self, step: int, now: float, *, drain: bool = False) -> None:
        """Read what this client reads at this boundary, then hang up if it is time. With
        `drain` (the engine is idle for good), read everything left at once."""
        ex = self.ex
        if ex is None or self.done:
            return
        ex.poll()
        never = self.req.client.read == "never"
        if never:
            pass  # what the app sent waits in the transport, unread
        elif ex.status is not None and (ex.status != 200 or not self.stream):
            if ex.complete:
                self._take_json(ex.json())
                self.done = True
        elif ex.status == 200:
            self._read_frames(step, now, drain)
        if self.done:
            return
        c = self.req.client
        by_frames = c.hangup_after_frames is not None and self.frames >= c.hangup_after_frames
        by_step = c.hangup_at_step is not None and step >= c.hangup_at_step
        if by_frames or by_step or (never and drain):
            ex.disconnect()
            self.hangup_step = step
            self.done = True
        elif drain:
            self.done = True  # the app will send nothing more: the driver checks it ended

    def _read_frames(self, step: int, now: float, drain: bool) -> None:
        assert self.ex is not None
        events = self.ex.events
        read = self.req.client.read
        paced = isinstance(read, EverySteps | EverySeconds)
        limit = self.req.client.hangup_after_frames
        while events and not self.saw_done and (limit is None or self.frames < limit):
            if not drain and not self._may_read(step, now):
                break
            self._take_event(events.popleft())
            if events and events[0] == DONE:
                self._take_event(events.popleft())
            if paced and not drain:
                break  # one paced read per boundary at most
        if self.saw_done:
            self.done = True

    def _may_read(self, step: int, now: float) -> bool:
        read = self.req.client.read
        if isinstance(read, FramesByStep):  # recorded: frames taken by each boundary
            allowed = read.allowed(step)
            return allowed is None or self.frames < allowed
        if isinstance(read, EverySteps | EverySeconds):
            at = step if isinstance(read, EverySteps) else now
            if at < self.next_read:
                return False
            self.next_read = at + (read.n if isinstance(read, EverySteps) else read.s)
        return True

    def _take_event(self, payload: str) -> None:
        if payload == DONE:
            self.saw_done = True
            return
        self.frames += 1
        obj = json.loads(payload)
        if "error" in obj:
            self.error = _error_code(obj)
            return
        if isinstance(obj.get("usage"), dict):
            self.usage_tokens = obj["usage"].get("completion_tokens")
        for ch in obj.get("choices", []):
            self.texts[ch["index"]].append(_choice_text(ch, "delta"))
            self.calls.add(ch, "delta")
            if ch.get("finish_reason") is not None:
                self.wire_finish[ch["index"]] = ch["finish_reason"]

    def _take_json(self, obj: Any) -> None:
        assert self.ex is not None
        if self.ex.status != 200 or not isinstance(obj, dict) or "choices" not in obj:
            self.error = _error_code(obj)
            return
        if isinstance(obj.get("usage"), dict):
            self.usage_tokens = obj["usage"].get("completion_tokens")
        for ch in obj["choices"]:
            self.texts[ch["index"]].append(_choice_text(ch, "message"))
            self.calls.add(ch, "message")
            if ch.get("finish_reason") is not None:
                self.wire_finish[ch["index"]] = ch["finish_reason"]

    @property
    def n(self) -> int:
        n = self.req.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    def num_prompts(self) -> int:
        """How many prompts the body holds (1 for chat, and for an odd shape)."""
        prompt = self.req.body.get("prompt")
        if self.req.path.endswith("/chat/completions") or not isinstance(prompt, list):
            return 1
        if prompt and all(isinstance(p, str | list) for p in prompt):
            return len(prompt)
        return 1

    def num_choices(self) -> int:
        return self.n * self.num_prompts()


def _choice_text(ch: dict[str, Any], holder: str) -> str:
    if "text" in ch:
        return str(ch["text"] or "")
    part = ch.get(holder) or {}
    return str(part.get("content") or "")


def _error_code(obj: Any) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return "unknown"
    return str(err.get("code") or err.get("type") or "unknown")

