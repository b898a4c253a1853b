"""`nanoserve serve --record`: the recorder the `nanoserve.recorders` entry point names
(recorder.py), what it writes (trace.py), how it reads requests off the wire (wire.py), and
taking the text out of a recorded trace (redact.py)."""

from sim.record.recorder import TraceRecorder

__all__ = ["TraceRecorder"]
