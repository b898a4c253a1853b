"""bridge: between Trio and the engine, many request tasks and one engine.

    async_engine  AsyncEngine: what callers call (stream, generate, abort, statistics)
    loop      EngineLoop: the loop task, the engine's only writer, and its step boundaries
    ledger    every accepted request until its last final update; the per-request channels
    types     BridgeStats, EngineDeadError, the recorder hook (BridgeRecorder)
    stream    RequestStream: one request's updates, and its reader's hang-up as an abort
    clock     how the loop turns a step into time: live (a worker thread, wall seconds),
              step (inline, no time: exact replay), virtual (a cost model), gate (tests)

The engine below knows nothing of Trio; everything here does.
"""

from __future__ import annotations

from nanoserve.bridge.async_engine import AsyncEngine
from nanoserve.bridge.stream import RequestStream
from nanoserve.bridge.types import (
    BridgeRecorder,
    BridgeStats,
    EngineDeadError,
    Prompt,
    StepListener,
)

__all__ = ["AsyncEngine", "BridgeRecorder", "BridgeStats", "EngineDeadError", "Prompt",
           "RequestStream", "StepListener"]
