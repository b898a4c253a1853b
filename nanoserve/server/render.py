"""Response shapes: completion and chat objects, their stream chunks, logprobs and usage.

One `Choice` folds a completion's updates, for a unary answer and a stream alike; a stream
chunk renders what arrived since the last chunk, a unary response renders everything. The
logprobs of a chunk are those of the tokens since the last chunk, and `text_offset` carries
on from it, so the concatenated chunks equal the unary response by construction, logprobs
included (docs/ARCHITECTURE.md: streaming is a delivery schedule, not a different model).

Token strings (a token's bytes and display text) are token_text.py's `TokenText`.

vLLM's extras. `prompt_logprobs` (asked for by name) is vLLM's list: null for the first
prompt token, then per token a map of token id (a string, as JSON keys are) to `{logprob,
rank, decoded_token}`, the prompt's own token first and then its top alternatives. It goes
on the choice for completions and on the response for chat, and, in a stream, on the first
chunk of each choice. `return_token_ids` adds `prompt_token_ids` (first chunk) and
`token_ids` (each chunk's own, so they concatenate to the unary list) as vLLM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nanoserve.engine.request import Update
from nanoserve.sampling.params import MAX_LOGPROBS
from nanoserve.sampling.sampler import TokenLogprobs
from nanoserve.server.token_text import TokenText
from nanoserve.server.tools.output import ChoiceOutput, OutputPlan, delta_json, message_json

Json = dict[str, Any]


# One token of a logprobs list: its id, and its logprobs, or None for the first token of an
# echoed prompt (nothing precedes it, so the API reports null for it).
Entry = tuple[int, TokenLogprobs | None]


def _finite(x: float) -> float:
    # JSON has no -Infinity; a masked token's logprob is reported as a very small number.
    return x if math.isfinite(x) else -9999.0


@dataclass(slots=True)
class Choice:
    """One completion (one index) as it accumulates. `pending` holds the logprobs of tokens
    not yet sent in a chunk; tokens whose text is held back send no chunk of their own.
    With echo and logprobs, the prompt's logprobs come on the update of the first output
    token and go first, so they ride on the first chunk with the echoed text."""

    index: int
    prefix: str = ""  # echoed prompt text, sent with the first chunk
    prompt_ids: tuple[int, ...] = ()  # names the first prompt token, which has no logprobs
    echo: bool = False  # the prompt's logprobs lead the completion's own
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    sent_ids: int = 0  # how many of token_ids the chunks so far carried
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    logprobs: list[Entry] = field(default_factory=list)
    pending: list[Entry] = field(default_factory=list)
    offset: int = 0  # text_offset of the next token: runs over the echoed prompt's tokens too
    sent_any: bool = False
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    out: ChoiceOutput | None = None  # a chat choice's reasoning and tool calls, as streamed

    def add(self, u: Update) -> bool:
        """Fold one update in; True when it deserves a chunk (it has text or a finish)."""
        self.token_ids.extend(u.new_token_ids)
        self.text.append(u.text)
        got: list[Entry] = []
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = u.prompt_logprobs
            if self.echo:
                got += [(lp.token_id if lp is not None else self.prompt_ids[0], lp)
                        for lp in u.prompt_logprobs]
        got += [(lp.token_id, lp) for lp in u.logprobs if lp is not None]
        self.logprobs.extend(got)
        self.pending.extend(got)
        if u.finished:
            self.finished = True
            self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
        return bool(u.text) or u.finished


@dataclass(slots=True)
class Shapes:
    """What every object of one response shares."""

    kind: str  # "completion" | "chat"
    id: str
    created: int
    model: str
    tokens: TokenText
    logprobs: bool  # were logprobs asked for (else the field is null)
    # How many alternatives a token's logprobs list: an echoed prompt's may hold more (its
    # prompt_logprobs count), cut to the completion's own, as vLLM's echo does.
    num_top: int = MAX_LOGPROBS
    prompt_logprobs: bool = False  # vLLM's extras (module docstring)
    token_ids: bool = False
    output: OutputPlan | None = None  # chat: reasoning and tool calls read out of the text

    def chunk(self, c: Choice, text: str) -> Json | None:
        """The chunk for one update of choice `c`, whose own text is `text`; None where
        the reading of the text holds all of it back (a tool call's markup forming): the
        update's logprobs then ride on the choice's next chunk."""
        first = not c.sent_any
        if first:
            text = c.prefix + text
        delta: Json | None = None
        if self.kind == "chat":
            delta = self._chat_delta(c, text, first)
            if delta is None:
                return None
        lps, c.offset = self._logprobs(c.pending, c.offset)
        c.pending = []
        c.sent_any = True
        choice: Json
        if delta is not None:
            choice = {"index": c.index, "delta": delta, "logprobs": lps}
        else:
            choice = {"index": c.index, "text": text, "logprobs": lps}
        choice["finish_reason"] = self._finish_reason(c) if c.finished else None
        choice["stop_reason"] = c.stop_reason if c.finished else None
        extras = self._extras(c, first)
        if self.token_ids:
            choice["token_ids"] = c.token_ids[c.sent_ids:]
            c.sent_ids = len(c.token_ids)
        if self.kind == "chat":
            return {**self._envelope("chunk", [choice]), **extras}
        if self.token_ids and not first:
            extras["prompt_token_ids"] = None  # vLLM's: only the first chunk carries them
        choice.update(extras)
        return self._envelope("chunk", [choice])

    def _chat_delta(self, c: Choice, text: str, first: bool) -> Json | None:
        if self.output is None:
            return {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
        if c.out is None:
            c.out = self.output.start(self.id, c.index)
        d = c.out.feed(text)
        if c.finished:
            end = c.out.finish()
            d.content, d.reasoning = d.content + end.content, d.reasoning + end.reasoning
            d.tool_calls += end.tool_calls
        if not d and not first and not c.finished:
            return None
        return delta_json(d, first)

    def _finish_reason(self, c: Choice) -> str | None:
        """As OpenAI's: "tool_calls" where the model stopped after calling tools."""
        if c.finish_reason == "stop" and c.out is not None and c.out.has_calls:
            return "tool_calls"
        return c.finish_reason

    def _message(self, c: Choice, text: str) -> Json:
        """A unary chat answer's message: the whole text read as the stream reads it."""
        if self.output is None:
            return {"role": "assistant", "content": text}
        c.out = self.output.start(self.id, c.index)
        return message_json(c.out, text, self.output.reasoning is not None)

    def _extras(self, c: Choice, first: bool) -> Json:
        """The prompt's logprobs and token ids, for a response or a first chunk."""
        out: Json = {}
        if first and self.prompt_logprobs:
            out["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
        if first and self.token_ids:
            out["prompt_token_ids"] = list(c.prompt_ids)
        return out

    def usage_chunk(self, usage: Json) -> Json:
        return {**self._envelope("chunk", []), "usage": usage}

    def response(self, choices: list[Choice], usage: Json) -> Json:
        out = []
        for c in choices:
            lps, _ = self._logprobs(c.logprobs, 0)
            text = c.prefix + "".join(c.text)
            body: Json = ({"message": self._message(c, text)} if self.kind == "chat"
                          else {"text": text})
            choice = {"index": c.index, **body, "logprobs": lps,
                      "finish_reason": self._finish_reason(c), "stop_reason": c.stop_reason}
            if self.token_ids:
                choice["token_ids"] = list(c.token_ids)
            if self.kind != "chat":
                choice.update(self._extras(c, True))
            out.append(choice)
        # Chat has one prompt: its extras go on the response, as vLLM puts them.
        extras = self._extras(choices[0], True) if self.kind == "chat" else {}
        return {**self._envelope("response", out), **extras, "usage": usage}

    def _envelope(self, what: str, choices: list[Json]) -> Json:
        obj = {
            ("chat", "chunk"): "chat.completion.chunk",
            ("chat", "response"): "chat.completion",
        }.get((self.kind, what), "text_completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _logprobs(self, entries: list[Entry], offset: int) -> tuple[Json | None, int]:
        """The logprobs object for `entries`, whose first token starts at `offset` in the
        text; returns it with the offset after the last token."""
        if not self.logprobs:
            return None, offset
        if self.kind == "chat":  # no echo in chat: every entry has its logprobs
            return {"content": [self._chat_entry(lp) for _, lp in entries if lp]}, offset
        tokens: list[str] = []
        offsets: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for token_id, lp in entries:
            s = self.tokens.text(token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(lp.logprob))
            # The OpenAI completions API: the top alternatives *and* the chosen token.
            top = {self.tokens.text(t): _finite(v) for t, v in lp.top[:self.num_top]}
            top.setdefault(s, _finite(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}, offset

    def _prompt_logprobs(self, lps: tuple[TokenLogprobs | None, ...] | None
                         ) -> list[Json | None] | None:
        """vLLM's prompt_logprobs list; None when there are none (the request ended before
        its first token)."""
        if lps is None:
            return None
        out: list[Json | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): self._ranked(lp.token_id, lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(str(t), self._ranked(t, v, rank))
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int) -> Json:
        # decoded_token: the token's text, with `\xNN` for bytes of a split character
        # where vLLM would show U+FFFD (see TokenText).
        return {"logprob": _finite(logprob), "rank": rank,
                "decoded_token": self.tokens.text(token_id)}

    def _chat_entry(self, lp: TokenLogprobs) -> Json:
        raw, s = self.tokens.get(lp.token_id)
        top = []
        for t, v in lp.top:
            traw, ts = self.tokens.get(t)
            top.append({"token": ts, "logprob": _finite(v), "bytes": list(traw)})
        return {"token": s, "logprob": _finite(lp.logprob), "bytes": list(raw),
                "top_logprobs": top}


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
