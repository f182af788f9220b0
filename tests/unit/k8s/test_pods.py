"""Pod → endpoint mapping: labels, annotations, ports, roles, readiness."""

from __future__ import annotations

import json

import pytest

from gateway.config.schema import KubernetesModelConfig, ModelConfig
from k8s.pods import PodView, Skipped, is_routable, map_pod, parse_profile

# -- pods ---------------------------------------------------------------------------------------


def pod(name="p", labels=None, annotations=None, ip="10.0.0.7", ready=True, deleting=False, phase="Running"):
    md = {"name": name, "namespace": "llm", "uid": "u-" + name, "labels": labels or {}, "annotations": annotations or {}}
    if deleting:
        md["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": md, "status": status}


M = {"model.aibrix.ai/name": "llama"}


def test_plain_pod_maps_to_an_aggregated_vllm_endpoint_on_port_8000():
    v = map_pod(pod(labels=M))
    assert isinstance(v, PodView)
    assert (v.model, v.url, v.engine, v.role, v.roleset, v.name, v.key) == (
        "llama", "http://10.0.0.7:8000", "vllm", "aggregated", None, "p", "llm/p")
    assert v.metrics_url == "http://10.0.0.7:8000/metrics" and v.routable


def test_ports_engine_and_metric_port_default_to_the_serving_port():
    v = map_pod(pod(labels={**M, "model.aibrix.ai/port": "30000", "model.aibrix.ai/engine": "SGLang"}))
    assert v.url == "http://10.0.0.7:30000" and v.engine == "sglang"
    assert v.metrics_url == "http://10.0.0.7:30000/metrics"     # not AIBrix's fixed 8000
    v = map_pod(pod(labels={**M, "model.aibrix.ai/port": "30000", "model.aibrix.ai/metric-port": "9100"}))
    assert v.metrics_url == "http://10.0.0.7:9100/metrics"


def test_engine_defaults_to_the_model_config_then_vllm():
    models = {"llama": ModelConfig(name="llama", engine="sglang")}
    assert map_pod(pod(labels=M), models).engine == "sglang"
    assert map_pod(pod(labels={**M, "model.aibrix.ai/engine": "vllm"}), models).engine == "vllm"


def test_model_annotation_wins_over_the_label_for_names_with_a_slash():
    v = map_pod(pod(labels=M, annotations={"model.aibrix.ai/name": "meta-llama/Llama-3.1-8B"}))
    assert v.model == "meta-llama/Llama-3.1-8B"


def test_ipv6_pod_ip_is_bracketed():
    assert map_pod(pod(labels=M, ip="fd00::7")).url == "http://[fd00::7]:8000"


@pytest.mark.parametrize("p,reason", [
    (pod(labels={}), "no model.aibrix.ai/name"),
    (pod(labels={**M, "model.aibrix.ai/port": "http"}), "must be a port number"),
    (pod(labels={**M, "model.aibrix.ai/port": "70000"}), "must be a port number"),
    # Python's int() reads these as 8000; the API's other readers (Go's strconv) refuse them
    (pod(labels={**M, "model.aibrix.ai/port": "8_000"}), "must be a port number"),
    (pod(labels={**M, "model.aibrix.ai/port": "+8000"}), "must be a port number"),
    (pod(labels={**M, "model.aibrix.ai/metric-port": "\u0668\u0660\u0660\u0660"}), "must be a port number"),
    (pod(labels=M, annotations={"model.aibrix.ai/sglang-bootstrap-port": "8_998"}), "must be a port number"),
    (pod(labels={**M, "model.aibrix.ai/engine": "trtllm"}), "not supported"),
    (pod(labels={**M, "stormservice.orchestration.aibrix.ai/pod-group-index": "1"}), "pod-group-index"),
    (pod(labels={**M, "ray.io/node-type": "worker"}), "Ray worker"),
    (pod(labels=M, ip=None), "no pod IP"),
    (pod(labels=M, ip="10.0.0.7:8000"), "not an IP address"),
    (pod(labels=M, ip="10.0.0.7/24"), "not an IP address"),
    (pod(labels=M, ip="fd00::7]"), "not an IP address"),
    (pod(labels=M, ip=167772167), "not an IP address"),
    (pod(labels=M, phase="Succeeded"), "phase Succeeded"),
    (pod(labels=M, annotations={"model.aibrix.ai/config": "{not json"}), "not JSON"),
])
def test_pods_that_are_not_used_say_why(p, reason):
    v = map_pod(p)
    assert isinstance(v, Skipped) and reason in v.reason


def test_a_pod_waiting_for_its_address_names_its_model_and_a_failed_one_does_not():
    assert map_pod(pod(labels=M, ip=None, ready=False, phase="Pending")) == Skipped("llm/p", "no pod IP yet", "llama")
    assert map_pod(pod(labels=M, ip=None, ready=False, phase="Failed")) == Skipped("llm/p", "phase Failed")


@pytest.mark.parametrize("p", [
    pod(labels={"model.aibrix.ai/name": 7}),
    pod(labels=M, annotations={"model.aibrix.ai/name": ["llama"]}),
    pod(labels={**M, "model.aibrix.ai/port": 8000}),
    pod(labels={**M, "role-name": None}),
    pod(labels={**M, 7: "x"}),
    pod(labels=["model.aibrix.ai/name"]),
    pod(labels=M, annotations="model.aibrix.ai/name=llama"),
], ids=["model-int", "model-annotation-list", "port-int", "value-null", "key-int", "labels-list", "annotations-string"])
def test_labels_and_annotations_that_do_not_map_strings_to_strings_skip_the_pod(p):
    """The API server's labels and annotations map strings to strings; a pod whose do not (an
    object a proxy made up) is skipped with why, rather than giving its model a name that is not
    a string (a model id 7 in /v1/models, a metric label /metrics cannot write)."""
    v = map_pod(p)
    assert isinstance(v, Skipped) and "must map strings to strings" in v.reason


