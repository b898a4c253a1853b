"""A trace written as it is recorded, and how a reader puts an unfinished one in order.

`serve --record` cannot write the canonical trace (format.py) until it stops: requests go in
the order the bridge took them, each followed later by what its client did and an
expectation, and the `end` line needs the last step. Held in memory until then, a recording
was lost whole to a kill, a crash, or one value the writer could not encode. So the recorder
appends to the file as it goes, one line per fact, each handed to the kernel as one write
(a SIGKILL keeps every line written before it), and only at a clean stop rewrites the file
as the canonical trace (temporary file, then rename).

Until then the file is a journal. Line 1 is the canonical header plus `"incomplete"` (why
the file is not a finished trace). Then, in the order they became known:

- a request line, canonical plus `"order": [a, b, c]` (its place in the trace: the boundary
  that took it, then the bridge's arrival order), written when a boundary takes the request
  (so a request in flight at a kill is there, and later ones keep their admission numbers,
  which seed unseeded requests) or, for one refused before the engine, when it ends;
- `{"amend": id, "client": {...}}`: what its client did, once known (a hang-up as soon as
  the boundary that applied it, the reading pattern when the exchange ends); the last wins;
- its expectation line, once the request has ended.

`recover` turns such a file into canonical lines: the header without `incomplete` (its note
says what was recovered), the requests in trace order with their clients amended, their
expectations, and no `end` line (the recording did not reach one). A request in flight when
the recording stopped replays as an eager client with no expectation: every request that
ended before the stop still meets the same schedule up to it. A last line cut short by the
kill is dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

INCOMPLETE = "incomplete"
ORDER = "order"
AMEND = "amend"


class JournalError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def is_incomplete(first_line: str) -> bool:
    """Is this line 1 of a journal? (Cheap: only a header line is parsed.)"""
    try:
        obj = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(obj, dict) and "nanoserve_trace" in obj and INCOMPLETE in obj


def recover(first_line: str, rest: Iterable[str]) -> Iterator[str]:
    """The canonical lines of the journal whose line 1 is `first_line`."""
    header = json.loads(first_line)
    requests: list[dict[str, Any]] = []
    clients: dict[str, Any] = {}
    expectations: dict[str, str] = {}
    raw = [line for line in rest if line.strip()]
    torn = 0
    for number, line in enumerate(raw, start=2):
        try:
            obj = json.loads(line)
        except ValueError:
            if number == len(raw) + 1:  # the last line, cut short by the kill
                torn = 1
                continue
            raise JournalError(number, f"not valid JSON in an unfinished recording: "
                               f"{line:.80}") from None
        if not isinstance(obj, dict):
            raise JournalError(number, "must be a JSON object")
        if AMEND in obj:
            clients[str(obj[AMEND])] = obj.get("client")
        elif "expect" in obj:
            expectations[str(obj["expect"])] = line
        else:
            requests.append(obj)
    requests.sort(key=lambda r: r.get(ORDER) or [])  # stable: file order within a key
    del header[INCOMPLETE]
    ended = sum(1 for r in requests if str(r.get("id")) in expectations)
    header["note"] = (
        (header.get("note") or "recorded by nanoserve serve --record")
        + f"; recovered from a recording that did not finish: {len(requests)} requests, "
        f"{ended} of them with an outcome, no end line"
        + ("; its last line, cut short, dropped" if torn else ""))
    yield json.dumps(header, ensure_ascii=False)
    for r in requests:
        r.pop(ORDER, None)
        if str(r.get("id")) in clients:
            r["client"] = clients[str(r["id"])]
        yield json.dumps(r, ensure_ascii=False)
    for r in requests:
        if (e := expectations.get(str(r.get("id")))) is not None:
            yield e


class JournalWriter:
    """Appends lines to a file, each handed to the kernel whole before the call returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, line: str) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: the journal is closed")
        data = memoryview((line + "\n").encode("utf-8"))
        while data:  # one write for a regular file; the loop is for the rare short one
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
