"""The checks of what one request shows: stream against unary, UTF-8 in the frames, stop
strings, usage, and bad input. Each reads deterministic exchanges (target.py) and ends in an
Outcome (outcome.py); the checks that need several requests at once are load.py's
(hang-ups) and pacing.py's (slow readers).
"""

from __future__ import annotations

from typing import Any

from sim.target import answer, wire
from sim.target.answer import Answer
from sim.target.outcome import Outcome, verdict
from sim.target.target import CHAT, COMPLETIONS, PROMPTS, Pair, Target
from sim.target.wire import Seen

FFFD = "\ufffd"


async def identity(t: Target) -> dict[str, Any]:
    """Who answers: the model /v1/models lists and the `server` header."""
    r = await t.client.get(t.url + "/v1/models")
    return {"model": wire.first_model(r.content),
            "server": r.headers.get("server", "(none)")}


async def stream_equals_unary(t: Target) -> Outcome:
    """Each deterministic pair: the same text streamed and unary, and the same tokens where
    both give logprobs."""
    failures = []
    pairs = await t.pairs()
    for p in pairs:
        bad = _not_ok(p.unary) or _not_ok(p.stream)
        u, s = answer.read(p.unary), answer.read(p.stream)
        if bad is None and u.text() != s.text():
            bad = f"texts differ at character {_first_difference(u.text(), s.text())}"
        elif bad is None and None not in (u.tokens(), s.tokens()) and u.tokens() != s.tokens():
            bad = "texts agree, tokens differ"
        if bad is not None:
            failures.append({"prompt": p.prompt, "path": p.path, "why": bad,
                             "unary": u.text(), "stream": s.text(),
                             "unary_tokens": u.tokens(), "stream_tokens": s.tokens(),
                             "request": p.unary.evidence(), "streamed": p.stream.evidence()})
    if not failures and not any(answer.read(p.unary).text() for p in pairs):
        return Outcome("stream = unary", "unsupported", "no answer had text (content null?)")
    how = "tokens (logprobs) and text" if t.logprobs else "text (no logprobs)"
    return verdict("stream = unary", failures, f"{len(pairs)} requests alike in {how}",
                   f"{len(failures)} of {len(pairs)} deterministic requests differ")


async def utf8_frames(t: Target) -> Outcome:
    """No delta ends inside a character (a U+FFFD or lone surrogate the unary answer does not
    have), and no frame says nothing at all."""
    failures: list[dict[str, Any]] = []
    wide = frames = 0
    for p in await t.pairs():
        if p.stream.status != 200:
            continue
        unary_text = answer.read(p.unary).text()
        for f in p.stream.frames:
            frames += 1
            piece = answer.frame_text(f.obj)
            wide += sum(ord(ch) > 127 for ch in piece)
            why = bad_piece(piece, unary_text) or empty_frame(f.obj)
            if why:
                failures.append({"prompt": p.prompt, "path": p.path, "why": why,
                                 "frame": f.data[:400], "unary": unary_text})
    if not failures and frames == 0:
        return Outcome("utf-8 frames", "unsupported", "no stream answered 200")
    if not failures and wide == 0:
        return Outcome("utf-8 frames", "unsupported",
                       "no streamed answer had a character outside ASCII: nothing to split")
    return verdict("utf-8 frames", failures,
                   f"{frames} frames, {wide} non-ASCII characters, none split or empty",
                   f"{len(failures)} of {frames} frames split a character or say nothing")


def bad_piece(piece: str, unary_text: str) -> str | None:
    if FFFD in piece and FFFD not in unary_text:
        return "a delta has U+FFFD that the unary answer does not: a character split"
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in piece):
        return "a delta has a lone surrogate"
    return None


