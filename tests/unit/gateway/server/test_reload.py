"""The pure parts of a reload: what needs a restart, and the endpoint pool brought to a config."""

from __future__ import annotations

import pytest
import yaml

from gateway.config.schema import ConfigError, parse_config
from gateway.server.app import pool_from_config
from gateway.server.reload import check_offline, restart_needed, sync_pool

BASE = """
listen: {host: 127.0.0.1, port: 8888}
models:
  - {name: m, endpoints: [http://10.0.0.1:8000, http://10.0.0.2:8000]}
"""


def cfg(extra: str = "", models: str | None = None):
    """BASE (or its models replaced), with the top-level blocks of ``extra`` in place of its own."""
    text = BASE if models is None else "listen: {host: 127.0.0.1, port: 8888}\nmodels: " + models + "\n"
    raw = {**yaml.safe_load(text), **(yaml.safe_load(extra) or {})}
    return parse_config(yaml.safe_dump(raw))


@pytest.mark.parametrize(("extra", "path"), [
    ("listen: {host: 127.0.0.1, port: 9999}", "listen.port"),
    ("server: {workers: 2}", "server.workers"),
    ("server: {cors_allowed_origins: ['https://app.example.com']}", "server.cors_allowed_origins"),
    ("upstream: {max_connections: 10}", "upstream.max_connections"),
    ("health: {interval_s: 1}", "health.interval_s"),
    ("state: {key_prefix: other}", "state.key_prefix"),
    ("kubernetes: {enabled: true}", "kubernetes.enabled"),
    ("tracing: {enabled: true}", "tracing.enabled"),
    ("batch: {enabled: true}", "batch.enabled"),         # its routes and runner are set up at start
    ("batch: {max_concurrency: 4}", "batch.max_concurrency"),
    ("view: {workers: false}", "view.workers"),           # the workers' bus is opened at start
    ("limits: {users: {a: {rpm: 1}}}", "limits"),
    ("auth: {api_keys: [{key: sk-0123456789abcdef, user: a}]}", "auth"),
    ("kubernetes: {models: {m: {max_prompt_tokens: 10}}}", None),     # discovery's model settings reload
    ("watchdog: {idle_timeout_s: 1}", None),
    ("routing: {strategy: round-robin}", None),
    ("aliases: [{name: a, targets: [{model: m}]}]", None),
])
def test_what_needs_a_restart(extra, path):
    assert restart_needed(cfg(), cfg(extra), tenancy=False, admin=False) == path


def test_with_tenancy_at_start_keys_and_limits_reload():
    started = cfg("auth: {admin_token: t}")
    new = cfg("auth: {admin_token: u, api_keys: [{key: sk-0123456789abcdef, user: a}]}\nlimits: {users: {a: {rpm: 1}}}")
    assert restart_needed(started, new, tenancy=True, admin=True) is None
    check_offline(started, cfg(), new)      # tenancy is decided by the config the process started with
    with pytest.raises(ConfigError) as e:
        check_offline(cfg(), cfg(), cfg("routing: {strategy: fastest}"))
    assert e.value.key_path == "routing.strategy"


def test_sync_pool_keeps_what_is_unchanged_and_drains_what_left():
    pool = pool_from_config(cfg())
    one, two = pool.endpoints("m")
    one.in_flight = 1
    added, removed = sync_pool(pool, cfg(models="[{name: m, endpoints: [http://10.0.0.1:8000, http://10.0.0.3:8000]},"
                                              " {name: n, engine: sglang, endpoints: [http://10.0.0.2:8000]}]"))
    assert pool.endpoints("m")[0] is one and one.in_flight == 1 and not one.draining
    assert removed == [two] and two.draining and two not in pool.endpoints()
    assert [(e.model, e.url, e.engine) for e in added] == [("m", "http://10.0.0.3:8000", "vllm"),
                                                           ("n", "http://10.0.0.2:8000", "sglang")]
    one.in_flight = 0


def test_sync_pool_leaves_discovered_endpoints_alone():
    pool = pool_from_config(cfg())
    from gateway.endpoints import Endpoint
    pod = pool.add(Endpoint(url="http://10.1.0.1:8000", model="m", source="kubernetes", name="pod-0"))
    added, removed = sync_pool(pool, cfg(models="[]", extra="kubernetes: {enabled: true}"))
    assert not added and len(removed) == 2 and pool.endpoints() == [pod]


def _kv(name: str, url: str, events: str | None) -> str:
    from enginesim.tiny_tokenizer import TINY_DIR

    ev = f", tokenizer: '{TINY_DIR}', kv_events: {events}" if events else ""
    return f"{{name: {name}, endpoints: [{url}]{ev}}}"


M, K = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


@pytest.mark.parametrize(("before", "after", "path"), [
    ([("m", M, "{enabled: true, port: 5557}")], [("m", M, "{enabled: true, port: 5560}")], "models[0].kv_events"),
    ([("m", M, "{enabled: true}")], [("m", M, None)], "models[0].kv_events"),
    ([("m", M, None)], [("m", M, None), ("k", K, "{enabled: true}")], "models[1].kv_events"),
    ([("m", M, None), ("k", K, "{enabled: true}")], [("m", M, None)], None),     # it leaves: nothing to keep
])
def test_a_models_kv_events_change_needs_a_restart(before, after, path):
    """The subscriptions and the tokenizer are set up at start: a reload that would change them
    is refused, not accepted and left unapplied."""
    def models(ms):
        return "[" + ", ".join(_kv(*m) for m in ms) + "]"
    assert restart_needed(cfg(models=models(before)), cfg(models=models(after)), tenancy=False, admin=False) == path


@pytest.mark.parametrize("events", ["{enabled: true}", None])
def test_another_tokenizer_for_a_model_on_kv_events_needs_a_restart(tmp_path, events):
    """The tokenizer is loaded at start, for the models whose prompts are keyed on KV events: a
    reload that names another directory (a new model revision's) with the events block unchanged
    was applied, the file saying one tokenizer while the blocks were keyed with the other. Without
    events no tokenizer is loaded, and nothing needs a restart."""
    import shutil

    from enginesim.tiny_tokenizer import TINY_DIR

    other = tmp_path / "revision-2"
    shutil.copytree(TINY_DIR, other)
    ev = f", kv_events: {events}" if events else ""
    before = cfg(models=f"[{{name: m, endpoints: [{M}], tokenizer: '{TINY_DIR}'{ev}}}]")
    after = cfg(models=f"[{{name: m, endpoints: [{M}], tokenizer: '{other}'{ev}}}]")
    expected = "models[0].tokenizer" if events else None
    assert restart_needed(before, after, tenancy=False, admin=False) == expected
