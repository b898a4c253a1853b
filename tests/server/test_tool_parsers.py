"""Tool-call parsers (nanoserve/server/tools): each format's scripted outputs parse to exact
content and calls, and a stream cut anywhere (char by char, every two-way split, seeded
random cuts) folds to exactly the unary result, with no markup in its content."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import pytest

from nanoserve.server.tools import (
    TOOL_PARSERS,
    Content,
    Event,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
    collect,
    parse_all,
    random_ids,
    sequential_ids,
)

Case = tuple[str, str, str, list[tuple[str, str]]]  # parser, output, content, calls

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
W_ARGS = '{"city": "Paris"}'
F = '{"name": "f", "arguments": {"x": 1, "s": "a } b \\" {"}}'
F_ARGS = '{"x": 1, "s": "a } b \\" {"}'

HERMES: list[Case] = [
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", W_ARGS)]),
    (
        "hermes",
        f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{F}\n</tool_call>",
        "",
        [("get_weather", W_ARGS), ("f", F_ARGS)],
    ),
    (
        "hermes",
        f"Let me check.\n\n<tool_call>{W}</tool_call>",
        "Let me check.",
        [("get_weather", W_ARGS)],
    ),
    ("hermes", f"<tool_call>{W}</tool_call>\n\nDone.", "Done.", [("get_weather", W_ARGS)]),
    (
        "hermes",
        "4 < 5, a <tool is no <tool_call, and ends <tool_",
        "4 < 5, a <tool is no <tool_call, and ends <tool_",
        [],
    ),
    ("hermes", "Plain answer.\n", "Plain answer.\n", []),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        f"Hi <tool_call>oops</tool_call>\n<tool_call>{W}</tool_call>",
        "Hi <tool_call>oops</tool_call>",
        [("get_weather", W_ARGS)],
    ),
    ("hermes", f"<tool_call>\n{W}", "", [("get_weather", W_ARGS)]),  # cut before the close
    ("hermes", 'Hi <tool_call>{"name": "f"', 'Hi <tool_call>{"name": "f"', []),
    (
        "hermes",
        '<tool_call>{"name": "g", "arguments": "{\\"city\\": \\"Zürich\\"}"}</tool_call>',
        "",
        [("g", '{"city": "Zürich"}')],
    ),
]

LLAMA3: list[Case] = [
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", W_ARGS)],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{F}; {{"name": "g", "parameters": {{}}}}',
        "",
        [("f", F_ARGS), ("g", "{}")],
    ),
    ("llama3_json", f"\n{W};\n", "", [("get_weather", W_ARGS)]),
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", f"Sure: {W}", f"Sure: {W}", []),  # calls open the output, or none
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", "  <|python_ta", "  <|python_ta", []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"x": }',
        '{"name": "f", "parameters": {"x": }',
        [],
    ),
    ("llama3_json", '{"name": 3, "parameters": {}}', '{"name": 3, "parameters": {}}', []),
    ("llama3_json", f"{W} and then", " and then", [("get_weather", W_ARGS)]),
]

MISTRAL: list[Case] = [
    ("mistral", f"[TOOL_CALLS][{W}]", "", [("get_weather", W_ARGS)]),
    ("mistral", f"[TOOL_CALLS] [{W}, {F}]", "", [("get_weather", W_ARGS), ("f", F_ARGS)]),
    (
        "mistral",
        f"Checking.\n[TOOL_CALLS][{W}]\nDone.",
        "Checking.Done.",
        [("get_weather", W_ARGS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}',
        "",
        [("get_weather", W_ARGS), ("f", "{}")],
    ),
    (
        "mistral",
        "Use [TOOL] and [TOOL_CALL brackets [ok]",
        "Use [TOOL] and [TOOL_CALL brackets [ok]",
        [],
    ),
    ("mistral", '[TOOL_CALLS][{"name": "f"', '[TOOL_CALLS][{"name": "f"', []),
    ("mistral", "[TOOL_CALLS] hello [x]", "[TOOL_CALLS] hello [x]", []),
    ("mistral", "[TOOL_CALLS][1, 2] rest", "[TOOL_CALLS][1, 2] rest", []),
    ("mistral", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[ARGS][1]", []),
    ("mistral", "ends [TOOL_CALLS]f[AR", "ends [TOOL_CALLS]f[AR", []),
]

PYTHONIC: list[Case] = [
    ("pythonic", '[get_weather(city="Paris")]', "", [("get_weather", W_ARGS)]),
    (
        "pythonic",
        "[get_weather(city='Paris', days=3), search(query='rain ]', "
        'filters={"lang": "en"}, tags=("a", None, True))]',
        "",
        [
            ("get_weather", '{"city": "Paris", "days": 3}'),
            ("search", '{"query": "rain ]", "filters": {"lang": "en"}, "tags": ["a", null, true]}'),
        ],
    ),
    ("pythonic", "<|python_start|>[f(x=1)]<|python_end|>", "", [("f", '{"x": 1}')]),
    ("pythonic", "[f(x=1)]\n\nDone.", "Done.", [("f", '{"x": 1}')]),
    ("pythonic", '[brave_search.call(query="x")]', "", [("brave_search.call", '{"query": "x"}')]),
    ("pythonic", "Sunny in Paris.", "Sunny in Paris.", []),
    ("pythonic", "[1, 2] is a list", "[1, 2] is a list", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),
    ("pythonic", '[f(x=open("a"))]', '[f(x=open("a"))]', []),
    ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", []),
    ("pythonic", "[f(x=1)", "[f(x=1)", []),
    ("pythonic", "[f(x=float('nan'))]", "[f(x=float('nan'))]", []),
    ("pythonic", "[f(**k)]", "[f(**k)]", []),
]

CASES = HERMES + LLAMA3 + MISTRAL + PYTHONIC


def _chunkings(text: str, seed: int) -> Iterator[list[str]]:
    """Char by char, every two-way split, and seeded random multi-way cuts."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream(parser: ToolParser, pieces: list[str]) -> list[Event]:
    return [event for piece in pieces for event in parser.feed(piece)] + parser.finish()


