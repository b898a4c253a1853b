"""`/metrics`: Prometheus exposition through `prometheus_client`, one registry per app.

Names and buckets are vLLM's (`vllm:num_requests_running` is `nanoserve:num_requests_running`,
`vllm:time_to_first_token_seconds` keeps its buckets), so dashboards and tools built for vLLM
need only the prefix changed. The registry also holds prometheus_client's process, platform
and garbage-collector collectors, as a Python service's default registry does.

Every nanoserve metric is produced by one custom collector, at scrape time: gauges and the
engine's own counters (prefix cache, preemptions) from the bridge's statistics, request
counters and histograms from what the jobs reported as requests progressed. Why not
prometheus_client's own Counter and Histogram objects: each adds a `_created` sample stamped
with the wall clock (it can be switched off only for the whole process), which would make a
replay's /metrics differ from run to run. Durations come from `trio.current_time()`: real
seconds on a live server, modelled seconds under the virtual clock, so a replay's
histograms are as reproducible as its tokens.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.openmetrics import exposition as openmetrics

from nanoserve.bridge import BridgeStats
from nanoserve.engine.outputs import EngineStats, SpecStats, StepResult

PREFIX = "nanoserve:"
# vLLM's bucket bounds, in seconds (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

BridgeSource = Callable[[], BridgeStats | None]


@dataclass(slots=True)
class Histogram:
    """Observations by bucket: what HistogramMetricFamily is built from at a scrape."""

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

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += c
            out.append(("+Inf" if math.isinf(bound) else repr(bound), running))
        return out


class Metrics:
    def __init__(self, model_name: str, bridge: BridgeSource = lambda: None) -> None:
        """`bridge` gives the bridge's statistics at scrape time (None before the engine is
        up)."""
        self.model_name = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue = Histogram(REQUEST_BUCKETS)
        self.engine: EngineStats | None = None
        self._arrivals: dict[str, float] = {}  # engine request id -> arrival, until scheduled
        self._last_step_end: float | None = None
        self._bridge = bridge
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        for default in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            # The same collector objects the default registry holds: they keep no state.
            self.registry.register(default)

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

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format the scraper's Accept header
        asks for (OpenMetrics, or Prometheus text by default)."""
        encode, content_type = choose_encoder(accept or "")
        if content_type.startswith("application/openmetrics-text"):
            # prometheus_client 0.26 escapes a sample's name with the label-name alphabet,
            # which lacks ':', under OpenMetrics' default `escaping=underscores`: the samples
            # read nanoserve_x under a `# TYPE nanoserve:x` (client_python#1177, open). Every
            # name here is a valid legacy metric name, which underscore escaping leaves as it
            # is, so writing the names unescaped is what that escaping means.
            return openmetrics.generate_latest(self.registry, escaping=openmetrics.ALLOWUTF8,
                                               version="1.0.0"), content_type
        return encode(self.registry), content_type


class _Collector:
    """nanoserve's metric families, built from `Metrics` at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m, bridge, e = self.m, self.m._bridge(), self.m.engine
        labels, values = ["model_name"], [m.model_name]

        def one(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                help_: str, value: float) -> Metric:
            family = kind(PREFIX + name, help_, labels=labels)
            family.add_metric(values, value)
            return family

        def histogram(name: str, help_: str, h: Histogram) -> Metric:
            family = HistogramMetricFamily(PREFIX + name, help_, labels=labels)
            family.add_metric(values, h.cumulative(), h.total)
            return family

        usage = 0.0
        if bridge is not None and bridge.num_blocks:
            usage = 1.0 - bridge.free_blocks / bridge.num_blocks
        yield one(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
                  bridge.running if bridge else 0)
        yield one(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be "
                  "scheduled.", (bridge.waiting + bridge.queued) if bridge else 0)
        yield one(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in "
                  "use (0-1).", usage)
        yield one(CounterMetricFamily, "prefix_cache_queries", "Prefix-cache lookups.",
                  e.prefix_queries if e else 0)
        yield one(CounterMetricFamily, "prefix_cache_hits", "Prefix-cache hits.",
                  e.prefix_hits if e else 0)
        yield one(CounterMetricFamily, "num_preemptions", "Preemptions by the scheduler.",
                  bridge.preemptions if bridge else 0)
        if e is not None and e.spec is not None:
            yield from _speculative(one, labels, values, e.spec)
        yield one(CounterMetricFamily, "prompt_tokens", "Prompt tokens of finished requests.",
                  m.prompt_tokens)
        yield one(CounterMetricFamily, "generation_tokens", "Generated tokens.",
                  m.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished completions by "
                                      "reason.", labels=[*labels, "finished_reason"])
        for reason, count in sorted(m.success.items()):
            success.add_metric([*values, reason], count)
        yield success
        yield histogram("time_to_first_token_seconds", "Time to first token.", m.ttft)
        yield histogram("inter_token_latency_seconds", "Time between tokens.", m.itl)
        yield histogram("e2e_request_latency_seconds", "Arrival to last token.", m.e2e)
        yield histogram("request_queue_time_seconds", "Arrival to the step of the first "
                        "token.", m.queue)


def _speculative(one: Callable[..., Metric], labels: list[str], values: list[str],
                 spec: SpecStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, where the engine speculates."""
    yield one(CounterMetricFamily, "spec_decode_num_drafts", "Proposals checked.", spec.drafts)
    yield one(CounterMetricFamily, "spec_decode_num_draft_tokens", "Proposed tokens checked.",
              spec.draft_tokens)
    yield one(CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens kept.",
              spec.accepted_tokens)
    per = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                              "Proposed tokens kept, by position in the proposal.",
                              labels=[*labels, "position"])
    for position, count in enumerate(spec.accepted_per_position):
        per.add_metric([*values, str(position)], count)
    yield per
