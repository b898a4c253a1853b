"""Each check of `sim replay --target` against a toy server (tests/support/toy_server.py) on
a real Hypercorn socket: sound, every check passes; with each fault, the check that looks
for it fails, and shows the evidence.

The toy says a fixed text cut into three-byte tokens, so every emoji and CJK character is
split across tokens, as byte-level BPE splits them. Its ticks are 2 ms, so a check runs in
well under a second; the settle and phase limits are shortened to match.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from support.toy_server import Toy

from sim.http.loopback import hypercorn_on_loopback
from sim.target import checks, load, pacing, run, traces, wire
from sim.target.outcome import Outcome, Report
from sim.target.run import Check
from sim.target.target import Target
from sim.trace.format import ClientSpec, FramesByStep, Read, Trace, TraceHeader, TraceRequest


@asynccontextmanager
async def toy_target(*faults: str) -> AsyncIterator[Target]:
    async with hypercorn_on_loopback(Toy(frozenset(faults))) as url, wire.make_client() as cl:
        yield Target(url, cl, "toy", settle_s=2.0, phase_timeout_s=2.0, window_s=4.0)


async def outcome(check: Check, *faults: str) -> Outcome:
    async with toy_target(*faults) as t:
        return await check(t)


ALL: tuple[Check, ...] = (checks.stream_equals_unary, checks.utf8_frames, checks.stop_strings,
                          checks.usage, load.hangup_frees_slot, pacing.slow_readers,
                          checks.bad_input)


async def test_a_sound_server_passes_every_check() -> None:
    async with toy_target() as t:
        results = [await c(t) for c in ALL]
    assert [(o.check, o.status) for o in results] == [
        ("stream = unary", "pass"), ("utf-8 frames", "pass"), ("stop strings", "pass"),
        ("usage", "pass"), ("hang-up frees its slot", "pass"),
        ("slow readers don't pace", "pass"), ("bad input", "pass")]
    # The UTF-8 check saw frames and split characters to judge (not a vacuous pass).
    frames, _, wide, *_ = results[1].detail.split()
    assert int(frames) > 10
    assert int(wide) > 0
    assert "non-ASCII" in results[1].detail


@pytest.mark.parametrize(("fault", "check", "why"), [
    ("split_char", checks.utf8_frames, "a character split"),
    ("empty_frames", checks.utf8_frames, "an empty delta frame"),
    ("stream_differs", checks.stream_equals_unary, "texts differ at character"),
    ("stop_ignored", checks.stop_strings, None),
    ("usage_wrong", checks.usage, "completion_tokens 49, 48 tokens streamed"),
    ("error_500", checks.bad_input, "a server error (500)"),
])
async def test_each_fault_fails_its_check(fault: str, check: Check, why: str | None) -> None:
    o = await outcome(check, fault)
    assert o.status == "fail", o
    assert o.evidence
    if why is not None:
        assert why in o.evidence[0]["why"]


async def test_a_stop_string_a_stream_ignores_is_shown_with_what_came_back() -> None:
    o = await outcome(checks.stop_strings, "stop_ignored")
    # Two paths (completions, chat), the unary answers right, the streams not.
    assert [(e["path"], e["stream"]) for e in o.evidence] == [
        ("/v1/completions", True), ("/v1/chat/completions", True)]
    for e in o.evidence:
        assert e["finish_reason"] == "length"
        assert e["got"].startswith(e["want"] + e["stop"])


async def test_a_server_that_ignores_a_hang_up_fails_with_its_gauge() -> None:
    o = await outcome(load.hangup_frees_slot, "ignore_hangup")
    assert o.status == "fail"
    assert o.detail == "still running 2.0 s after the client left"
    assert set(o.evidence[0]["running"]) == {1}


async def test_a_server_paced_by_slow_readers_fails() -> None:
    o = await outcome(pacing.slow_readers, "pacing")
    assert o.status == "fail"
    assert o.detail.startswith("beside eight slow readers a 64-token stream did not finish")


async def test_a_server_without_a_gauge_is_unsupported_for_hang_ups() -> None:
    async with toy_target() as t:
        t.url += "/nowhere"  # /metrics and /slots answer 404 there
        o = await load.hangup_frees_slot(t)
    assert (o.status, o.detail) == ("unsupported", "no running-requests gauge (/metrics, "
                                    "/slots); --slots N measures by queueing instead")


async def test_the_checks_run_on_trio_alone() -> None:
    # The harness's own clock: nothing in it may need asyncio (the server's world is trio).
    async with toy_target() as t:
        with trio.fail_after(30):
            assert (await checks.bad_input(t)).status == "pass"


def toy_trace(*bodies: dict[str, object], hangup_after: int | None = None,
              last_reads: Read = "eager") -> Trace:
    """Requests on the toy at step 0; the last one hung up after `hangup_after` frames where
    given, and reading as `last_reads`."""
    reqs = []
    for i, body in enumerate(bodies, start=1):
        last = i == len(bodies)
        client = ClientSpec(read=last_reads if last else "eager",
                            hangup_after_frames=hangup_after if last else None)
        reqs.append(TraceRequest(f"r{i}", "/v1/completions", {"model": "toy", **body},
                                 client, at_step=0))
    return Trace(TraceHeader("step", "toy", {}), tuple(reqs))


GREEDY = {"prompt": "東京 café", "max_tokens": 30, "temperature": 0}


@pytest.mark.parametrize(("fault", "check", "trace"), [
    ("", None, toy_trace(GREEDY, {**GREEDY, "stream": True})),
    ("", None, toy_trace({**GREEDY, "max_tokens": 2000, "stream": True}, hangup_after=3)),
    # A stream's twin is unary, without the stream_options a unary request may not carry.
    ("", None, toy_trace({**GREEDY, "stream": True, "stream_options": {"include_usage": True}})),
    # A reader that never reads and one that takes frames by a recorded pattern.
    ("", None, toy_trace(GREEDY, {**GREEDY, "max_tokens": 2000, "stream": True},
                         last_reads="never")),
    ("ignore_hangup", "trace: hang-ups free their slots",
     toy_trace(GREEDY, {**GREEDY, "max_tokens": 2000, "stream": True}, last_reads="never")),
    ("", None, toy_trace({**GREEDY, "stream": True},
                         last_reads=FramesByStep(((2, 1), (10, 3))))),
    ("stream_differs", "trace: stream = unary", toy_trace(GREEDY, {**GREEDY, "stream": True})),
    ("empty_frames", "trace: frames", toy_trace({**GREEDY, "stream": True})),
    ("error_500", "trace: no server errors", toy_trace(GREEDY, {"prompt": 5})),
    ("ignore_hangup", "trace: hang-ups free their slots",
     toy_trace({**GREEDY, "max_tokens": 2000, "stream": True}, hangup_after=3)),
])
async def test_each_trace_check_fails_on_its_fault(fault: str, check: str | None,
                                                  trace: Trace) -> None:
    async with toy_target(*([fault] if fault else [])) as t:
        outcomes = await traces.replay_at(t, trace, step_s=0.01)
    failed = [o.check for o in outcomes if o.status == "fail"]
    assert failed == ([check] if check else []), outcomes


@pytest.mark.parametrize(("faults", "status"), [((), "pass"), (("ignore_hangup",), "fail")])
async def test_without_a_gauge_a_hang_up_is_timed_by_a_queued_request(
        faults: tuple[str, ...], status: str) -> None:
    app = Toy(frozenset(faults), slots=2, metrics=False)
    async with hypercorn_on_loopback(app) as url, wire.make_client() as cl:
        t = Target(url, cl, "toy", settle_s=2.0, slots=2)
        o = await load.hangup_frees_slot(t)
    assert o.status == status, o
    assert o.detail.startswith("a request sent after 2 hang-ups")


async def test_a_check_the_server_breaks_is_a_fail_and_the_rest_still_run() -> None:
    async def broken() -> Outcome:
        raise KeyError("choices")

    got = await run.guarded("usage", broken)
    assert [(o.check, o.status) for o in got] == [("usage", "fail")]
    assert got[0].detail == "the check could not finish: KeyError: 'choices'"
    assert "KeyError" in got[0].evidence[0]["traceback"]


def test_a_report_with_a_lone_surrogate_prints() -> None:
    report = Report("http://x", {"model": "m"}, [Outcome("utf-8 frames", "fail", "1 split",
                                                         ({"frame": "caf\ud83d"},))])
    assert "caf\\ud83d" in report.table()
    assert report.dumps().encode("utf-8")
