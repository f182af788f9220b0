"""The Helm chart, rendered without helm: a small Go helper (tests/support/helm_render) runs Go's own
text/template with the Sprig functions the chart uses. Every rendered object must load into the
official kubernetes client's models without losing a field, the gateway config in the ConfigMap
must pass the gateway's own config loader, and values.yaml must satisfy values.schema.json."""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes
import pytest

from gateway.config.schema import parse_config
from tests.support.helm import CHART, ROOT, by_kind, chart_values, render

MODELS = {  # kind -> the official client's model
    "ConfigMap": "V1ConfigMap", "Deployment": "V1Deployment", "Service": "V1Service",
    "ServiceAccount": "V1ServiceAccount", "Role": "V1Role", "RoleBinding": "V1RoleBinding",
    "ClusterRole": "V1ClusterRole", "ClusterRoleBinding": "V1ClusterRoleBinding",
    "HorizontalPodAutoscaler": "V2HorizontalPodAutoscaler", "PodDisruptionBudget": "V1PodDisruptionBudget",
}


def load_into_official_model(doc: dict):
    """Deserialize into the official client's model and serialize back: a field the model does
    not know (a typo, a wrong nesting) would be dropped, and the round trip would differ."""
    obj = {k: v for k, v in doc.items() if k != "__template"}
    api = kubernetes.client.ApiClient()
    model = api._ApiClient__deserialize(obj, MODELS[obj["kind"]])
    again = api.sanitize_for_serialization(model)
    assert again == obj, f"{doc['__template']}: fields lost or changed by the {MODELS[obj['kind']]} model"
    return model


def gateway_config(docs: list[dict]):
    cm = by_kind(docs)["ConfigMap"][0]
    return parse_config(cm["data"]["config.yaml"], source="configmap")


# -- values -------------------------------------------------------------------------------------


def test_values_yaml_satisfies_its_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(chart_values())
    jsonschema.Draft7Validator(schema).validate(chart_values(PD_HPA_ALL_NS))


@pytest.mark.parametrize("bad", [
    {"replicaCount": -1},
    {"image": {"pullPolicy": "Sometimes"}},
    {"drain": {"graceSeconds": "30"}},
    {"discovery": {"namespaces": ["Not_A_Namespace"]}},
    {"discovery": {"allNamespaces": True, "namespaces": ["a"]}},
    {"discovery": {"models": {"m": {"combined": "yes"}}}},
    {"config": {"server": {"log_level": "debug"}}},        # the chart owns server/listen/kubernetes
    {"serviceMonitor": {"interval": "often"}},
    {"replicas": 3},                                         # a typo of replicaCount
    {"dashboards": {"enable": True}},
    {"dashboards": {"label": "not a label"}},
    {"prometheusRule": {"alerts": {"errorRatio": {"threshold": 5}}}},       # a ratio
    {"prometheusRule": {"alerts": {"ttftP99": {"for": "1.5m"}}}},            # not a Prometheus duration
    {"prometheusRule": {"alerts": {"watchdogFires": {"window": None}}}},
    {"prometheusRule": {"extraRules": [{"expr": "up == 0"}]}},               # neither alert nor record
])
def test_schema_rejects_bad_values(bad):
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(chart_values(bad))


# -- rendering ----------------------------------------------------------------------------------


def test_default_render(helm_render, tmp_path):
    docs = render(helm_render, tmp=tmp_path)
    kinds = by_kind(docs)
    assert sorted(kinds) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Role", "RoleBinding", "Service",
                             "ServiceAccount"]
    for d in docs:
        load_into_official_model(d)
        assert d["metadata"]["name"].startswith("sy-switchyard")
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "sy"

    cfg = gateway_config(docs)
    assert cfg.kubernetes.enabled and cfg.kubernetes.kubeconfig is None
    assert cfg.kubernetes.namespaces == ("llm",)          # the release namespace by default
    assert cfg.kubernetes.label_selector == "model.aibrix.ai/name"
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 8888)
    assert cfg.server.log_format == "json" and cfg.routing.strategy == "least-request"

    dep = kinds["Deployment"][0]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "switchyard:0.1.0"
    assert c["args"] == ["--config", "/etc/switchyard/config.yaml"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8888, "protocol": "TCP"}]
    # the drain fits in the kill deadline: preStop sleep + the gateway's grace + margin
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + cfg.server.shutdown_grace_s
    assert cfg.server.drain_delay_s <= cfg.server.shutdown_grace_s
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["serviceAccountName"] == "sy-switchyard" and pod["automountServiceAccountToken"] is True
    assert len(dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]) == 64
    assert dep["spec"]["selector"]["matchLabels"] == kinds["Service"][0]["spec"]["selector"]

    role, binding = kinds["Role"][0], kinds["RoleBinding"][0]
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sy-switchyard", "namespace": "llm"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


