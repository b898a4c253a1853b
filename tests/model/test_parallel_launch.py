"""Tensor parallelism's processes (nanoserve/model/parallel/launch.py, channel.py, watch.py):
ranks start as fresh interpreters, so a script with no `__main__` guard works; the channel's
pipe and files; the watch's heartbeat.

The ranks here run a tiny random Llama (tests/support/tiny_llama.py): what is tested is how the
processes start, talk and end, and its ranks load at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from support.tiny_llama import write_tiny_llama

from nanoserve.llm import LLM
from nanoserve.model.parallel.channel import (
    EXIT,
    FORWARD,
    INIT_KV,
    READY,
    RESIZE,
    Channel,
    WorkerChannel,
)
from nanoserve.model.parallel.watch import Watch
from nanoserve.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = "The capital of France is"


def test_a_script_without_a_main_guard_starts_its_ranks_and_runs_once(
        tmp_path: Path, smollm2_folder: Path) -> None:
    """vLLM's offline quickstart has no guard. Under multiprocessing's spawn every rank
    re-ran it and died ("... before the current process has finished its bootstrapping
    phase"); the ranks are now `python -m nanoserve.model.parallel`, and the script's tokens
    are one process's."""
    tiny = write_tiny_llama(tmp_path / "tiny", smollm2_folder)
    script = tmp_path / "quickstart.py"
    script.write_text(
        'print("SCRIPT RAN", flush=True)\n'
        "from nanoserve.llm import LLM\n"
        "from nanoserve.sampling.params import SamplingParams\n"
        f"llm = LLM(model={str(tiny)!r}, tensor_parallel_size=3, num_blocks=64)\n"
        f"out = llm.generate([{PROMPT!r}], SamplingParams(max_tokens=8, temperature=0.0),\n"
        "                   use_tqdm=False)\n"
        'print("TOKENS", list(out[0].token_ids))\n')
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("SCRIPT RAN") == 1, out.stdout
    tokens = json.loads(out.stdout.split("TOKENS", 1)[1])
    one = LLM(model=str(tiny), num_blocks=64).generate([PROMPT], GREEDY, use_tqdm=False)
    assert tokens == list(one[0].token_ids)


def _worker_end(ch: Channel) -> tuple[WorkerChannel, int]:
    """Rank 1's end of `ch`, in this process, and the write end of its wake pipe."""
    r, w = os.pipe()
    ch.connect(1, w)
    worker = WorkerChannel(ch.files, 1, r)
    worker.stage(READY)
    ch.unlink()
    return worker, w


def test_a_payload_larger_than_the_buffer_comes_with_a_bigger_one() -> None:
    """The channel's resize path: a worker (a thread here) takes a command whose payload
    does not fit the shared buffer, after the buffer that holds it; no file is left."""
    ch = Channel(2, capacity=8)
    worker, _ = _worker_end(ch)
    got: list[tuple[int, list[int]]] = []

    def run() -> None:
        for _ in range(3):  # INIT_KV, RESIZE, FORWARD
            got.append(worker.receive())

    t = threading.Thread(target=run)
    t.start()
    big = list(range(100))
    ch.send(INIT_KV, [4, 16], lambda: None)
    ch.send(FORWARD, big, lambda: None)
    t.join(10)
    assert [c for c, _ in got] == [INIT_KV, RESIZE, FORWARD]
    assert got[0][1] == [4, 16]
    assert got[2][1] == big
    assert ch.buf.numel() >= 3 + len(big)
    assert not os.path.exists(f"{ch.files.buffer}.1")
    assert not os.path.exists(ch.files.buffer)


def test_a_worker_whose_rank_0_is_gone_reads_exit() -> None:
    """The wake pipe's end-of-file: however rank 0 died, its end closed with it."""
    ch = Channel(2, capacity=8)
    worker, w = _worker_end(ch)
    got: list[tuple[int, list[int]]] = []
    t = threading.Thread(target=lambda: got.append(worker.receive()), daemon=True)
    t.start()
    os.close(w)
    t.join(10)
    assert got == [(EXIT, [])]


class _FakeRank:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid, self.exitcode, self.killed = rank, 1000 + rank, None, False

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout_s: float | None = None) -> None:
        pass


def _watch(timeout_s: float) -> tuple[Watch, list[_FakeRank], memoryview, threading.Event,
                                      list[str]]:
    beats = memoryview(bytearray(8 * 3)).cast("q")
    ranks = [_FakeRank(1), _FakeRank(2)]
    watch = Watch(beats, timeout_s)
    watch.ranks = ranks  # type: ignore[assignment]
    heard: list[str] = []
    told = threading.Event()

    def hear(reason: str) -> None:
        heard.append(reason)
        told.set()

    watch.on_lost(hear)
    return watch, ranks, beats, told, heard


def test_the_watch_loses_a_rank_whose_heartbeat_stands_still_and_kills_every_rank() -> None:
    watch, ranks, beats, told, heard = _watch(0.3)
    stop = threading.Event()

    def rank1_beats() -> None:  # rank 1 beats on; rank 2 never does
        while not stop.wait(0.02):
            beats[1] += 1

    threading.Thread(target=rank1_beats, daemon=True).start()
    watch.start()
    try:
        assert told.wait(10)
    finally:
        stop.set()
        watch.stop()
    assert heard == ["rank 2 (pid 1002) stopped answering: no heartbeat for 0.3 s"]
    assert all(r.killed for r in ranks)
    late: list[str] = []
    watch.on_lost(late.append)  # a listener that comes after the loss hears at once
    assert late == heard


def test_the_watch_loses_a_rank_that_exits() -> None:
    watch, ranks, _, told, heard = _watch(60.0)
    watch.start()
    ranks[0].exitcode = -9  # type: ignore[assignment]
    try:
        assert told.wait(10)
    finally:
        watch.stop()
    assert heard == ["rank 1 (pid 1001) exited with code -9"]
    assert ranks[1].killed


def test_the_watch_leaves_beating_ranks_alone() -> None:
    watch, _, beats, told, _ = _watch(0.2)
    stop = threading.Event()

    def both_beat() -> None:
        while not stop.wait(0.02):
            beats[1] += 1
            beats[2] += 1

    threading.Thread(target=both_beat, daemon=True).start()
    watch.start()
    try:
        assert not told.wait(1.0)  # five timeouts' worth of beats
    finally:
        stop.set()
        watch.stop()
