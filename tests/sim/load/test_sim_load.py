"""sim convert and sim load: Azure CSV parsing, exact prompt lengths, seeded and rate-scalable
arrivals, byte-identical generation, and the CLI."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from pathlib import Path

import pytest

from nanoserve.tokenizer import Tokenizer
from sim.commands import main
from sim.load.azure import (
    ConvertError,
    convert_azure,
    parse_azure_timestamp,
    read_azure_csv,
)
from sim.load.synthetic import (
    LoadSpec,
    SpecError,
    arrival_times,
    format_load_spec,
    generate_load,
    parse_load_spec,
    ramp_arrivals,
    scale_arrivals,
    unit_arrivals,
)
from sim.trace.loader import load_trace, loads_trace
from sim.trace.write import dumps_trace

SHARED_TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"
CSV = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,3,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:53.0000000,1,1
"""


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_folder)


@pytest.fixture
def csv_path(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text(CSV)
    return path


# ------------------------------------------------------------------------------- Azure CSV


def test_azure_timestamps_are_exact_to_the_100ns() -> None:
    a = parse_azure_timestamp("2023-11-16 23:59:59.9999999")
    b = parse_azure_timestamp("2023-11-17 00:00:00.0000001")
    assert b - a == 200  # nanoseconds, across midnight, with no float rounding
    assert parse_azure_timestamp("2023-11-16 18:15:46") == parse_azure_timestamp(
        "2023-11-16 18:15:46.0000000")


def test_read_azure_csv_any_column_order_sorted_by_time() -> None:
    rows = read_azure_csv(["GeneratedTokens,Extra,TIMESTAMP,ContextTokens\n",
                           "7,x,2023-11-16 18:00:01.5,10\n", "8,y,2023-11-16 18:00:00,20\n"])
    assert [(r.line, r.context_tokens, r.generated_tokens) for r in rows] == [(3, 20, 8),
                                                                             (2, 10, 7)]
    assert rows[1].t_ns - rows[0].t_ns == 1_500_000_000


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty"),
    ("TIMESTAMP,ContextTokens\n", "missing column(s) GeneratedTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,1\nyesterday,5,1\n",
     'line 3: column "TIMESTAMP"'),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,0,1\n",
     'line 2: column "ContextTokens": must be an integer >= 1'),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,x\n",
     'line 2: column "GeneratedTokens"'),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5\n", "line 2: 2 cells"),
])  # fmt: skip
def test_read_azure_csv_rejects(text: str, message: str) -> None:
    with pytest.raises(ConvertError, match="^<csv>") as info:
        read_azure_csv(text.splitlines(keepends=True))
    assert message in str(info.value)


# -------------------------------------------------------------------------------- convert


def test_convert_prompts_have_exact_token_counts(csv_path: Path, tokenizer: Tokenizer) -> None:
    rows = read_azure_csv(csv_path)
    trace = convert_azure(rows, tokenizer, source=csv_path.name)
    assert trace.header.clock == "virtual"
    assert [r.at_s for r in trace.requests] == [0.0, 4.314579, 4.541877, 4.710427, 6.31941]
    for row, r in zip(rows, trace.requests, strict=True):
        assert len(tokenizer.encode(r.body["prompt"])) == row.context_tokens
        assert r.body["max_tokens"] == row.generated_tokens
        assert (r.body["temperature"], r.body["ignore_eos"], r.body["stream"]) == (0, True,
                                                                                  False)
        assert r.path == "/v1/completions"
    note = trace.header.note or ""
    assert "Azure/AzurePublicDataset" in note
    assert "CC-BY 4.0" in note
    assert "Splitwise" in note
    assert loads_trace(dumps_trace(trace)) == trace


