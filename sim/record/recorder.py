"""`nanoserve serve --record`: live traffic written as a trace that `sim replay` repeats.

The recorder listens at two layers (nanoserve.bridge.BridgeRecorder for the steps,
nanoserve.server.recording for the HTTP exchanges). It appends to the file as it goes
(sim/trace/journal.py: a request's line when a boundary takes it, its client and its
expectation once it has ended, each line handed to the kernel whole), so a kill or a crash
keeps everything recorded before it, and the file says it is unfinished until `close`
rewrites it as the canonical trace (a temporary file renamed over it), once the bridge has
closed and the `end` line is known. A body strict JSON cannot hold (a NaN, a lone surrogate,
no object at all), which the server refuses, is recorded as the bytes the client sent
(`body_base64`), so one bad request never costs the others. Whatever still cannot be written
is logged with the request it belonged to, and `serve` exits 1.

Every time in the trace is a step boundary, taken from the bridge, never from a clock:

- `at_step`: the boundary that took the request from the inbox (it joined step at_step + 1).
  Requests are written in the order the bridge took them, so a replay that sends one
  boundary's arrivals in trace order gives every request the same admission number (which
  seeds an unseeded request) and the same place in the queue.
- `hangup_at_step`: the boundary that applied the abort of a client that hung up, which is
  exact for the step clock (the engine produced its tokens up to that step and no further).
  The frames the client had been sent are not the same fact: under the live clock the step
  that was running when the client left still made a token, whose frame was never sent. A
  streaming client that hung up with fewer frames than an eager reader would have had by
  that boundary gets `read: {"frames_by_step": [[step, frames], ...]}` (the frames the
  transport took by each boundary, the last pair at the hang-up), so the replay reads
  exactly as many.
- A slow reader, one whose send to the socket was still blocked when a step ended, gets the
  same `frames_by_step` pattern; any other client reads `"eager"`.
- A request the server itself ended at shutdown is written as a hang-up at that boundary
  (its tokens replay) with no expectation line (its error frame cannot be replayed).

The expectation lines come from `sim.trace.expect`'s Outcome, the very builder the replay
uses: token
ids and steps are the engine's (from the bridge's updates), status, error, text and frames
are the client's (parsed from the bytes the transport took). Left out, because a replay
cannot repeat them: requests refused with 503 while the server was loading or draining, a
body a 408 or 413 cut short, and a request still queued when the server stopped.

The exchanges are also held in memory until shutdown, for the canonical trace: this is for
recording sessions, not for a server that runs for weeks.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanoserve.engine.request import Update
from nanoserve.model.loader import resolve_model
from sim.record.live import LiveJournal
from sim.record.trace import (
    Completion,
    EngineRequest,
    Exchange,
    order,
    request_line,
)
from sim.record.wire import parse_wire
from sim.trace.expect import EndOutcome, Outcome, RequestOutcome, expectation_lines
from sim.trace.format import Trace, TraceHeader, TraceRequest
from sim.trace.journal import INCOMPLETE
from sim.trace.write import (
    header_object,
    write_trace,
)

if TYPE_CHECKING:
    from nanoserve.bridge import AsyncEngine
    from nanoserve.engine.engine import Engine
    from nanoserve.server.settings import ServerConfig

log = logging.getLogger("sim.record")


class TraceRecorder:
    """Implements server.recording.Recorder: appends to `path` as it records (journal.py)
    and, at `close`, rewrites it as the canonical trace."""

    def __init__(self, path: str | os.PathLike[str], *, weights: str | None = None,
                 redact: bool = False, note: str | None = None) -> None:
        """`weights`: `serve --model`'s value, whose digest (`model_sha256`) goes in the
        header. The file is created here, so a path that cannot be written fails before the
        server binds (OSError)."""
        self.path = Path(path)
        self.weights = weights
        self.redact = redact
        self.note = note
        self.trace: Trace | None = None  # set by close()
        self._failed = False  # the finished trace could not be written (logged)
        self._bridge: AsyncEngine | None = None
        self._engine_header: dict[str, Any] = {}
        self._server_header: dict[str, Any] = {}
        self._model = ""
        self._tokenizer: Any = None
        self._exchanges: list[Exchange] = []
        self._live: dict[str, EngineRequest] = {}  # engine id -> its record, latest first
        self._owner: dict[str, Exchange] = {}  # engine id -> its exchange, likewise
        self._arrivals = itertools.count()
        self._live_journal = LiveJournal(self.path, self._owner)  # creates the file

    @property
    def failed(self) -> bool:
        """Something could not be recorded (logged with its request): serve exits 1."""
        return self._failed or self._live_journal.failed

    # -- the server's side -----------------------------------------------------------------

    def start(self, engine: Engine, bridge: AsyncEngine, config: ServerConfig) -> None:
        self._bridge = bridge
        self._model = config.served_model_name
        self._tokenizer = engine.tokenizer
        self._engine_header = engine_header(engine, config.max_queue)
        self._server_header = server_header(config)
        if self.redact:
            from sim.record.redact import Redactor

            self._live_journal.redactor = Redactor(engine.tokenizer)
        head = header_object(self._header(self.note or "recorded by nanoserve serve --record"))
        head[INCOMPLETE] = ("the recording has not finished (the server is running, or was "
                            "stopped before it wrote the whole trace); sim replay replays "
                            "what it holds")
        self._live_journal.header(head)

    def steps(self) -> int:
        """Steps run and delivered so far: the boundary an HTTP event falls before."""
        return 0 if self._bridge is None else self._bridge.statistics().steps

    def exchange(self, path: str) -> Exchange:
        ex = Exchange(self, len(self._exchanges), path, self.steps())
        self._exchanges.append(ex)
        return ex

    def track(self, request_id: str, ex: Exchange) -> EngineRequest:
        # A client may reuse an X-Request-Id once the first one has ended: the newest wins.
        req = self._live[request_id] = EngineRequest()
        self._owner[request_id] = ex
        return req

    def boundary(self, step: int, aborted: Sequence[str], arrived: Sequence[str]) -> None:
        for rid in aborted:
            req = self._live.get(rid)
            if req is not None and req.abort_step is None:
                req.abort_step = step
                self._live_journal.hung_up(self._owner[rid], step)
        for rid in arrived:
            req = self._live.get(rid)
            if req is not None:
                req.at_step, req.arrival = step, next(self._arrivals)
                ex = self._owner[rid]
                if ex.engine and ex.engine[0] is req:
                    self._live_journal.request(ex)

    def update(self, step: int, update: Update) -> None:
        req = self._live.get(update.request_id)
        if req is None:
            return
        c = req.completions.setdefault(update.index, Completion())
        if update.new_token_ids:
            c.token_ids += update.new_token_ids
            req.first_step = step if req.first_step is None else req.first_step
            req.last_step = step
        if update.finished:
            c.finish_reason = update.finish_reason
            req.ended += 1
            if update.finish_reason == "abort" and req.abort_step is None:
                req.abort_step = step  # an abort at shutdown comes without a boundary
        if update.text or (update.finished and update.finish_reason != "abort"):
            req.frame_steps.append(step)
        if update.finished:
            self.finished(self._owner[update.request_id])

    def refused(self, ex: Exchange) -> None:
        self._live_journal.refused(ex)

    def finished(self, ex: Exchange) -> None:
        self._live_journal.finished(ex)

    def close(self, engine: Engine) -> None:
        self._live_journal.close()
        if self._bridge is None:  # the engine never started: nothing was recorded
            self.path.unlink(missing_ok=True)
            return
        try:
            self.trace = self.build(engine)
            write_trace(self.trace, self.path)  # a temporary file renamed over the journal
        except Exception:
            self._failed = True
            log.exception("could not write the finished trace to %s; it holds the "
                          "recording as it went (an unfinished trace, which sim replay "
                          "reads)", self.path)
            return
        log.info("recorded %d requests to %s", len(self.trace.requests), self.path)

    # -- the trace -------------------------------------------------------------------------

    def _header(self, note: str) -> TraceHeader:
        engine_settings = dict(self._engine_header)
        sha = model_sha256(self.weights) if self.weights is not None else None
        if sha is not None:
            engine_settings["model_sha256"] = sha
        return TraceHeader("step", self._model or "unknown", engine_settings, note,
                           server=self._server_header)

    def build(self, engine: Engine) -> Trace:
        kept = [(key, ex) for ex in self._exchanges if (key := order(ex)) is not None]
        kept.sort(key=lambda pair: pair[0])
        requests: list[TraceRequest] = []
        outcomes: list[RequestOutcome] = []
        cut: set[str] = set()  # ended by the server's shutdown: no expectation line
        for i, (_, ex) in enumerate(kept, start=1):
            stream = ex.parsed()[0].get("stream") is True
            wire = parse_wire(ex.status, b"".join(c for _, c in ex.chunks), stream)
            req, got = request_line(f"r{i}", ex, wire)
            requests.append(req)
            outcomes.append(got)
            if ex.disconnect_step is None and req.client.hangup_at_step is not None:
                cut.add(req.id)
        s = engine.statistics()
        end = EndOutcome(s.steps, s.num_blocks, s.free_blocks, s.peak_used_blocks,
                         s.preemptions, sum(o.aborted for o in outcomes))
        outcome = Outcome(tuple(outcomes), end)
        note = self.note or (f"recorded by nanoserve serve --record: {len(requests)} "
                             f"requests, {s.steps} steps")
        if cut:  # the client saw an error a replay cannot repeat; its tokens still replay
            note += (f"; {len(cut)} request(s) ended by the server's shutdown, recorded as "
                     "hang-ups at that boundary, with no expectation line")
        if self.redact:
            from sim.record.redact import redact_requests

            requests = redact_requests(requests, self._tokenizer)
            note += "; prompts redacted (token counts kept), so no expectation lines"
        expectations = () if self.redact else tuple(
            e for e in expectation_lines(outcome) if e.id not in cut)
        return Trace(self._header(note), tuple(requests), expectations)


def model_sha256(model: str) -> str | None:
    """The weights' digest where the loader recorded one (a converted GGUF, the embedded
    model included); None for the stub and for a plain folder."""
    if model == "stub":
        return None
    try:
        folder = resolve_model(model)
        source = json.loads((folder / "nanoserve_source.json").read_text())
    except (OSError, ValueError):
        return None
    sha = source.get("gguf_sha256") if isinstance(source, dict) else None
    return sha if isinstance(sha, str) else None


def engine_header(engine: Engine, max_queue: int | None) -> dict[str, Any]:
    """The header's engine settings: everything that changes the schedule, as served."""
    cfg = engine.config
    out: dict[str, Any] = {
        "block_size": cfg.block_size, "num_blocks": engine.statistics().num_blocks,
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "seed": cfg.seed, "max_model_len": engine.max_model_len,
        "prefix_caching": cfg.prefix_caching, "max_queue": max_queue,
    }  # fmt: skip
    if cfg.speculative is not None:  # vLLM's JSON
        out["speculative_config"] = cfg.speculative.as_json()
    eos_prob = getattr(engine.model, "eos_prob", None)  # the stub's only setting
    if isinstance(eos_prob, float):
        out["stub_eos_prob"] = eos_prob
    return out


def server_header(config: ServerConfig) -> dict[str, Any]:
    """The header's server settings: what changes how a chat answer reads (its template,
    its tool-call and reasoning parsers), where they are not the defaults."""
    a = config.agents
    out: dict[str, Any] = {"chat_template": config.chat_template,
                           "tool_call_parser": a.tool_call_parser,
                           "enable_auto_tool_choice": a.enable_auto_tool_choice or None,
                           "reasoning_parser": a.reasoning_parser}
    return {k: v for k, v in out.items() if v is not None}
