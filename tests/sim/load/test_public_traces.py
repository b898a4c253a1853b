"""The field's public trace formats (sim/load/public.py): each committed sample parsed, bad
rows named by line and field, windows and time scale exact, and prompts prefix-faithful:
two requests that share hash ids hit the prefix cache for exactly those blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.stub import StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import simulate
from sim.load.azure import ConvertError
from sim.load.public import (
    PublicTrace,
    TraceRow,
    detect_format,
    implied_hit_rate,
    read_public_trace,
    text_trace,
    window,
)
from sim.load.workload import file_workload, public_workload

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "traces" / "public"
SHARED_AZURE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,20,5
"""
COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic-test",
                 model="stub", machine={"cpu": "test"}, kv_bytes_per_token=46080)


def test_the_mooncake_sample_reads_as_published() -> None:
    t = read_public_trace(SAMPLES / "mooncake_conversation.jsonl")
    assert (t.format, t.block_tokens, len(t.rows), t.dropped) == ("mooncake", 512, 300, {})
    first, last = t.rows[0], t.rows[-1]
    assert (first.line, first.at_s, first.input_tokens, first.output_tokens) == (1, 0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert last.at_s == 102.0  # timestamps are milliseconds: 102000 ms
    # Hand-computed from the file: 8.10% of prompt tokens lie in blocks an earlier request
    # led with (every request shares block 0, the system prompt).
    assert implied_hit_rate(t.rows, 512) == pytest.approx(0.081023, abs=1e-6)


def test_the_burstgpt_format_drops_failed_calls_and_counts_them() -> None:
    t = read_public_trace(SAMPLES / "burstgpt_format.csv")
    assert (t.format, t.block_tokens, len(t.rows)) == ("burstgpt", None, 189)
    assert t.dropped == {"response tokens 0 (a failed call)": 8, "request tokens 0": 3}
    assert t.rows[0].line == 2
    assert t.rows[0].at_s == 0.0
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in t.rows)


def test_burstgpt_columns_are_found_by_name(tmp_path: Path) -> None:
    # BurstGPT_3 inserts Session ID and Elapsed time after Timestamp: a positional reader
    # would take the session for the model and the elapsed time for the request length.
    p = tmp_path / "b3.csv"
    p.write_text("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,"
                 "Total tokens,Log Type\n10,abc,3.5,ChatGPT,100,20,120,Conversation log\n"
                 "12.5,,1.0,GPT-4,7,9,16,API log\n")
    rows = read_public_trace(p).rows
    assert [(r.at_s, r.input_tokens, r.output_tokens) for r in rows] == [(0, 100, 20),
                                                                         (2.5, 7, 9)]


def test_the_alibaba_format_has_16_token_blocks() -> None:
    t = read_public_trace(SAMPLES / "alibaba_format.jsonl")
    assert (t.format, t.block_tokens, len(t.rows)) == ("alibaba", 16, 200)
    assert all(len(r.hash_ids or ()) * 16 >= r.input_tokens for r in t.rows)
    assert 0.4 < implied_hit_rate(t.rows, 16) < 0.5  # later turns resend their parents


def test_azure_csvs_read_through_the_same_rows(tmp_path: Path) -> None:
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    t = read_public_trace(p)
    assert t.format == "azure"
    assert t.block_tokens is None
    assert [(r.at_s, r.input_tokens, r.output_tokens) for r in t.rows] == [
        (0.0, 374, 44), (pytest.approx(4.314579), 396, 109), (pytest.approx(4.31941), 20, 5)]
    if SHARED_AZURE.exists():  # the published 2023 file, where this checkout has it
        assert len(read_public_trace(SHARED_AZURE).rows) == 19366


@pytest.mark.parametrize(("name", "fmt"), [("mooncake_conversation.jsonl", "mooncake"),
                                           ("alibaba_format.jsonl", "alibaba"),
                                           ("burstgpt_format.csv", "burstgpt")])
def test_formats_are_detected_from_the_first_line(name: str, fmt: str) -> None:
    assert detect_format(SAMPLES / name) == fmt


def test_a_nanoserve_trace_is_detected_too() -> None:
    assert detect_format(ROOT / "traces" / "virtual.jsonl") == "nanoserve"


@pytest.mark.parametrize(("text", "message"), [
    ('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}\n',
     'line 1: field "hash_ids": 1 blocks of 512 tokens cannot hold input_length 600'),
    ('{"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [1]}\n'
     '{"timestamp": -5, "input_length": 6, "output_length": 3, "hash_ids": [1]}\n',
     'line 2: field "timestamp": must be >= 0'),
    ('{"timestamp": 0, "input_length": "x", "output_length": 3, "hash_ids": [1]}\n',
     'line 1: field "input_length": must be an integer >= 0'),
    ('{"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [1, "a"]}\n',
     'line 1: field "hash_ids": must be a list of integers'),
    ("Timestamp,Request tokens\n1,2\n", "not a known trace header"),
])
def test_bad_rows_name_their_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / ("t.jsonl" if text.startswith("{") else "t.csv")
    p.write_text(text)
    with pytest.raises(ConvertError, match=message):
        read_public_trace(p)


