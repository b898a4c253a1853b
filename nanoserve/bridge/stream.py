"""RequestStream: one request's updates as an async iterator, and its reader's hang-up.

The bridge (async_engine.py) hands each accepted request a channel; the stream reads it and, when
its reader stops early in any way (closing it, leaving `async with`, cancellation while
waiting, or dropping it after `break`), tells the bridge to abort the request, with a
synchronous call that is safe in a cancelled `finally`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from types import TracebackType

import trio

from nanoserve.engine.request import Endings, Update


class RequestStream:
    """One request's updates, in order; iteration ends after every completion has ended.

    Closing it earlier (`aclose()`, leaving `async with`, cancellation while waiting for the
    next update, or dropping it after `break`) aborts the request at the next boundary."""

    def __init__(
        self,
        abort: Callable[[str], None],
        request_id: str,
        prompt_ids: Sequence[int],
        n: int,
        recv: trio.MemoryReceiveChannel[Update],
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.n = n
        self._abort = abort  # the bridge's abort_nowait
        self._recv = recv
        self._endings = Endings(n)  # its completions' final updates read so far
        self._closed = False
        self._token = trio.lowlevel.current_trio_token()

    @property
    def finished(self) -> bool:
        return self._endings.all

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Update:
        if self._closed or self.finished:
            raise StopAsyncIteration
        try:
            update = await self._recv.receive()
        except BaseException:  # cancelled (or interrupted) while waiting: a stopped reader
            self.close()
            raise
        self._endings.note(update)
        return update

    def close(self) -> None:
        """Stop reading; synchronous, so it is safe in a cancelled `finally`."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._abort(self.request_id)
        self._recv.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()  # no await: this often runs in a cancelled scope

    def __del__(self) -> None:
        # `break` out of `async for` drops a stream without closing it (PEP 533 never
        # landed). The collector may run in any thread (a live step's, say), so the abort
        # goes through Trio's thread-safe queue; after the run has ended there is no one to
        # tell, and nothing left to abort.
        with contextlib.suppress(Exception):
            if not self._closed and not self.finished:
                self._token.run_sync_soon(self._abort, self.request_id)
