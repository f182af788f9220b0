"""The auth, limits and state blocks: typed, defaulted, and errors that name the key."""

import hashlib

import certifi
import pytest

from gateway.config.schema import ConfigError, parse_config

FULL = """
models: [{name: m, endpoints: [http://127.0.0.1:1]}]
auth:
  api_keys:
    - {key: sk-alice-1, user: alice}
    - {key_sha256: BOB_DIGEST, user: bob, name: ci}
  admin_token_env: SY_TEST_ADMIN
limits:
  default_user: {rpm: 10}
  users:
    alice: {rpm: 60, tpm: 100000, max_concurrent: 4}
  models:
    m: {rps: 5}
state:
  redis_url: rediss://redis.example:6380/1
  password_env: SY_TEST_REDIS_PW
  tls_ca_file: CA_FILE
  failure_policy: closed
  timeout_s: 0.1
  sync_interval_s: 0.05
  replica_ttl_s: 0.5
  share_in_flight: false
  key_prefix: "{sy}"
  replica_id: gw-0
""".replace("BOB_DIGEST", hashlib.sha256(b"sk-bob-1").hexdigest()).replace("CA_FILE", certifi.where())


def test_full_tenancy_config(monkeypatch):
    monkeypatch.setenv("SY_TEST_ADMIN", "admin-secret")
    monkeypatch.setenv("SY_TEST_REDIS_PW", "redis-secret")
    c = parse_config(FULL)
    assert c.auth.on and c.auth.admin_token == "admin-secret" and not c.auth.forward_authorization
    alice, bob = c.auth.api_keys
    assert alice.user == "alice" and alice.key_sha256 == hashlib.sha256(b"sk-alice-1").hexdigest()
    assert bob.key == "" and bob.name == "ci"
    assert c.limits.users["alice"].max_concurrent == 4 and c.limits.users["alice"].tpm == 100000
    assert c.limits.default_user.rpm == 10 and c.limits.default_user.tpm == 0
    assert c.limits.models["m"].rps == 5
    s = c.state
    assert (s.password, s.failure_policy, s.timeout_s, s.share_in_flight, s.key_prefix, s.replica_id) == (
        "redis-secret", "closed", 0.1, False, "{sy}", "gw-0")
    # secrets never show in a repr (logs, tracebacks)
    text = repr(c)
    assert "sk-alice-1" not in text and "admin-secret" not in text and "redis-secret" not in text


def test_defaults_and_auth_switch():
    c = parse_config("models: [{name: m, endpoints: [http://127.0.0.1:1]}]")
    assert not c.auth.on and c.state.redis_url is None and c.state.failure_policy == "open"
    assert c.state.timeout_s == 0.25 and c.state.sync_interval_s == 0.1 and c.state.share_in_flight
    # keys only in the store (admin API): auth must be switched on explicitly
    assert parse_config("auth: {enabled: true}").auth.on
    # keys in the config, but auth explicitly off
    assert not parse_config("auth: {enabled: false, api_keys: [{key: k, user: u}]}").auth.on


@pytest.mark.parametrize("text,key", [
    ("auth: {api_keys: [{user: a}]}", "auth.api_keys[0].key"),
    ("auth: {api_keys: [{key: x, key_sha256: ab, user: a}]}", "auth.api_keys[0].key"),
    ("auth: {api_keys: [{key_sha256: nothex, user: a}]}", "auth.api_keys[0].key_sha256"),
    ("auth: {api_keys: [{key: x, user: a}, {key: x, user: b}]}", "auth.api_keys[1].key"),
    ("auth: {api_keys: [{key: x, user: ''}]}", "auth.api_keys[0].user"),
    ("auth: {api_keys: [{key: x, user: \"a\\nb\"}]}", "auth.api_keys[0].user"),
    ("auth: {api_keys: [{key: x, user: \"a\\0b\"}]}", "auth.api_keys[0].user"),
    ("auth: {api_keys: [{key: x, usr: a}]}", "auth.api_keys[0].usr"),
    ("auth: {api_keys: {key: x}}", "auth.api_keys"),
    ("auth: {admin_tokn: x}", "auth.admin_tokn"),
    ("auth: {admin_token_env: SY_TEST_SURELY_UNSET}", "auth.admin_token_env"),
    ("auth: {admin_token: a, admin_token_env: B}", "auth.admin_token_env"),
    ("auth: {enabled: maybe}", "auth.enabled"),
    ("auth: {forward_authorization: 1}", "auth.forward_authorization"),
    ("limits: {users: {alice: {rpm: -1}}}", "limits.users.alice.rpm"),
    ("limits: {users: {alice: {rpm: 1.5}}}", "limits.users.alice.rpm"),
    ("limits: {users: {alice: {rps: 1}}}", "limits.users.alice.rps"),
    ("limits: {users: [alice]}", "limits.users"),
    ("limits: {models: {m: {rps: x}}}", "limits.models.m.rps"),
    ("limits: {models: {m: {rpm: 1}}}", "limits.models.m.rpm"),
    ("limits: {default_user: {tpm: 1.5}}", "limits.default_user.tpm"),
    ("limits: {users: {alice: {models: m}}}", "limits.users.alice.models"),
    ("limits: {users: {alice: {models: []}}}", "limits.users.alice.models"),
    ("limits: {users: {alice: {models: ['']}}}", "limits.users.alice.models[0]"),
    ("limits: {default_user: {models: [m, 1]}}", "limits.default_user.models[1]"),
    ("limits: {userz: {}}", "limits.userz"),
    ("state: {redis_url: 'http://x:1'}", "state.redis_url"),
    ("state: {redis_url: 5}", "state.redis_url"),
    ("state: {failure_policy: maybe}", "state.failure_policy"),
    ("state: {timeout_s: 0}", "state.timeout_s"),
    ("state: {sync_interval_s: 1, replica_ttl_s: 1}", "state.replica_ttl_s"),
    ("state: {tls_ca_file: /ca.pem, redis_url: 'redis://x'}", "state.tls_ca_file"),
    ("state: {password: a, password_env: B}", "state.password_env"),
    ("state: {key_prefix: 'a b'}", "state.key_prefix"),
    ("state: {redis_host: x}", "state.redis_host"),
])
def test_errors_name_the_key(text, key):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="conf.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert str(ei.value).startswith(f"conf.yaml: {key}:")
