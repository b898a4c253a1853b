"""`nanoserve bench` on the stub: the workload is hf_peer's, every figure is reported."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nanoserve import bench


def test_bench_on_the_stub_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    bench.add_args(p)
    a = p.parse_args(["--model", "stub", "--n", "6", "--out-max", "20"])
    out = bench.run(a)
    reqs = bench.workload(0, 6, 49152, 16, 256, 16, 20)
    assert out["output_tokens"] == sum(o for _, o in reqs)
    assert out["prompt_tokens"] == sum(len(p) for p, _ in reqs)
    # Every prompt token and every output token but each request's last is computed.
    assert out["computed_tokens"] == out["prompt_tokens"] + out["output_tokens"] - 6
    assert out["mm2048_gflops"] > 0
    assert "fraction_of_mm_peak" in out
    assert "single_decode_tokens_per_s" not in out  # the stub has no weights to stream
    assert "GFLOP/s" in capsys.readouterr().out


def test_workload_matches_hf_peer_draws() -> None:
    # The first request of hf_peer.py's default workload (seed 0), drawn the same way.
    [(prompt, out_len)] = bench.workload(0, 1, 49152, 16, 256, 16, 128)
    assert (len(prompt), out_len) == (232, 103)
    assert prompt[:3] == [25347, 27662, 2753]


def test_the_last_level_cache_is_read_from_sysfs(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    for index, size in (("index0", "32K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    real = bench.Path
    monkeypatch.setattr(bench, "Path", lambda p: tmp_path if "cache" in str(p) else real(p))
    assert bench.last_level_cache_bytes() == 32 << 20


def test_each_round_sets_a_decode_against_the_read_just_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nanoserve.bench import decode

    events: list[str] = []
    speeds = iter([20e9, 10e9, 40e9])  # bytes/s of the three rounds' reads
    rates = iter([99.0, 30.0, 12.0, 45.0])  # tok/s: the warm-up's, then the rounds' decodes

    def read(times: int) -> float:
        events.append(f"read x{times}")
        return next(speeds)

    engines: list[object] = []

    def make_engine(*args: object, **kwargs: object) -> object:
        engines.append(object())
        return engines[-1]

    def timed_decode(engine: object, prompt: list[int], n: int) -> float:
        events.append(f"decode {n} on engine {engines.index(engine)}")
        return next(rates)

    monkeypatch.setattr(decode, "Engine", make_engine)
    monkeypatch.setattr(decode, "_decode", timed_decode)
    shares = decode.shares_of_bound(None, None, [1, 2], 1_000_000_000,  # type: ignore[arg-type]
                                    read, 3, 16)
    # One engine, warmed once, for every round (a fresh one a round cost SmolLM2 a third).
    assert len(engines) == 1
    assert events == ["decode 8 on engine 0"] + ["read x3", "decode 16 on engine 0"] * 3
    # Round by round: 30 tok/s of a 20 tok/s bound, 12 of 10, 45 of 40.
    assert shares == [1.5, 1.2, 1.125]


def test_each_step_is_set_against_the_read_just_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nanoserve.bench import decode

    events: list[str] = []
    clock = [0.0]
    speeds = iter([4e9, 2e9, 8e9])  # bytes/s of the reads before the three decode steps
    seconds = iter([0.125, 1.0, 0.0625])  # each step's time (binary fractions: exact sums)
    made = iter([1, 3, 1])  # tokens each step gives (a speculative step can give several)

    def read(times: int) -> float:
        events.append(f"read x{times}")
        return next(speeds)

    class Update:
        def __init__(self, n: int) -> None:
            self.new_token_ids = tuple(range(n))

    class Output:
        def __init__(self, n: int) -> None:
            self.updates = [Update(n)]

    class FakeEngine:
        steps = 0

        def add_request(self, prompt: list[int], params: object) -> None:
            events.append(f"add {params.max_tokens}")  # type: ignore[attr-defined]

        def has_unfinished(self) -> bool:
            return self.steps < 4

        def step(self) -> Output:
            self.steps += 1
            if self.steps == 1:
                events.append("prefill")
                return Output(1)
            events.append("step")
            clock[0] += next(seconds)
            return Output(next(made))

    monkeypatch.setattr(decode, "_warmed", lambda *args: FakeEngine())
    monkeypatch.setattr(decode.time, "perf_counter", lambda: clock[0])
    pairs = decode.paired_shares(None, None, [1, 2], 1_000_000_000,  # type: ignore[arg-type]
                                 read, 4)
    # The prefill untimed, then one read right before each step, never two in a row.
    assert events == ["add 4", "prefill"] + ["read x1", "step"] * 3
    # A step's bound: its tokens' weights at the read just before it (1 GB at 4 GB/s is
    # 0.25 s; three tokens at 2 GB/s, 1.5 s), beside the step's own seconds.
    assert pairs == [(0.25, 0.125), (1.5, 1.0), (0.125, 0.0625)]


def test_the_reader_warms_its_buffer_once_not_every_call() -> None:
    from nanoserve.bench import yardsticks

    reads: list[int] = []

    class Ops:
        @staticmethod
        def stream_read(buf: object) -> float:
            reads.append(1)
            return 0.0

    class FakeKernels:
        ops = Ops()

    read = yardsticks.reader(1 << 20, FakeKernels())  # type: ignore[arg-type]
    assert len(reads) == 1  # the first touch, untimed
    read(1)  # a step's read (paired_shares): one read, no second warm-up
    assert len(reads) == 2
    read(3)
    assert len(reads) == 5
