"""The engine's running totals, and the EngineStats snapshot made from them with the
scheduler's queues and the KV pool's counts (`engine_stats`)."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.batch import Work
from nanoserve.engine.kv import BlockPool
from nanoserve.engine.outputs import EngineStats, SpecStats
from nanoserve.engine.scheduler import Scheduler


@dataclass(slots=True)
class Counters:
    """What the engine has done since it started. Only the engine's writer changes them."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0  # completions ended by a stop rule or their length
    # The caller's requests (the groups of their n completions) that abort_request found
    # live and ended: once per request, however many completions it had. The bridge counts
    # its own aborts apart (bridge/loop.py), queued requests included.
    aborted_groups: int = 0
    # Requests a failed step ended (once each), and completions a drawn token ended in error.
    failed: int = 0

    def add_work(self, work: Work) -> None:
        self.prefill_tokens += work.prefill
        self.decode_tokens += work.decode


def engine_stats(steps: int, scheduler: Scheduler, pool: BlockPool, counts: Counters,
                 spec: SpecStats | None) -> EngineStats:
    """The engine's counters now; `spec` None where the engine does not speculate."""
    p = pool.statistics()
    return EngineStats(
        steps=steps,
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        num_blocks=p.num_blocks,
        free_blocks=p.free,
        peak_used_blocks=p.peak_used,
        preemptions=scheduler.num_preemptions,
        prefill_tokens=counts.prefill_tokens,
        decode_tokens=counts.decode_tokens,
        prefix_queries=p.prefix_queries,
        prefix_hits=p.prefix_hits,
        finished=counts.finished,
        aborted=counts.aborted_groups,
        failed=counts.failed,
        spec=spec,
    )
