"""The Responses API layer (nanoserve/server/responses/translate.py, events.py): each
request field maps to its chat-completions spelling or to a 400 naming it, and each rendered
output streams events that the official `openai` package's own types accept, in the
documented order, and that its stream accumulator folds to exactly our final Response,
through `client.responses.create/stream/parse` over a mocked transport."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from nanoserve.server.errors import ApiError
from nanoserve.server.responses.events import Event, ResponseRenderer
from nanoserve.server.responses.translate import request_echo, to_chat_body

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}

# --- the request ---------------------------------------------------------------------------


def test_string_input_instructions_and_passed_fields() -> None:
    body = {"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
            "parallel_tool_calls": False, "store": True, "metadata": {"k": "v"}, "user": "u",
            "reasoning": {"effort": "low"}, "truncation": "auto", "include": [],
            "background": False, "previous_response_id": None, "unknown_vendor_extra": 1}
    assert to_chat_body(body) == {
        "model": "m", "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
        "parallel_tool_calls": False, "max_tokens": 7,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}]}


def test_message_items_every_role_and_part() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "Rules."},
        {"role": "system", "content": [{"type": "input_text", "text": "More."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]
    assert to_chat_body({"input": items})["messages"] == [
        {"role": "system", "content": "Rules."}, {"role": "system", "content": "More."},
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"}]


def test_function_calls_merge_into_one_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": "Checking again."},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "snow"},
    ]
    call = _chat_call
    assert to_chat_body({"input": items})["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", "w", '{"city":"Paris"}'), call("c2", "w", '{"city":"Rome"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Checking again.", "tool_calls": [call("c3", "w", "{}")]},
        {"role": "tool", "tool_call_id": "c3", "content": "snow"},
    ]


def _chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_response_output_is_the_next_input() -> None:
    """The client's stateless loop: `input += response.output` plus the calls' outputs."""
    final = render(SCRIPTS["reasoning_text_call"][0], "tool_calls")[1]
    items = [{"role": "user", "content": "Paris?"}, *final["output"],
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    assert to_chat_body({"input": items})["messages"] == [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [_chat_call("call_1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def test_tools_and_tool_choice() -> None:
    bare = {"type": "function", "name": "noop", "parameters": None}
    chat = to_chat_body({"input": "x", "tools": [WEATHER, bare],
                         "tool_choice": {"type": "function", "name": "get_weather"}})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a "
         "city", "parameters": WEATHER["parameters"], "strict": True}},
        {"type": "function", "function": {"name": "noop"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("none", "auto", "required"):
        assert to_chat_body({"input": "x", "tools": [WEATHER],
                             "tool_choice": choice})["tool_choice"] == choice
    assert "tools" not in to_chat_body({"input": "x", "tools": []})


@pytest.mark.parametrize(("fmt", "response_format"), [
    ({"type": "json_schema", "name": "A", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}),
    ({"type": "json_schema", "name": "A", "schema": SCHEMA, "description": "d"},
     {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "description": "d"}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, None),
    (None, None),
])
def test_text_format(fmt: Any, response_format: Any) -> None:
    chat = to_chat_body({"input": "x", "text": {"format": fmt, "verbosity": "low"}})
    assert chat.get("response_format") == response_format


BAD = [  # body, param
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "background": True}, "background"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": ["x"]}, "input[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_1"}]},
     "input[1].type"),
    ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[2].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[1].output"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [WEATHER, {"type": "file_search", "vector_store_ids": []}]},
     "tools[1].type"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "description": 1}]},
     "tools[0].description"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "A"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "text.format.name"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_requests_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        to_chat_body(body)
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_previous_response_id_says_stateless() -> None:
    with pytest.raises(ApiError, match="stateless"):
        to_chat_body({"input": "x", "previous_response_id": "resp_1"})


# --- the rendering -------------------------------------------------------------------------

CALL_W = [("call", 0, "call_1", "get_weather"), ("args", 0, '{"city": '),
          ("args", 0, '"Paris"}')]
SCRIPTS: dict[str, tuple[list[tuple[Any, ...]], str]] = {  # script, finish_reason
    "text": ([("text", "Hello"), ("text", ", "), ("text", ""), ("text", "world.")], "stop"),
    "json_schema": ([("text", '{"answer"'), ("text", ": 42}")], "stop"),
    "one_call": (CALL_W, "tool_calls"),
    "two_calls": ([*CALL_W, ("call", 1, "call_2", "get_weather"),
                   ("args", 1, '{"city": "Rome"}')], "tool_calls"),
    "reasoning_text": ([("reasoning", "The user "), ("reasoning", "greets."),
                        ("text", "Hi!")], "stop"),
    "reasoning_text_call": ([("reasoning", "Need weather."), ("text", "Let me check."),
                             *CALL_W], "tool_calls"),
    "length": ([("reasoning", "Hmm"), ("text", "The answer is")], "length"),
    "length_in_call": ([("call", 0, "call_1", "f"), ("args", 0, '{"a": ')], "length"),
    "empty": ([], "stop"),
}
ITEM_EVENTS = {
    "message": ["response.output_item.added", "response.content_part.added",
                "response.output_text.delta*", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"],
    "reasoning": ["response.output_item.added", "response.content_part.added",
                  "response.reasoning_text.delta*", "response.reasoning_text.done",
                  "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta*",
                      "response.function_call_arguments.done", "response.output_item.done"],
}


def render(script: list[tuple[Any, ...]], finish: str, body: dict[str, Any] | None = None,
           usage: tuple[int, int] = (5, 9)) -> tuple[list[Event], dict[str, Any]]:
    body = body or {"model": "m", "input": "x", "tools": [WEATHER]}
    r = ResponseRenderer("resp_abc", "m", 1700000000, request_echo(body))
    events = r.start()
    for step in script:
        if step[0] == "text":
            events += r.text(step[1])
        elif step[0] == "reasoning":
            events += r.reasoning(step[1])
        elif step[0] == "call":
            events += r.tool_call(step[1], step[2], step[3])
        else:
            events += r.tool_arguments(step[1], step[2])
    events += r.finish(finish, *usage)
    return events, r.final()


def _collapse(types: list[str]) -> list[str]:
    """Runs of one delta type as one `...delta*`."""
    out: list[str] = []
    for t in types:
        t = f"{t}*" if t.endswith(".delta") else t
        if not (t.endswith("*") and out and out[-1] == t):
            out.append(t)
    return out


def _no_extras(model: pydantic.BaseModel, where: str) -> None:
    """Every key we send is a field of the openai type (the types allow extras silently)."""
    assert not model.model_extra, f"{where}: unknown fields {sorted(model.model_extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, pydantic.BaseModel):
                _no_extras(v, f"{where}.{name}[{i}]")


@pytest.mark.parametrize("name", SCRIPTS)
def test_events_validate_and_follow_the_documented_order(name: str) -> None:
    events, final = render(*SCRIPTS[name])
    for e in events:
        _no_extras(EVENTS.validate_python(e), e["type"])
    _no_extras(Response.model_validate(final), "response")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    end = "response.incomplete" if SCRIPTS[name][1] == "length" else "response.completed"
    expected = ["response.created", "response.in_progress"]
    for item in final["output"]:
        expected += ITEM_EVENTS[item["type"]]
    expected.append(end)
    assert _collapse([e["type"] for e in events]) == expected
    assert events[-1]["response"] == final
    for e in events:  # output_index is the item's position in the final output
        if "output_index" in e:
            item_id = e["item"]["id"] if "item" in e else e["item_id"]
            assert final["output"][e["output_index"]]["id"] == item_id


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_clients_accumulator_folds_the_stream_to_final(name: str) -> None:
    """openai's own ResponseStreamState, fed our events as the client parses them, ends with
    our final Response; its snapshot, built from the deltas alone, holds the same text."""
    events, final = render(*SCRIPTS[name])
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[WEATHER],
                                                          text_format=openai.omit)
    seen = []
    for e in events:
        seen += state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    assert [e.type for e in seen] == [e["type"] for e in events]
    if final["status"] == "completed":
        assert _plain(state._completed_response) == _plain(Response.model_validate(final))
    else:  # the client keeps no completed response for response.incomplete
        assert state._completed_response is None
        assert _plain(seen[-1].response) == _plain(Response.model_validate(final))
    snapshot = state._ResponseStreamState__current_snapshot
    for streamed, item in zip(snapshot.output, final["output"], strict=True):
        if item["type"] == "message":
            assert streamed.content[0].text == item["content"][0]["text"]
        elif item["type"] == "function_call":
            assert streamed.arguments == item["arguments"]


def _plain(response: Any) -> dict[str, Any]:
    """A (parsed) Response as JSON data, less the client's own `parsed*` additions."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if not k.startswith("parsed")}
        return [strip(x) for x in v] if isinstance(v, list) else v
    return strip(response.to_dict()) | {"output_text": response.output_text}


