"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Two sources:
- the scheduler's counters and gauges (`await client.stats()`), refreshed on each /metrics
  scrape and exported by `EngineStatsCollector` from the last snapshot;
- latencies the ingress sees in each stream (`RequestTimer`): time to first token, time per
  output token, end-to-end latency, and successful requests by finish reason.

`vllm:request_queue_time_seconds` is the scheduler's own histogram when its stats carry one
(`request_queue_time`, same shape as `iteration_tokens`); otherwise the ingress observes the
part of the queueing it can see: from the HTTP request's arrival to its submission.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagedserve.pipeline.ingress.lora_metrics import lora_requests_info

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# stats key -> (metric name, help); gauges first, then monotonically growing counters.
_GAUGES = {
    "num_requests_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "num_requests_swapped": ("vllm:num_requests_swapped", "Requests swapped out to the CPU."),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent."),
}
_COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("vllm:num_preemptions", "Preemptions (swap or recompute)."),
    "prompt_tokens": ("vllm:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Generation tokens processed."),
    "steps_planned_ahead": ("pagedserve:steps_planned_ahead",
                            "Steps planned while the step before ran (--async-scheduling)."),
}
# Only when n-gram speculation is on (--speculative-config): the scheduler's stats carry them.
_SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Draft verifications."),
    "spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",
                                        "Draft tokens accepted."),
}


# Only with KV tiers (--kv-offload-memory / --kv-offload-dir): per tier, host and disk.
_TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens served from the KV tier instead of computed.",
    "loads": "Blocks loaded from the KV tier into the device pool.",
    "stores": "Blocks stored into the KV tier.",
    "bytes": "Bytes moved to and from the KV tier.",
    "failures": "Blocks whose store or load failed (full disk, I/O error, corrupt file).",
}


def _kv_tiers(stats: dict[str, Any]) -> Iterator[Any]:
    for key, doc in _TIER_COUNTERS.items():
        fam = CounterMetricFamily(f"pagedserve:kv_tier_{key}", doc, labels=["tier"])
        for tier in ("host", "disk"):
            fam.add_metric([tier], float(stats.get(f"kv_{tier}_{key}", 0)))
        yield fam


def histogram_family(name: str, doc: str, model_name: str, data: dict[str, Any]) -> HistogramMetricFamily:
    """A histogram from {"buckets": upper bounds, "counts": cumulative, "sum", "count"}."""
    fam = HistogramMetricFamily(name, doc, labels=["model_name"])
    buckets = [(floatToGoString(le), int(c)) for le, c in zip(data.get("buckets", ()),
                                                              data.get("counts", ()))]
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", int(data.get("count", buckets[-1][1] if buckets else 0))))
    fam.add_metric([model_name], buckets, float(data.get("sum", 0.0)))
    return fam


