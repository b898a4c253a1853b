"""`/metrics`: Prometheus text exposition (format 0.0.4), written by hand.

Names follow vLLM's (`vllm:num_requests_running` becomes `nanoserve:num_requests_running`),
so dashboards built for vLLM need only the prefix changed. Gauges are read from the bridge's
statistics at scrape time; counters and histograms are fed as requests progress. Durations
come from `trio.current_time()`: real seconds on a live server, modelled seconds under the
virtual clock, so a replay's histograms are as reproducible as its tokens.

The format is small enough not to need `prometheus_client`: per metric a `# HELP` and a
`# TYPE` line, then samples `name{label="value"} number`; a histogram is cumulative
`_bucket{le=...}` samples ending in `le="+Inf"`, then `_sum` and `_count`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nanoserve.engine import EngineStats, StepResult
from nanoserve.serving import BridgeStats

PREFIX = "nanoserve:"
# Bucket bounds in seconds, close to vLLM's: fine near a step's duration, coarse beyond.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, then one for > last bound
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: bound >= value
        self.total += value
        self.count += 1


def _num(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    esc = (
        (k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in labels.items()
    )
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc) + "}"


class Exposition:
    """Accumulates metric families as text lines."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str,
               samples: Iterable[tuple[str, Mapping[str, str], float]]) -> None:
        full = PREFIX + name
        self.lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
        for suffix, extra, value in samples:
            self.lines.append(f"{full}{suffix}{_labels({**self.labels, **extra})} {_num(value)}")

    def scalar(self, name: str, kind: str, help_: str, value: float) -> None:
        self.family(name, kind, help_, [("", {}, value)])

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        samples: list[tuple[str, Mapping[str, str], float]] = []
        running = 0
        for bound, c in zip((*h.bounds, math.inf), h.counts, strict=True):
            running += c
            samples.append(("_bucket", {"le": _num(bound)}, running))
        samples += [("_sum", {}, h.total), ("_count", {}, h.count)]
        self.family(name, "histogram", help_, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)
        self.engine: EngineStats | None = None
        self._arrivals: dict[str, float] = {}  # engine request id -> arrival, until scheduled
        self._last_step_end: float | None = None

    # -- fed by jobs ---------------------------------------------------------------------------

    def arrived(self, request_id: str, t: float) -> None:
        self._arrivals[request_id] = t

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int) -> None:
        self.generation_tokens += n

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, reasons: list[str], prompt_tokens: int, seconds: float) -> None:
        for r in reasons:
            self.success[r] = self.success.get(r, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.e2e.observe(seconds)

    # -- fed by the bridge's loop, after each step -------------------------------------------

    def on_step(self, result: StepResult, engine: EngineStats, now: float) -> None:
        """Queue time is arrival to the start of the step that produced the first token.
        The engine does not report step start times; the end of the previous step is the
        start of this one when the loop is busy, and an idle loop starts a step as soon as
        work arrives, hence max(previous end, arrival)."""
        for u in result.updates:
            arrival = self._arrivals.pop(u.request_id, None)
            if arrival is not None:
                start = arrival if self._last_step_end is None else max(
                    arrival, self._last_step_end)
                self.queue.observe(start - arrival)
        self._last_step_end = now
        self.engine = engine

    def forget(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)

    # -- the scrape ----------------------------------------------------------------------------

    def render(self, bridge: BridgeStats | None) -> str:
        out = Exposition({"model_name": self.model_name})
        running = bridge.running if bridge else 0
        waiting = (bridge.waiting + bridge.queued) if bridge else 0
        usage = 0.0
        if bridge is not None and bridge.num_blocks:
            usage = 1.0 - bridge.free_blocks / bridge.num_blocks
        out.scalar("num_requests_running", "gauge", "Requests in the running batch.", running)
        out.scalar("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", waiting)
        out.scalar("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0-1).",
                   usage)
        e = self.engine
        out.scalar("prefix_cache_queries_total", "counter", "Prefix-cache lookups.",
                   e.prefix_queries if e else 0)
        out.scalar("prefix_cache_hits_total", "counter", "Prefix-cache hits.",
                   e.prefix_hits if e else 0)
        out.scalar("num_preemptions_total", "counter", "Preemptions by the scheduler.",
                   bridge.preemptions if bridge else 0)
        out.scalar("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   self.prompt_tokens)
        out.scalar("generation_tokens_total", "counter", "Generated tokens.",
                   self.generation_tokens)
        out.family("request_success_total", "counter", "Finished completions by reason.",
                   [("", {"finished_reason": r}, c) for r, c in sorted(self.success.items())])
        out.histogram("time_to_first_token_seconds", "Time to first token.", self.ttft)
        out.histogram("inter_token_latency_seconds", "Time between tokens.", self.itl)
        out.histogram("e2e_request_latency_seconds", "Arrival to last token.", self.e2e)
        out.histogram("request_queue_time_seconds", "Arrival to the step of the first token.",
                      self.queue)
        return out.text()