def test_convert_window_keeps_each_rows_text(csv_path: Path, tokenizer: Tokenizer) -> None:
    rows = read_azure_csv(csv_path)
    whole = convert_azure(rows, tokenizer)
    window = convert_azure(rows, tokenizer, start_offset_s=4.4, limit=2, stream=True)
    assert [r.id for r in window.requests] == ["r1", "r2"]
    assert [r.at_s for r in window.requests] == [0.0, pytest.approx(0.16855)]
    assert [r.body["prompt"] for r in window.requests] == [
        r.body["prompt"] for r in whole.requests[2:4]]
    assert window.requests[0].body["stream"] is True
    other_seed = convert_azure(rows, tokenizer, seed=1)
    assert other_seed.requests[0].body["prompt"] != whole.requests[0].body["prompt"]
    with pytest.raises(ConvertError, match="no rows"):
        convert_azure(rows, tokenizer, start_offset_s=60)


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="../shared/traces is not here")
def test_convert_published_azure_file(tokenizer: Tokenizer) -> None:
    rows = read_azure_csv(SHARED_TRACES / "AzureLLMInferenceTrace_code.csv")
    assert len(rows) == 8819
    trace = convert_azure(rows, tokenizer, limit=8)
    for row, r in zip(rows, trace.requests, strict=False):
        assert len(tokenizer.encode(r.body["prompt"])) == row.context_tokens


# ------------------------------------------------------------------------------- arrivals


def test_unit_arrivals_are_seeded_prefix_stable_sequences() -> None:
    a = unit_arrivals("poisson", 200, seed=3)
    assert a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert a == unit_arrivals("poisson", 200, seed=3)
    assert a != unit_arrivals("poisson", 200, seed=4)
    assert unit_arrivals("poisson", 300, seed=3)[:200] == a
    assert unit_arrivals("constant", 4, seed=0) == [0.0, 1.0, 2.0, 3.0]


def test_higher_rate_is_the_same_sequence_compressed() -> None:
    base = dict(n=100, arrival="gamma", burstiness=0.5, seed=7)
    at1 = arrival_times(LoadSpec(rate=1.0, **base))  # type: ignore[arg-type]
    at2 = arrival_times(LoadSpec(rate=2.0, **base))  # type: ignore[arg-type]
    assert at2 == [t / 2 for t in at1]
    unit = unit_arrivals("poisson", 50, seed=1)
    assert scale_arrivals(unit, 4.0) == [u / 4 for u in unit]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_keeps_the_mean_and_sets_the_variance(burstiness: float) -> None:
    times = unit_arrivals("gamma", 20_001, seed=0, burstiness=burstiness)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Gamma(shape b, scale 1/b): mean 1, variance 1/b. Loose bounds, fixed seed.
    assert statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    assert statistics.variance(gaps) == pytest.approx(1 / burstiness, rel=0.15)


def test_ramp_warps_time_through_the_cumulative_rate() -> None:
    unit = unit_arrivals("constant", 101, seed=0)  # u = 0..100
    r0, r1 = 1.0, 4.0
    times = ramp_arrivals(unit, r0, r1)
    duration = 2 * 100 / (r0 + r1)  # the default: the ramp holds all 101 arrivals
    for u, t in zip(unit, times, strict=True):
        # Λ(t) = r0 t + (r1 - r0) t² / (2 D) recovers the unit time.
        assert r0 * t + (r1 - r0) * t * t / (2 * duration) == pytest.approx(u, abs=1e-9)
    assert times[-1] == pytest.approx(duration)
    first_half = sum(t < duration / 2 for t in times)
    assert first_half < 101 - first_half  # the rate rises, so the second half is busier
    assert ramp_arrivals(unit, 2.0, 2.0) == pytest.approx(scale_arrivals(unit, 2.0))
    # Past the ramp the rate holds at r1.
    held = ramp_arrivals(unit, r0, r1, duration=10.0)
    assert held[-1] - held[-2] == pytest.approx(1 / r1)
    # Doubling both rates (default duration) compresses the ramp in time.
    assert ramp_arrivals(unit, 2 * r0, 2 * r1) == pytest.approx([t / 2 for t in times])


# ----------------------------------------------------------------------------------- specs


def test_parse_load_spec_and_format_round_trip() -> None:
    spec = parse_load_spec("n=200,arrival=poisson,rate=4,prompt=uniform:32:512,"
                           "output=normal:128.5:40,shared_prefix=0.5:200,api=chat,stream=true,"
                           "hangup=0.1,seed=3")
    assert (spec.n, spec.rate, spec.shared_prefix, spec.prefix_tokens) == (200, 4.0, 0.5, 200)
    assert str(spec.prompt) == "uniform:32:512"
    assert str(spec.output) == "normal:128.5:40"
    assert (spec.api, spec.stream, spec.hangup, spec.seed) == ("chat", True, 0.1, 3)
    assert parse_load_spec(format_load_spec(spec)) == spec
    ramp = parse_load_spec("arrival=ramp,rate=1,rate_end=8,duration=60,prompt=fixed:8")
    assert parse_load_spec(format_load_spec(ramp)) == ramp
    assert dataclasses.replace(ramp, rate=2.0).rate == 2.0  # what a capacity sweep does


