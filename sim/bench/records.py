"""Per-request records of `sim bench` and the summary computed from them.

The metrics follow vLLM's `bench serve` so that figures compare across servers:

- TTFT: from sending the request to its first content chunk.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request: the mean time per token
  after the first. A request of one token has none.
- ITL: every gap between consecutive content chunks, pooled over all requests. A server
  that holds a multi-byte character back sends two tokens in one chunk, so ITL counts
  chunk gaps and TPOT counts tokens; the two differ exactly there.
- E2E: from sending to the last byte of the response.

Percentiles interpolate linearly between order statistics (numpy's default, and vLLM's):
the p-th percentile of sorted x[0..n-1] is at rank p/100 * (n - 1).

Throughput divides by the bench's duration: from the first request sent to the last
response finished. Goodput (DistServe's term, as vLLM uses it) is the rate of requests that
succeeded *and* met every per-request SLO given: `ttft=2s,tpot=200ms,e2e=30s`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.stats import PERCENTILES, parse_slo_items, percentile

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What one request did, in seconds since the bench started."""

    id: str
    sent_s: float
    ok: bool = False
    status: int | None = None  # the HTTP status, None when no response came
    error: str | None = None
    ttft_s: float | None = None  # None: no content chunk arrived (or not streaming)
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_from: str = "chunks"  # "usage" when the server's usage gave the count
    chunks: int = 0  # content chunks
    hung_up: bool = False  # the trace asked the client to hang up, and it did

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "ok": self.ok, "status": self.status, "error": self.error,
            "sent_ms": _ms(self.sent_s), "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(self.tpot_s), "e2e_ms": _ms(self.e2e_s),
            "itl_ms": [_ms(x) for x in self.itl_s], "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "tokens_from": self.tokens_from,
            "chunks": self.chunks, "hung_up": self.hung_up,
        }  # fmt: skip


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 3)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """{mean, p50, p90, p99} in milliseconds, or None for no values."""
    if not values_s:
        return None
    out = {"mean": round(sum(values_s) / len(values_s) * 1000, 3)}
    for p in PERCENTILES:
        out[f"p{p}"] = round(percentile(values_s, p) * 1000, 3)
    return out


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=2s,tpot=200ms` -> {"ttft": 2.0, "tpot": 0.2} (seconds; sim/stats.py reads the
    items)."""
    return {metric: secs for metric, _, secs in parse_slo_items(text, SLO_KEYS,
                                                                  percentile=False)}


def meets_slo(r: RequestRecord, slo: Mapping[str, float]) -> bool:
    """A successful request within every threshold; a metric it lacks (no TPOT for a
    one-token answer) does not count against it."""
    if not r.ok:
        return False
    got = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    return all(got[k] is None or got[k] <= limit for k, limit in slo.items())  # type: ignore[operator]


def summarize(
    records: Iterable[RequestRecord], duration_s: float, slo: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The bench's figures. Latency distributions count only successful requests; a
    hang-up the trace asked for is neither a success nor a failure."""
    rs = list(records)
    ok = [r for r in rs if r.ok]
    failed = [r for r in rs if not r.ok and not r.hung_up]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "requests": len(rs), "completed": len(ok), "failed": len(failed),
        "hung_up": sum(r.hung_up for r in rs), "duration_s": round(duration_s, 3),
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": round(per_s(len(ok)), 4),
        "output_throughput": round(per_s(out_tokens), 2),
        "total_token_throughput": round(per_s(in_tokens + out_tokens), 2),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }  # fmt: skip
    if slo:
        good = sum(meets_slo(r, slo) for r in rs)
        summary["slo"] = {k: _ms(v) for k, v in slo.items()}  # thresholds in ms
        summary["good"] = good
        summary["goodput"] = round(per_s(good), 4)
    if failed:
        summary["first_errors"] = sorted({r.error or f"HTTP {r.status}" for r in failed})[:5]
    return summary
