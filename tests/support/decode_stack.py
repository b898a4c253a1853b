"""Decode-only steps run every layer in one native call (csrc/stack.cpp), other steps the
Python layer loop over the same kernels: `both_ways` decodes the same requests with the
stack and without, for a test to hold them equal bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.sampling.params import SamplingParams

Run = dict[str, list[tuple[int, float]]]


def both_ways(model: Any, tok: Any, prompts: Sequence[list[int]], max_tokens: int,
              config: EngineConfig) -> tuple[Run, Run, int]:
    """(token and logprob of every decoded position with the stack, the same without it,
    how many steps the stack ran in the first run)."""
    stack = model.stack
    assert stack is not None, "the model runs no decode stack"
    calls = 0

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return type(model)._decode_stack(model, *args)

    def run() -> Run:
        e = Engine(model, tok, config)
        for i, ids in enumerate(prompts):
            e.add_request(list(ids), SamplingParams(
                temperature=0.0, ignore_eos=True, max_tokens=max_tokens, logprobs=2), f"r{i}")
        out: Run = {}
        while e.has_unfinished():
            for u in e.step().updates:
                out.setdefault(u.request_id, []).extend(
                    (lp.token_id, lp.logprob) for lp in u.logprobs if lp is not None)
        return out

    try:
        model._decode_stack = counted
        stacked = run()
        model.stack = None
        looped = run()
    finally:
        model.stack = stack
        del model._decode_stack
    return stacked, looped, calls
