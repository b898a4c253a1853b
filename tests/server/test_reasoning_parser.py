"""Reasoning splitter (nanoserve/server/tools/reasoning.py): `<think>` and `</think>` cut at
every boundary give the unary reasoning_content and content, and `reasoning_ended` turns
true exactly where the text fed so far closes the reasoning."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from nanoserve.server.tools import REASONING_PARSERS, Reasoning, collect_reasoning, split_all
from nanoserve.server.tools.base import Content

CASES = [  # parser, output, reasoning_content, content
    ("deepseek_r1", "<think>\nLet me think.\n</think>\n\nIt is 4.", "Let me think.", "It is 4."),
    ("deepseek_r1", "Let me think.\n</think>\n\nIt is 4.", "Let me think.", "It is 4."),
    ("deepseek_r1", "<think>Hmm, still", "Hmm, still", ""),
    ("deepseek_r1", "Just thinking", "Just thinking", ""),
    ("deepseek_r1", "a < b, <thin c </think", "a < b, <thin c </think", ""),
    ("deepseek_r1", "x</think>y <think> z", "x", "y <think> z"),
    ("deepseek_r1", "\n</think>\n\nAnswer", "", "Answer"),
    ("qwen3", "<think>\nA.\n</think>\n\nB", "A.", "B"),
    ("qwen3", "<think>\n\n</think>\n\nHi", "", "Hi"),
    ("qwen3", "<think>\nhmm", "hmm", ""),
    ("qwen3", "The answer </think> is", "", "The answer </think> is"),
    ("qwen3", "<thinking is fun", "", "<thinking is fun"),
    ("qwen3", "  <thi", "", "  <thi"),
    ("qwen3", "\n<think>a</think>b</think>c", "a", "b</think>c"),
]


def _chunkings(text: str) -> Iterator[list[str]]:
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 5))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("name", "output", "reasoning", "content"), CASES)
def test_unary(name: str, output: str, reasoning: str, content: str) -> None:
    assert split_all(REASONING_PARSERS[name], output) == (reasoning, content)


@pytest.mark.parametrize(("name", "output", "reasoning", "content"), CASES)
def test_any_chunking_streams_the_unary_result(
    name: str, output: str, reasoning: str, content: str
) -> None:
    for pieces in _chunkings(output):
        parser = REASONING_PARSERS[name]()
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        assert collect_reasoning(events) == (reasoning, content), pieces
        assert all(e.text for e in events)


@pytest.mark.parametrize(
    ("name", "output", "ended_at"),
    [
        ("deepseek_r1", "<think>a</think>b", len("<think>a</think>")),
        ("deepseek_r1", "a\n</think>\nb", len("a\n</think>")),
        ("deepseek_r1", "<think>never closed", None),
        ("qwen3", "<think>a</think>b", len("<think>a</think>")),
        ("qwen3", " Hello", len(" H")),  # no reasoning: decided at the first letter
        ("qwen3", "<thinking", len("<thinki")),
    ],
)
def test_reasoning_ends_exactly_when_the_close_is_fed(
    name: str, output: str, ended_at: int | None
) -> None:
    parser = REASONING_PARSERS[name]()
    ended = []
    for i, char in enumerate(output, start=1):
        parser.feed(char)
        ended.append(i if parser.reasoning_ended else None)
    first = next((i for i in ended if i is not None), None)
    assert first == ended_at
    assert all(i is not None for i in ended[(first or len(ended) + 1) - 1 :])


def test_the_close_is_held_back_until_decided() -> None:
    parser = REASONING_PARSERS["deepseek_r1"]()
    assert parser.feed("<think>Plan </thi") == [Reasoning("Plan")]
    assert not parser.reasoning_ended
    assert parser.feed("nk>\n\nDone") == [Content("Done")]
    assert parser.reasoning_ended


def test_registry_has_vllms_names() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
