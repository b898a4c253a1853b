"""Tool calls and reasoning content, parsed out of a choice's generated text (issue 29).

Pure text processing: no HTTP, no engine, no tokenizer. The chat route (wired elsewhere)
makes one parser per choice, feeds it each text delta as it is detokenized, and turns the
events into the OpenAI shapes; the names are vLLM's flags'.

    base.py         the interface: events, ToolCall, call ids, ToolParser, parse_all, collect
    hermes.py       `<tool_call>{json}</tool_call>` (Qwen2.5/Qwen3, Hermes; ChatML)
    llama3_json.py  `<|python_tag|>{"name": ..., "parameters": ...}; {...}` (Llama 3.1/3.2)
    mistral.py      `[TOOL_CALLS][{...}, ...]` and `[TOOL_CALLS]name[ARGS]{...}`
    pythonic.py     `[f(a=1), g(b="x")]` read with `ast` (Llama 3.2/4)
    reasoning.py    `<think>...</think>` -> reasoning_content, content (deepseek_r1, qwen3)
    plan.py         a chat request's tools read: what the template gets, what the sampler
                    enforces, how the output is read back (an OutputPlan)
    constrained.py  tool calls the sampler enforces: `tool_choice` "required" or a name
    schema_check.py is a tool's `parameters` (or a response format's schema) a valid schema?
    output.py       a choice's text -> reasoning_content, content and tool_calls, streamed
                    and whole

The tool-call interface:

    parser = TOOL_PARSERS["hermes"](new_id)    # new_id: () -> "call_..."; default random
    parser.feed(text: str) -> list[Event]      # any number of times, any cut points
    parser.finish() -> list[Event]             # once, at the end of the output
    Event = Content(text) | ToolCallStart(index, id, name) | ToolCallArgs(index, text)
    parse_all(cls, text, new_id) -> (content: str, calls: list[ToolCall(id, name, arguments)])
    collect(events) -> the same pair, from a stream's events

A call's `ToolCallStart` comes before its `ToolCallArgs`; the arguments' pieces join to a
JSON object's text (`json.dumps` of the parsed object, non-ASCII kept; all parsers emit it
in one piece once the call is complete). Streams never carry markup: text that could still
become a marker is held back until the next piece decides it, and `finish()` releases what
never did as content. Whatever the cut points, the events fold to exactly `parse_all`'s
result (ids included, given the same id source). Text a parser cannot read as calls
(malformed JSON, a list that is not calls) is content, verbatim; parsers never raise.
Content is None in the OpenAI body where the parsed content is "".

The reasoning interface:

    splitter = REASONING_PARSERS["qwen3"]()
    splitter.feed(text) -> list[Reasoning(text) | Content(text)]; splitter.finish() -> ...
    splitter.reasoning_ended -> bool       # content from here on: the grammar applies now
    split_all(cls, text) -> (reasoning_content, content)

With both, the reasoning splitter runs first and its `Content` text feeds the tool parser.
"""

from nanoserve.server.tools.base import (
    Content,
    Event,
    IdSource,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
    collect,
    parse_all,
    random_ids,
    sequential_ids,
)
from nanoserve.server.tools.hermes import HermesToolParser
from nanoserve.server.tools.llama3_json import Llama3JsonToolParser
from nanoserve.server.tools.mistral import MistralToolParser
from nanoserve.server.tools.pythonic import PythonicToolParser
from nanoserve.server.tools.reasoning import (
    REASONING_PARSERS,
    Reasoning,
    ReasoningParser,
    collect_reasoning,
    split_all,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Content",
    "Event",
    "IdSource",
    "Reasoning",
    "ReasoningParser",
    "ToolCall",
    "ToolCallArgs",
    "ToolCallStart",
    "ToolParser",
    "collect",
    "collect_reasoning",
    "parse_all",
    "random_ids",
    "sequential_ids",
    "split_all",
]