def test_window_and_speedup_cut_and_scale_time() -> None:
    rows = tuple(TraceRow(i + 1, float(t), 10, 5) for i, t in enumerate([0, 1, 2, 5, 9]))
    t = PublicTrace("burstgpt", rows, "x", None)
    w = window(t, start_s=1, duration_s=4.5, speedup=2)
    assert [(r.line, r.at_s) for r in w.rows] == [(2, 0.0), (3, 0.5), (4, 2.0)]
    with pytest.raises(ConvertError, match="no rows"):
        window(t, start_s=10)
    with pytest.raises(ConvertError, match="--speedup must be > 0"):
        window(t, speedup=0)


def test_implied_hit_rate_counts_leading_runs_only() -> None:
    rows = [TraceRow(1, 0, 48, 1, (7, 8, 9)),
            TraceRow(2, 1, 48, 1, (7, 8, 10)),  # 7, 8 seen: 32 tokens
            TraceRow(3, 2, 48, 1, (11, 8, 9)),  # 8, 9 seen, but not behind 11: 0
            TraceRow(4, 3, 32, 1, (7, 8))]  # all seen: never the last token, so 31
    assert implied_hit_rate(rows, 16) == (32 + 31) / (48 * 3 + 32)


def _cached_tokens(trace: PublicTrace, tok: Tokenizer, prefixes: bool = True) -> list[int]:
    w = public_workload(trace, tok.vocab_size, prefixes=prefixes)
    model = StubModel(tok)
    config = EngineConfig(num_blocks=256, max_num_seqs=1, max_num_batched_tokens=512)
    result = simulate(w.requests, lambda: Engine(model, tok, config), COST)
    return [r.cached_tokens for r in result.records]


def test_shared_hash_ids_hit_the_prefix_cache_for_exactly_those_blocks(tok: Tokenizer) -> None:
    # Alibaba's blocks are the engine's size (16): a shared id is one cached KV block.
    rows = (TraceRow(1, 0, 48, 2, (7, 8, 9)),
            TraceRow(2, 1, 40, 2, (7, 8, 10)),  # shares 7, 8: 32 tokens
            TraceRow(3, 2, 48, 2, (7, 12, 13)),  # shares 7: 16 tokens
            TraceRow(4, 3, 48, 2, (14, 8, 9)))  # 8, 9 after another block: no hit
    t = PublicTrace("alibaba", rows, "x", 16)
    assert _cached_tokens(t, tok) == [0, 32, 16, 0]
    assert _cached_tokens(t, tok, prefixes=False) == [0, 0, 0, 0]
    # Mooncake's blocks are 512 tokens, 32 of the engine's: one shared id, 512 tokens.
    big = PublicTrace("mooncake", (TraceRow(1, 0, 1000, 2, (0, 1)),
                                   TraceRow(2, 1, 900, 2, (0, 2))), "x", 512)
    assert _cached_tokens(big, tok) == [0, 512]


def test_prompts_are_exact_length_and_deterministic(tok: Tokenizer) -> None:
    t = window(read_public_trace(SAMPLES / "mooncake_conversation.jsonl"), duration_s=4)
    a, b = (public_workload(t, tok.vocab_size, seed=3) for _ in range(2))
    assert a == b
    assert [len(r.prompt_ids) for r in a.requests] == [r.input_tokens for r in t.rows]
    assert public_workload(t, tok.vocab_size, seed=4) != a
    # The same hash id is the same tokens in every request that names it (block 0).
    assert len({r.prompt_ids[:512] for r in a.requests}) == 1


def test_text_prompts_share_the_same_blocks(tok: Tokenizer) -> None:
    rows = (TraceRow(1, 0, 40, 2, (7, 8, 9)), TraceRow(2, 1, 35, 2, (7, 8, 10)))
    trace = text_trace(PublicTrace("alibaba", rows, "x", 16), tok)
    ids = [tok.encode(r.body["prompt"]) for r in trace.requests]
    assert [len(x) for x in ids] == [40, 35]
    assert ids[0][:32] == ids[1][:32]
    assert ids[0][32] != ids[1][32]


def test_file_workload_takes_a_nanoserve_trace_unwindowed(tok: Tokenizer) -> None:
    w = file_workload(ROOT / "traces" / "virtual.jsonl", tok)
    assert w.trace is None
    assert w.requests
    with pytest.raises(ValueError, match="apply to public traces"):
        file_workload(ROOT / "traces" / "virtual.jsonl", tok, speedup=2)


def test_the_workload_carries_the_trace_description(tok: Tokenizer) -> None:
    w = file_workload(SAMPLES / "alibaba_format.jsonl", tok, duration_s=30, speedup=2)
    assert w.trace is not None
    assert json.loads(json.dumps(w.trace))["format"] == "alibaba"
    assert w.trace["prefix_structure"] is True
    assert max(r.at_s for r in w.requests) < 15  # 30 s of trace at twice the speed
