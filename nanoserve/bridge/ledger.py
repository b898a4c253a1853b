"""The bridge's ledger: every request it accepted, from acceptance to its last final update.

Nothing is lost silently: a request leaves the ledger only when each of its n completions
has had a final update routed to its reader, the engine's own or one the bridge writes
(`end`). `route` is the one place an update reaches a reader; it hands each update to the
recorder hook first.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from nanoserve.engine.admission import Prepared
from nanoserve.engine.outputs import empty_final
from nanoserve.engine.request import Endings, FinishReason, Update, check_unused
from nanoserve.sampling.params import ParamError

log = logging.getLogger("nanoserve.bridge")


@dataclass(slots=True, eq=False)
class Entry:
    """One request as the bridge sees it, from acceptance to its last final update."""

    request_id: str
    seq: int  # arrival number: the canonical order of admissions and aborts
    prepared: Prepared
    send: trio.MemorySendChannel[Update]
    endings: Endings  # its completions' final updates routed so far
    admitted: bool = False
    ended: bool = False
    errored: bool = False


class Ledger:
    def __init__(self, record_update: Callable[[Update], None]) -> None:
        self.entries: dict[str, Entry] = {}
        self.arrivals = 0  # requests accepted so far: the next one's arrival number
        self.completed = 0  # requests whose every completion has ended, for any reason
        self.failed = 0  # requests with a completion that ended in error
        self._record_update = record_update

    def new_id(self, request_id: str | None) -> str:
        """The caller's id, checked, or a fresh one."""
        if request_id is None:
            request_id = f"req-{self.arrivals}"
            while request_id in self.entries:  # a caller gave its own request this name
                request_id += "'"
        elif not isinstance(request_id, str) or not request_id:
            raise ParamError("request_id", f"request_id must be a non-empty string, got "
                             f"{request_id!r}")
        else:
            check_unused(request_id, self.entries)
        return request_id

    def accept(self, request_id: str, prepared: Prepared
               ) -> tuple[Entry, trio.MemoryReceiveChannel[Update]]:
        """A new entry, numbered in arrival order, and the receiving end of its channel."""
        send, recv = trio.open_memory_channel[Update](math.inf)
        entry = Entry(request_id, self.arrivals, prepared, send, Endings(prepared.params.n))
        self.arrivals += 1
        self.entries[request_id] = entry
        return entry, recv

    def in_arrival_order(self) -> list[Entry]:
        return sorted(self.entries.values(), key=lambda e: e.seq)

    def route(self, update: Update) -> None:
        """Hand `update` to its reader (never waiting for it); close the entry after the last
        completion's final update."""
        entry = self.entries.get(update.request_id)
        if entry is None or update.index in entry.endings:
            log.warning("dropping an update for a request that has ended: %r", update)
            return
        self._record_update(update)
        with contextlib.suppress(trio.BrokenResourceError):  # the reader has gone
            entry.send.send_nowait(update)
        if entry.endings.note(update):
            entry.errored |= update.finish_reason == FinishReason.ERROR
            if entry.endings.all:
                self._close(entry)

    def end(self, entry: Entry, reason: FinishReason, error: str | None) -> None:
        """Write the final update of every completion of `entry` that has not ended."""
        for index in range(entry.prepared.params.n):
            if not entry.ended and index not in entry.endings:
                self.route(empty_final(entry.request_id, index, reason, error,
                                       len(entry.prepared.prompt_ids)))

    def _close(self, entry: Entry) -> None:
        entry.ended = True
        del self.entries[entry.request_id]
        entry.send.close()
        self.completed += 1
        self.failed += entry.errored
