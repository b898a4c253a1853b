"""The fault traces (issue 9, part 5): their format, their hand-checked figures, and teeth.

The committed traces/fault_*.jsonl replay in CI with every other trace (test_replay.py picks
up traces/*.jsonl: expectations, invariants, the twin). Here: the optional fields they add to
format v1 load, refuse bad values by name and write back byte for byte; the figures each
trace's note promises hold; an edited expectation line is one precise mismatch and exit 1;
a fault that never fires changes nothing; and removing the bridge's protection against a
dead loop is caught by the replay.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from nanoserve.bridge.loop import EngineLoop
from sim import commands as cli
from sim.replay.run import replay
from sim.trace.format import Expectation
from sim.trace.loader import TraceError, load_trace, loads_trace
from sim.trace.write import dumps_trace, write_trace

TRACES = Path(__file__).resolve().parents[3] / "traces"
HEADER = {"nanoserve_trace": 1, "clock": "step", "model": "stub",
          "engine": {"block_size": 16, "num_blocks": 128, "max_num_seqs": 8,
                     "max_num_batched_tokens": 256, "seed": 0}}
REQUEST = {"id": "r1", "at_step": 0, "path": "/v1/completions",
           "body": {"model": "stub", "prompt": "x", "max_tokens": 2},
           "client": {"read": "eager"}}


def _lines(header: dict[str, Any] | None = None, client: dict[str, Any] | None = None) -> str:
    req = {**REQUEST, "client": client} if client is not None else REQUEST
    return json.dumps({**HEADER, **(header or {})}) + "\n" + json.dumps(req) + "\n"


def _outcome(name: str) -> dict[str, dict[str, Any]]:
    result = replay(TRACES / f"{name}.jsonl", twin=False)
    assert result.mismatches == ()
    return {e.id: e.fields for e in result.expectations()}


def test_the_fault_fields_load_and_write_back_byte_for_byte() -> None:
    text = _lines({"faults": [{"kind": "step_raises", "at_step": 5},
                              {"kind": "detokenize_raises", "token_id": 588}],
                   "body_timeout": 30.0},
                  {"read": "never", "hangup_at_step": 10})
    trace = loads_trace(text)
    assert trace.header.faults[1] == {"kind": "detokenize_raises", "token_id": 588}
    assert trace.header.body_timeout == 30.0
    assert trace.requests[0].client.read == "never"
    assert dumps_trace(trace) == text
    stall = loads_trace(_lines(client={"read": "eager", "send_body_bytes": 40,
                                       "then": "stall"}))
    c = stall.requests[0].client
    assert (c.send_body_bytes, c.then, c.extra) == (40, "stall", {})
    assert loads_trace(dumps_trace(stall)) == stall


@pytest.mark.parametrize(("header", "client", "field"), [
    ({"faults": {"kind": "step_raises"}}, None, "faults"),
    ({"faults": [{"kind": "explode", "at_step": 1}]}, None, "faults[0].kind"),
    ({"faults": [{"kind": "step_raises", "at_step": 0}]}, None, "faults[0].at_step"),
    ({"faults": [{"kind": "step_raises", "token_id": 3}]}, None, "faults[0]"),
    ({"faults": [{"kind": "encode_raises", "text": ""}]}, None, "faults[0].text"),
    ({"body_timeout": 0}, None, "body_timeout"),
    (None, {"read": "eager", "send_body_bytes": 40}, "client.then"),
    (None, {"read": "eager", "then": "stall"}, "client.send_body_bytes"),
    (None, {"read": "eager", "send_body_bytes": 40, "then": "hang"}, "client.then"),
    (None, {"read": "sometimes"}, "client.read"),
])
def test_a_bad_fault_field_is_refused_by_name(header: dict[str, Any] | None,
                                              client: dict[str, Any] | None, field: str) -> None:
    with pytest.raises(TraceError) as info:
        loads_trace(_lines(header, client))
    assert info.value.field == field


def test_hand_checked_fault_figures() -> None:
    step = _outcome("fault_step_raises")
    # Failed in step 5 after tokens at steps 1-4: the stream's 4 frames plus its error frame.
    assert (step["r1"]["status"], step["r1"]["error"], step["r1"]["frames"]) == (
        200, "engine_error", 5)
    assert (step["r2"]["status"], step["r2"]["last_step"]) == (500, 4)
    assert (step["r3"]["first_token_step"], step["r3"]["last_step"]) == (6, 13)
    assert "error" not in step["r3"]
    assert "error" not in step["r4"]
    assert step["end"]["free_blocks"] == 128

    tok = _outcome("fault_tokenizer")
    assert (tok["r1"]["status"], tok["r1"]["first_token_step"]) == (500, None)
    assert tok["r3"]["token_ids"][-1] == tok["r4"]["token_ids"][-1] == 588
    assert (tok["r3"]["completion_tokens"], tok["r4"]["completion_tokens"]) == (11, 8)
    assert (tok["r2"]["completion_tokens"], tok["r2"]["finish_reason"]) == (16, "length")

    stall = _outcome("fault_stall_body")
    assert (stall["r1"]["status"], stall["r1"]["error"]) == (408, "body_timeout")
    assert stall["r1"]["last_step"] is None
    assert stall["end"]["steps"] == 10  # r2's ten tokens; nothing of r1 ever ran

    never = _outcome("fault_never_reader")
    assert (never["r1"]["first_token_step"], never["r1"]["last_step"]) == (1, 40)
    assert (never["r2"]["hangup_step"], never["r2"]["last_step"], never["r2"]["aborted"]) == (
        10, 10, True)
    assert never["r3"]["completion_tokens"] == 30
    assert never["r3"]["frames"] == 0
    assert never["end"]["free_blocks"] == 128

    dead = _outcome("fault_loop_dies")
    assert dead["end"]["loop_failed"] is True
    assert dead["end"]["steps"] == 4
    assert [dead[r]["status"] for r in ("r1", "r2", "r3", "r4")] == [200, 500, 500, 503]
    assert [dead[r]["error"] for r in ("r1", "r2", "r3", "r4")] == [
        "engine_error", "engine_error", "engine_error", "engine_dead"]


def _edited(tmp_path: Path, name: str, eid: str, **fields: Any) -> Path:
    trace = load_trace(TRACES / f"{name}.jsonl")
    out = []
    for e in trace.expectations:
        if e.id == eid:
            new = {**e.fields, **fields}
            e = Expectation(eid, {k: v for k, v in new.items() if v is not ...})
        out.append(e)
    path = tmp_path / f"{name}.jsonl"
    write_trace(dataclasses.replace(trace, expectations=tuple(out)), path)
    return path


@pytest.mark.parametrize(("name", "eid", "fields", "line"), [
    ("fault_step_raises", "r2", {"status": 200}, "r2 status: expected 200, got 500"),
    ("fault_tokenizer", "r3", {"last_step": 12}, "r3 last_step: expected 12, got 11"),
    ("fault_stall_body", "r1", {"error": ...}, 'r1 error: expected none, got "body_timeout"'),
    ("fault_never_reader", "r2", {"hangup_step": 11}, "r2 hangup_step: expected 11, got 10"),
    ("fault_loop_dies", "end", {"loop_failed": ...}, "end loop_failed: expected none, got true"),
])
def test_one_edited_expectation_is_one_mismatch_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, eid: str,
    fields: dict[str, Any], line: str,
) -> None:
    path = _edited(tmp_path, name, eid, **fields)
    assert cli.main(["replay", "--no-twin", str(path)]) == 1
    assert capsys.readouterr().out == line + "\n"


def test_a_fault_that_never_fires_changes_nothing() -> None:
    trace = load_trace(TRACES / "fault_step_raises.jsonl")
    late = dataclasses.replace(trace, header=dataclasses.replace(
        trace.header, faults=({"kind": "step_raises", "at_step": 10_000},)))
    none = dataclasses.replace(trace, header=dataclasses.replace(trace.header, faults=()))
    a = replay(late, twin=False, check_expectations=False)
    b = replay(none, twin=False, check_expectations=False)
    assert a.mismatches == b.mismatches == ()
    assert a.digest == b.digest
    assert a.outcome.requests[1].status == 200  # r2 ran to its end this time


def test_a_dead_loop_that_fails_nobody_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The protection: when the loop dies, the bridge ends every request in flight with an
    # error. Without it the loop is still marked dead, and the clients wait for ever.
    def mark_only(self: EngineLoop, reason: str) -> None:
        self._dead = reason

    monkeypatch.setattr(EngineLoop, "_fail_all", mark_only)
    lines = replay(TRACES / "fault_loop_dies.jsonl", twin=False).mismatches
    for rid in ("r1", "r2", "r3"):
        assert f"{rid} invariant: the response never completed" in lines
    assert "r4 error" not in " ".join(lines)  # the late arrival is still refused, 503
