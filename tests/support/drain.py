"""Running an engine to the end, and what its steps produced: the loop tests share."""

from __future__ import annotations

from collections.abc import Iterable

from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult


def drain(engine: Engine) -> list[StepResult]:
    """Step until no request is unfinished; every step's result, in order."""
    results = []
    while engine.has_unfinished():
        results.append(engine.step())
    return results


def tokens(results: Iterable[StepResult]) -> dict[str, list[int]]:
    """Each request's output token ids (n = 1), in order."""
    out: dict[str, list[int]] = {}
    for r in results:
        for u in r.updates:
            out.setdefault(u.request_id, []).extend(u.new_token_ids)
    return out


def completion_tokens(results: Iterable[StepResult]) -> dict[tuple[str, int], list[int]]:
    """Each completion's output token ids, keyed by (request id, completion index)."""
    out: dict[tuple[str, int], list[int]] = {}
    for r in results:
        for u in r.updates:
            out.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
    return out
