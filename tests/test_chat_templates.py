"""Chat templates of the models people bring (Qwen2.5, Qwen3, Llama 3.1, Llama 3.2; their own
text, tests/fixtures/chat_templates/) render the same prompt through nanoserve's tokenizer as
through transformers' `apply_chat_template`, for 20 conversations each: with and without a
system message, one to three turns, text that a template trims or escapes, and with and
without the generation prompt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from nanoserve.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
TEXTS = ["Hello!", "What is 2 + 2?", "  leading and trailing spaces  ", "Ünïcödé, 日本語, emoji 🙂",
         "line one\nline two\n\nline four", "<b>markup</b> & \"quotes\" 'apostrophes'",
         "def f(x):\n    return x * 2", "{\"json\": [1, 2, 3]}"]
SYSTEMS = [None, "You are a terse assistant.", "  Answer in French.\n"]


def conversations() -> list[tuple[list[dict[str, str]], bool]]:
    """20 (messages, add_generation_prompt) pairs, deterministic."""
    out: list[tuple[list[dict[str, str]], bool]] = []
    k = 0
    while len(out) < 20:
        system = SYSTEMS[k % len(SYSTEMS)]
        turns = 1 + k % 3
        msgs: list[dict[str, str]] = [] if system is None else [
            {"role": "system", "content": system}]
        for t in range(turns):
            msgs.append({"role": "user", "content": TEXTS[(k + t) % len(TEXTS)]})
            if t + 1 < turns or k % 4 == 3:  # some end on an assistant turn
                msgs.append({"role": "assistant", "content": TEXTS[(k + t + 3) % len(TEXTS)]})
        out.append((msgs, msgs[-1]["role"] == "user"))
        k += 1
    return out


@pytest.fixture(scope="module", params=NAMES)
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           smollm2_folder: Path) -> Path:
    """SmolLM2's tokenizer with the template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp(request.param)
    shutil.copy(smollm2_folder / "tokenizer.json", out / "tokenizer.json")
    cfg: dict[str, Any] = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (TEMPLATES / f"{request.param}.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_the_template_renders_as_transformers_renders_it(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    cases = conversations()
    assert len(cases) == 20
    for messages, gen in cases:
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        got = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert got == want, (messages, gen)


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_tools_and_tool_turns_render_as_transformers_renders_them(folder: Path) -> None:
    """A tool loop through each model's own template: the tools (`tools=`, as transformers
    passes them), an assistant turn carrying tool_calls and the tool's result, as the chat
    route hands them over (server/body/parts.py: arguments as an object)."""
    from transformers import AutoTokenizer

    from nanoserve.server.body.parts import Message

    ours = Tokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    assert ours.template_reads("tools")
    body = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    messages = [Message.model_validate(m).as_dict() for m in body]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    for gen in (True, False):
        want = theirs.apply_chat_template(messages, tools=[TOOL], tokenize=False,
                                          add_generation_prompt=gen)
        got = ours.apply_chat_template(messages, tools=[TOOL], add_generation_prompt=gen)
        assert got == want
        assert "get_weather" in got
