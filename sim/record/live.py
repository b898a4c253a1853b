"""The recording as it goes: what `serve --record` appends to its file while the server
runs (sim/trace/journal.py's lines), so a kill keeps everything written before it.

The recorder (recorder.py) tells this journal of each fact as the bridge and the HTTP layer
report it; the journal writes a request's line when a boundary takes it (or, for a refusal,
as its status goes out), a hang-up as soon as its abort is applied, and the client and the
expectation once the exchange has ended. A line that cannot be written is logged with its
request, and `failed` is set: `serve` then exits 1.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.record.trace import Exchange, order, request_line
from sim.record.wire import parse_wire
from sim.trace.format import ClientSpec, Expectation, TraceRequest
from sim.trace.journal import AMEND, ORDER, JournalWriter
from sim.trace.write import client_object, dumps_line, expectation_object, request_object

if TYPE_CHECKING:
    from sim.record.redact import Redactor

log = logging.getLogger("sim.record")


class LiveJournal:
    def __init__(self, path: Path, owner: Mapping[str, Exchange]) -> None:
        """Creates (truncates) `path`. `owner`: engine id -> its exchange, for naming what
        was lost."""
        self.path = path
        self.failed = False
        self.redactor: Redactor | None = None  # --record-redact, once there is a tokenizer
        self._owner = owner
        self._writer: JournalWriter | None = JournalWriter(path)
        self._written = itertools.count(1)

    def header(self, head: dict[str, Any]) -> None:
        self._append(head, "the header")

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def refused(self, ex: Exchange) -> None:
        """A request answered without reaching the engine: its line is written as its status
        goes out, so a client that has its answer finds it in the file."""
        if ex.journal_id is None:
            self.request(ex)

    def finished(self, ex: Exchange) -> None:
        """Write the exchange's outcome once it has ended (journal.py: the amended client
        and the expectation; for a request refused before the engine, its line too)."""
        if not ex.ended() or ex.journal_id == "":
            return
        if not ex.engine and ex.journal_id is None:
            self.request(ex)
        if ex.journal_id is None:
            return  # nothing a replay can repeat (order() says why)
        jid, ex.journal_id = ex.journal_id, ""  # "": its outcome is written
        try:
            wire = parse_wire(ex.status, b"".join(c for _, c in ex.chunks),
                              ex.parsed()[0].get("stream") is True)
            req, got = request_line(jid, ex, wire)
            if req.client != ClientSpec():
                self._append({AMEND: jid, "client": client_object(req.client)}, jid, ex)
            shut = ex.disconnect_step is None and req.client.hangup_at_step is not None
            if not (self.redactor is not None or shut):
                self._append(expectation_object(Expectation(jid, got.fields())), jid, ex)
        except Exception as exc:  # a recorder bug: this request's outcome is lost, say so
            self._lost(jid, ex, exc)

    def request(self, ex: Exchange) -> None:
        """The exchange's request line, with its place in the trace."""
        key = order(ex)
        if key is None:
            return
        jid = ex.journal_id = f"r{next(self._written)}"
        try:
            at_step = ex.engine[0].at_step if ex.engine else ex.received_step
            body, raw = ex.parsed()
            req = TraceRequest(jid, ex.path, body, at_step=at_step, raw_body=raw)
            if self.redactor is not None:
                from sim.record.redact import redact_request

                if (redacted := redact_request(self.redactor, req)) is None:
                    ex.journal_id = ""  # not written: its outcome is not either
                    return
                req = redacted
            self._append({**request_object(req), ORDER: list(key)}, jid, ex)
        except Exception as exc:
            self._lost(jid, ex, exc)

    def hung_up(self, ex: Exchange, step: int) -> None:
        """A client's hang-up, as soon as the boundary applied it: a kill before the
        exchange ends must not leave it replaying as a client that stayed."""
        if ex.disconnect_step is None or ex.hangup_written or not ex.journal_id:
            return
        ex.hangup_written = True
        self._append({AMEND: ex.journal_id,
                      "client": client_object(ClientSpec(hangup_at_step=step))},
                     ex.journal_id, ex)

    def _append(self, obj: dict[str, Any], what: str, ex: Exchange | None = None) -> None:
        if self._writer is None:
            return
        try:
            self._writer.write(dumps_line(obj))
        except Exception as exc:
            self._lost(what, ex, exc)

    def _lost(self, what: str, ex: Exchange | None, exc: BaseException) -> None:
        self.failed = True
        where = ""
        if ex is not None:
            ids = ", ".join(self._engine_ids(ex))
            where = (f" ({ex.path}, request ids {ids})" if ids else
                     f" ({ex.path}, answered {ex.status} at step {ex.received_step})")
        log.error("could not record %s%s to %s: %r", what, where, self.path, exc)

    def _engine_ids(self, ex: Exchange) -> list[str]:
        return [rid for rid, owner in self._owner.items() if owner is ex]