def empty_frame(obj: dict[str, Any] | None) -> str | None:
    """A frame with no text, role, tool call, reasoning, logprobs, finish reason or usage."""
    if obj is None or obj.get("usage") or not answer.choice_list(obj):
        return None
    for c in answer.choice_list(obj):
        if not isinstance(c, dict):
            return None
        delta = c.get("delta")
        said = [v for v in (delta.values() if isinstance(delta, dict) else ())
                if v not in (None, "", [])]
        if said or c.get("text") or c.get("finish_reason") or c.get("logprobs"):
            return None
    return "an empty delta frame"


async def stop_strings(t: Target) -> Outcome:
    """A stop string taken from the middle of a deterministic answer, where it spans two
    tokens: both modes end just before it, with finish_reason "stop"."""
    failures: list[dict[str, Any]] = []
    tried = across = 0
    for p in await t.pairs():
        if p.prompt != "plain" or p.unary.status != 200:
            continue
        u = answer.read(p.unary)
        cut = _stop_across_tokens(u)
        if cut is None:
            continue
        stop, at_boundary = cut
        tried += 1
        across += at_boundary
        want = u.text()[:u.text().find(stop)]
        text = dict(PROMPTS)[p.prompt]
        for stream in (False, True):
            extra: dict[str, Any] = {"stop": [stop], "stream": stream}
            seen = await t.send(p.path, t.body(p.path, text, **extra))
            got = answer.read(seen)
            if (_not_ok(seen) or got.text() != want or got.finish_reason() != "stop"):
                failures.append({"path": p.path, "stop": stop, "stream": stream,
                                 "want": want, "got": got.text(),
                                 "finish_reason": got.finish_reason(),
                                 "request": seen.evidence()})
    if tried == 0:
        return Outcome("stop strings", "unsupported", "no answer long enough to cut")
    where = (f"{across} of {tried} across a token boundary" if across
             else "from the middle of the text (no tokens to cut at)")
    return verdict("stop strings", failures,
                   f"{2 * tried} requests end before their stop ({where})",
                   f"{len(failures)} of {2 * tried} requests missed the stop string")


