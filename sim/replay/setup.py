"""What a replay runs on: the weights, the engine settings and the step-cost model, all read
from a trace's header (and the caller's overrides), refusing what it cannot honour.

Weights are loaded once per process and name (`functools.cache`): every replay builds a
fresh `Engine` (a fresh KV pool) around the same model object, so the second and the twin
run cost no loading. The stub is built per `stub_eos_prob`, on the tokenizer of the one
cached load.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.outputs import StepResult
from nanoserve.model.base import Model
from nanoserve.tokenizer import Tokenizer
from sim.trace.format import TraceHeader

# A step's cost in virtual seconds when neither the trace nor the caller gives a model.
DEFAULT_STEP_S = 0.02
HONOURED_ENGINE_KEYS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                        "seed", "max_model_len", "prefix_caching", "max_queue",
                        "stub_eos_prob", "model_sha256", "speculative_config")
CostFn = Callable[[StepResult], float]
CostSpec = str | Path | float | int | dict[str, Any] | CostFn | None


class ReplayError(ValueError):
    """A trace this replay cannot honour, or weights it cannot load; the message says which."""


@dataclass(frozen=True, slots=True)
class Weights:
    model: Model
    tokenizer: Tokenizer
    name: str  # what the caller asked for ("stub", "smollm2", a path, or "preloaded")
    is_headers: bool  # the header's own model: its expectations are checked
    warning: str | None = None


@contextlib.contextmanager
def torch_threads_for(weights: Weights) -> Iterator[None]:
    """One intra-op thread while the stub runs: its tensors are a few rows of the vocabulary,
    too small to gain from threads, and on a busy machine (2 shared cores) waking the others
    made a replay twenty times slower. Real weights keep torch's setting."""
    from nanoserve.model.stub import StubModel

    if not isinstance(weights.model, StubModel):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_header(header: TraceHeader) -> None:
    for key in header.engine:
        if key not in HONOURED_ENGINE_KEYS:
            raise ReplayError(f'field "engine.{key}": replay cannot honour this setting '
                              f"(it knows {', '.join(HONOURED_ENGINE_KEYS)})")


def engine_config(header: TraceHeader, weights: Weights) -> EngineConfig:
    e = header.engine
    pool_tokens = e["num_blocks"] * e["block_size"]
    ctx = weights.model.config.max_position_embeddings
    # Absent max_model_len: the longest sequence both the model and the pool can hold (the
    # engine's own default, the model's context, refuses a pool smaller than it).
    max_len = e.get("max_model_len") or min(ctx, pool_tokens)
    return EngineConfig(
        block_size=e["block_size"], num_blocks=e["num_blocks"], max_num_seqs=e["max_num_seqs"],
        max_num_batched_tokens=e["max_num_batched_tokens"], seed=e["seed"],
        max_model_len=max_len, prefix_caching=e.get("prefix_caching", True),
        speculative=(SpeculativeConfig.parse(e["speculative_config"])
                     if e.get("speculative_config") is not None else None),
    )


def resolve_weights(header: TraceHeader, model: str | Model | None,
                    tokenizer: Tokenizer | None, tensor_parallel_size: int = 1) -> Weights:
    """`model`: None (the header's), a name or path, or a preloaded model (taken to be the
    header's; it needs its `tokenizer`). `tensor_parallel_size` shards a named model's
    weights over that many processes (nanoserve.model.parallel)."""
    if model is not None and not isinstance(model, str):
        if tokenizer is None:
            raise ReplayError("a preloaded model needs its tokenizer (tokenizer=...)")
        return Weights(model, tokenizer, "preloaded", True)
    name = model if model is not None else header.model
    eos = float(header.engine.get("stub_eos_prob", 0.0))
    try:
        if name == "stub" and tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size: the stub model has no weights to shard")
        loaded, tok = _stub(eos) if name == "stub" else _load(name, tensor_parallel_size)
    except (OSError, ValueError) as exc:
        hint = "" if model is not None else " (pass --model stub|smollm2|PATH)"
        raise ReplayError(f"cannot load model {name!r}: {exc}{hint}") from None
    want = header.engine.get("model_sha256")
    if name != header.model or not want or name == "stub":
        return Weights(loaded, tokenizer or tok, name, name == header.model)
    have = _weights_sha256(name)
    if have == want:
        return Weights(loaded, tokenizer or tok, name, True)
    # Other weights under the same name replay, checked on invariants only.
    return Weights(loaded, tokenizer or tok, name, False,
                   f"the header's model_sha256 {want[:12]} is not {name!r}'s "
                   f"({have[:12] if have else 'unknown'}): checking only the invariants and "
                   "the twin")


def _weights_sha256(name: str) -> str | None:
    """The digest the loader recorded when it converted these weights (a GGUF's sha256)."""
    from nanoserve.model.loader import resolve_model

    try:
        source = json.loads((resolve_model(name) / "nanoserve_source.json").read_text())
    except (OSError, ValueError):
        return None
    sha = source.get("gguf_sha256") if isinstance(source, dict) else None
    return sha if isinstance(sha, str) else None


@functools.cache
def _stub(eos_prob: float) -> tuple[Model, Tokenizer]:
    from nanoserve.model.stub import StubModel

    _, tok = _load("stub")
    return StubModel(tok, eos_prob=eos_prob), tok


@functools.cache
def _load(name: str, tensor_parallel_size: int = 1) -> tuple[Model, Tokenizer]:
    from nanoserve.model import load

    return load(name, tensor_parallel_size=tensor_parallel_size)


def cost_function(spec: CostSpec, base: Path | None = None) -> CostFn:
    """A step-cost model: a callable; a number (seconds per step); `{"constant_s": X}`; a
    JSON file holding one of those, or a model fitted by `sim profile` (`sim.capacity.cost`); or
    None for `DEFAULT_STEP_S`."""
    if spec is None:
        return _constant(DEFAULT_STEP_S)
    if callable(spec):
        return spec
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        return _constant(float(spec))
    if isinstance(spec, str | Path):
        path = Path(spec)
        if base is not None and not path.is_absolute() and not path.exists():
            path = base / path
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReplayError(f"cost model {str(spec)!r}: {exc}") from None
        return cost_function(obj)
    if isinstance(spec, dict):
        for key in ("constant_s", "per_step_s"):
            if key in spec and len(spec) == 1:
                return _constant(spec[key])
        return _fitted(spec)
    raise ReplayError(f"cost model: expected a number, an object or a path, got {spec!r:.80}")


def _constant(seconds: object) -> CostFn:
    if not (isinstance(seconds, int | float) and not isinstance(seconds, bool)
            and math.isfinite(seconds) and seconds >= 0):
        raise ReplayError(f"cost model: a constant must be seconds >= 0, got {seconds!r:.80}")
    value = float(seconds)
    return lambda _result: value


def _fitted(obj: dict[str, Any]) -> CostFn:
    """A model fitted by `sim profile` (sim.capacity.cost's JSON), imported only when one is
    used."""
    from sim.capacity.cost import CostModel

    try:
        return CostModel.from_dict(obj)
    except (KeyError, TypeError, ValueError) as exc:
        raise ReplayError(f"cost model: neither {{\"constant_s\": X}} nor a fitted model "
                          f"(sim.capacity.cost): {exc!r}") from None
