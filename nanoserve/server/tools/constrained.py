"""Tool calls the sampler enforces: `tool_choice` "required" or naming a function.

As vLLM does, the constrained output has one shape whatever the model family, so no
family's markup has to be spelled as a grammar: a named function's output is its arguments
object alone, and "required" is a JSON array of `{"name": ..., "parameters": {...}}`, one
item (or several, with `parallel_tool_calls`), each item's parameters under its own
function's schema. The grammar engine (sampling/grammar.py) makes every output a valid
instance; the parsers here read it back as calls, streaming the arguments as they are
generated. Under a reasoning parser the constraint starts after `</think>`
(`after_reasoning`), as vLLM applies structured outputs after the reasoning ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from nanoserve.sampling.grammar import JSON_LAYOUT, GuidedSpec
from nanoserve.server.tools.base import (
    Event,
    IdSource,
    Nesting,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
    content,
)

# One item's head in the array: the brace closing the item before it, the separator, the
# name, and the parameters' key; and the array's end.
_HEAD = re.compile(r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                   r'\s*"parameters"\s*:\s*')
_END = re.compile(r"\s*\}?\s*\]\s*")
_HEAD_DONE = re.compile(r'"parameters"\s*:\s*\S')  # enough text to judge a head by


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_LAYOUT}


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool's parameters schema; a function without one takes an empty object."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def named_spec(tool: dict[str, Any]) -> GuidedSpec:
    return GuidedSpec.json_schema(parameters(tool), "tool_choice")


def required_spec(tools: Sequence[dict[str, Any]], parallel: bool) -> GuidedSpec:
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "parameters": parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return GuidedSpec.json_schema(schema, "tool_choice")


def after_reasoning(spec: GuidedSpec, opening_optional: bool) -> GuidedSpec:
    """`spec` applied once the thinking ends: free text up to `</think>`, any blank, then
    what `spec` allows. One Lark grammar, the constraint nested in it. `opening_optional`
    (deepseek_r1, whose template may already have opened the thinking): the output thinks
    first, with or without its own `<think>`; else (qwen3) it thinks only if it opens with
    `<think>`, and may go straight to what `spec` allows (thinking switched off)."""
    thinking = ('"<think>"? think /[ \\t\\n]*/' if opening_optional
                else '("<think>" think /[ \\t\\n]*/)?')
    grammar = (f"%llguidance {{}}\nstart: {thinking} body\n"
               f'think[stop="</think>"]: /(.|\\n)*/\nbody: {_rule_body(spec)}\n')
    return GuidedSpec("grammar", grammar, spec.field)


def _rule_body(spec: GuidedSpec) -> str:
    """`spec` as the right-hand side of one Lark rule: a nested JSON schema, regex, choice
    or grammar (llguidance nests grammars with `%json {...}` and `%lark {...}`)."""
    if spec.kind == "json":
        return "%json " + json.dumps(_laid_out(json.loads(spec.source)))
    if spec.kind == "regex":
        return "/" + spec.source.replace("/", "\\/") + "/"
    if spec.kind == "choice":
        return " | ".join(json.dumps(o) for o in json.loads(spec.source))
    return "%lark {\n" + spec.source + "\n}"


# Each parser's markup around its calls under "auto" (the text the parser reads back as
# calls): what opens the calls, what separates two, what closes them, and the key the
# arguments go under. The markers are written as text: the model may spell them in plain
# tokens, and the parser reads the detokenized text either way. Pythonic calls are Python,
# not JSON, and have their own rules (_PYTHONIC).
_FORMATS: dict[str, tuple[str, str, str, str]] = {
    "hermes": ("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>",
               "arguments"),
    "llama3_json": ("", "; ", "", "parameters"),
    "mistral": ("[TOOL_CALLS][", ", ", "]", "arguments"),
}
# A Python literal, as the pythonic parser's `ast.literal_eval` reads it: one space after
# ',' and ':' as JSON_LAYOUT lays JSON out. The arguments are not checked against the
# tools' schemas here (only their names are): a call that does not fit still reads back.
_PYTHONIC = r"""
pyval: PYSTR | PYNUM | "True" | "False" | "None" | "[" (pyval (", " pyval)*)? "]"
     | "{" (PYSTR ": " pyval (", " PYSTR ": " pyval)*)? "}"
