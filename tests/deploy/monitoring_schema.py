"""JSON schemas for the Prometheus operator's PodMonitor and ServiceMonitor
(monitoring.coreos.com/v1), which kubernetes-validate does not know (they are CRDs).

Written for the fields deploy/ uses, with the types and required fields of the operator's CRDs;
any other field is refused, so a typo fails here instead of being ignored by the cluster.
"""
from __future__ import annotations

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": _LABELS,
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False,
        "properties": {"key": {"type": "string"},
                       "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                          r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_ENDPOINT = {"type": "object", "additionalProperties": False, "properties": {
    "port": {"type": "string"}, "path": {"type": "string"}, "interval": _DURATION,
    "scrapeTimeout": _DURATION, "scheme": {"enum": ["http", "https"]},
    "honorLabels": {"type": "boolean"}}}
_METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
    "namespace": {"type": "string"}, "labels": _LABELS, "annotations": _LABELS}}


def _monitor(kind: str, endpoints_field: str) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False, "properties": {
                "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                "metadata": _METADATA,
                "spec": {"type": "object", "required": ["selector", endpoints_field],
                         "additionalProperties": False, "properties": {
                             "selector": _SELECTOR, "jobLabel": {"type": "string"},
                             "namespaceSelector": {"type": "object"},
                             endpoints_field: {"type": "array", "minItems": 1,
                                               "items": _ENDPOINT}}}}}


SCHEMAS = {"PodMonitor": _monitor("PodMonitor", "podMetricsEndpoints"),
           "ServiceMonitor": _monitor("ServiceMonitor", "endpoints")}
