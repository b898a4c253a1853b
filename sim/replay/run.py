"""`sim replay`: a trace through the real server on the step clock, checked and digested.

Python API (used by the CLI, the tests, and the recorder's round trip)::

    from sim.replay.run import replay
    result = replay("traces/burst16.jsonl")          # or a sim.trace.format.Trace
    result.ok              # True when nothing below is wrong
    result.mismatches      # ("r3 last_step: expected 16, got 41", "end invariant: ...", ...)
    result.digest          # sha256 of the observed outcome's canonical JSON
    result.outcome         # sim.trace.expect.Outcome: per request and end, as observed
    result.expectations()  # the outcome as expectation lines (what --update writes)
    result.summary()       # "16 requests, 40 steps, 512 tokens, 0 aborted, 0 preempted, ..."

`replay(trace, *, model=None, tokenizer=None, twin=True, cost=None, check_expectations=None)`

- `model`: None loads the header's model (once per process); a name ("stub", "smollm2", a
  path) loads that; a preloaded `Model` (with its `tokenizer`) is taken to be the header's.
  On a model other than the header's (or on weights whose digest differs from the header's
  `model_sha256`, with a warning) the app still serves the header's model name, and only
  the invariants and the twin are checked, not the expectation lines (`check_expectations`
  overrides that choice either way).
- `twin` (default on): the trace runs a second time with every stream made unary and every
  unary request made a stream, each hang-up kept at the step boundary where it happened in
  the first run; each request's token ids, finish reasons and steps, the text of every
  request that was not hung up, and the end totals must be identical.
- `cost`: the step-cost model of a virtual-clock trace (`sim.replay.setup.cost_function`:
  a callable, seconds per step, `{"constant_s": X}` or a JSON file); default: the header's
  `cost_model`, else a constant per step.

Faults the header declares (`"faults"`, sim/replay/faults.py) are injected in both runs, and its
`body_timeout` is the server's; a trace without them replays as it always has.

Mismatch lines name the request (or `end`) and the field; invariant lines say `invariant`,
twin lines say `twin`; `result.warnings` holds what is odd but not wrong (an `at_step` the
idle engine could not wait for, a weights digest that differs). `replay` runs its own
`trio.run` on `MockClock(autojump_threshold=0)`: from inside a Trio run, call it in a worker
thread (`trio.to_thread.run_sync`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import trio
import trio.testing

from nanoserve.model.base import Model
from nanoserve.tokenizer import Tokenizer
from sim.replay.driver import Driver, Observed
from sim.replay.setup import (
    CostFn,
    CostSpec,
    ReplayError,
    Weights,
    check_header,
    cost_function,
    torch_threads_for,
)
from sim.replay.setup import resolve_weights as resolve_weights
from sim.trace.expect import Outcome, compare, diff_value, expectation_lines
from sim.trace.format import ClientSpec, Expectation, Trace
from sim.trace.loader import load_trace

__all__ = ["ReplayError", "ReplayResult", "replay", "resolve_weights", "twin_trace"]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    trace: Trace
    outcome: Outcome
    mismatches: tuple[str, ...]
    warnings: tuple[str, ...]
    digest: str
    expectations_checked: bool
    twin_digest: str | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def expectations(self) -> list[Expectation]:
        return expectation_lines(self.outcome)

    def summary(self) -> str:
        o = self.outcome
        tokens = sum(r.completion_tokens for r in o.requests)
        return (f"{len(o.requests)} requests, {o.end.steps} steps, {tokens} tokens, "
                f"{o.end.aborted} aborted, {o.end.preemptions} preempted, "
                f"digest {self.digest[:16]}")


def replay(
    trace: Trace | str | os.PathLike[str],
    *,
    model: str | Model | None = None,
    tokenizer: Tokenizer | None = None,
    twin: bool = True,
    cost: CostSpec = None,
    check_expectations: bool | None = None,
    tensor_parallel_size: int = 1,
) -> ReplayResult:
    base: Path | None = None
    if not isinstance(trace, Trace):
        base = Path(trace).parent
        trace = load_trace(trace)
    check_header(trace.header)
    weights = resolve_weights(trace.header, model, tokenizer, tensor_parallel_size)
    check = weights.is_headers if check_expectations is None else check_expectations
    cost_fn: CostFn | None = None
    if trace.header.clock == "virtual":
        cost_fn = cost_function(cost if cost is not None else trace.header.cost_model, base)
    with torch_threads_for(weights):
        first = run_once(trace, weights, cost_fn)
        mismatches = compare(trace.expectations, first.outcome) if check else []
        mismatches += first.problems
        twin_digest = None
        if twin:
            second = run_once(twin_trace(trace, first.outcome), weights, cost_fn)
            mismatches += [f"twin {p}" for p in second.problems]
            mismatches += twin_mismatches(first.outcome, second.outcome)
            twin_digest = second.outcome.digest()
    warnings = (weights.warning,) if weights.warning else ()
    return ReplayResult(trace, first.outcome, tuple(mismatches), warnings + first.warnings,
                        first.outcome.digest(), check, twin_digest)


def run_once(trace: Trace, weights: Weights, cost: CostFn | None) -> Observed:
    """One run of the trace, in a fresh Trio run on a fresh engine."""

    async def main() -> Observed:
        return await Driver(trace, weights, cost).run()

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def twin_trace(trace: Trace, outcome: Outcome) -> Trace:
    """Streams made unary, unary requests made streams, every client an eager reader that
    hangs up at the boundary where the first run's client did. A request the first run
    refused (4xx) keeps its body: its twin must be refused the same way."""
    by_id = outcome.by_id()
    requests = []
    for r in trace.requests:
        seen = by_id[r.id]
        body = dict(r.body)
        if r.raw_body is not None:
            pass  # sent as the bytes it was: a body strict JSON cannot hold was refused
        elif seen.status is None or seen.status < 400:
            if body.get("stream") is True:
                del body["stream"]
                body.pop("stream_options", None)
            elif body.get("stream") in (None, False):
                body["stream"] = True
        # A stalled body stays stalled: its twin must be refused (408) the same way.
        client = ClientSpec(hangup_at_step=seen.hangup_step,
                            send_body_bytes=r.client.send_body_bytes, then=r.client.then)
        requests.append(dataclasses.replace(r, body=body, client=client))
    return Trace(trace.header, tuple(requests))


def twin_mismatches(first: Outcome, twin: Outcome) -> list[str]:
    """`expected` is the trace's own delivery mode, `got` the twin's."""
    out: list[str] = []
    for a, b in zip(first.requests, twin.requests, strict=True):
        hung = a.hangup_step is not None or b.hangup_step is not None
        # A failure after a stream's first frame is an error frame under status 200, and the
        # same failure is the unary twin's 5xx: the error must agree, the status cannot,
        # and neither client has the text the other read.
        failed = a.error is not None and a.error == b.error
        pairs: list[tuple[str, object, object]] = [
            ("status", a.status, b.status),
            ("error", a.error, b.error),
            ("first_token_step", a.first_token_step, b.first_token_step),
            ("last_step", a.last_step, b.last_step),
            ("aborted", a.aborted, b.aborted),
            ("choices", len(a.choices), len(b.choices)),
        ]
        if hung:
            pairs = pairs[2:]  # a client gone before the status line has none
        elif failed:
            pairs = pairs[1:]
        for i, (ca, cb) in enumerate(zip(a.choices, b.choices, strict=False)):
            at = f"choices[{i}]." if len(a.choices) > 1 else ""
            pairs += [(f"{at}token_ids", list(ca.token_ids), list(cb.token_ids)),
                      (f"{at}finish_reason", ca.finish_reason, cb.finish_reason)]
            if not (hung or failed):
                pairs.append((f"{at}text", ca.text, cb.text))
        for key, va, vb in pairs:
            line = diff_value(key.rpartition(".")[2], va, vb)
            if line is not None:
                out.append(f"{a.id} twin {key}: {line}")
    ea, eb = first.end.fields(), twin.end.fields()
    for key in ("steps", "free_blocks", "peak_used_blocks", "preemptions"):
        line = diff_value(key, ea[key], eb[key])
        if line is not None:
            out.append(f"end twin {key}: {line}")
    return out

