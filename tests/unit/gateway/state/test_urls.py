"""``state.redis_url``: the forms the gateway accepts, and errors that name the key."""

import certifi
import pytest

from gateway.config.schema import ConfigError, parse_config
from gateway.state.urls import RedisTarget, parse_redis_url

MODELS = "models: [{name: m, endpoints: [http://127.0.0.1:1]}]\n"


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///run/redis.sock?db=2"])
def test_a_single_server_url_is_handed_over_as_it_is(url):
    t = parse_redis_url(url)
    assert (t.mode, t.url, t.nodes) == ("standalone", url, ())
    assert t.tls is url.startswith("rediss://")


def test_sentinel_urls_name_the_sentinels_and_the_service():
    t = parse_redis_url("redis+sentinel://:s%40cret@10.0.0.1:26380,sentinel-b,[::1]:5000/mymaster/2")
    assert t == RedisTarget("sentinel", t.url, tls=False, nodes=(("10.0.0.1", 26380), ("sentinel-b", 26379),
                                                                ("::1", 5000)),
                            service="mymaster", db=2, username=None, password="s@cret")
    t = parse_redis_url("rediss+sentinel://app:pw@s1:26379/cache")
    assert (t.tls, t.username, t.password, t.service, t.db) == (True, "app", "pw", "cache", 0)
    assert t.redacted == "rediss+sentinel://***@s1:26379/cache"


def test_cluster_urls_name_startup_nodes():
    t = parse_redis_url("redis+cluster://n1:7000,n2,n3:7002")
    assert (t.mode, t.nodes, t.db, t.password) == ("cluster", (("n1", 7000), ("n2", 6379), ("n3", 7002)), 0, None)
    t = parse_redis_url("rediss+cluster://:pw@n1:7000/")
    assert (t.tls, t.password) == (True, "pw")


@pytest.mark.parametrize(("url", "says"), [
    ("http://h:1", "must be a redis://"),
    ("redis+sentinel://s1:26379", "needs the primary's service name"),
    ("redis+sentinel://s1:26379/", "needs the primary's service name"),
    ("redis+sentinel://s1:26379/m/x", "only a database number"),
    ("redis+sentinel://s1:26379/m/1/2", "only a database number"),
    ("redis+cluster://n1:7000/1", "only database 0"),
    ("redis+cluster://n1:70000", "bad port"),
    ("redis+cluster://n1:7000,,n2", "bad host:port"),
    ("redis+cluster://n1:7000?ssl=1", "no query"),
    ("redis+sentinel://:pw@s1:x/m", "bad host:port"),
])
def test_a_bad_url_is_refused_with_the_reason(url, says):
    with pytest.raises(ValueError, match=says):
        parse_redis_url(url)


def test_an_error_hides_the_password():
    with pytest.raises(ValueError) as ei:
        parse_redis_url("redis+cluster://:hunter2@n1:7000/3")
    assert "hunter2" not in str(ei.value)


@pytest.mark.parametrize(("state", "key"), [
    ("{redis_url: 'redis+sentinel://s1'}", "state.redis_url"),
    ("{redis_url: 'redis+cluster://n1/2'}", "state.redis_url"),
    ("{redis_url: 'redis+cluster://n1', tls_ca_file: /ca.pem}", "state.tls_ca_file"),
    ("{redis_url: 'redis://n1', sentinel_password: x}", "state.sentinel_password"),
])
def test_config_errors_name_the_key(state, key):
    with pytest.raises(ConfigError) as ei:
        parse_config(MODELS + f"state: {state}\n")
    assert ei.value.key_path == key, str(ei.value)


def test_config_accepts_sentinel_and_cluster_urls(monkeypatch):
    monkeypatch.setenv("SY_TEST_SENTINEL_PW", "sentinel-secret")
    c = parse_config(MODELS + f"state: {{redis_url: 'rediss+sentinel://s1,s2/mymaster', tls_ca_file: {certifi.where()}, "
                              "sentinel_password_env: SY_TEST_SENTINEL_PW}\n")
    assert c.state.sentinel_password == "sentinel-secret"
    assert "sentinel-secret" not in repr(c.state)
    assert parse_config(MODELS + "state: {redis_url: 'redis+cluster://n1:7000,n2:7001'}\n").state.redis_url


@pytest.mark.parametrize(("url", "says"), [
    ("redis://localhost:99999", "port"),
    ("redis://localhost:abc/0", "port"),
    ("rediss://:pw@localhost:6379a", "port"),
    ("redis://localhost:6379?db=x", "db"),
    ("redis://localhost:6379/abc", "database number"),
    ("redis://localhost:6379/0/1", "database number"),
])
def test_a_single_server_url_the_client_would_refuse_is_refused_at_load(url, says):
    """``redis://`` and ``rediss://`` URLs go to the Redis client as they are: one it cannot read
    (a port out of range, a database that is no number) must be a config error naming the key, as
    --check-config and a start give it, not a line at the start naming neither key nor file (or a
    database silently taken as 0)."""
    with pytest.raises(ConfigError) as ei:
        parse_config(MODELS + f"state: {{redis_url: '{url}'}}\n")
    assert ei.value.key_path == "state.redis_url", str(ei.value)
    assert says in str(ei.value).lower()
    assert "pw@" not in str(ei.value)


@pytest.mark.parametrize(("ca", "says"), [
    ("missing.pem", "cannot read"),
    (".", "cannot read"),
    ("garbage.pem", "no CA certificate"),
])
def test_a_ca_file_that_cannot_verify_is_refused_at_load(tmp_path, ca, says):
    """state.tls_ca_file is read when the first TLS connection to Redis is made: a path that is
    no file, or a file with no certificate, is a config error naming the key, not a Redis taken
    for unreachable (Error 2 connecting to host:port. No such file or directory)."""
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError) as ei:
        parse_config(MODELS + f"state: {{redis_url: 'rediss://h:6380', tls_ca_file: '{tmp_path / ca}'}}\n")
    assert ei.value.key_path == "state.tls_ca_file", str(ei.value)
    assert says in str(ei.value)


def test_a_ca_bundle_is_taken():
    c = parse_config(MODELS + f"state: {{redis_url: 'rediss://h:6380', tls_ca_file: '{certifi.where()}'}}\n")
    assert c.state.tls_ca_file == certifi.where()
