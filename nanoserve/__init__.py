"""nanoserve: an LLM inference server written from scratch, and the simulator that runs it.

Layers, top to bottom; a module imports only from layers below it (docs/ARCHITECTURE.md). The
contracts in pyproject.toml (import-linter: `just lint`, tests/test_layers.py) check it:

    cli, live_fleet  `nanoserve serve | generate | bench`; N `serve` replicas behind SGLang's
                  router (`python -m nanoserve.live_fleet N`)
    server/       HTTP: OpenAI routes, SSE, metrics (Quart-Trio on Hypercorn)
    bridge/       AsyncEngine, the Trio bridge: inbox, loop task, per-request channels;
                  the step, live and virtual clocks that turn a step into time
    bench, llm    the offline benchmark; LLM, the offline API
    engine/       Engine.step(): schedule -> execute -> sample -> update (sync, no clock);
                  the runner, n > 1, batch, scheduler, KV blocks, outputs, stop rules,
                  admission, a request's state, the detokenizer (its own layers inside)
    model/        Llama forward over a paged KV cache; the stub; weight + tokenizer loading
    sampling/     SamplingParams, the batched sampler, its logits stages, structured
                  outputs' grammars, the seeded hashes (its own layers inside)
    tokenizer, config, progress, flags, workloads (the copy prompts of speculation's benchmarks)

`sim/` imports nanoserve, never the reverse. Nothing at or below `engine` imports trio,
HTTP, or reads the wall clock; no package has an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from nanoserve.llm import LLM
    from nanoserve.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so `import nanoserve` stays cheap for tools that only need a submodule.
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanoserve.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
