"""Recording traffic as a trace.

`nanoserve serve --record`: the recorder the `nanoserve.recorders` entry point names
(recorder.py), the journal it appends as it goes (live.py), what it writes (trace.py), how
it reads a client's answer off the wire (wire.py), and taking the text out of a recorded
trace (redact.py). `sim record --upstream`: the recording proxy in front of any server
(upstream.py) and its command line (proxy_cli.py)."""

from sim.record.recorder import TraceRecorder

__all__ = ["TraceRecorder"]
