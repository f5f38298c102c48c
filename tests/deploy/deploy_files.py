"""What deploy/ holds, read for the tests: its YAML documents, the dashboard's PromQL, and the
Prometheus metric names the dashboard and the HPA (through prometheus-adapter's rules) query."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "base" / "grafana-dashboard.json"
ADAPTER_RULES = DEPLOY / "base" / "prometheus-adapter-rules.yaml"

# PromQL words that look like metric names but are not (functions are followed by '(').
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                 "unless", "bool", "offset", "le", "inf", "nan"}
_IDENT = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")


def manifest_files() -> list[Path]:
    return sorted(DEPLOY.rglob("*.yaml"))


def documents() -> list[tuple[Path, dict]]:
    """Every YAML document under deploy/, with its file."""
    return [(path, doc) for path in manifest_files()
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: label matchers, grouping lists, range and
    offset brackets, strings and Grafana's $variables are cut out first; what is left and not a
    function call or keyword is a metric name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end():].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard_queries(dashboard: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and variable queries."""
    board = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    for var in board["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query or "")
        if inner:
            exprs.append(inner.group(1))
    return exprs


def adapter_rules() -> list[dict]:
    config = yaml.safe_load(ADAPTER_RULES.read_text())
    return yaml.safe_load(config["data"]["config.yaml"])["rules"]


def adapter_metric(rule: dict) -> tuple[str, str]:
    """(Prometheus series the rule reads, custom-metrics API name it serves)."""
    (series,) = metric_names(rule["seriesQuery"])
    pattern, replacement = rule["name"]["matches"], rule["name"]["as"]
    served = re.sub(pattern, replacement.replace("${", "\\g<").replace("}", ">"), series)
    return series, served


def hpa_series() -> set[str]:
    """The Prometheus series behind every custom metric an HPA under deploy/ scales on."""
    served = {adapter_metric(rule)[1]: adapter_metric(rule)[0] for rule in adapter_rules()}
    wanted = set()
    for _, doc in documents():
        if doc.get("kind") != "HorizontalPodAutoscaler":
            continue
        for metric in doc["spec"]["metrics"]:
            spec = metric.get("pods") or metric.get("object") or metric.get("external")
            if spec is None:
                continue
            name = spec["metric"]["name"]
            if name not in served:
                raise AssertionError(f"the HPA scales on {name!r}, which no prometheus-adapter "
                                     f"rule serves (served: {sorted(served)})")
            wanted.add(served[name])
    return wanted


def used_metric_names(exporter: str = "engine") -> set[str]:
    """Every series name the dashboard and the HPA need from an engine (`vllm:*`,
    `pagedserve:*`) or from the router (`router_*`), as Prometheus stores it (counters with
    _total, histograms as _bucket/_sum/_count)."""
    names = set()
    for expr in dashboard_queries():
        names |= metric_names(expr)
    names |= hpa_series()
    router = {name for name in names if name.startswith("router_")}
    return router if exporter == "router" else names - router


_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count"), "gauge": ("",), "untyped": ("",)}


def exported_series(metrics_text: str) -> set[str]:
    """Every series name a /metrics page declares: each family's samples as Prometheus stores
    them, also for a family with no sample yet (a labelled counter before its first event)."""
    from prometheus_client.parser import text_string_to_metric_families
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names |= {family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def missing_from(exported: set[str], names: set[str]) -> set[str]:
    return {name for name in names if name not in exported}
