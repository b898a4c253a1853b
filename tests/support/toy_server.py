"""A small OpenAI-compatible ASGI server with faults to order: the server `sim replay
--target`'s checks are tested against, sound and broken. Like OpenAI and vLLM, it refuses
`stream_options` on a request that does not stream.

Its "model" says a fixed text from an offset the prompt picks, and its tokenizer cuts UTF-8
bytes in threes, so emoji, CJK and accented letters are split across tokens as byte-level
BPE splits them. Sound, it streams each character once it is whole, ends before a stop
string, counts usage, refuses bad input with a 400 and an OpenAI error object, stops a
request whose client hung up, and writes each stream on its own. Each fault breaks one of
those:

    split_char      a stream decodes each token alone: U+FFFD where a character splits
    empty_frames    a token that completes no character still gets a frame, with ""
    stream_differs  a stream leaves out its last piece of text
    stop_ignored    a stream ignores stop strings
    usage_wrong     completion_tokens one more than the tokens said
    error_500       bad input gets a 500
    ignore_hangup   a request runs to max_tokens after its client has gone
    pacing          one lock around every write: a reader that stops reading stops all
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any

import trio

from sim.http import raw_asgi
from sim.http.raw_asgi import Receive, Send

CORPUS = ("Hello 🎉 world, 東京 café crème 👨‍👩‍👧 안녕하세요 the quick brown fox jumps over "
          "the lazy dog. ") * 40
FAULTS = frozenset({"split_char", "empty_frames", "stream_differs", "stop_ignored",
                    "usage_wrong", "error_500", "ignore_hangup", "pacing"})


def tokens_of(text: str) -> list[bytes]:
    raw = text.encode()
    return [raw[i:i + 3] for i in range(0, len(raw), 3)]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Plan:
    tokens: list[bytes]
    pieces: list[str]  # each token's text as a sound stream sends it ("" while held back)
    text: str
    finish: str


def plan(prompt: str, max_tokens: int, stop: list[str]) -> Plan:
    """What the model says: a deterministic text, cut at max_tokens or before a stop."""
    start = sum(prompt.encode()) % 97
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    toks: list[bytes] = []
    text, finish = "", "length"
    for tok in tokens_of(CORPUS[start:])[:max_tokens]:
        toks.append(tok)
        text += dec.decode(tok)
        hits = [text.find(s) for s in stop if s and s in text]
        if hits:
            text, finish = text[:min(hits)], "stop"
            break
    else:
        text += dec.decode(b"", final=True)
    return Plan(toks, _pieces(toks, len(text)), text, finish)


def _pieces(toks: list[bytes], length: int) -> list[str]:
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    out, said = [], 0
    for i, tok in enumerate(toks):
        piece = dec.decode(tok, final=i == len(toks) - 1)[:max(0, length - said)]
        said += len(piece)
        out.append(piece)
    return out


class Toy:
    def __init__(self, faults: frozenset[str] = frozenset(), tick: float = 0.002,
                 slots: int | None = None, metrics: bool = True) -> None:
        """`slots`: requests that run at once (others wait); `metrics`: serve /metrics."""
        unknown = faults - FAULTS
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        self.faults = faults
        self.tick = tick
        self.running = 0
        self.metrics = metrics
        self._lock = trio.Lock()
        self._slots = trio.Semaphore(slots) if slots is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await raw_asgi.lifespan(receive, send)
            return
        raw, _ = await raw_asgi.read_body(receive)
        route = (scope["method"], scope["path"])
        try:
            if route == ("GET", "/v1/models"):
                models = {"object": "list", "data": [{"id": "toy"}]}
                await raw_asgi.respond_json(send, 200, models)
            elif route == ("GET", "/metrics") and self.metrics:
                await raw_asgi.respond(send, 200, b"text/plain",
                                       f"toy:num_requests_running {self.running}\n".encode())
            elif route == ("POST", "/tokenize"):
                body = _object(raw)
                ids = list(range(len(tokens_of(_prompt(body, "messages" in body)))))
                await raw_asgi.respond_json(send, 200, {"tokens": ids})
            elif route[0] == "POST" and route[1] in ("/v1/completions", "/v1/chat/completions"):
                await self._generate(route[1], _object(raw), receive, send)
            else:
                await raw_asgi.respond_json(send, 404, _error("no such route"))
        except BadRequest as exc:
            status = 500 if "error_500" in self.faults else 400
            await raw_asgi.respond_json(send, status, _error(str(exc), exc.param))

    async def _generate(self, path: str, body: dict[str, Any], receive: Receive,
                        send: Send) -> None:
        chat = path.endswith("chat/completions")
        prompt = _prompt(body, chat)
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("max_tokens must be an integer >= 1", "max_tokens")
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, int | float) or isinstance(temperature, bool):
            raise BadRequest("temperature must be a number", "temperature")
        stream = body.get("stream") is True
        if body.get("stream_options") is not None and not stream:  # as OpenAI and vLLM
            raise BadRequest("stream_options is only allowed with stream", "stream_options")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stream and "stop_ignored" in self.faults:
            stop = []
        p = plan(prompt, max_tokens, stop)
        usage = {"prompt_tokens": len(tokens_of(prompt)),
                 "completion_tokens": len(p.tokens) + ("usage_wrong" in self.faults)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self._slots is not None:
            await self._slots.acquire()
        self.running += 1
        try:
            async with trio.open_nursery() as nursery:
                if "ignore_hangup" not in self.faults:
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                if stream:
                    await self._stream(send, chat, body, p, usage)
                else:
                    await trio.sleep(self.tick * len(p.tokens))
                    await raw_asgi.respond_json(send, 200, _unary(chat, body, p, usage))
                nursery.cancel_scope.cancel()
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    async def _stream(self, send: Send, chat: bool, body: dict[str, Any], p: Plan,
                      usage: dict[str, int]) -> None:
        await self._write(send, {"type": "http.response.start", "status": 200,
                                 "headers": [(b"content-type", b"text/event-stream")]})
        if chat:
            await self._frame(send, {"choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}, "finish_reason": None}]})
        pieces = p.pieces
        if "split_char" in self.faults:
            pieces = [t.decode("utf-8", "replace") for t in p.tokens]
        if "stream_differs" in self.faults:
            pieces = pieces[:-1] + [""]
        held: list[bytes] = []
        for i, (tok, piece) in enumerate(zip(p.tokens, pieces, strict=True)):
            await trio.sleep(self.tick)
            held.append(tok)
            last = i == len(p.tokens) - 1
            if not (piece or last):
                if "empty_frames" in self.faults:  # the fault: a frame that says nothing
                    await self._frame(send, {"choices": [_choice(chat, "", [], {}, None,
                                                                 delta=True)]})
                continue  # nothing whole yet: its token goes out with the next text
            choice = _choice(chat, piece, held, body, p.finish if last else None, delta=True)
            await self._frame(send, {"choices": [choice]})
            held = []
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._frame(send, {"choices": [], "usage": usage})
        await self._write(send, {"type": "http.response.body", "body": b"data: [DONE]\n\n",
                                 "more_body": False})

    async def _frame(self, send: Send, obj: dict[str, Any]) -> None:
        data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
        await self._write(send, {"type": "http.response.body", "body": data,
                                 "more_body": True})

    async def _write(self, send: Send, msg: dict[str, Any]) -> None:
        if "pacing" in self.faults:
            async with self._lock:  # the fault: one slow socket holds every stream
                await send(msg)
        else:
            await send(msg)


def _choice(chat: bool, text: str, toks: list[bytes], body: dict[str, Any],
            finish: str | None, delta: bool) -> dict[str, Any]:
    strs = [t.decode("utf-8", "backslashreplace") for t in toks]
    out: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        out["delta" if delta else "message"] = {"role": "assistant", "content": text}
        if body.get("logprobs"):
            out["logprobs"] = {"content": [{"token": s, "logprob": 0.0} for s in strs]}
    else:
        out["text"] = text
        if body.get("logprobs"):
            out["logprobs"] = {"tokens": strs, "token_logprobs": [0.0] * len(strs)}
    return out


def _unary(chat: bool, body: dict[str, Any], p: Plan, usage: dict[str, int]) -> dict[str, Any]:
    return {"object": "chat.completion" if chat else "text_completion", "model": "toy",
            "choices": [_choice(chat, p.text, p.tokens, body, p.finish, delta=False)],
            "usage": usage}


def _prompt(body: dict[str, Any], chat: bool) -> str:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("messages must be a non-empty list of objects", "messages")
        return str(msgs[-1].get("content", ""))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", "prompt")
    return prompt


def _object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("the body must be a JSON object")
    return obj


def _error(message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": None}}


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