PYSTR: /"(\\[\\"nrt]|[^"\\\x00-\x1f])*"/
PYNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
kwarg: /[A-Za-z_][A-Za-z_0-9]*/ "=" pyval
kwargs: (kwarg (", " kwarg)*)?
"""


def auto_calls(tools: Sequence[dict[str, Any]], parser: str, parallel: bool) -> str:
    """Lark rules whose `calls` is what `parser` reads as calls of `tools` (one, or several
    with `parallel`): the "call" side of "a call, or text in the schema" under "auto"."""
    if parser == "pythonic":
        names = " | ".join(json.dumps(t["function"]["name"]) for t in tools)
        more = ' (", " pcall)*' if parallel else ""
        return (f'calls: "[" pcall{more} "]"\npcall: ({names}) "(" kwargs ")"\n' + _PYTHONIC)
    opening, between, closing, key = _FORMATS[parser]
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: parameters(t)},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    call = items[0] if len(items) == 1 else {"anyOf": items}
    more = f"({json.dumps(between)} call)*" if parallel else ""
    seq = " ".join(p for p in (opening and json.dumps(opening), "call", more,
                               closing and json.dumps(closing)) if p)
    return f"calls: {seq}\ncall: %json {json.dumps(_laid_out(call))}\n"


def call_or_answer(calls: str, answer: GuidedSpec) -> GuidedSpec:
    """Under "auto" with a response format: the output is the calls (`auto_calls`'s rules)
    or an answer that `answer` allows, whichever the model starts; one grammar, named by
    the response format's field (its errors are the ones a client can fix there)."""
    grammar = f"%llguidance {{}}\nstart: calls | answer\nanswer: {_rule_body(answer)}\n{calls}"
    return GuidedSpec("grammar", grammar, answer.field)


class NamedCallParser(ToolParser):
    """The whole output is one call of the named function: its arguments, streamed as they
    are generated."""

    def __init__(self, name: str, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._name = name

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if self._calls == 0:
            self._calls = 1
            out.append(ToolCallStart(0, self._new_id(), self._name))
        out.append(ToolCallArgs(0, text))
        return out

    def finish(self) -> list[Event]:
        return []


class RequiredCallsParser(ToolParser):
    """`[{"name": "f", "parameters": {...}}, ...]`: each item's name as soon as its head is
    complete, its parameters in pieces as they are generated. Text that is not such an array
    (only an output cut short can end so) is content."""

    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._buf = ""
        self._args: Nesting | None = None  # inside an item's parameters
        self._rejected = False

    def feed(self, text: str) -> list[Event]:
        if self._rejected:
            return content(text)
        self._buf += text
        out: list[Event] = []
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._args is not None or rest.lstrip()[:1] in ("", "[", ",", "]", "}"):
            return []  # the array's end, or an output cut short inside an item
        return content(rest)

    def _step(self, out: list[Event]) -> bool:
        """Take what the buffer decides; False when it needs more text."""
        if self._args is not None:
            end = self._args.end(self._buf)
            piece = self._buf if end is None else self._buf[:end]
            if piece:
                out.append(ToolCallArgs(self._calls - 1, piece))
            self._buf = "" if end is None else self._buf[end:]
            if end is not None:
                self._args = None
            return end is not None
        if _END.fullmatch(self._buf):
            self._buf = ""
            return False
        if not _HEAD_DONE.search(self._buf):
            return False
        head = _HEAD.match(self._buf)
        if head is None:
            self._rejected = True
            out.extend(content(self._buf))
            self._buf = ""
            return False
        self._calls += 1
        out.append(ToolCallStart(self._calls - 1, self._new_id(), json.loads(head.group(1))))
        self._buf = self._buf[head.end():]
        self._args = Nesting()
        return True