def test_final_response_shapes() -> None:
    final = render(*SCRIPTS["reasoning_text_call"])[1]
    assert final["status"] == "completed"
    assert final["incomplete_details"] is None
    assert final["output"] == [
        {"type": "reasoning", "id": "rs_abc_0", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Need weather."}]},
        {"type": "message", "id": "msg_abc_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": [],
                      "logprobs": []}]},
        {"type": "function_call", "id": "fc_abc_2", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"}]
    assert final["usage"] == {
        "input_tokens": 5, "output_tokens": 9, "total_tokens": 14,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0}}
    assert (final["tools"], final["tool_choice"], final["parallel_tool_calls"]) == (
        [WEATHER], "auto", True)
    assert final["text"] == {"format": {"type": "text"}}


def test_length_cut_is_incomplete_and_cuts_only_the_open_item() -> None:
    events, final = render(*SCRIPTS["length"])
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]
    assert events[-1]["type"] == "response.incomplete"


@pytest.mark.parametrize(("finish", "status", "reason"), [
    ("stop", "completed", None), ("tool_calls", "completed", None),
    ("length", "incomplete", "max_output_tokens"),
    ("content_filter", "incomplete", "content_filter")])
def test_finish_reasons(finish: str, status: str, reason: str | None) -> None:
    final = render([("text", "a")], finish)[1]
    assert (final["status"], final["incomplete_details"]) == (
        status, reason and {"reason": reason})


