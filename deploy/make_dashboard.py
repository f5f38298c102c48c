"""Writes deploy/base/grafana-dashboard.json: `python deploy/make_dashboard.py`.

The panels are listed here, once, as (title, unit, [(PromQL, legend)]); the JSON is what Grafana
imports (the kustomize base ships it in a ConfigMap for Grafana's dashboard sidecar).
tests/deploy/ checks the file is this script's output and that every metric it queries is one a
live engine exports.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "base" / "grafana-dashboard.json"
SEL = '{model_name=~"$model_name", pod=~"$pod"}'
RATE = "[$__rate_interval]"


def quantiles(metric: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}{RATE})))",
             f"p{round(q * 100)}") for q in qs]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests running / waiting / swapped", "short", [
        (f"sum by (pod) (vllm:num_requests_running{SEL})", "running {{pod}}"),
        (f"sum by (pod) (vllm:num_requests_waiting{SEL})", "waiting {{pod}}"),
        (f"sum by (pod) (vllm:num_requests_swapped{SEL})", "swapped {{pod}}")]),
    ("Queue time (arrival to first schedule)", "s",
     quantiles("vllm:request_queue_time_seconds", (0.5, 0.99))),
    ("Batch size (tokens per engine step)", "short", [
        (f"sum(rate(vllm:iteration_tokens_total_sum{SEL}{RATE})) / "
         f"sum(rate(vllm:iteration_tokens_total_count{SEL}{RATE}))", "mean"),
        *quantiles("vllm:iteration_tokens_total", (0.5, 0.99))]),
    ("KV cache usage", "percentunit", [
        (f"max by (pod) (vllm:kv_cache_usage_perc{SEL})", "{{pod}}")]),
    ("Prefix cache hit rate (prompt tokens)", "percentunit", [
        (f"sum(rate(vllm:prefix_cache_hits_total{SEL}{RATE})) / "
         f"clamp_min(sum(rate(vllm:prefix_cache_queries_total{SEL}{RATE})), 1)", "hit rate")]),
    ("Preemptions per second", "short", [
        (f"sum by (pod) (rate(vllm:num_preemptions_total{SEL}{RATE}))", "{{pod}}")]),
    ("Errors: aborted requests, process restarts, dropped messages", "short", [
        (f'sum(rate(vllm:request_success_total{{model_name=~"$model_name", pod=~"$pod", '
         f'finished_reason="abort"}}{RATE}))', "aborted / s"),
        ('sum by (role) (increase(pagedserve:process_restarts_total{pod=~"$pod"}[5m]))',
         "restarts of {{role}} (5 min)"),
        (f'sum by (role) (rate(pagedserve:unknown_messages_total{{pod=~"$pod"}}{RATE}))',
         "dropped by {{role}} / s")]),
    ("Time to first token", "s", quantiles("vllm:time_to_first_token_seconds")),
    ("Time per output token", "s", quantiles("vllm:time_per_output_token_seconds")),
    ("End-to-end request latency", "s", quantiles("vllm:e2e_request_latency_seconds")),
    ("Tokens per second", "short", [
        (f"sum(rate(vllm:prompt_tokens_total{SEL}{RATE}))", "prompt (prefill)"),
        (f"sum(rate(vllm:generation_tokens_total{SEL}{RATE}))", "generated")]),
    ("Finished requests per second, by reason", "reqps", [
        (f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}{RATE}))",
         "{{finished_reason}}")]),
]
# The router's own /metrics (router_*), scraped through its ServiceMonitor.
ROUTER_PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Router: requests per replica", "reqps", [
        ("sum by (replica) (rate(router_requests_total[$__rate_interval]))", "{{replica}}")]),
    ("Router: prefix affinity hits, spills, retries", "reqps", [
        ("sum(rate(router_affinity_hits_total[$__rate_interval]))", "affinity hits"),
        ("sum(rate(router_spills_total[$__rate_interval]))", "spills (over the load bound)"),
        ("sum(rate(router_retries_total[$__rate_interval]))", "retries (replica failed)"),
        ("sum by (reason) (rate(router_rejected_total[$__rate_interval]))",
         "rejected: {{reason}}")]),
    ("Router: outstanding tokens per replica", "short", [
        ("sum by (replica) (router_replica_outstanding_tokens)", "{{replica}}")]),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def variable(name: str, query: str) -> dict:
    return {"name": name, "type": "query", "label": name, "includeAll": True, "multi": True,
            "allValue": ".*", "current": {"text": "All", "value": "$__all"},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-values"}, "refresh": 2}


def dashboard() -> dict:
    return {
        "uid": "pagedserve-engine", "title": "pagedserve engines", "schemaVersion": 39,
        "version": 1, "editable": True, "tags": ["pagedserve", "llm-serving"],
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "data source"},
            variable("model_name", "label_values(vllm:num_requests_running, model_name)"),
            variable("pod", 'label_values(vllm:num_requests_running{model_name=~"$model_name"}, pod)'),
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS + ROUTER_PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
