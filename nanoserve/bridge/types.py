"""The bridge's public types: its statistics, its error, the recorder hook, the listener."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from nanoserve.engine.outputs import StepResult
from nanoserve.engine.request import Update

Prompt = str | Sequence[int]
StepListener = Callable[[StepResult], None]


class BridgeRecorder(Protocol):
    """The recorder hook. Both calls come from the loop task, synchronously, between steps;
    an exception from either is logged and ignored (recording must not stop serving)."""

    def boundary(self, step: int, aborted: Sequence[str], arrived: Sequence[str]) -> None:
        """A boundary taken after `step` steps: the requests it aborted (in arrival order,
        any never admitted included; their final updates have just been routed), and those
        it is taking from the inbox, in arrival order (one whose admission fails then gets
        an error final update)."""
        ...

    def update(self, step: int, update: Update) -> None:
        """An update routed to its reader after `step` steps: a step's own, or a final one
        the bridge wrote (an abort, an admission failure, shutdown)."""
        ...


class EngineDeadError(RuntimeError):
    """The bridge takes no more requests: its loop failed, or it was closed."""


@dataclass(frozen=True, slots=True)
class BridgeStats:
    steps: int  # engine steps run
    queued: int  # arrivals waiting for the next step boundary
    running: int
    waiting: int
    in_flight: int  # accepted requests that have not ended (queued ones included)
    num_blocks: int
    free_blocks: int
    admitted: int
    completed: int  # requests whose every completion has ended, for any reason
    aborted: int  # requests the bridge aborted: hang-ups, cancellations, abort_nowait, close
    failed: int  # requests with a completion that ended in error
    preemptions: int
    healthy: bool
