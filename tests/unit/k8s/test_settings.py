"""The kubernetes config block: defaults, keys, errors that name them."""

from __future__ import annotations

import pytest

from gateway.config.schema import ConfigError, KubernetesModelConfig, config_from_dict, parse_config

# -- config -------------------------------------------------------------------------------------


def test_kubernetes_block_defaults_and_keys():
    c = config_from_dict({"kubernetes": {"enabled": True, "kubeconfig": "/k", "namespaces": ["llm", "b"],
                                         "label_selector": "model.aibrix.ai/name,env=prod",
                                         "resync_interval_s": 60, "watch_timeout_s": 30, "retry_backoff_s": 0.5,
                                         "models": {"llama": {"combined": True, "max_prompt_tokens": 2048}}}})
    k = c.kubernetes
    assert (k.enabled, k.kubeconfig, k.namespaces, k.resync_interval_s) == (True, "/k", ("llm", "b"), 60.0)
    assert k.models["llama"] == KubernetesModelConfig(combined=True, max_prompt_tokens=2048)
    d = config_from_dict({}).kubernetes
    assert (d.enabled, d.kubeconfig, d.namespaces, d.label_selector) == (False, None, (), "model.aibrix.ai/name")
    assert d.resync_interval_s > 0


@pytest.mark.parametrize("block,key", [
    ({"enabled": "yes"}, "kubernetes.enabled"),
    ({"namespaces": "llm"}, "kubernetes.namespaces"),
    ({"namespaces": ["Bad_NS"]}, "kubernetes.namespaces[0]"),
    ({"namespaces": ["a", "a"]}, "kubernetes.namespaces[1]"),
    ({"label_selector": "x in ("}, "kubernetes.label_selector"),
    ({"resync_interval_s": -1}, "kubernetes.resync_interval_s"),
    ({"watch_timeout_s": 0}, "kubernetes.watch_timeout_s"),
    ({"retry_backoff_s": 0}, "kubernetes.retry_backoff_s"),
    ({"models": {"m": {"combined": 1}}}, "kubernetes.models.m.combined"),
    ({"models": {"m": {"min_prompt_tokens": 9, "max_prompt_tokens": 3}}}, "kubernetes.models.m.min_prompt_tokens"),
    ({"bogus": 1}, "kubernetes.bogus"),
])
def test_kubernetes_block_errors_name_the_key(block, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"kubernetes": block})
    assert e.value.key_path == key


def test_models_without_endpoints_need_discovery():
    with pytest.raises(ConfigError, match="kubernetes.enabled"):
        parse_config("models: [{name: m}]")
    c = parse_config("kubernetes: {enabled: true}\nmodels: [{name: m, engine: sglang, strategy: random}]")
    assert c.model("m").endpoints == () and c.model("m").engine == "sglang"


def test_drain_delay_is_a_server_key():
    assert config_from_dict({}).server.drain_delay_s == 5.0
    assert config_from_dict({"server": {"drain_delay_s": 0}}).server.drain_delay_s == 0.0
    with pytest.raises(ConfigError) as e:
        config_from_dict({"server": {"drain_delay_s": -1}})
    assert e.value.key_path == "server.drain_delay_s"


def test_retry_after_is_read_as_seconds_or_an_http_date():
    import email.utils
    import time

    from k8s.discovery import retry_after_s

    assert [retry_after_s(v) for v in ("5", " 1.5 ", "0", "-3")] == [5.0, 1.5, 0.0, 0.0]
    assert [retry_after_s(v) for v in (None, "", "soon", "inf", "nan", "Mon, 99 Foo 2025 00:00:00")] == [None] * 6
    ahead = retry_after_s(email.utils.formatdate(time.time() + 60, usegmt=True))
    assert ahead is not None and 50 < ahead <= 60
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0
