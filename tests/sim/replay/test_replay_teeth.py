"""Teeth: each fault patched into the real code makes a committed trace fail its replay, with
a mismatch line that names the request (or `end`) and the field the fault broke.

Each case replays only the traces it needs, without the twin (one run each), so the file
stays cheap. Without the patch the same replays are clean (test_replay.py), so every line
asserted here is the fault's doing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.ledger import Ledger
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.request import Request, Update
from nanoserve.engine.scheduler import Scheduler
from nanoserve.server.render import Choice, Json, Shapes
from sim.replay.run import replay

TRACES = Path(__file__).resolve().parents[3] / "traces"


def mismatches(*names: str) -> list[str]:
    out: list[str] = []
    for name in names:
        out += replay(TRACES / f"{name}.jsonl", twin=False).mismatches
    return out


def test_skipping_the_abort_on_hangup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AsyncEngine, "abort_nowait", lambda self, request_id: None)
    lines = mismatches("hangups", "unary_giveup")
    # The mid-decode stream (gone after 4 frames at step 4) ran on to its 32nd token.
    assert "r2 last_step: expected 4, got 32" in lines
    assert "r2 invariant: hung up at step 4 but produced a token at step 32" in lines
    assert "r2 finish_reason: expected \"abort\", got \"length\"" in lines
    # The unary client that gave up at step 6 and the hang-up mid-prefill likewise.
    assert any(line.startswith("r1 last_step: expected 6, got ") for line in lines)
    assert any(line.startswith("r1 last_step: expected null, got ") for line in lines)


def test_leaking_one_block_on_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    real_remove = Scheduler.remove
    leaked: list[int] = []

    def leaky_remove(self: Scheduler, req: Request) -> None:
        if not leaked and req.blocks:
            leaked.append(req.blocks.pop())  # this one is never released
        real_remove(self, req)

    monkeypatch.setattr(Scheduler, "remove", leaky_remove)
    lines = mismatches("unary_giveup")
    assert leaked
    assert "end free_blocks: expected 128, got 127" in lines
    assert "end invariant: free_blocks 127 at the end, the pool has 128 (blocks leaked)" in lines


def test_dropping_a_held_back_character(monkeypatch: pytest.MonkeyPatch) -> None:
    real_finish = IncrementalDetokenizer.finish

    def lossy_finish(self: IncrementalDetokenizer) -> str:
        return real_finish(self)[1:]  # what was held back until the end loses a character

    monkeypatch.setattr(IncrementalDetokenizer, "finish", lossy_finish)
    lines = mismatches("unicode")
    text_lines = [line for line in lines if " text: first differ at character " in line]
    assert text_lines, lines
    # Only the text is wrong: the same tokens were produced at the same steps.
    assert all(" text: " in line for line in lines), lines


def test_delivering_a_token_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    real_route = Ledger.route

    def route_twice(self: Ledger, update: Update) -> None:
        real_route(self, update)
        if update.new_token_ids and not update.finished:
            real_route(self, update)

    monkeypatch.setattr(Ledger, "route", route_twice)
    lines = mismatches("burst16")
    # r1 streams (odd ids), r2 is unary: both show the doubled text.
    assert any(line.startswith("r1 text: first differ at character ") for line in lines)
    assert any(line.startswith("r2 text: first differ at character ") for line in lines)
    # Usage is the engine's own count (server/jobs.py), not the deliveries': it stays 16.
    assert not any("usage says" in line for line in lines), lines


def test_the_twin_alone_catches_a_unary_answer_that_differs_from_its_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On weights with no expectation lines (check_expectations=False) the twin is what is
    # left: a unary body that loses its last character no longer equals the joined stream.
    real_response = Shapes.response

    def clipped(self: Shapes, choices: list[Choice], usage: dict[str, object]) -> Json:
        out = real_response(self, choices, usage)
        for ch in out["choices"]:
            if "text" in ch:
                ch["text"] = ch["text"][:-1]
        return out

    monkeypatch.setattr(Shapes, "response", clipped)
    result = replay(TRACES / "stop_strings.jsonl", check_expectations=False)
    # r1 streams (its twin is unary), r2 is unary: each side of the pair is caught.
    assert any(m.startswith("r1 twin text: first differ at character ") for m in result.mismatches)
    assert any(m.startswith("r2 twin text: first differ at character ") for m in result.mismatches)


def test_losing_a_final_update(monkeypatch: pytest.MonkeyPatch) -> None:
    # The bridge swallows the first final update: the reader waits until the bridge's safety
    # net ends it with an error once the engine is empty, and its last text never arrives.
    real_route = Ledger.route
    lost: list[str] = []

    def lossy_route(self: Ledger, update: Update) -> None:
        if update.finished and not lost:
            lost.append(update.request_id)
            return
        real_route(self, update)

    monkeypatch.setattr(Ledger, "route", lossy_route)
    lines = mismatches("burst16")
    assert lost == ["cmpl-0"]  # r1: trace position 0
    assert 'r1 error: expected none, got "engine_error"' in lines
    assert any(line.startswith("r1 text: first differ at character ") for line in lines)
