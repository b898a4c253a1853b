"""A chat completion's output, rendered as a Responses API answer (issue 29).

The chat machinery hands one `ResponseRenderer` the pieces of one choice as they come:
text, reasoning text, a tool call's start and its arguments, then the end. Each method
returns the Responses stream events that piece produces (dicts, each with its `type` and a
running `sequence_number` from 0), and `final()` is the whole Response object, the same
one `response.completed` carries. A unary request calls the same methods and keeps only
`final()`, so the streamed and the unary answer cannot differ.

The output is a list of items, each opened when its first piece arrives and closed when a
piece of another kind (or the end) arrives: a reasoning item, a message, one function_call
per call. Every event names its item by `output_index` (the client's stream accumulator,
`openai.lib.streaming.responses`, looks items up by it) and `item_id`. The documented order:

    response.created, response.in_progress
    per item: response.output_item.added
        message:       content_part.added, output_text.delta..., output_text.done,
                       content_part.done
        reasoning:     content_part.added, reasoning_text.delta..., reasoning_text.done,
                       content_part.done
        function_call: function_call_arguments.delta..., function_call_arguments.done
      response.output_item.done
    response.completed, or response.incomplete (cut at max_output_tokens)

A call's arguments arrive before the next item starts (the tool parsers emit them so); a
piece for an item already closed is a programming error (ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]

# finish_reason -> incomplete_details.reason; any other finish (stop, tool_calls) completes.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(slots=True)
class _Item:
    """One output item while it streams: its kind, ids, and the text gathered so far."""

    kind: str  # "message" | "reasoning" | "function_call"
    index: int  # output_index
    id: str
    text: str = ""  # the message's or reasoning's text, or the call's arguments
    call_id: str = ""
    name: str = ""

    def as_item(self, status: str) -> dict[str, Any]:
        """The item as the Response's `output` holds it, with `status`."""
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id,
                    "name": self.name, "arguments": self.text, "status": status}
        if self.kind == "reasoning":
            content = [_part("reasoning", self.text)] if status != "in_progress" else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content,
                    "status": status}
        content = [_part("message", self.text)] if status != "in_progress" else []
        return {"type": "message", "id": self.id, "role": "assistant", "status": status,
                "content": content}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(slots=True)
class ResponseRenderer:
    """The Responses events and the Response object of one chat choice.

    `request_echo` is `translate.request_echo(body)`: the request fields the Response
    repeats. Ids of output items derive from `response_id` and the item's position, so a
    rendering is a pure function of its inputs.
    """

    response_id: str
    model: str
    created_at: int
    request_echo: dict[str, Any]
    _seq: int = 0
    _items: list[_Item] = field(default_factory=list)
    _done: list[dict[str, Any]] = field(default_factory=list)  # closed items, in order
    _calls: dict[int, _Item] = field(default_factory=dict)  # chat tool-call index -> item
    _end: dict[str, Any] | None = None  # status, incomplete_details and usage, once ended

    def start(self) -> list[Event]:
        """response.created and response.in_progress: call first, once."""
        snapshot = self._response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def text(self, delta: str) -> list[Event]:
        """A piece of the answer's text."""
        return self._append("message", delta, "response.output_text.delta")

    def reasoning(self, delta: str) -> list[Event]:
        """A piece of reasoning text (the chat API's reasoning_content)."""
        return self._append("reasoning", delta, "response.reasoning_text.delta")

    def tool_call(self, index: int, call_id: str, name: str) -> list[Event]:
        """A tool call starts: `index` is its chat index, which its arguments name."""
        events = self._close()
        self._calls[index] = self._open("function_call", events, call_id, name)
        return events

    def tool_arguments(self, index: int, delta: str) -> list[Event]:
        """A piece of the arguments (JSON text) of the call started with `index`."""
        item = self._calls.get(index)
        if item is None or item is not self._current():
            raise ValueError(f"arguments for tool call {index}, which is not the open item")
        item.text += delta
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=item.index, delta=delta)]

    def finish(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int = 0) -> list[Event]:
        """The end: closes the open item and returns response.completed (or .incomplete)."""
        reason = _INCOMPLETE.get(finish_reason or "")
        events = self._close("incomplete" if reason else "completed")
        self._end = {
            "status": "incomplete" if reason else "completed",
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        kind = "response.incomplete" if reason else "response.completed"
        return [*events, self._event(kind, response=self.final())]

    def error(self, code: str | None, message: str, param: str | None) -> Event:
        """The stream's `error` event: a failure after the status was sent."""
        return self._event("error", code=code, message=message, param=param)

    def final(self) -> dict[str, Any]:
        """The whole Response object: call after `finish`."""
        if self._end is None:
            raise ValueError("final() before finish()")
        return {**self._response(self._end["status"]), **self._end}

    def _response(self, status: str) -> dict[str, Any]:
        return {
            **self.request_echo,
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "model": self.model, "status": status, "error": None, "incomplete_details": None,
            "output": [dict(item) for item in self._done], "usage": None,
        }

    def _append(self, kind: str, delta: str, event_type: str) -> list[Event]:
        if not delta:
            return []
        current = self._current()
        events: list[Event] = []
        if current is None or current.kind != kind:
            events = self._close()
            current = self._open(kind, events)
            events.append(self._event("response.content_part.added", item_id=current.id,
                                      output_index=current.index, content_index=0,
                                      part=_part(kind, "")))
        current.text += delta
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(event_type, item_id=current.id, output_index=current.index,
                                  content_index=0, delta=delta, **extra))
        return events

    def _current(self) -> _Item | None:
        """The open item: the last one, unless it is closed already."""
        if len(self._items) > len(self._done):
            return self._items[-1]
        return None

    def _open(self, kind: str, events: list[Event], call_id: str = "", name: str = "") -> _Item:
        """A new item at the next output_index; appends its output_item.added to `events`."""
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        index, base = len(self._items), self.response_id.removeprefix("resp_")
        item = _Item(kind, index, f"{prefix}_{base}_{index}", call_id=call_id, name=name)
        self._items.append(item)
        events.append(self._event("response.output_item.added", output_index=item.index,
                                  item=item.as_item("in_progress")))
        return item

    def _close(self, status: str = "completed") -> list[Event]:
        """The events that end the open item (none if there is none)."""
        item = self._current()
        if item is None:
            return []
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **ids,
                                  arguments=item.text)]
        else:
            done = ("response.output_text.done" if item.kind == "message"
                    else "response.reasoning_text.done")
            extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
            events = [self._event(done, **ids, content_index=0, text=item.text, **extra),
                      self._event("response.content_part.done", **ids, content_index=0,
                                  part=_part(item.kind, item.text))]
        self._done.append(item.as_item(status))
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=self._done[-1]))
        return events

    def _event(self, type_: str, **fields: Any) -> Event:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
