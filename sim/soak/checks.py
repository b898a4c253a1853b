"""The soak's checks: quiescence by step count, idle state, counts, twins, and figures.

Each check returns the problems it found, one line each, so a run reports every failure at
once rather than the first; `sim.soak.run` runs them in order and collects the lines.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import trio
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.bridge import AsyncEngine, BridgeStats
from nanoserve.server import server_state
from nanoserve.server.jobs import Registry
from sim.soak import twin as soak_twin
from sim.soak.client import Outcome, Progress, request, run_all


async def jobs_close(registry: Registry, grace_s: float) -> list[str]:
    """Wait (at most `grace_s`) for the server to close every job once the clients have
    gone: a job left open keeps its requests running, for no one."""
    with trio.move_on_after(grace_s):
        await registry.wait_empty()
        return []
    return [f"{len(registry)} job(s) still open {grace_s} s after every client had gone"]


async def settle(bridge: AsyncEngine, progress: Progress) -> list[str]:
    """Wait for the bridge to go idle once every job has closed, allowing it ONE more step:
    the one a live thread may be running. Each job closed its streams, so every request
    still unfinished has its abort queued for the next boundary (docs/ARCHITECTURE.md: a stopped
    reader is a stopped request, proved by a step count). A request still running after
    that is held by nobody: its blocks are leaked until it runs out of tokens."""
    limit = progress.steps + 2
    late: list[str] = []
    async with trio.open_nursery() as nursery:

        async def idle() -> None:
            await bridge.wait_idle()
            nursery.cancel_scope.cancel()

        nursery.start_soon(idle)
        await progress.wait_steps(limit)
        s = bridge.statistics()
        late.append(f"the engine ran 2 more steps after the last job closed, with {s.running} "
                    f"running and {s.waiting} waiting (they end only at their max_tokens)")
        nursery.cancel_scope.cancel()
    return late


async def idle_problems(url: str, app: Any) -> list[str]:
    """Nothing running, waiting, queued or in flight; every KV block free (a prefix-cached
    block that no request holds counts as free); /health 200."""
    ready = server_state(app).ready
    assert ready is not None
    s, out = ready.bridge.statistics(), []
    busy = {k: getattr(s, k) for k in ("running", "waiting", "queued", "in_flight")}
    if any(busy.values()) or len(ready.registry):
        out.append(f"not idle: {busy}, {len(ready.registry)} jobs")
    if s.free_blocks != s.num_blocks:
        out.append(f"{s.num_blocks - s.free_blocks} KV blocks leaked")
    health = await request(url, "GET", "/health")
    if health.status != 200 or not s.healthy:
        out.append(f"/health {health.status}, bridge healthy={s.healthy}")
    return out


async def metric_aborts(url: str) -> int:
    """`request_success_total{finished_reason="abort"}` from /metrics: completions."""
    text = (await request(url, "GET", "/metrics")).body.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name == "nanoserve:request_success_total"
                    and s.labels.get("finished_reason") == "abort"):
                return int(s.value)
    raise ValueError("/metrics has no request_success_total for abort")


def count_problems(before: BridgeStats, after: BridgeStats, metric_aborts: int,
                   outcomes: list[Outcome]) -> list[str]:
    """Over the soak, the bridge admitted and ended every request once, aborted exactly the
    clients that hung up and failed none; /metrics counted each hang-up's n completions."""
    hung = [o for o in outcomes if o.hung_up]
    delta = {k: getattr(after, k) - getattr(before, k)
             for k in ("admitted", "completed", "aborted", "failed")}
    want = {"admitted": len(outcomes), "completed": len(outcomes), "aborted": len(hung),
            "failed": 0}
    out = []
    if delta != want:
        out.append(f"bridge counts over the soak: {delta}, expected {want}")
    if metric_aborts != sum(o.plan.n for o in hung):
        out.append(f"metrics: {metric_aborts} aborted completions, expected "
                   f"{sum(o.plan.n for o in hung)}")
    return out


