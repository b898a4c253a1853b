"""nanoserve: an LLM inference server written from scratch, and the simulator that runs it.

Layers, top to bottom; a module imports only from layers below it (DESIGN.md). The
contracts in pyproject.toml (import-linter: `just lint`, tests/test_layers.py) check it:

    cli           `nanoserve serve | generate | bench`
    server/       HTTP: OpenAI routes, SSE, metrics (Quart-Trio on Hypercorn)
    serving/      AsyncEngine, the Trio bridge: inbox, loop task, per-request channels;
                  the step, live and virtual clocks that turn a step into time
    bench, llm    the offline benchmark; LLM, the offline API
    engine        Engine.step(): schedule -> execute -> sample -> update (sync, no clock)
    runner        ModelRunner.run: a schedule through the model and the sampler
    batch         a schedule -> the step's ForwardBatch; prompt-logprob rows; work counts
    scheduler     token-budget continuous batching, chunked prefill, preemption
    kv            block pool, ref counts, prefix hashes, block tables (pure Python)
    outputs       RequestOutput, what LLM.generate returns
    stop          check_stop: the stop rules in one function
    updates       the Update of a sampled token, and the final one
    request       a request's state and its updates
    detokenizer   incremental detokenizer with stop strings and hold-back
    sampler       the batched sampler: stages in order, greedy rows, the seeded draw
    logits        its logits stages as pure tensor functions (penalties ... min-p)
    sampling      SamplingParams, validated
    model/        Llama forward over a paged KV cache; the stub; weight + tokenizer loading
    tokenizer, seeds, config, progress

`sim/` imports nanoserve, never the reverse. Nothing at or below `engine` imports trio,
HTTP, or reads the wall clock; no package has an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import nanoserve` stays cheap for tools that only need a submodule.
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanoserve.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
