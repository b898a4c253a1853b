"""`sim capacity --executor ray`: a local Ray instance of 2 CPUs writes the bytes that
`--jobs 2` (spawned processes) and `--jobs 1` (in process) write, SLO search included."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_capacity_jobs import COST, _cli

from sim.commands import main

pytest.importorskip("ray")


def test_ray_writes_the_same_bytes_as_jobs_2_and_jobs_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    cost = tmp_path / "cost.json"
    COST.save(cost)
    texts, files = [], []
    for name, extra in (("serial", ["--jobs", "1"]), ("pool", ["--jobs", "2"]),
                        ("ray", ["--jobs", "2", "--executor", "ray"])):
        out = tmp_path / name
        args = _cli(out, cost, 1)
        assert main(args[:-2] + extra) == 0
        texts.append(capsys.readouterr().out.replace(str(out), "OUT"))
        files.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert files[2] == files[1] == files[0]
    assert texts[2] == texts[1] == texts[0]
    assert "highest rate 21.18 req/s" in texts[0]
    assert not ray.is_initialized()  # the local instance it started is shut down


def test_ray_address_needs_the_ray_executor(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    args = _cli(tmp_path, cost, 2) + ["--ray-address", "auto"]
    assert main(args) == 2
    assert "--ray-address needs --executor ray" in capsys.readouterr().err