def _check_order(events: list[Event]) -> None:
    """A call's name comes first, its arguments after; indices count up; no empty text."""
    started: list[int] = []
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == len(started)
            started.append(event.index)
        elif isinstance(event, ToolCallArgs):
            assert event.index in started
        else:
            assert event.text


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_unary(name: str, output: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_all(TOOL_PARSERS[name], output, sequential_ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i:024d}" for i in range(len(calls))]


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_any_chunking_streams_the_unary_result(
    name: str, output: str, content: str, calls: list[tuple[str, str]]
) -> None:
    cls = TOOL_PARSERS[name]
    expected = parse_all(cls, output, sequential_ids())
    for pieces in _chunkings(output, seed=len(output)):
        events = _stream(cls(sequential_ids()), pieces)
        assert collect(events) == expected, pieces
        _check_order(events)


@pytest.mark.parametrize(
    ("name", "fed", "now", "held"),
    [
        ("hermes", "Hi <tool_", "Hi", " <tool_"),
        ("mistral", "Hi\n[TOOL_CA", "Hi", "\n[TOOL_CA"),
        ("llama3_json", " <|python", "", " <|python"),
        ("pythonic", "\n<|python_st", "", "\n<|python_st"),
    ],
)
def test_a_forming_marker_is_held_back_then_released(
    name: str, fed: str, now: str, held: str
) -> None:
    parser = TOOL_PARSERS[name](sequential_ids())
    assert parser.feed(fed) == ([Content(now)] if now else [])
    assert parser.finish() == [Content(held)]


def test_hermes_emits_the_call_the_moment_its_block_closes() -> None:
    parser = TOOL_PARSERS["hermes"](sequential_ids())
    assert parser.feed(f"<tool_call>{W}</tool_cal") == []
    assert parser.feed("l>") == [
        ToolCallStart(0, "call_" + "0" * 24, "get_weather"),
        ToolCallArgs(0, W_ARGS),
    ]


def test_registry_has_vllms_names() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]


def test_ids_are_openai_shaped_and_repeatable_when_seeded() -> None:
    first = random_ids(random.Random(7))
    second = random_ids(random.Random(7))
    ids = [first() for _ in range(3)]
    assert ids == [second() for _ in range(3)]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    _, calls = parse_all(TOOL_PARSERS["hermes"], f"<tool_call>{W}</tool_call>")
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0].id)


# Pieces of every format's markup, whole and cut, for random outputs that a model could
# plausibly never write: the property holds for any text, not only the scripted cases.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
    "<|python_start|>", "<|python_end|>", W, F, "[", "]", "{", "}", ";", " ", "\n", "x",
    "f(a=1)", "'", '"', "\\", ",", "g(b='x')", f"<tool_call>{W}</tool_call>",
    f"[TOOL_CALLS][{W}]", "[TOOL_CALLS]f[ARGS]{}", f"; {F}",
]  # fmt: skip
OPENINGS = ["", W, "<|python_tag|>", "[f(a=1), g(b='x')]", "<|python_start|>"]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_random_outputs_stream_as_unary(name: str) -> None:
    cls = TOOL_PARSERS[name]
    rng = random.Random(name)
    with_calls = 0
    for _ in range(150):
        fragments = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10))]
        output = rng.choice(OPENINGS) + "".join(fragments)
        expected = parse_all(cls, output, sequential_ids())
        with_calls += bool(expected[1])
        cuts = sorted(rng.sample(range(len(output) + 1), min(len(output) + 1, rng.randint(1, 6))))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
        for chunking in (pieces, list(output)):
            assert collect(_stream(cls(sequential_ids()), chunking)) == expected, chunking
    assert with_calls >= 20  # the property is tested on calls, not only on plain text
