"""Rank 0's wait for a tensor-parallel group to start: its own shard built in a thread while
it watches the workers' stages in the channel's control block (parallel/channel.py).

Apart from the model it starts (group.py) because it runs once, before the model exists, and
is all about failing well: a rank that exits fails the start at once, one that is not ready
by the deadline fails it then, each as one ModelStartError that names every rank that was
not ready and what it was doing; and a slow start is logged every 10 s, naming who is at
which stage.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from nanoserve.model.base import ModelStartError
from nanoserve.model.llama import LlamaModel
from nanoserve.model.parallel.channel import READY, STAGES, Channel
from nanoserve.model.parallel.launch import Rank
from nanoserve.model.parallel.worker import GroupSpec, LoadSpec, build_shard

# The group's logger: start-up's lines are the group's (server/main.py names it).
log = logging.getLogger("nanoserve.model.parallel.group")
_PROGRESS_EVERY_S = 10.0
# Rank 0's start threads that a failed start left inside torch (loading the shard, or in
# the rendezvous until its own timeout): see `exit_status`.
_left: list[threading.Thread] = []


def exit_status(code: int) -> int:
    """A command line's exit status, passed through; but where a failed start left rank 0's
    thread running in torch, the process ends here with it, its logs and standard streams
    flushed (the caller has reaped the workers and stopped serving by then).

    CPython before 3.14 ends a daemon thread that wakes during interpreter shutdown with
    pthread_exit, which unwinds it through the C++ frames it is in and aborts the process
    ("terminate called without an active exception"; CPython gh-87135, where 3.14 parks
    the thread instead). Rank 0's rendezvous times out `timeout_s` after it began, so after
    a start that failed at its deadline it wakes about when the process ends."""
    if any(t.is_alive() for t in _left):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def start_rank0(spec: LoadSpec, group: GroupSpec, channel: Channel, procs: Sequence[Rank],
                timeout_s: float) -> LlamaModel:
    """Build rank 0's shard in a thread while watching the workers start: a rank that
    exits fails the start at once, one that does not get ready fails it at the
    deadline, each with a message that names the ranks and their stages."""
    box: list[Any] = []
    stages = channel.control.stages

    def rank0_stage(stage: int) -> None:
        stages[0] = stage

    def target() -> None:
        try:
            box.append((True, build_shard(spec, group, 0, rank0_stage)))
        except BaseException as exc:  # handed to the caller below
            box.append((False, exc))

    t = threading.Thread(target=target, name="nanoserve-tp-rank0-start", daemon=True)
    t.start()
    try:
        return _watch(t, box, group, channel, procs, timeout_s)
    except BaseException:
        if t.is_alive():  # it cannot be stopped: torch's waits take no cancellation
            _left.append(t)
        raise


def _watch(t: threading.Thread, box: list[Any], group: GroupSpec, channel: Channel,
           procs: Sequence[Rank], timeout_s: float) -> LlamaModel:
    stages = channel.control.stages
    t0 = time.monotonic()
    next_report = t0 + _PROGRESS_EVERY_S
    while t.is_alive() or any(stages[r] != READY for r in range(1, group.world_size)):
        t.join(0.05)
        now = time.monotonic()
        for p in procs:
            if p.exitcode is not None:
                raise ModelStartError(
                    f"tensor parallel start-up failed: rank {p.rank} (pid {p.pid}) exited "
                    f"with code {p.exitcode} while {STAGES[stages[p.rank]]}")
        if box and not box[0][0]:
            first = str(box[0][1]).splitlines()[0] if str(box[0][1]) else repr(box[0][1])
            raise ModelStartError(
                f"tensor parallel start-up failed: rank 0 while {STAGES[stages[0]]}: "
                f"{first}; {not_ready(channel, procs)}")
        if now - t0 > timeout_s:
            raise ModelStartError(
                f"tensor parallel start-up failed: not every rank was ready within the "
                f"distributed timeout of {timeout_s:g} s: {not_ready(channel, procs)}")
        if now >= next_report:
            next_report += _PROGRESS_EVERY_S
            log.info("tensor parallel: %.0f s into start-up (of at most %g s): %s",
                     now - t0, timeout_s, not_ready(channel, procs))
    ok, value = box[0]
    if not ok:
        raise value
    log.info("tensor parallel: %d ranks ready in %.1f s", group.world_size,
             time.monotonic() - t0)
    model: LlamaModel = value
    return model


def not_ready(channel: Channel, procs: Sequence[Rank]) -> str:
    """Each rank that is not ready, with its pid and stage (rank 0 is this process)."""
    stages = channel.control.stages
    pids = [os.getpid(), *(p.pid for p in procs)]
    return "; ".join(f"rank {r} (pid {pids[r]}) was {STAGES[stages[r]]}"
                     for r in range(channel.world_size) if stages[r] != READY
                     ) or "every rank was ready"
