"""`sim replay` on the committed traces: clean, twice, with one digest; hand-checked figures;
mismatch lines; the command line; determinism across processes; one trace on SmolLM2.

The replays are synchronous (`replay` runs its own `trio.run` on a MockClock), so these
tests are plain functions. Figures asserted by hand below were worked out from the traces'
notes, not read back from the expectation lines: e.g. the burst of 16 with max_num_seqs 8
runs in two waves of 16 steps.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.model.llama import LlamaModel
from nanoserve.tokenizer import Tokenizer
from sim import commands as cli
from sim.replay.run import ReplayError, replay, twin_trace
from sim.trace.expect import diff_value
from sim.trace.format import Expectation
from sim.trace.loader import load_trace
from sim.trace.write import write_trace

ROOT = Path(__file__).resolve().parents[3]
TRACES = sorted((ROOT / "traces").glob("*.jsonl"))
SHARED = ROOT.parent / "shared" / "traces"


def test_at_least_ten_traces_each_with_a_note() -> None:
    assert len(TRACES) >= 10
    for path in TRACES:
        trace = load_trace(path)
        assert trace.header.note, path.name
        assert trace.expectations, path.name
        assert trace.expectations[-1].id == "end", path.name


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_committed_trace_replays_clean_twice_with_one_digest(path: Path) -> None:
    first = replay(path)  # expectations, invariants and the twin
    assert first.mismatches == ()
    assert first.expectations_checked
    assert first.twin_digest is not None
    again = replay(path, twin=False)
    assert again.mismatches == ()
    assert again.digest == first.digest
    # The expectation lines on disk are exactly what was observed, field for field.
    assert [(e.id, e.fields) for e in load_trace(path).expectations] == [
        (e.id, e.fields) for e in first.expectations()]


def _outcome(name: str) -> dict[str, dict[str, object]]:
    result = replay(ROOT / "traces" / f"{name}.jsonl", twin=False)
    return {e.id: e.fields for e in result.expectations()}


def test_hand_checked_figures() -> None:
    burst = _outcome("burst16")
    assert burst["end"]["steps"] == 32  # two waves of 8, 16 tokens each
    assert [burst[f"r{i}"]["last_step"] for i in range(1, 9)] == [16] * 8
    assert [burst[f"r{i}"]["first_token_step"] for i in range(9, 17)] == [17] * 8
    assert burst["end"]["free_blocks"] == 128

    hang = _outcome("hangups")
    r1, r2 = hang["r1"], hang["r2"]
    # Mid-prefill: aborted at boundary 3, before its prompt was through; no status line.
    assert (r1["hangup_step"], r1["last_step"], r1["completion_tokens"]) == (3, None, 0)
    assert "status" not in r1
    assert r1["aborted"] is True
    # Mid-decode: one token and one frame per step, gone after 4 frames, at boundary 4.
    assert (r2["frames"], r2["hangup_step"], r2["last_step"], r2["completion_tokens"]) == (
        4, 4, 4, 4)
    assert hang["r3"]["first_token_step"] == 4  # r1's prefill held the token budget

    giveup = _outcome("unary_giveup")["r1"]
    assert (giveup["hangup_step"], giveup["last_step"], giveup["aborted"]) == (6, 6, True)

    slow = _outcome("slow_readers")["r2"]  # a frame per 20 steps, gone after 2
    assert (slow["frames"], slow["hangup_step"], slow["last_step"]) == (2, 40, 40)

    pressure = _outcome("preemption")
    assert pressure["end"]["preemptions"] > 0
    assert pressure["end"]["free_blocks"] == pressure["end"]["num_blocks"] == 24
    assert all(pressure[f"r{i}"]["completion_tokens"] == 40 for i in range(1, 5))

    too_long = _outcome("too_long")
    assert (too_long["r1"]["status"], too_long["r3"]["status"]) == (400, 400)
    assert too_long["r2"]["status"] == 200
    assert too_long["end"]["steps"] == 8

    stops = _outcome("stop_strings")
    assert stops["r1"]["text"] == stops["r2"]["text"]  # stream and unary agree
    assert str(stops["r1"]["text"]).endswith(" over the")  # cut before " lazy d"
    assert str(stops["r3"]["text"]).endswith("fox jum")  # kept: include_stop_str_in_output
    assert stops["r4"]["finish_reason"] == "length"


def test_a_mismatch_is_one_line_naming_request_field_and_values() -> None:
    trace = load_trace(ROOT / "traces" / "hangups.jsonl")
    edited = []
    for e in trace.expectations:
        if e.id == "r2":
            ids = list(e.fields["token_ids"])
            ids[2] += 1
            e = Expectation("r2", {**e.fields, "last_step": 9, "token_ids": ids})
        edited.append(e)
    result = replay(dataclasses.replace(trace, expectations=tuple(edited)), twin=False)
    token_line, step_line = result.mismatches  # in the expectation's field order
    assert step_line == "r2 last_step: expected 9, got 4"
    assert token_line.startswith("r2 token_ids: first differ at index 2: expected ")
    assert token_line.endswith("(4 ids expected, 4 got)")


def test_diff_value_finds_the_first_divergence() -> None:
    assert diff_value("token_ids", [1, 2, 3], [1, 2, 3]) is None
    assert diff_value("token_ids", [1, 2, 3], [1, 2]) == (
        "first differ at index 2: expected 3, got the end (3 ids expected, 2 got)")
    assert diff_value("text", "héllo wörld", "héllo world") == (
        'first differ at character 7: expected "örld", got "orld" '
        "(11 characters expected, 11 got)")
    assert diff_value("status", 200, None) == "expected 200, got null"
    assert diff_value("aborted", True, False) == "expected true, got false"


def test_twin_swaps_streams_and_keeps_hangups_at_their_step() -> None:
    path = ROOT / "traces" / "hangups.jsonl"
    trace = load_trace(path)
    twin = twin_trace(trace, replay(trace, twin=False).outcome)
    by_id = {r.id: r for r in twin.requests}
    assert "stream" not in by_id["r2"].body  # was a stream
    assert by_id["r2"].client.hangup_at_step == 4
    assert by_id["r2"].client.hangup_after_frames is None
    assert by_id["r1"].client.hangup_at_step == 3
    assert by_id["r3"].client.hangup_at_step is None


def test_cli_prints_mismatch_lines_and_exits_1(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    trace = load_trace(ROOT / "traces" / "unary_giveup.jsonl")
    edited = tuple(Expectation("end", {**e.fields, "steps": 99}) if e.id == "end" else e
                   for e in trace.expectations)
    bad = tmp_path / "bad.jsonl"
    write_trace(dataclasses.replace(trace, expectations=edited), bad)
    assert cli.main(["replay", "--no-twin", str(bad)]) == 1
    assert capsys.readouterr().out == "end steps: expected 99, got 14\n"


def test_cli_update_writes_the_committed_expectations(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    committed = ROOT / "traces" / "too_long.jsonl"
    bare = tmp_path / "too_long.jsonl"
    write_trace(dataclasses.replace(load_trace(committed), expectations=()), bare)
    assert cli.main(["replay", "--update", str(bare)]) == 0
    assert bare.read_bytes() == committed.read_bytes()
    out = tmp_path / "result.jsonl"
    assert cli.main(["replay", "--no-twin", "--out", str(out), str(committed)]) == 0
    assert out.read_text(encoding="utf-8").splitlines() == (
        committed.read_text(encoding="utf-8").splitlines()[4:])
    assert "ok: 3 requests, 8 steps, 8 tokens, 0 aborted, 0 preempted" in capsys.readouterr().out


def test_a_header_setting_replay_cannot_honour_is_refused(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    trace = load_trace(ROOT / "traces" / "too_long.jsonl")
    header = dataclasses.replace(trace.header, engine={**trace.header.engine, "speculate": 4})
    with pytest.raises(ReplayError, match='field "engine.speculate"'):
        replay(dataclasses.replace(trace, header=header))
    path = tmp_path / "x.jsonl"
    write_trace(dataclasses.replace(trace, header=header), path)
    assert cli.main(["replay", str(path)]) == 2
    assert "engine.speculate" in capsys.readouterr().err


def test_the_digest_is_the_same_in_another_process() -> None:
    path = ROOT / "traces" / "slow_readers.jsonl"
    here = replay(path, twin=False).digest
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-m", "sim.commands", "replay", "--no-twin", str(path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    assert out.strip().endswith(f"digest {here[:16]}")


@pytest.mark.skipif(not (SHARED / "AzureLLMInferenceTrace_conv.csv").exists(),
                    reason="../shared/traces is not here")
def test_a_converted_virtual_clock_trace_replays_clean(tmp_path: Path) -> None:
    from nanoserve.model import load
    from sim.load.azure import convert_azure, read_azure_csv

    _, tok = load("stub")
    rows = read_azure_csv(SHARED / "AzureLLMInferenceTrace_conv.csv")
    trace = convert_azure(rows, tok, source="conv", limit=12, model="stub", stream=True,
                          engine={"num_blocks": 1024, "max_num_seqs": 8})
    result = replay(trace, cost={"constant_s": 0.05})
    assert result.mismatches == ()
    assert result.outcome.end.free_blocks == 1024
    assert sum(r.completion_tokens for r in result.outcome.requests) > 0


@pytest.mark.real
def test_a_trace_replays_on_smollm2(smollm2_model: LlamaModel,
                                    smollm2_tokenizer: Tokenizer) -> None:
    # The header's model is the stub: on other weights only the invariants and the twin (a
    # stream made unary, two unary requests made streams, the give-up kept at step 6).
    result = replay(ROOT / "traces" / "unary_giveup.jsonl", model=smollm2_model,
                    tokenizer=smollm2_tokenizer, check_expectations=False)
    assert result.mismatches == ()
    r1, r2, r3 = result.outcome.requests
    assert (r1.hangup_step, r1.last_step, r1.aborted, r1.status) == (6, 6, True, None)
    assert (r2.completion_tokens, r2.last_step) == (10, 10)  # ignore_eos: a token a step
    assert (r3.completion_tokens, r3.first_token_step, r3.last_step) == (12, 3, 14)
    assert result.outcome.end.free_blocks == 128


def test_the_outcome_does_not_depend_on_trios_task_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # Trio reverses each batch of ready tasks when its (private, unseeded) generator says so:
    # always, never, and three seeded coin flips are five task orders. The burst's 16
    # arrivals share one boundary: admitted in any order but the trace's, another 8 would
    # run first, and the digest would change.
    import random

    import trio._core._run as trio_run

    rng = getattr(trio_run, "_r", None)
    if rng is None:
        pytest.skip("trio's scheduler random is not where it used to be")
    flips = [lambda: 0.0, lambda: 0.99, *(random.Random(s).random for s in range(3))]
    digests = set()
    for flip in flips:
        monkeypatch.setattr(rng, "random", flip)
        digests.add(replay(ROOT / "traces" / "burst16.jsonl", twin=False).digest)
    assert len(digests) == 1


def test_an_engine_loop_that_dies_is_reported_not_waited_for() -> None:
    # A cost model that breaks at step 3 kills the bridge's loop mid-trace.
    result = replay(ROOT / "traces" / "virtual.jsonl", twin=False,
                    cost=lambda r: -1.0 if r.step == 3 else 0.05)
    assert "end invariant: the engine loop stopped at step 3 with work left (healthy: False)" in (
        result.mismatches)
    assert "end steps: expected 26, got 3" in result.mismatches


def test_cost_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sim.replay.setup import DEFAULT_STEP_S, cost_function

    assert cost_function(None)(None) == DEFAULT_STEP_S  # type: ignore[arg-type]
    assert cost_function(0.25)(None) == 0.25  # type: ignore[arg-type]
    with pytest.raises(ReplayError, match="seconds >= 0"):
        cost_function({"constant_s": -1})
    with pytest.raises(ReplayError, match="fitted model"):
        cost_function({"a": 1})
    # --cost FILE: the header's own 0.05 s from a file replays the virtual trace clean.
    path = tmp_path / "cost.json"
    path.write_text('{"constant_s": 0.05}')
    trace = str(ROOT / "traces" / "virtual.jsonl")
    assert cli.main(["replay", "--no-twin", "--cost", str(path), trace]) == 0
    # Twice as slow a step: the arrivals in seconds land on earlier steps.
    path.write_text('{"constant_s": 0.1}')
    assert cli.main(["replay", "--no-twin", "--cost", str(path), trace]) == 1
    assert "r2 first_token_step: expected 4, got 3" in capsys.readouterr().out.splitlines()


@pytest.mark.real
def test_other_weights_under_the_headers_name_check_invariants_only(
    monkeypatch: pytest.MonkeyPatch, smollm2_model: LlamaModel, smollm2_tokenizer: Tokenizer
) -> None:
    from sim.replay import setup as replay_setup
    from sim.replay.setup import _weights_sha256, resolve_weights

    # The session's model, not a second load of it; the digest comes from its folder.
    monkeypatch.setattr(replay_setup, "_load",
                        lambda name, tp=1: (smollm2_model, smollm2_tokenizer))
    header = load_trace(ROOT / "traces" / "too_long.jsonl").header
    sha = _weights_sha256("smollm2")
    assert sha is not None
    same = dataclasses.replace(header, model="smollm2",
                               engine={**header.engine, "model_sha256": sha})
    assert resolve_weights(same, None, None).is_headers
    other = dataclasses.replace(same, engine={**same.engine, "model_sha256": "0" * 64})
    weights = resolve_weights(other, None, None)
    assert not weights.is_headers
    assert weights.warning is not None
    assert "model_sha256 000000000000" in weights.warning