class EngineStatsCollector:
    """Exports the last scheduler stats snapshot; a scrape refreshes it first (see app.py)."""

    def __init__(self, model_name: str, fallback_queue_time: Histogram):
        self.model_name = model_name
        self.snapshot: dict[str, Any] = {}
        self._fallback_queue_time = fallback_queue_time
        self.local_unknown: dict[str, int] = {}  # the ingress's engine client's drops, by type

    def collect(self) -> Iterator[Any]:
        stats = self.snapshot
        for key, (name, doc) in _GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], float(stats.get(key, 0)))
            yield fam
        for key, (name, doc) in _COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], float(stats.get(key, 0)))
            yield fam
        if "spec_decode_num_drafts" in stats:
            yield from self._speculation(stats)
        if "kv_host_loads" in stats:
            yield from _kv_tiers(stats)
        if "lora_running" in stats:
            yield lora_requests_info(stats)
        yield histogram_family("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                               self.model_name, stats.get("iteration_tokens") or {})
        yield self._unknown_messages(stats)
        restarts = CounterMetricFamily("pagedserve:process_restarts",
                                       "Restarts of each role since the scheduler started (the "
                                       "scheduler's own: since the group started).",
                                       labels=["role"])
        for role, count in sorted((stats.get("restarts") or {}).items()):
            restarts.add_metric([str(role)], float(count))
        yield restarts
        if stats.get("request_queue_time"):
            yield histogram_family("vllm:request_queue_time_seconds",
                                   "Time requests spent waiting to be scheduled.",
                                   self.model_name, stats["request_queue_time"])
        else:
            yield from self._fallback_queue_time.collect()


    def _speculation(self, stats: dict[str, Any]) -> Iterator[Any]:
        for key, (name, doc) in _SPEC_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], float(stats.get(key, 0)))
            yield fam
        fam = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position.",
                                  labels=["model_name", "position"])
        for pos, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            fam.add_metric([self.model_name, str(pos)], float(count))
        yield fam
        yield histogram_family("pagedserve:spec_decode_request_acceptance_rate",
                               "Each finished request's share of its draft tokens accepted.",
                               self.model_name, stats.get("spec_decode_request_acceptance") or {})

    def _unknown_messages(self, stats: dict[str, Any]) -> CounterMetricFamily:
        """Messages a process received and did not handle: every role's count as the scheduler
        gathered them, plus this ingress's own engine client."""
        fam = CounterMetricFamily("pagedserve:unknown_messages",
                                  "Messages a process received and did not handle (dropped).",
                                  labels=["role", "type"])
        for row in stats.get("unknown_messages") or ():
            fam.add_metric([str(row["role"]), str(row["type"])], float(row["count"]))
        for tag, count in sorted(self.local_unknown.items()):
            fam.add_metric(["ingress", tag], float(count))
        return fam


class IngressMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Time per output token between consecutive outputs of a sample.",
                              labels, registry=self.registry, buckets=TPOT_BUCKETS).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished samples by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        queue_time = Histogram("vllm:request_queue_time_seconds",
                               "Time from arrival at the ingress to submission to the engine.",
                               labels, registry=None, buckets=LATENCY_BUCKETS)
        self.queue_time = queue_time.labels(model_name)
        self.engine = EngineStatsCollector(model_name, queue_time)
        self.registry.register(self.engine)
        self._aborted = 0  # samples the client left unfinished (also request_success "abort")

    def count_aborted(self, num_samples: int) -> None:
        """Samples of a request whose client went away (or stopped it) before they finished:
        the engine aborts them, and no finish reason reaches this ingress."""
        if num_samples > 0:
            self._aborted += num_samples
            self.request_success.labels(self.model_name, "abort").inc(num_samples)

    def aborted_samples(self) -> int:
        return self._aborted

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> "RequestTimer":
        return RequestTimer(self, arrival)


class RequestTimer:
    """Timing of one engine request (all its n samples), fed with each delta as it arrives."""

    __slots__ = ("metrics", "arrival", "first_token", "last_token", "num_finished")

    def __init__(self, metrics: IngressMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.num_finished = 0

    def submitted(self, now: float) -> None:
        self.metrics.queue_time.observe(max(0.0, now - self.arrival))

    def on_delta(self, delta: Any, now: float) -> None:
        num_tokens = len(delta.token_ids)
        if num_tokens:
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.arrival)
            prev = self.last_token.get(delta.index)
            if prev is not None:
                self.metrics.tpot.observe((now - prev) / num_tokens)
            self.last_token[delta.index] = now
        if delta.finish_reason is not None:
            self.num_finished += 1
            self.metrics.request_success.labels(self.metrics.model_name, delta.finish_reason).inc()

    def finished(self, now: float) -> None:
        self.metrics.e2e.observe(now - self.arrival)

    def abandoned(self, num_samples: int) -> None:
        """The stream was closed before its `num_samples` samples all finished."""
        self.metrics.count_aborted(num_samples - self.num_finished)