@pytest.mark.parametrize(("text", "key"), [
    ("n=5,colour=red", "colour"),
    ("rate=fast", "rate"),
    ("rate=inf", "rate"),
    ("rate=0", "rate"),
    ("n=0", "n"),
    ("n=1,n=2", "n"),
    ("arrival=weibull", "arrival"),
    ("arrival=trace", "arrival"),
    ("arrival=poisson:x", "arrival"),
    ("arrival=ramp,rate=1", "rate_end"),
    ("rate=1,duration=5", "duration"),
    ("arrival=poisson,burstiness=2", "burstiness"),
    ("prompt=uniform:5:3", "prompt"),
    ("prompt=uniform:5", "prompt"),
    ("output=fixed:2.5", "output"),
    ("output=lognormal:0:1", "output"),
    ("prompt=zipf:1", "prompt"),
    ("shared_prefix=0.5", "shared_prefix"),
    ("shared_prefix=1.5:10", "shared_prefix"),
    ("hangup=0.1", "hangup"),
    ("api=embeddings", "api"),
    ("stream=maybe", "stream"),
    ("oops", "oops"),
])  # fmt: skip
def test_parse_load_spec_rejects_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(SpecError, match=f"^load spec: {key}: ") as info:
        parse_load_spec(text)
    assert info.value.key == key


# ---------------------------------------------------------------------------- generation

SPEC = ("n=40,arrival=gamma,burstiness=0.5,rate=4,prompt=uniform:1:40,output=uniform:1:30,"
        "shared_prefix=0.25:20,stream=true,hangup=0.2,seed=0")


def test_generate_is_byte_identical_and_seeded(tokenizer: Tokenizer) -> None:
    spec = parse_load_spec(SPEC)
    text = dumps_trace(generate_load(spec, tokenizer))
    assert dumps_trace(generate_load(parse_load_spec(SPEC), tokenizer)) == text
    other = dumps_trace(generate_load(dataclasses.replace(spec, seed=1), tokenizer))
    assert other != text
    assert loads_trace(text) == generate_load(spec, tokenizer)  # a valid trace


def test_generate_lengths_prefix_and_hangups(tokenizer: Tokenizer) -> None:
    spec = parse_load_spec(SPEC)
    trace = generate_load(spec, tokenizer)
    prompts = [tokenizer.encode(r.body["prompt"]) for r in trace.requests]
    # Random words never agree on 20 tokens by chance: the common 20-token start is the prefix.
    prefix, n_shared = Counter(tuple(ids[:20]) for ids in prompts).most_common(1)[0]
    assert len(prefix) == 20
    assert n_shared == 10
    for r, ids in zip(trace.requests, prompts, strict=True):
        own = len(ids) - 20 if tuple(ids[:20]) == prefix else len(ids)
        assert 1 <= own <= 40
        assert 1 <= r.body["max_tokens"] <= 30
        assert r.body["stream"] is True
        frames = r.client.hangup_after_frames
        assert frames is None or 0 <= frames < r.body["max_tokens"]
    assert sum(r.client.hangup_after_frames is not None for r in trace.requests) == 8
    # The header records the spec, and the same spec at twice the rate only moves time.
    assert trace.header.note == f"sim load {format_load_spec(spec)}"
    fast = generate_load(dataclasses.replace(spec, rate=8.0), tokenizer)
    assert [r.body for r in fast.requests] == [r.body for r in trace.requests]
    for slow_r, fast_r in zip(trace.requests, fast.requests, strict=True):
        assert fast_r.at_s == pytest.approx((slow_r.at_s or 0) / 2, abs=1e-6)


