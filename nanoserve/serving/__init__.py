"""serving: the Trio side of nanoserve, between many request tasks and one engine.

    bridge    AsyncEngine: the inbox, the loop task that is the engine's only writer
    ledger    every accepted request until its last final update; the per-request channels
    types     BridgeStats, EngineDeadError, the recorder hook (BridgeRecorder)
    stream    RequestStream: one request's updates, and its reader's hang-up as an abort
    clock     how the loop turns a step into time: live (a worker thread, wall seconds),
              step (inline, no time: exact replay), virtual (a cost model), gate (tests)

The engine below knows nothing of Trio; everything here does.
"""

from __future__ import annotations

from nanoserve.serving.bridge import AsyncEngine
from nanoserve.serving.stream import RequestStream
from nanoserve.serving.types import (
    BridgeRecorder,
    BridgeStats,
    EngineDeadError,
    Prompt,
    StepListener,
)

__all__ = ["AsyncEngine", "BridgeRecorder", "BridgeStats", "EngineDeadError", "Prompt",
           "RequestStream", "StepListener"]
