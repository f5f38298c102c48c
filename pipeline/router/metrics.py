"""The router's Prometheus metrics (`router_*`), in a registry of its own; each engine keeps
its `vllm:*` metrics on its own endpoint. /metrics is open: no label holds an API key, and a
local group is labelled by its name (`model/index`), not its URL (its port is for the router
only); a remote engine keeps the URL the operator gave (--engine-url) as its name."""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from pagedserve.pipeline.router.core import RouterCore


class RouterMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series: this process exports only these
        self.registry = r = CollectorRegistry()
        self.requests = Counter("router_requests", "Requests sent to each replica (retries too).",
                                ["model", "replica"], registry=r)
        self.affinity_hits = Counter("router_affinity_hits", "Requests that went to the replica "
                                     "their prefix hashes to.", ["model"], registry=r)
        self.spills = Counter("router_spills", "Requests sent elsewhere because the prefix's "
                              "replica was over its load bound (or down).", ["model"], registry=r)
        self.retries = Counter("router_retries", "Requests sent again after a replica failed "
                               "(streams resumed where they were).", ["model"], registry=r)
        self.rejected = Counter("router_rejected", "Requests refused by the router.",
                                ["reason"], registry=r)
        self.replica_up = Gauge("router_replica_up", "1 while the replica answers its health "
                                "check.", ["model", "replica"], registry=r)
        self.outstanding = Gauge("router_replica_outstanding_tokens", "Prompt and generation "
                                 "tokens in flight on each replica (the load bound's measure).",
                                 ["model", "replica"], registry=r)
        self.replica_restarts = Counter("router_replica_restarts", "Local engine groups "
                                        "restarted after they died.", ["model"], registry=r)
        self.model_loaded = Gauge("router_model_loaded", "1 while the model's engine groups are "
                                  "loaded.", ["model"], registry=r)
        self.model_loads = Counter("router_model_loads", "Model loads (cold starts).", ["model"],
                                   registry=r)
        self.model_evictions = Counter("router_model_evictions", "Models unloaded to make room "
                                       "(least recently used first).", ["model"], registry=r)
        self.cold_start = Histogram("router_model_cold_start_seconds", "Time from starting a "
                                    "model's engine groups until they answer.", ["model"],
                                    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=r)

    def render(self, core: RouterCore) -> bytes:
        for gauge in (self.replica_up, self.outstanding):
            gauge.clear()  # replicas come and go (evicted models, restarted groups)
        for replica in core.replicas.values():
            labels = (replica.model, replica.replica_id)
            self.replica_up.labels(*labels).set(1 if replica.healthy else 0)
            self.outstanding.labels(*labels).set(replica.outstanding_tokens)
        return generate_latest(self.registry)
