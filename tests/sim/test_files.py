"""Files sim writes appear whole or not at all (sim/files.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.files import atomic_open, atomic_path
from sim.trace.format import Trace, TraceHeader, TraceRequest
from sim.trace.loader import loads_trace
from sim.trace.write import dumps_trace, write_trace

ENGINE = {"block_size": 16, "num_blocks": 8, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "seed": 0}


def trace(*bodies: dict[str, object]) -> Trace:
    return Trace(TraceHeader("step", "stub", ENGINE),
                 tuple(TraceRequest(f"r{i}", "/v1/completions", b, at_step=0)
                       for i, b in enumerate(bodies)))


def test_a_trace_that_fails_mid_write_leaves_the_old_file_and_no_litter(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = trace({"prompt": "a"})
    write_trace(good, path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="not JSON compliant"):  # NaN: the writer refuses it
        write_trace(trace({"prompt": "b"}, {"prompt": "c", "x": float("nan")}), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.jsonl"]
    assert loads_trace(path.read_text()) == loads_trace(dumps_trace(good))


def test_atomic_open_and_path_rename_only_on_success(tmp_path: Path) -> None:
    out = tmp_path / "report.json"

    def half() -> None:
        with atomic_open(out) as f:
            f.write("half")
            raise RuntimeError

    with pytest.raises(RuntimeError):
        half()
    assert not out.exists()
    with atomic_path(tmp_path / "plot.png") as tmp:
        tmp.write_bytes(b"png")
        assert not (tmp_path / "plot.png").exists()
    assert (tmp_path / "plot.png").read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    assert oct((tmp_path / "plot.png").stat().st_mode & 0o777) == "0o644"