PD_HPA_ALL_NS = {
    "discovery": {"allNamespaces": True, "models": {"qwen3-8b": {"combined": True, "max_prompt_tokens": 2048}}},
    "config": {"routing": {"strategy": "least-request"},
               "pd": {"prefill_timeout_s": 20},
               "models": [{"name": "qwen3-8b", "engine": "sglang", "strategy": "pd"},
                          {"name": "llama-8b", "strategy": "prefix-cache:2,least-request:1"}]},
    "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12, "targetCPUUtilizationPercentage": 60},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "podDisruptionBudget": {"minAvailable": "50%"},
    "drain": {"preStopSleepSeconds": 0, "delaySeconds": 5, "graceSeconds": 120},
    "image": {"repository": "registry.example/switchyard", "tag": "1.2.3"},
    "extraEnv": [{"name": "OTEL_EXPORTER_OTLP_CERTIFICATE", "value": "/etc/otel-ca/ca.crt"}],
    "extraVolumes": [{"name": "otel-ca", "secret": {"secretName": "collector-ca"}}],
    "extraVolumeMounts": [{"name": "otel-ca", "mountPath": "/etc/otel-ca", "readOnly": True}],
}


def test_pd_hpa_all_namespaces_render(helm_render, tmp_path):
    docs = render(helm_render, PD_HPA_ALL_NS, release="gw", namespace="gateway", tmp=tmp_path)
    kinds = by_kind(docs)
    assert "Role" not in kinds and "RoleBinding" not in kinds
    assert {"ClusterRole", "ClusterRoleBinding", "HorizontalPodAutoscaler", "ServiceMonitor"} <= set(kinds)
    for d in docs:
        if d["kind"] != "ServiceMonitor":           # a CRD: the official client has no model for it
            load_into_official_model(d)

    cfg = gateway_config(docs)
    assert cfg.kubernetes.namespaces == ()          # all namespaces
    assert cfg.kubernetes.models["qwen3-8b"].combined and cfg.kubernetes.models["qwen3-8b"].max_prompt_tokens == 2048
    assert cfg.model("qwen3-8b").strategy == "pd" and cfg.model("qwen3-8b").endpoints == ()
    assert cfg.pd.prefill_timeout_s == 20 and cfg.server.shutdown_grace_s == 120

    dep = kinds["Deployment"][0]
    assert "replicas" not in dep["spec"]            # the HPA owns it
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "lifecycle" not in c and c["image"] == "registry.example/switchyard:1.2.3"
    # a collector's CA from a Secret: the volume beside the chart's own, mounted beside theirs
    pod = dep["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["config", "tmp", "otel-ca"]
    assert pod["volumes"][2]["secret"] == {"secretName": "collector-ca"}
    assert c["volumeMounts"][-1] == {"name": "otel-ca", "mountPath": "/etc/otel-ca", "readOnly": True}
    assert {"name": "OTEL_EXPORTER_OTLP_CERTIFICATE", "value": "/etc/otel-ca/ca.crt"} in c["env"]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 125
    hpa = kinds["HorizontalPodAutoscaler"][0]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"], hpa["scaleTargetRef"]["name"]) == (3, 12, "gw-switchyard")
    assert hpa["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    assert kinds["PodDisruptionBudget"][0]["spec"] == {
        "minAvailable": "50%", "selector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
    crb = kinds["ClusterRoleBinding"][0]
    assert crb["subjects"][0] == {"kind": "ServiceAccount", "name": "gw-switchyard", "namespace": "gateway"}
    assert kinds["ClusterRole"][0]["rules"][0]["verbs"] == ["get", "list", "watch"]
    sm = kinds["ServiceMonitor"][0]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s",
                                          "honorLabels": True}


def test_listed_namespaces_get_a_role_each_and_static_only_needs_no_rbac(helm_render, tmp_path):
    docs = render(helm_render, {"discovery": {"namespaces": ["engines-a", "engines-b"]}}, tmp=tmp_path)
    kinds = by_kind(docs)
    assert sorted(r["metadata"]["namespace"] for r in kinds["Role"]) == ["engines-a", "engines-b"]
    assert sorted(r["metadata"]["namespace"] for r in kinds["RoleBinding"]) == ["engines-a", "engines-b"]
    for d in docs:
        load_into_official_model(d)
    assert gateway_config(docs).kubernetes.namespaces == ("engines-a", "engines-b")

    static = {"discovery": {"enabled": False},
              "config": {"models": [{"name": "m", "endpoints": ["http://10.0.0.5:8000"]}]}}
    docs = render(helm_render, static, tmp=tmp_path)
    kinds = by_kind(docs)
    assert "Role" not in kinds and "ClusterRole" not in kinds
    assert kinds["ServiceAccount"][0]["automountServiceAccountToken"] is False
    cfg = gateway_config(docs)
    assert not cfg.kubernetes.enabled and cfg.model("m").endpoints[0].url == "http://10.0.0.5:8000"


def test_dockerfile_runs_the_gateway_as_a_non_root_user():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert froms and all("python:3.11-slim" in f for f in froms)
    user = [ln for ln in lines if ln.startswith("USER ")][-1]
    assert user.split()[1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["python", "-m", "gateway"]' in lines
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv*" in ignored and ".git" in ignored


RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
PROM_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def test_dashboards_configmap_and_prometheus_rule(helm_render, tmp_path):
    from tests.support.promql_check import parse

    values = {"dashboards": {"enabled": True, "namespace": "monitoring", "label": "grafana_dashboard",
                             "labelValue": "yes", "annotations": {"grafana_folder": "LLM"}},
              "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                                 "alerts": {"errorRatio": {"threshold": 0.02, "window": "10m"},
                                            "ttftP99": {"thresholdSeconds": 1.5},
                                            "watchdogFires": {"enabled": False}},
                                 "extraRules": [{"alert": "SwitchyardInternalErrors",
                                                 "expr": "increase(switchyard_internal_errors_total[10m]) > 0",
                                                 "labels": {"severity": "warning"}}]}}
    docs = render(helm_render, values, tmp=tmp_path)
    kinds = by_kind(docs)
    cm = [c for c in kinds["ConfigMap"] if c["metadata"]["name"] == "sy-switchyard-dashboards"][0]
    load_into_official_model(cm)
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "yes"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert shipped and cm["data"] == shipped               # byte for byte, every file
    for text in cm["data"].values():
        assert json.loads(text)["uid"].startswith("switchyard-")
    # a ConfigMap must stay under 1 MiB; client-side apply also copies it into a 256 KiB annotation
    assert sum(len(v.encode()) for v in cm["data"].values()) < 200_000

    rule = kinds["PrometheusRule"][0]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == "llm"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rules] == ["SwitchyardHighErrorRatio", "SwitchyardTimeToFirstTokenHigh",
                                           "SwitchyardNoReadyEndpoint", "SwitchyardDiscoveryStale",
                                           "SwitchyardInternalErrors"]
    for r in rules:
        assert set(r) <= RULE_KEYS and ("alert" in r) != ("record" in r)
        assert "for" not in r or PROM_DURATION.match(r["for"])
        parse(r["expr"])
    by_name = {r["alert"]: r for r in rules}
    err = by_name["SwitchyardHighErrorRatio"]
    assert "[10m]" in err["expr"] and err["expr"].rstrip().endswith("> 0.02") and err["for"] == "5m"
    assert err["labels"] == {"severity": "critical"}
    assert "{{ $labels.model }}" in err["annotations"]["description"]     # left for Prometheus to fill in
    assert by_name["SwitchyardTimeToFirstTokenHigh"]["expr"].rstrip().endswith("> 1.5")

    stale = by_name["SwitchyardDiscoveryStale"]
    assert stale["expr"].rstrip().endswith("> 600") and stale["for"] == "5m"
    # a gateway without discovery exports no such series: no such alert
    off = by_kind(render(helm_render, {"discovery": {"enabled": False}, "prometheusRule": {"enabled": True}},
                         tmp=tmp_path))
    assert "SwitchyardDiscoveryStale" not in [r["alert"] for g in off["PrometheusRule"][0]["spec"]["groups"]
                                             for r in g["rules"]]

    # off by default
    kinds = by_kind(render(helm_render, tmp=tmp_path))
    assert "PrometheusRule" not in kinds and [c["metadata"]["name"] for c in kinds["ConfigMap"]] == ["sy-switchyard"]
