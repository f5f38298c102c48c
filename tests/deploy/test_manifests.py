"""deploy/ offline: every manifest against the Kubernetes schemas (kubernetes-validate, strict:
unknown fields fail), the Prometheus operator's monitors against monitoring_schema.py, the
kustomizations against their folders, the dashboard against its generator, and the HPA's metric
against prometheus-adapter's rules. Which metric names a live engine exports is checked in
tests/e2e/test_http_openai.py (it has a running group)."""
from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy import deploy_files
from deploy.monitoring_schema import SCHEMAS

K8S_VERSION = "1.31.0"   # a cluster version the manifests must hold for (and anything newer)
NOT_KUBERNETES = {"Kustomization"}   # kustomize's own file: checked by test_kustomizations


def _name(item):
    path, doc = item
    return f"{path.relative_to(deploy_files.DEPLOY)}:{doc.get('kind')}/{doc['metadata']['name']}" \
        if "metadata" in doc else str(path.relative_to(deploy_files.DEPLOY))


DOCS = deploy_files.documents()


@pytest.mark.parametrize("item", DOCS, ids=[_name(d) for d in DOCS])
def test_manifest_validates(item):
    path, doc = item
    if doc["kind"] in NOT_KUBERNETES:
        return
    if doc["kind"] in SCHEMAS:
        jsonschema.validate(doc, SCHEMAS[doc["kind"]])
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_typo_is_caught():
    """The validation is strict: a misspelt field fails instead of being dropped."""
    hpa = next(doc for _, doc in DOCS if doc["kind"] == "HorizontalPodAutoscaler")
    bad = json.loads(json.dumps(hpa))
    bad["spec"]["minReplica"] = bad["spec"].pop("minReplicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="minReplica"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    monitor = next(doc for _, doc in DOCS if doc["kind"] == "PodMonitor")
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(bad, SCHEMAS["PodMonitor"])


def test_kustomizations():
    """Each kustomization lists every manifest of its folder and nothing missing, and what its
    configMapGenerator makes is a valid ConfigMap."""
    for path in deploy_files.DEPLOY.rglob("kustomization.yaml"):
        folder, kust = path.parent, yaml.safe_load(path.read_text())
        assert kust["kind"] == "Kustomization"
        listed = set(kust.get("resources", ()))
        on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == on_disk, f"{path}: listed {sorted(listed)}, present {sorted(on_disk)}"
        for gen in kust.get("configMapGenerator", ()):
            data = {}
            for entry in gen["files"]:
                key, _, source = entry.partition("=")
                data[key] = (folder / (source or key)).read_text()
            configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": gen["name"],
                                      "labels": gen.get("options", {}).get("labels", {})},
                         "data": data}
            kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)


def test_engine_pods_have_health_readiness_resources_and_shm():
    for _, doc in DOCS:
        if doc["kind"] not in ("Deployment", "StatefulSet") or \
                doc["metadata"]["labels"].get("app.kubernetes.io/component") != "engine":
            continue
        pod = doc["spec"]["template"]["spec"]
        (engine,) = pod["containers"]
        assert "/health" in json.dumps(engine["readinessProbe"]), doc["metadata"]["name"]
        assert {"cpu", "memory"} <= set(engine["resources"]["requests"])
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]


def test_dashboard_is_the_generators_output_and_has_the_panels():
    spec = importlib.util.spec_from_file_location("make_dashboard",
                                                  deploy_files.DEPLOY / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert deploy_files.DASHBOARD.read_text() == module.render(), \
        "deploy/base/grafana-dashboard.json is stale: run python deploy/make_dashboard.py"
    board = json.loads(deploy_files.DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in board["panels"])
    for topic in ("queue time", "running", "waiting", "batch size", "kv cache", "prefix cache",
                  "preemption", "errors", "first token", "per output token", "tokens per second"):
        assert topic in titles, topic
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["targets"] for p in board["panels"])


def test_hpa_metric_is_served_by_an_adapter_rule_from_the_queue():
    assert deploy_files.hpa_series() == {"vllm:num_requests_waiting"}


def test_metric_name_extraction():
    names = deploy_files.metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(vllm:a_bucket{x="y", p=~"$pod"}[5m]))) '
        '/ clamp_min(sum without (pod) (b_total offset 5m), 1) > bool 2')
    assert names == {"vllm:a_bucket", "b_total"}


def test_exported_series_reads_families_with_and_without_samples():
    text = ("# HELP a_total x\n# TYPE a_total counter\n"
            "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 2\nh_count 1\n"
            "# HELP g x\n# TYPE g gauge\ng 3\n")
    exported = deploy_files.exported_series(text)
    assert {"a_total", "h_bucket", "h_count", "g"} <= exported
    assert deploy_files.missing_from(exported, {"g", "h_bucket", "nope_total"}) == {"nope_total"}


def test_router_metrics_on_the_dashboard_are_the_routers():
    """The router_* series the dashboard queries are families the router's /metrics declares
    (its registry, rendered as the router serves it); the engines' are checked against a live
    engine in tests/e2e/test_http_openai.py."""
    used = deploy_files.used_metric_names("router")
    assert used, "the dashboard has no router panels"
    try:
        from pagedserve.pipeline.router.metrics import RouterMetrics
    except ImportError:
        pytest.skip("the router role (pagedserve.pipeline.router) is not in this tree")
    from prometheus_client import generate_latest
    text = generate_latest(RouterMetrics().registry).decode()
    assert deploy_files.missing_from(deploy_files.exported_series(text), used) == set()


def _serve_args(component: str):
    """(file, args) of every `pagedserve serve` container of the pods labelled `component`."""
    for path, doc in DOCS:
        if doc["kind"] not in ("Deployment", "StatefulSet") or \
                doc["metadata"]["labels"].get("app.kubernetes.io/component") != component:
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            assert container["command"] == ["pagedserve", "serve"], path
            # $(VAR) is the kubelet's expansion of the container's env: a number here
            yield path, [re.sub(r"\$\(\w+\)", "0", a) for a in container.get("args", ())]


def test_engine_containers_pass_flags_the_launcher_takes():
    from pagedserve.pipeline.cli_args import build_arg_parser
    found = list(_serve_args("engine"))
    assert len(found) >= 2     # the Deployment and the multi-host StatefulSet
    for path, args in found:
        try:
            build_arg_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{path}: `pagedserve serve {' '.join(args)}` does not parse")


def test_router_container_passes_flags_the_router_takes():
    try:
        from pagedserve.pipeline.router.config import build_parser, wants_router
    except ImportError:
        pytest.skip("the router role (pagedserve.pipeline.router) is not in this tree")
    found = list(_serve_args("router"))
    assert found
    for path, args in found:
        assert wants_router(args), f"{path}: `pagedserve serve {' '.join(args)}` starts an engine"
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{path}: the router's `{' '.join(args)}` does not parse")