def test_misuse_raises() -> None:
    r = ResponseRenderer("resp_x", "m", 0, request_echo({"input": "x"}))
    r.start()
    with pytest.raises(ValueError, match="final"):
        r.final()
    r.tool_call(0, "c0", "f")
    r.text("after the call")
    with pytest.raises(ValueError, match="tool call 0"):
        r.tool_arguments(0, "{}")
    with pytest.raises(ValueError, match="tool call 7"):
        r.tool_arguments(7, "{}")


# --- the official client, over a mocked transport -----------------------------------------


def _client(script: list[tuple[Any, ...]], finish: str) -> tuple[openai.OpenAI, list[Any]]:
    """A client whose /v1/responses translates the body and answers with `script`."""
    seen: list[Any] = []  # [chat body, final]

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(to_chat_body(body))
        events, final = render(script, finish, body)
        seen.append(final)
        if not body.get("stream"):
            return httpx.Response(200, json=final)
        sse = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    http = httpx.Client(transport=httpx.MockTransport(answer))
    return openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=http), seen


def test_client_create_and_stream() -> None:
    client, seen = _client(*SCRIPTS["reasoning_text"])
    unary = client.responses.create(model="m", input="Hi", instructions="Be kind.")
    assert unary.output_text == "Hi!"
    assert unary.status == "completed"
    assert seen[0]["messages"][0] == {"role": "system", "content": "Be kind."}
    with client.responses.stream(model="m", input="Hi", instructions="Be kind.") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert deltas == ["Hi!"]
    assert seen[2]["stream"] is True
    assert _plain(streamed) == _plain(unary) == _plain(Response.model_validate(seen[3]))


class Answer(pydantic.BaseModel):
    answer: int


def test_client_parse_with_a_pydantic_format() -> None:
    client, seen = _client(*SCRIPTS["json_schema"])
    parsed = client.responses.parse(model="m", input="6*7?", text_format=Answer)
    assert parsed.output_parsed == Answer(answer=42)
    assert seen[0]["response_format"]["json_schema"]["name"] == "Answer"
    with client.responses.stream(model="m", input="6*7?", text_format=Answer) as stream:
        assert stream.get_final_response().output_parsed == Answer(answer=42)


def test_client_stream_of_parallel_calls() -> None:
    client, seen = _client(*SCRIPTS["two_calls"])
    with client.responses.stream(model="m", input="Paris and Rome?", tools=[WEATHER],
                                 tool_choice="required") as stream:
        done = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert done == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert [(c.call_id, c.parsed_arguments) for c in final.output] == [
        ("call_1", {"city": "Paris"}), ("call_2", {"city": "Rome"})]
    assert seen[0]["tool_choice"] == "required"
    assert len(seen[0]["tools"]) == 1

