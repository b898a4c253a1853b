"""Injected faults: a model, a tokenizer and a scheduler that fail on cue, for replays and tests.

nanoserve's production path has no fault flags: a fault is a wrapper around the real part,
built here (sim imports nanoserve, never the reverse) and handed to the `Engine` in place of
the part it wraps. Each wrapper delegates everything to the part inside and raises
`InjectedFault` only where its fault says, so a run with faults that never fire is the run
without them, step for step.

A trace declares its faults in the header (`"faults": [...]`, sim/trace/format.py); the kinds:

- `{"kind": "step_raises", "at_step": K}`: the model's forward (and its greedy fast path)
  raises during step K. The engine contains that: the step's own requests end with an error,
  the others run on.
- `{"kind": "encode_raises", "text": T}`: the tokenizer raises encoding any text that
  contains T (a prompt, or a chat prompt as rendered): that request is refused before it is
  queued.
- `{"kind": "detokenize_raises", "token_id": I}`: the tokenizer raises decoding any ids that
  hold I, so the detokenizer of a request that samples I fails: that request ends with an
  error, the others run on.
- `{"kind": "schedule_raises", "at_step": K}`: the scheduler raises at step K, before the
  engine's own containment: the bridge's loop dies, every request in flight ends with an
  error, and the server refuses new work (503) from then on.

Steps are the engine's own numbers (`Engine.num_steps` during the step), so a fault fires at
the same boundary in every replay.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.kv import KVManager
from nanoserve.engine.scheduler import Schedule, Scheduler, SchedulerFactory
from nanoserve.model.base import ForwardBatch, Model, ModelConfig
from nanoserve.tokenizer import Tokenizer
from sim.trace.check import FAULT_PARAMS

__all__ = ["Fault", "FaultyModel", "FaultyTokenizer", "InjectedFault",
           "inject", "kills_loop", "parse_faults", "quiet_injected"]

# The loggers that report a failure with its traceback (the bridge's loop, the app's 500s).
_LOGGERS = ("nanoserve.bridge", "nanoserve.server")

class InjectedFault(RuntimeError):
    """The error every injected fault raises; its message names the fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    value: int | str  # at_step, text or token_id: the kind's one parameter (FAULT_PARAMS)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Fault:
        """A fault from its header object, once `sim.trace.check.check_faults` accepted it."""
        kind = obj["kind"]
        return cls(kind, obj[FAULT_PARAMS[kind]])


def parse_faults(raw: Sequence[Mapping[str, Any]] | None) -> tuple[Fault, ...]:
    return tuple(Fault.from_json(f) for f in raw or ())


def kills_loop(faults: Sequence[Fault]) -> bool:
    """Whether a fault is one the bridge's loop cannot survive (it fails outside a step)."""
    return any(f.kind == "schedule_raises" for f in faults)


def _steps(faults: Sequence[Fault], kind: str) -> frozenset[int]:
    return frozenset(int(f.value) for f in faults if f.kind == kind)


class FaultyModel:
    """A `Model` that raises in the steps its faults name; the same model otherwise, greedy
    fast path included, so the engine takes the same path."""

    def __init__(self, inner: Model, faults: Sequence[Fault]) -> None:
        self.inner = inner
        self.config: ModelConfig = inner.config
        self.device: torch.device = inner.device
        self._at = _steps(faults, "step_raises")
        self._step: Callable[[], int] = lambda: 0

    def attach(self, engine: Engine) -> None:
        """Read step numbers from `engine` (built around this model, so attached after)."""
        self._step = lambda: engine.num_steps

    def _check(self) -> None:
        step = self._step()
        if step in self._at:
            raise InjectedFault(f"injected fault: the model's forward raised at step {step}")

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.init_kv_cache(num_blocks, block_size)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.inner.kv_bytes_per_block(block_size)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.inner.copy_blocks(pairs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._check()
        return self.inner.forward(batch)

    def pick_greedy(self, batch: ForwardBatch) -> list[int] | None:
        self._check()
        return self.inner.pick_greedy(batch)


class FaultyTokenizer(Tokenizer):
    """The same tokenizer (it shares the wrapped one's state), raising where its faults say.

    A subclass rather than a proxy because the engine and the server are typed on
    `Tokenizer`; it does not call `Tokenizer.__init__`, which would load the vocabulary
    again, but takes the wrapped instance's attributes as they are."""

    def __init__(self, inner: Tokenizer, faults: Sequence[Fault]) -> None:
        self.__dict__.update(vars(inner))
        self._poison_text = tuple(str(f.value) for f in faults if f.kind == "encode_raises")
        self._poison_ids = frozenset(int(f.value) for f in faults
                                     if f.kind == "detokenize_raises")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        hit = next((t for t in self._poison_text if t in text), None)
        if hit is not None:
            raise InjectedFault(f"injected fault: the tokenizer cannot encode {hit!r}")
        return super().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        hit = next((t for t in ids if t in self._poison_ids), None)
        if hit is not None:
            raise InjectedFault(f"injected fault: the tokenizer cannot decode token {hit}")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


class FaultyScheduler(Scheduler):
    """A Scheduler whose `schedule()` raises in the steps `at` (the engine calls it once per
    step, first, outside its step's containment, so its k-th call is step k)."""

    def __init__(self, kv: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 at: frozenset[int]) -> None:
        super().__init__(kv, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens)
        self._at = at
        self._calls = 0

    def schedule(self) -> Schedule:
        self._calls += 1
        if self._calls in self._at:
            raise InjectedFault(f"injected fault: the scheduler raised at step {self._calls}")
        return super().schedule()


def inject(model: Model, tokenizer: Tokenizer, faults: Sequence[Fault],
           config: EngineConfig) -> Engine:
    """An Engine on `config` with each part wrapped as `faults` need. With no faults the
    parts are passed through untouched."""
    kinds = {f.kind for f in faults}
    m: Model = FaultyModel(model, faults) if "step_raises" in kinds else model
    t = (FaultyTokenizer(tokenizer, faults)
         if kinds & {"encode_raises", "detokenize_raises"} else tokenizer)
    at = _steps(faults, "schedule_raises")
    make: SchedulerFactory = (functools.partial(FaultyScheduler, at=at) if at
                              else Scheduler)
    engine = Engine(m, t, config, make_scheduler=make)
    if isinstance(m, FaultyModel):
        m.attach(engine)
    return engine


def _not_injected(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, InjectedFault)


@contextlib.contextmanager
def quiet_injected() -> Iterator[None]:
    """Drop the tracebacks nanoserve logs for an injected fault (a replay of a fault trace
    would print one per run); a failure of any other kind is still logged."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for lg in loggers:
        lg.addFilter(_not_injected)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_injected)
