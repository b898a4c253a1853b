"""Trace format v1: the loader's rejections (line and field named), and byte-exact rewrites."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.trace.format import (
    ClientSpec,
    EverySeconds,
    EverySteps,
    Expectation,
    Trace,
    TraceHeader,
    TraceRequest,
)
from sim.trace.loader import TraceError, load_trace, loads_trace
from sim.trace.write import dumps_trace, write_trace

ENGINE = {"block_size": 16, "num_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
          "seed": 0}
STEP_HEADER = {"nanoserve_trace": 1, "clock": "step", "model": "stub", "engine": ENGINE}
VIRTUAL_HEADER = {**STEP_HEADER, "clock": "virtual"}


def req(rid: object = "r1", **over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"id": rid, "at_step": 0, "path": "/v1/completions",
                            "body": {"model": "stub", "prompt": "Hello", "max_tokens": 4},
                            "client": {"read": "eager"}}
    line.update(over)
    return {k: v for k, v in line.items() if v is not _DROP}


_DROP = object()  # req(x=_DROP) leaves the key out


def lines(*objs: Any) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def engine(**over: Any) -> dict[str, Any]:
    e = {**ENGINE, **over}
    return {k: v for k, v in e.items() if v is not _DROP}


# (case, trace lines, the line and field the error must name, a fragment of its message)
REJECTIONS: list[tuple[str, list[str], int, str | None, str]] = [
    ("empty", [], 1, "nanoserve_trace", "empty"),
    ("request first", lines(req()), 1, "nanoserve_trace", "must be the header"),
    ("version 2", lines({**STEP_HEADER, "nanoserve_trace": 2}), 1, "nanoserve_trace",
     "knows version 1, got 2"),
    ("wall clock", lines({**STEP_HEADER, "clock": "wall"}), 1, "clock", "got 'wall'"),
    ("no model", lines({**STEP_HEADER, "model": ""}), 1, "model", "non-empty string"),
    ("engine missing", lines({**STEP_HEADER, "engine": None}), 1, "engine", "JSON object"),
    ("no block_size", lines({**STEP_HEADER, "engine": engine(block_size=_DROP)}), 1,
     "engine.block_size", "is required"),
    ("num_blocks 0", lines({**STEP_HEADER, "engine": engine(num_blocks=0)}), 1,
     "engine.num_blocks", "integer >= 1, got 0"),
    ("seed float", lines({**STEP_HEADER, "engine": engine(seed=1.5)}), 1, "engine.seed",
     "integer >= 0"),
    ("prefix_caching str", lines({**STEP_HEADER, "engine": engine(prefix_caching="yes")}), 1,
     "engine.prefix_caching", "true or false"),
    ("eos prob", lines({**STEP_HEADER, "engine": engine(stub_eos_prob=1.5)}), 1,
     "engine.stub_eos_prob", "[0, 1]"),
    ("sha", lines({**STEP_HEADER, "engine": engine(model_sha256="abc")}), 1,
     "engine.model_sha256", "64 lowercase hex"),
    ("cost model on step", lines({**STEP_HEADER, "cost_model": "c.json"}), 1, "cost_model",
     'clock "virtual"'),
    ("note not str", lines({**STEP_HEADER, "note": 3}), 1, "note", "string"),
    ("bad json", lines(STEP_HEADER, '{"id": "r1",'), 2, None, "not valid JSON"),
    ("NaN", lines(STEP_HEADER, '{"id": "r1", "at_step": NaN}'), 2, None, "not valid JSON"),
    ("not object", lines(STEP_HEADER, [1, 2]), 2, None, "JSON object, got list"),
    ("at_step -1", lines(STEP_HEADER, req(at_step=-1)), 2, "at_step",
     "must be an integer >= 0, got -1"),
    ("at_step str", lines(STEP_HEADER, req(at_step="3")), 2, "at_step", "got '3'"),
    ("at_step bool", lines(STEP_HEADER, req(at_step=True)), 2, "at_step", "got True"),
    ("at_s on step", lines(STEP_HEADER, req(at_s=1.0)), 2, "at_s", "gives arrivals as at_step"),
    ("no at_step", lines(STEP_HEADER, req(at_step=_DROP)), 2, "at_step", "required"),
    ("no at_s", lines(VIRTUAL_HEADER, req(at_step=_DROP)), 2, "at_s", "required"),
    ("at_step on virtual", lines(VIRTUAL_HEADER, req(at_s=0.5)), 2, "at_step",
     "gives arrivals as at_s"),
    ("at_s negative", lines(VIRTUAL_HEADER, req(at_step=_DROP, at_s=-0.5)), 2, "at_s",
     "number >= 0"),
    ("out of order", lines(STEP_HEADER, req(at_step=3), req("r2", at_step=2)), 3, "at_step",
     "in order: 2 is before the previous request's 3"),
    ("duplicate id", lines(STEP_HEADER, req(), req()), 3, "id",
     "duplicate request id 'r1' (first on line 2)"),
    ("id end", lines(STEP_HEADER, req("end")), 2, "id", "reserved"),
    ("id int", lines(STEP_HEADER, req(7)), 2, "id", "non-empty string"),
    ("path", lines(STEP_HEADER, req(path="/v1/embeddings")), 2, "path", "/v1/embeddings"),
    ("body str", lines(STEP_HEADER, req(body="hi")), 2, "body", "JSON object"),
    ("no client", lines(STEP_HEADER, req(client=_DROP)), 2, "client", "JSON object"),
    ("read lazy", lines(STEP_HEADER, req(client={"read": "lazy"})), 2, "client.read",
     "got 'lazy'"),
    ("read two keys", lines(STEP_HEADER, req(client={"read": {"every_steps": 1, "every_s": 1}})),
     2, "client.read", "must be"),
    ("every_steps 0", lines(STEP_HEADER, req(client={"read": {"every_steps": 0}})), 2,
     "client.read.every_steps", "integer >= 1"),
    ("every_s 0", lines(VIRTUAL_HEADER, req(at_step=_DROP, at_s=0, client={
        "read": {"every_s": 0}})), 2, "client.read.every_s", "> 0"),
    ("every_s on step", lines(STEP_HEADER, req(client={"read": {"every_s": 0.5}})), 2,
     "client.read", 'needs clock "virtual"'),
    ("frames -1", lines(STEP_HEADER, req(client={"read": "eager", "hangup_after_frames": -1})),
     2, "client.hangup_after_frames", "integer >= 0 or null, got -1"),
    ("hangup step 0", lines(STEP_HEADER, req(client={"read": "eager", "hangup_at_step": 0})),
     2, "client.hangup_at_step", "integer >= 1"),
    ("second header", lines(STEP_HEADER, req(), STEP_HEADER), 3, "nanoserve_trace",
     "second header"),
    ("expect unknown", lines(STEP_HEADER, req(), {"expect": "r9"}), 3, "expect",
     "no request has id 'r9'"),
    ("expect twice", lines(STEP_HEADER, req(), {"expect": "r1"}, {"expect": "r1"}), 4,
     "expect", "first on line 3"),
    ("expect id int", lines(STEP_HEADER, req(), {"expect": 1}), 3, "expect", "request id"),
    ("completion_tokens", lines(STEP_HEADER, req(), {"expect": "r1", "completion_tokens": -1}),
     3, "completion_tokens", "integer >= 0"),
    ("token_ids", lines(STEP_HEADER, req(), {"expect": "r1", "token_ids": ["a"]}), 3,
     "token_ids", "list of integers"),
    ("text", lines(STEP_HEADER, req(), {"expect": "r1", "text": 5}), 3, "text", "string"),
    ("finish_reason", lines(STEP_HEADER, req(), {"expect": "r1", "finish_reason": 1}), 3,
     "finish_reason", "string or null"),
    ("end free_blocks", lines(STEP_HEADER, req(), {"expect": "end", "free_blocks": "x"}), 3,
     "free_blocks", "integer >= 0"),
    ("request after expect", lines(STEP_HEADER, req(), {"expect": "r1"}, req("r2")), 4, None,
     "requests come first"),
]  # fmt: skip


@pytest.mark.parametrize(("trace_lines", "line", "field", "fragment"),
                         [c[1:] for c in REJECTIONS], ids=[c[0] for c in REJECTIONS])
def test_loader_rejects_naming_line_and_field(
    trace_lines: list[str], line: int, field: str | None, fragment: str
) -> None:
    with pytest.raises(TraceError) as info:
        load_trace(trace_lines)
    err = info.value
    assert (err.line, err.field) == (line, field)
    prefix = f"line {line}: " + (f'field "{field}": ' if field else "")
    assert str(err).startswith(prefix)
    assert fragment in str(err)


def test_rejection_message_reads_as_documented() -> None:
    with pytest.raises(TraceError) as info:
        load_trace(lines(STEP_HEADER, req(), req("r2", at_step=-1)))
    assert str(info.value) == 'line 3: field "at_step": must be an integer >= 0, got -1'


def test_blank_lines_are_skipped_but_counted() -> None:
    with pytest.raises(TraceError, match=r'^line 4: field "path"'):
        load_trace([json.dumps(STEP_HEADER), "", "  ", json.dumps(req(path="/x"))])


def test_body_is_not_validated() -> None:
    # A trace may send a bad body on purpose (to replay a 400): only its JSON type is checked.
    body = {"prompt": None, "max_tokens": -5, "vendor_extra": [1]}
    trace = load_trace(lines(STEP_HEADER, req(body=body)))
    assert trace.requests[0].body == body


def full_trace() -> Trace:
    header = TraceHeader("step", "stub", {**ENGINE, "prefix_caching": False,
                                          "model_sha256": None, "future_setting": 1},
                         note="two streams, one hangs up after 2 frames — ünïcode",
                         extra={"recorded_by": "test"})
    r1 = TraceRequest("r1", "/v1/completions",
                      {"model": "stub", "prompt": "Hello", "stream": True, "seed": 7,
                       "max_tokens": 16},
                      ClientSpec(hangup_after_frames=2), at_step=0)
    r2 = TraceRequest("r2", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "日本語"}], "stream": True},
                      ClientSpec(EverySteps(3), hangup_at_step=9, extra={"note": "slow"}),
                      at_step=4, extra={"tag": "b"})
    expectations = (
        Expectation("r1", {"status": 200, "finish_reason": "length", "completion_tokens": 2,
                           "token_ids": [5, 6], "text": "😀", "first_token_step": 1,
                           "last_step": 2, "custom": {"a": 1}}),
        Expectation("end", {"steps": 21, "free_blocks": 128, "peak_used_blocks": 9,
                            "preemptions": 0}),
    )
    return Trace(header, (r1, r2), expectations)


def test_round_trip_records_and_bytes(tmp_path: Path) -> None:
    trace = full_trace()
    text = dumps_trace(trace)
    assert loads_trace(text) == trace
    assert dumps_trace(loads_trace(text)) == text
    out = tmp_path / "t.jsonl"
    write_trace(trace, out)
    assert out.read_bytes() == text.encode()
    assert load_trace(out) == trace
    # Known keys in the format's order, absent optionals left out, unicode kept as is.
    first_request = text.splitlines()[1]
    assert first_request.startswith('{"id": "r1", "at_step": 0, "path": "/v1/completions"')
    assert '"client": {"read": "eager", "hangup_after_frames": 2}}' in first_request
    assert "日本語" in text


def test_round_trip_virtual_clock() -> None:
    header = TraceHeader("virtual", "stub", dict(ENGINE),
                         cost_model={"prefill_s_per_token": 1e-4, "decode_s": 0.01})
    reqs = (TraceRequest("a", "/v1/completions", {"prompt": [1, 2]}, at_s=0),
            TraceRequest("b", "/v1/completions", {"prompt": "x"},
                         ClientSpec(EverySeconds(0.25)), at_s=1.5),
            TraceRequest("c", "/v1/completions", {"prompt": "x"}, at_s=1.5))
    trace = Trace(header, reqs)
    text = dumps_trace(trace)
    assert loads_trace(text) == trace
    assert dumps_trace(loads_trace(text)) == text


def test_hand_written_trace_normalises_once() -> None:
    # The DESIGN.md example spells an absent hang-up as null; the writer leaves it out, and
    # from then on rewrites are byte-identical.
    raw = lines(STEP_HEADER, req(client={"read": "eager", "hangup_after_frames": None}))
    first = dumps_trace(load_trace(raw))
    assert '"hangup_after_frames"' not in first
    assert dumps_trace(loads_trace(first)) == first
