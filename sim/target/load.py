"""A hang-up frees its slot: a long stream runs, its client leaves, and the server's own
gauge says it stopped (or, without a gauge, a request queued behind full slots starts).

A slot's state is read from the server's own gauges, whatever it calls them: vLLM's and
nanoserve's `*:num_requests_running` and llama.cpp's `llamacpp:requests_processing` on
/metrics, else llama.cpp's /slots (`is_processing`). Slow readers are pacing.py's.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import httpx
import trio

from sim.target import wire
from sim.target.outcome import Outcome
from sim.target.target import COMPLETIONS, Target

_RUNNING = re.compile(r"^([a-zA-Z_:][\w:]*(?:num_requests_running|requests_processing))"
                      r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")
LONG_PROMPT = "Count from 1 to 10000, one number a line: 1\n2\n3\n"


async def running(t: Target) -> int | None:
    """Requests the server says are running now; None where it exports no such figure."""
    status, _, text = await wire.get(t.client, t.url, "/metrics")
    if status == 200:
        values = [float(m.group(2)) for line in text.splitlines()
                  if (m := _RUNNING.match(line.strip()))]
        if values:
            return int(sum(values))
    status, obj, _ = await wire.get(t.client, t.url, "/slots")
    if status == 200 and isinstance(obj, list):
        return sum(1 for s in obj if isinstance(s, dict) and s.get("is_processing"))
    return None


async def settle(t: Target, want: int = 0) -> tuple[float | None, list[int | None]]:
    """Poll the gauge until it is at most `want`: the seconds it took (None: not within
    settle_s) and the values read."""
    start = trio.current_time()
    seen: list[int | None] = []
    while trio.current_time() - start < t.settle_s:
        n = await running(t)
        seen.append(n)
        if n is not None and n <= want:
            return trio.current_time() - start, seen
        await trio.sleep(0.05)
    return None, seen


def long_body(t: Target, stream: bool = True) -> dict[str, Any]:
    """A request that runs for a long while: many tokens, the end-of-text token ignored
    (vLLM's, llama.cpp's and nanoserve's `ignore_eos`)."""
    return t.body(COMPLETIONS, LONG_PROMPT, max_tokens=2048, ignore_eos=True, stream=stream)


async def hangup_frees_slot(t: Target) -> Outcome:
    """A long stream runs (the gauge counts it), its client closes the connection, and the
    gauge is back to 0 within settle_s."""
    name = "hang-up frees its slot"
    if await running(t) is None:
        if t.slots is None:
            return Outcome(name, "unsupported", "no running-requests gauge (/metrics, /slots); "
                           "--slots N measures by queueing instead")
        return await _hangups_by_queueing(t, name, t.slots)
    if (await settle(t))[0] is None:
        return Outcome(name, "unsupported", f"the server was not idle within {t.settle_s} s")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(eager_reader, t, long_body(t), stop)
        counted = await started(t, 1)
        stop.set()  # the hang-up
    if not counted:
        return Outcome(name, "unsupported", "the gauge never counted the long request")
    took, values = await settle(t)
    if took is None:
        return Outcome(name, "fail", f"still running {t.settle_s} s after the client left",
                       ({"request": long_body(t), "running": values[-20:]},))
    return Outcome(name, "pass", f"the running gauge back to 0 {took:.2f} s after the hang-up")


async def _hangups_by_queueing(t: Target, name: str, slots: int) -> Outcome:
    """Without a gauge: fill the server's `slots` with long streams, hang them all up, and
    time a one-token request sent just after. A server that frees the slots starts it at
    once; one that keeps generating starts it only when the long streams end."""
    short = t.body(COMPLETIONS, "Hello", max_tokens=1, stream=True)
    alone = await _first_frame_s(t, short)
    if alone is None:
        return Outcome(name, "unsupported", "a one-token stream got no frame")
    begun = [trio.Event() for _ in range(slots)]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for ev in begun:
            nursery.start_soon(eager_reader, t, long_body(t), stop, ev)
        with trio.move_on_after(t.settle_s):
            for ev in begun:
                await ev.wait()
        stop.set()  # every long stream hangs up
    if not all(ev.is_set() for ev in begun):
        return Outcome(name, "unsupported", f"not all {slots} long streams started")
    behind = None
    with trio.move_on_after(t.settle_s):
        behind = await _first_frame_s(t, short)
    if behind is None:
        return Outcome(name, "fail", f"a request sent after {slots} hang-ups did not start "
                       f"within {t.settle_s} s (alone: {alone:.2f} s)",
                       ({"request": long_body(t), "slots": slots},))
    return Outcome(name, "pass", f"a request sent after {slots} hang-ups started in "
                   f"{behind:.2f} s ({alone:.2f} s alone; no gauge, --slots {slots})")


async def _first_frame_s(t: Target, body: dict[str, Any]) -> float | None:
    seen = await t.send(COMPLETIONS, body, hangup_after_frames=1)
    return seen.frames[0].t if seen.status == 200 and seen.frames else None


async def eager_reader(t: Target, body: dict[str, Any], stop: trio.Event,
                       begun: trio.Event | None = None) -> None:
    """A stream read eagerly until `stop`, then closed: a hang-up. `begun` is set once the
    first bytes of a 200 arrive; a refusal or a dropped connection leaves it unset."""
    async def read() -> None:
        with contextlib.suppress(httpx.HTTPError):
            async with t.client.stream("POST", t.url + COMPLETIONS, json=body) as resp:
                async for _ in resp.aiter_bytes():
                    if begun is not None and resp.status_code == 200:
                        begun.set()

    async with trio.open_nursery() as inner:
        inner.start_soon(read)
        await stop.wait()
        inner.cancel_scope.cancel()


async def started(t: Target, n: int) -> bool:
    """Wait until `n` requests run, by the gauge where there is one (False: not within
    settle_s), else for two seconds."""
    if await running(t) is None:
        await trio.sleep(2.0)
        return True
    with trio.move_on_after(t.settle_s):
        while True:  # polling: the gauge is the other server's, no event to wait on
            if (await running(t) or 0) >= n:
                return True
            await trio.sleep(0.05)
    return False