def test_generate_chat_counts_message_contents(tokenizer: Tokenizer) -> None:
    spec = parse_load_spec("n=12,rate=1,prompt=fixed:9,output=fixed:3,shared_prefix=0.5:17,"
                           "api=chat,seed=5")
    trace = generate_load(spec, tokenizer)
    systems = set()
    for r in trace.requests:
        assert r.path == "/v1/chat/completions"
        assert r.body["stream"] is False
        *system, user = r.body["messages"]
        assert user["role"] == "user"
        assert len(tokenizer.encode(user["content"])) == 9
        for m in system:
            assert m["role"] == "system"
            assert len(tokenizer.encode(m["content"])) == 17
            systems.add(m["content"])
    assert len(systems) == 1
    assert sum(len(r.body["messages"]) == 2 for r in trace.requests) == 6


def test_generate_names_what_the_spec_lacks(tokenizer: Tokenizer) -> None:
    for text, key in [("rate=1,prompt=fixed:1,output=fixed:1", "n"),
                      ("n=3,prompt=fixed:1,output=fixed:1", "rate"),
                      ("n=3,rate=1,output=fixed:1", "prompt"),
                      ("n=3,rate=1,prompt=fixed:1", "output")]:
        with pytest.raises(SpecError, match=f"^load spec: {key}: is required"):
            generate_load(parse_load_spec(text), tokenizer)


def test_length_distributions(tokenizer: Tokenizer, csv_path: Path) -> None:
    def lengths(prompt: str) -> list[int]:
        spec = parse_load_spec(f"n=60,arrival=constant,rate=1,prompt={prompt},output=fixed:1")
        return [len(tokenizer.encode(r.body["prompt"]))
                for r in generate_load(spec, tokenizer).requests]

    assert set(lengths("fixed:7")) == {7}
    assert min(lengths("normal:3:20")) == 1  # clipped, not dropped
    assert set(lengths(f"empirical:{csv_path}")) <= {374, 3, 879, 91, 1}
    ln = lengths("lognormal:20:0.5")
    assert 12 <= statistics.median(ln) <= 30


def test_arrivals_from_a_converted_trace(tmp_path: Path, csv_path: Path,
                                         tokenizer: Tokenizer) -> None:
    spec = parse_load_spec(f"arrival=trace:{csv_path},prompt=fixed:2,output=fixed:1")
    raw = [r.at_s or 0.0 for r in generate_load(spec, tokenizer).requests]
    assert raw == [0.0, 4.314579, 4.541877, 4.710427, 6.31941]
    rescaled = arrival_times(dataclasses.replace(spec, n=4, rate=2.0))
    assert (len(rescaled) - 1) / rescaled[-1] == pytest.approx(2.0)  # the asked mean rate
    assert rescaled == pytest.approx([t * rescaled[-1] / raw[3] for t in raw[:4]])


# ------------------------------------------------------------------------------------ CLI


@pytest.fixture
def cli_tokenizer(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> None:
    # The CLI resolves the model (hashing the GGUF) on every call; tests share one load.
    monkeypatch.setattr("sim.commands.tokenizer", lambda name: tokenizer)


@pytest.mark.usefixtures("cli_tokenizer")
def test_cli_flags_and_spec_string_agree(tmp_path: Path) -> None:
    flags = ["--n", "6", "--arrival", "poisson", "--rate", "4", "--prompt", "uniform:3:9",
             "--output", "fixed:4", "--shared-prefix", "0.5:5", "--api", "chat", "--stream",
             "--hangup", "0.5", "--seed", "2"]
    assert main(["load", "--out", str(tmp_path / "a.jsonl"), *flags]) == 0
    spec = ("n=6,arrival=poisson,rate=1,prompt=uniform:3:9,output=fixed:4,shared_prefix=0.5:5,"
            "api=chat,stream=true,hangup=0.5,seed=2")
    # --rate overrides the string's rate=1.
    assert main(["load", "--out", str(tmp_path / "b.jsonl"), "--load", spec, "--rate", "4"]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


@pytest.mark.usefixtures("cli_tokenizer")
def test_cli_convert(tmp_path: Path, csv_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    args = ["convert", str(csv_path), "--out", str(out), "--limit", "2"]
    assert main([*args, "--engine", "num_blocks=64", "prefix_caching=false"]) == 0
    trace = load_trace(out)
    assert len(trace.requests) == 2
    assert trace.header.engine["num_blocks"] == 64
    assert trace.header.engine["prefix_caching"] is False
    assert main([*args, "--engine", "block_size=0"]) == 2
    assert 'field "engine.block_size": must be an integer >= 1' in capsys.readouterr().err
