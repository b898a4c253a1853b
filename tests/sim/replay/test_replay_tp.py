"""A committed trace replayed on SmolLM2 sharded over 3 gloo ranks: clean (invariants and the
stream/unary twin), with one outcome digest both times, as on one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanoserve.model.parallel import LoadSpec, TensorParallelModel
from sim.replay.run import replay

TRACE = Path(__file__).parents[3] / "traces" / "n3.jsonl"


def test_tp3_replays_give_one_digest_twice(tok: Any) -> None:
    model = TensorParallelModel(LoadSpec("smollm2"), 3)
    try:
        # Preloaded weights count as the header's; the header's are the stub's, so only
        # the invariants and the twin are checked, as `--model smollm2` would.
        runs = [replay(TRACE, model=model, tokenizer=tok, check_expectations=False)
                for _ in range(2)]
    finally:
        model.close()
    for r in runs:
        assert r.ok, r.mismatches
    assert runs[0].digest == runs[1].digest
    print(f"TP=3 replay of {TRACE.name}: digest {runs[0].digest}, twice")