def outcome_problems(outcomes: list[Outcome], progress: Progress) -> list[str]:
    """Each client did what its plan said: a hang-up left before its response was whole and
    its request was aborted rather than run to its end; every other client got all of its
    response (200, and a stream's [DONE]); no error anywhere."""
    out = []
    for o in outcomes:
        p, r, name = o.plan, o.reply, o.plan.request_id
        ended = progress.finish_reasons.get(p.engine_id)
        if o.error is not None:
            out.append(f"{name}: client error {o.error}")
        elif o.hung_up and ended is not None:
            out.append(f"{name}: hung up, yet its request ran on to its end ({ended})")
        elif (p.hangup is not None) != o.hung_up:
            out.append(f"{name}: planned {p.hangup or p.role}, but hung_up={o.hung_up} (read "
                       f"{len(r.events)} frames, complete={r.complete})")
        elif not o.hung_up and r.status != 200:
            out.append(f"{name}: status {r.status}: {bytes(r.body[:200])!r}")
        elif not o.hung_up and p.stream and not r.done:
            out.append(f"{name}: stream ended without [DONE]")
        elif any(e.startswith('{"error"') for e in r.events):
            out.append(f"{name}: error frame in its stream")
    return out


async def twin_problems(url: str, outcomes: list[Outcome],
                         progress: Progress) -> tuple[int, list[str]]:
    """Send every completed request again, unary, same body; compare. (twins, problems)"""
    done = [o for o in outcomes if not o.hung_up and o.error is None and o.reply.status == 200]
    twins = [dataclasses.replace(o.plan, tag="twin", role="eager",
                                 body=_unary_body(o.plan.body)) for o in done]
    replies = await run_all(url, twins, progress)
    out = []
    for o, twin in zip(done, replies, strict=True):
        name = o.plan.request_id
        if twin.error is not None or twin.reply.status != 200:
            out.append(f"{name}: unary twin failed: {twin.error or twin.reply.status}")
            continue
        try:
            mine = (soak_twin.from_stream(o.reply.events) if o.plan.stream
                    else soak_twin.from_unary(o.reply.json()))
        except ValueError as exc:
            out.append(f"{name}: unreadable response: {exc}")
            continue
        usage = not o.plan.stream or bool(o.plan.body.get("stream_options"))
        diffs = soak_twin.differences(mine, soak_twin.from_unary(twin.reply.json()), usage)
        out += [f"{name} vs its unary twin: {d}" for d in diffs]
    return len(done), out


def _unary_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["stream"] = False
    return out


def figures(clients: int, seed: int, outcomes: list[Outcome], stats: BridgeStats, wall: float,
            rss0: int, rss1: int, metric_aborts: int, twins: int) -> dict[str, Any]:
    """What `sim soak` prints. `stats` is the bridge's right after the soak (its `aborted`
    counts from server start; the warm-up aborts nothing); `wall` is the soak alone."""
    done = [o for o in outcomes if not o.hung_up and o.error is None]
    lags = [o.unread_at_end for o in outcomes if o.unread_at_end is not None]
    finishes = Counter(c["finish_reason"] for o in done if o.reply.status == 200
                       for c in _choices(o))
    return {
        "clients": clients,
        "seed": seed,
        "requests": len(outcomes),
        "completed": len(done),
        "streams_completed": sum(o.plan.stream for o in done),
        "hangups": sum(o.hung_up for o in outcomes),
        "hangups_by_kind": dict(Counter(o.plan.hangup for o in outcomes if o.hung_up)),
        "slow_readers": sum(o.plan.role == "slow" for o in outcomes),
        "slow_behind_at_end": sum(lag > 0 for lag in lags),
        "slow_max_frames_behind": max(lags, default=0),
        "sse_frames": sum(len(o.reply.events) for o in outcomes),  # [DONE] included
        "finish_reasons": dict(sorted(finishes.items())),
        "client_errors": sum(o.error is not None for o in outcomes),
        "bridge_aborted": stats.aborted,
        "metrics_aborted_completions": metric_aborts,
        "twins_compared": twins,
        "leaked_blocks": stats.num_blocks - stats.free_blocks,
        "num_blocks": stats.num_blocks,
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "rss_before_mib": round(rss0 / 2**20, 1),
        "rss_after_mib": round(rss1 / 2**20, 1),
        "rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "wall_s": round(wall, 2),
    }


def _choices(o: Outcome) -> list[dict[str, Any]]:
    try:
        got = soak_twin.from_stream(o.reply.events) if o.plan.stream else soak_twin.from_unary(
            o.reply.json())
    except ValueError:
        return []
    return list(got[0].values())