@pytest.mark.parametrize("p,routable,reason", [
    (pod(labels=M), True, ""),
    (pod(labels=M, ready=False), False, "not ready"),
    (pod(labels=M, deleting=True), False, "terminating"),
    (pod(labels=M, ip=None), False, "no pod IP"),
    ({"metadata": {"name": "x"}, "status": {"podIP": "10.0.0.1"}}, False, "not ready"),   # no conditions yet
])
def test_routable_means_ip_ready_and_not_terminating(p, routable, reason):
    assert is_routable(p) == (routable, reason)


def test_pd_roles_and_rolesets_from_labels():
    pre = map_pod(pod(labels={**M, "role-name": "prefill", "roleset-name": "rs-a"}))
    dec = map_pod(pod(labels={**M, "role-name": "decode", "roleset-name": "rs-a"}))
    assert (pre.role, pre.roleset, dec.role, dec.roleset) == ("prefill", "rs-a", "decode", "rs-a")
    # a role that is neither prefill nor decode, in a roleset: combined only when configured so
    other = pod(labels={**M, "role-name": "all", "roleset-name": "rs-a"})
    assert isinstance(map_pod(other), Skipped)
    v = map_pod(other, k8s_models={"llama": KubernetesModelConfig(combined=True)})
    assert (v.role, v.roleset) == ("combined", "rs-a")
    # no roleset: aggregated whatever the role-name
    v = map_pod(pod(labels={**M, "role-name": "all"}))
    assert (v.role, v.roleset) == ("aggregated", None)


def test_sglang_bootstrap_port_and_profile_from_annotations():
    cfg = {"defaultProfile": "pd", "profiles": {
        "default": {"routingStrategy": "random", "promptLenBucketMaxLength": 4096},
        "pd": {"routingStrategy": "pd", "promptLenBucketMinLength": 10, "promptLenBucketMaxLength": 2048,
               "combined": True}}}
    v = map_pod(pod(labels={**M, "model.aibrix.ai/engine": "sglang", "role-name": "all", "roleset-name": "r"},
                    annotations={"model.aibrix.ai/sglang-bootstrap-port": "9001",
                                 "model.aibrix.ai/config": json.dumps(cfg)}))
    assert (v.role, v.bootstrap_port, v.min_prompt_tokens, v.max_prompt_tokens, v.routing_strategy) == (
        "combined", 9001, 10, 2048, "pd")
    # the annotation wins over kubernetes.models; without it, the config applies
    k = {"llama": KubernetesModelConfig(min_prompt_tokens=1, max_prompt_tokens=100)}
    assert map_pod(pod(labels=M), k8s_models=k).max_prompt_tokens == 100
    ann = {"model.aibrix.ai/config": json.dumps({"profiles": {"x": {"routingConfig": {"promptLenBucketMaxLength": 7}}}})}
    assert map_pod(pod(labels=M, annotations=ann), k8s_models=k).max_prompt_tokens == 7


def test_profile_parsing_edge_cases():
    assert parse_profile(None) == {}
    assert parse_profile('{"profiles": {"a": {"combined": true}, "b": {}}}') == {}       # no default, ambiguous
    assert parse_profile('{"profiles": {"only": {"combined": true}}}') == {"combined": True}
    with pytest.raises(ValueError):
        parse_profile('{"profiles": []}')


def test_readiness_flap_keeps_the_same_endpoint_identity():
    a, b = map_pod(pod(labels=M)), map_pod(pod(labels=M, ready=False))
    assert a == b and a.routable != b.routable
    assert map_pod(pod(labels=M, ip="10.0.0.8")) != a


# -- switchyard.io/kv-events --------------------------------------------------------------------

KV = "switchyard.io/kv-events"


@pytest.mark.parametrize(("value", "parsed"), [
    (None, None), ("", None), ("false", None), (" FALSE ", None), ("true", ()), ("True", ()),
    ('{"port": 5557}', (("port", 5557),)),
    ('{"port": "6000", "replay_port": 6001, "topic": "kv@llama"}',
     (("port", 6000), ("replay_port", 6001), ("topic", "kv@llama"))),
])
def test_kv_events_annotation_values(value, parsed):
    v = map_pod(pod(labels=M, annotations={} if value is None else {KV: value}))
    assert (v.kv_events, v.kv_events_error) == (parsed, "")


@pytest.mark.parametrize(("value", "says"), [
    ("yes", "neither true/false nor JSON"),
    ("[5557]", "must be true, false or a JSON object"),
    ('{"port": 0}', "port must be a port number"),
    ('{"port": "http"}', "port must be a port number"),
    ('{"replay_port": 70000}', "replay_port must be a port number"),
    ('{"topic": 5}', "unknown or bad key 'topic'"),
    ('{"prot": 5557}', "unknown or bad key 'prot'"),
])
def test_a_bad_kv_events_annotation_refuses_the_events_not_the_pod(value, says):
    v = map_pod(pod(labels=M, annotations={KV: value}))
    assert isinstance(v, PodView) and v.routable           # still served, on the approximate index
    assert v.kv_events is None and KV in v.kv_events_error and says in v.kv_events_error