def _stop_across_tokens(u: Answer) -> tuple[str, bool] | None:
    """Four characters around a token boundary near the middle of the answer, where the
    tokens spell the text (True); otherwise four characters from its middle (False)."""
    text = u.text().rstrip()
    if len(text.strip()) < 12:
        return None
    toks = u.tokens()
    cut, at_boundary = len(text) // 2, False
    if toks and "".join(toks).startswith(text):
        ends = [sum(map(len, toks[:i])) for i in range(1, len(toks))]
        inner = [e for e in ends if 2 <= e <= len(text) - 2]
        if inner:
            cut, at_boundary = min(inner, key=lambda e: abs(e - len(text) // 2)), True
    stop = text[cut - 2:cut + 2]
    return (stop, at_boundary) if stop.strip() else None


async def usage(t: Target) -> Outcome:
    """`usage` agrees with the tokens streamed, with the stream's own usage, with max_tokens
    where the answer stopped at it, and with /tokenize where the server has it."""
    failures: list[dict[str, Any]] = []
    tokenized = n = 0
    for p in await t.pairs():
        if p.unary.status != 200:
            continue
        n += 1
        u, s = answer.read(p.unary), answer.read(p.stream)
        count = await _tokenize_count(t, p)
        tokenized += count is not None
        for why in _usage_faults(t, u, s, count):
            failures.append({"prompt": p.prompt, "path": p.path, "why": why,
                             "usage": u.usage, "stream_usage": s.usage,
                             "stream_tokens": len(s.tokens() or []) or None,
                             "tokenize_count": count})
    if n == 0:
        return Outcome("usage", "unsupported", "no deterministic request answered 200")
    also = f", prompts against /tokenize ({tokenized})" if tokenized else ", no /tokenize"
    return verdict("usage", failures, f"{n} answers' counts agree{also}",
                   f"{len(failures)} disagreements in {n} answers")


def _usage_faults(t: Target, u: Answer, s: Answer, prompt_count: int | None) -> list[str]:
    if u.usage is None:
        return ["the unary answer has no usage"]
    out = []
    done = u.usage.get("completion_tokens")
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if s.usage is not None and any(s.usage.get(k) != u.usage.get(k) for k in keys
                                   if k in s.usage and k in u.usage):
        out.append("the stream's usage differs from the unary answer's")
    toks = s.tokens()
    if toks is not None and done != len(toks):
        out.append(f"completion_tokens {done}, {len(toks)} tokens streamed")
    if u.finish_reason() == "length" and done != t.max_tokens:
        out.append(f"stopped at max_tokens {t.max_tokens} with completion_tokens {done}")
    if prompt_count is not None and u.usage.get("prompt_tokens") != prompt_count:
        out.append(f"prompt_tokens {u.usage.get('prompt_tokens')}, /tokenize {prompt_count}")
    return out


async def _tokenize_count(t: Target, p: Pair) -> int | None:
    """The prompt's token count from /tokenize: vLLM's shape (nanoserve's too; messages
    for a chat, rendered with the generation prompt as the chat route renders them), else,
    for a completion, llama.cpp's (`content`, special tokens asked for, as generation adds
    them). An empty list for a prompt that is not empty is a shape the server did not
    read."""
    text = dict(PROMPTS)[p.prompt]
    bodies: list[dict[str, Any]] = (
        [{"model": t.model, "messages": [{"role": "user", "content": text}],
          "add_generation_prompt": True}] if p.path == CHAT else
        [{"model": t.model, "prompt": text}, {"content": text, "add_special": True}])
    for body in bodies:
        seen = await t.send("/tokenize", body)
        obj = seen.json if isinstance(seen.json, dict) else {}
        if seen.status == 200 and isinstance(obj.get("tokens"), list) and obj["tokens"]:
            return len(obj["tokens"])
    return None


# Bodies no server should take: (what is wrong, path, body).
BAD_INPUT: tuple[tuple[str, str, dict[str, Any] | bytes], ...] = (
    ("body not JSON", CHAT, b'{"messages": [{"role": "user"'),
    ("body a JSON array", COMPLETIONS, b"[1, 2]"),
    ("messages missing", CHAT, {"max_tokens": 4}),
    ("messages a string", CHAT, {"messages": "hello", "max_tokens": 4}),
    ("max_tokens -1", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": -1}),
    ("temperature a word", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 4, "temperature": "hot"}),
    ("prompt missing", COMPLETIONS, {"max_tokens": 4}),
    ("max_tokens a word", COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}),
)


async def bad_input(t: Target) -> Outcome:
    """Each body of BAD_INPUT gets a 4xx with an OpenAI error object: never a 5xx, a dropped
    connection or an answer."""
    failures = []
    for what, path, body in BAD_INPUT:
        sent = body if isinstance(body, bytes) else {"model": t.model, **body}
        seen = await t.send(path, sent)
        why = _error_fault(seen)
        if why:
            failures.append({"input": what, "why": why, "request": seen.evidence()})
    return verdict("bad input", failures, f"{len(BAD_INPUT)} bad bodies, each a 4xx with an "
                   "error object", f"{len(failures)} of {len(BAD_INPUT)} bad bodies "
                   "not refused cleanly")


def _error_fault(seen: Seen) -> str | None:
    if seen.dropped or seen.status is None:
        return f"the connection dropped ({seen.dropped})"
    if seen.status >= 500:
        return f"a server error ({seen.status})"
    if seen.status < 400:
        return f"accepted ({seen.status})"
    if answer.error_message(seen.json) is None:
        return f"{seen.status} without an OpenAI error object"
    return None


def _not_ok(seen: Seen) -> str | None:
    if seen.dropped:
        return f"the connection dropped ({seen.dropped})"
    if seen.status != 200:
        return f"status {seen.status}"
    a = answer.read(seen)
    if a.error:
        return f"an error: {a.error}"
    if seen.stream and not (seen.done or a.finish_reason()):
        return "the stream ended without a finish_reason or [DONE]"
    return None


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))

