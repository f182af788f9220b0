"""Config loading: typed objects, defaults, and errors that name the key and the file."""

import hashlib

import pytest

from gateway.config.schema import ConfigError, load_config, parse_config

GOOD = """
listen: {host: 0.0.0.0, port: 9000}
routing: {strategy: round-robin}
watchdog: {first_chunk_timeout_s: 5}
models:
  - name: llama
    engine: vllm
    strategy: random
    endpoints:
      - http://127.0.0.1:8001/
      - {url: http://127.0.0.1:8002, min_prompt_tokens: 10}
    watchdog: {idle_timeout_s: 3, aggregated: true}
  - name: qwen
    engine: sglang
    endpoints: [http://127.0.0.1:9001]
"""


def test_good_config_loads_typed_and_frozen(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    c = load_config(f)
    assert c.listen.host == "0.0.0.0" and c.listen.port == 9000
    assert c.routing.strategy == "round-robin"
    assert c.watchdog.first_chunk_timeout_s == 5.0 and c.watchdog.idle_timeout_s == 120.0
    llama = c.model("llama")
    assert llama.endpoints[0].url == "http://127.0.0.1:8001"
    assert llama.endpoints[1].min_prompt_tokens == 10
    assert llama.endpoints[0].engine == "vllm"
    assert c.model("qwen").endpoints[0].engine == "sglang"
    assert c.watchdog_for("llama").idle_timeout_s == 3.0
    assert c.watchdog_for("qwen").idle_timeout_s == 120.0
    with pytest.raises(AttributeError):
        c.listen.port = 1  # frozen
    assert c.with_listen(None, 1234).listen.port == 1234


@pytest.mark.parametrize("text,key", [
    ("bogus: 1", "bogus"),
    ("listen: {port: abc}", "listen.port"),
    ("listen: {prot: 1}", "listen.prot"),
    ("models: [{name: a, engine: tgi, endpoints: [http://x:1]}]", "models[0].engine"),
    ("models: [{name: a, endpoints: [ftp://x]}]", "models[0].endpoints[0].url"),
    ("models: [{name: a}]", "models[0]"),
    ("models: [{endpoints: [http://x:1]}]", "models[0].name"),
    ("models: [{name: a, endpoints: [http://x:1]}, {name: a, endpoints: [http://y:1]}]", "models[1].name"),
    ("watchdog: {idle_timeout_s: -1}", "watchdog.idle_timeout_s"),
    ("health: {enabled: yes-please}", "health.enabled"),
    ("server: {log_format: xml}", "server.log_format"),
    ("models: [{name: a, endpoints: [{url: 'http://x:1', colour: red}]}]", "models[0].endpoints[0].colour"),
    ("models: [{name: a, endpoints: [http://x:1]}, {name: b, endpoints: [http://x:1], pd: {sglang: {bogus: 1}}}]",
     "models[1].pd.sglang.bogus"),
    ("models: [{name: a, endpoints: [http://x:1], pd: {prefill_timeout_s: -1}}]", "models[0].pd.prefill_timeout_s"),
    ("models: [{name: a, rolesets: [{prefill: [http://p:1], decode: [{url: http://d:1, max_prompt_tokens: -5}]}]}]",
     "models[0].rolesets[0].decode[0].max_prompt_tokens"),
    ("pd: {sglang: {abort_timeout_s: -1}}", "pd.sglang.abort_timeout_s"),
    ("pd: {prefill_score_policy: fastest}", "pd.prefill_score_policy"),
    ("pd: {abort_timeout_s: 1, sglang: {abort_timeout_s: 2}}", "pd.abort_timeout_s"),
    # a bad key of the global block is reported there, not in the models that inherit it
    ("pd: {bogus: 1}\nmodels: [{name: a, endpoints: [http://x:1], pd: {prefill_timeout_s: 2}}]", "pd.bogus"),
    ("routing: {prefix_block_chars: 0}", "routing.prefix_block_chars"),
    ("routing: {metrics_max_age_s: -1}", "routing.metrics_max_age_s"),
    ("routing: {slo_half_life_s: 0}", "routing.slo_half_life_s"),
    ("lora: {max_adapters_per_endpoint: -1}", "lora.max_adapters_per_endpoint"),
    ("lora: {max_adapters_per_endpoint: 1.5}", "lora.max_adapters_per_endpoint"),
    ("lora: {idle_unload_s: -1}", "lora.idle_unload_s"),
    ("batch: {max_stored_bytes: -1}", "batch.max_stored_bytes"),
    # a user's share above everyone's bound could never be used
    ("batch: {max_stored_bytes: 1000, max_stored_bytes_per_user: 2000}", "batch.max_stored_bytes_per_user"),
])
def test_errors_name_the_key_and_file(text, key):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="conf.yaml")
    assert ei.value.key_path == key
    assert str(ei.value).startswith("conf.yaml: ")


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_config("a: [1, 2", source="x.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("text", "where", "says"), [
    ("models:\n\t- name: m\n", "line 2, column 1", "(a tab: YAML indents with spaces)"),
    ("server: {workers: 1}\nmodels: []\nserver: {workers: 2}\n", "line 3, column 1",
     "found the key 'server' a second time (first at line 1, column 1)"),
    ("models: [{name: m, endpoints: [${URL}]}]\n", "line 1, column 33",
     "did not find expected ',' or ']' (while parsing a flow sequence at line 1, column 31)"),
])
def test_invalid_yaml_is_one_line_naming_the_file_line_and_column(text, where, says):
    """A YAML error is one line (a log field, a line of --check-config's output) that names the
    file and where in it, as every other config error: not PyYAML's lines naming "<unicode string>"."""
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="x.yaml")
    message = str(ei.value)
    assert message.startswith(f"x.yaml: <yaml>: invalid YAML, {where}: "), message
    assert says in message and "\n" not in message and "unicode string" not in message, message


def test_empty_config_has_defaults():
    c = parse_config("")
    assert c.listen.port == 8888 and c.routing.strategy == "least-request" and c.models == ()
    assert c.pd.prefill_timeout_s == 30.0 and c.watchdog.response_timeout_s == 0.0


def test_unknown_keys_and_negative_numbers_say_so():
    with pytest.raises(ConfigError, match=r"^c.yaml: models\[0\].pd.vllm.colour: unknown key \(known: rewrite_remote_host\)$"):
        parse_config("models: [{name: a, endpoints: [http://x:1], pd: {vllm: {colour: red}}}]", source="c.yaml")
    with pytest.raises(ConfigError, match=r"^c.yaml: watchdog.idle_timeout_s: .*>= 0"):
        parse_config("watchdog: {idle_timeout_s: -1}", source="c.yaml")
    with pytest.raises(ConfigError, match=r"models\[0\].engine: must be one of vllm, sglang, got 'tgi'"):
        parse_config("models: [{name: a, engine: tgi, endpoints: [http://x:1]}]")


PD = """
pd:
  rewrite_remote_host: false        # the older flat keys: moved into pd.vllm / pd.sglang
  abort_timeout_s: 5
  sglang: {default_bootstrap_port: 9000}
  prefill_timeout_s: 10
models:
  - name: a
    engine: sglang
    endpoints: [http://x:1]
    pd: {abort_retry_delay_s: 0.5, prefill_timeout_s: 3, decode_score_policy: least_request}
  - name: b
    endpoints: [http://x:1]
    pd: {vllm: {rewrite_remote_host: true}, sglang: {abort_timeout_s: 0}}
  - name: c
    endpoints: [http://x:1]
"""


def test_pd_engine_blocks_the_older_flat_keys_and_model_overrides():
    c = parse_config(PD)
    assert c.pd.vllm.rewrite_remote_host is False and c.pd.prefill_timeout_s == 10.0
    assert (c.pd.sglang.default_bootstrap_port, c.pd.sglang.abort_timeout_s, c.pd.sglang.abort_retry_delay_s) == (
        9000, 5.0, 2.0)
    a = c.pd_for("a")        # only the keys a model names change; the rest is the global block
    assert (a.prefill_timeout_s, a.decode_score_policy, a.vllm.rewrite_remote_host) == (3.0, "least_request", False)
    assert (a.sglang.default_bootstrap_port, a.sglang.abort_timeout_s, a.sglang.abort_retry_delay_s) == (9000, 5.0, 0.5)
    b = c.pd_for("b")
    assert b.vllm.rewrite_remote_host is True and b.prefill_timeout_s == 10.0
    assert (b.sglang.default_bootstrap_port, b.sglang.abort_timeout_s) == (9000, 0.0)
    assert c.pd_for("c") is c.pd and c.pd_for("unknown") is c.pd
    # the same flat key in a model's block
    assert parse_config("models: [{name: a, endpoints: [http://x:1], pd: {default_bootstrap_port: 7}}]"
                        ).pd_for("a").sglang.default_bootstrap_port == 7


def test_null_means_the_default():
    c = parse_config("listen:\nauth:\nmodels: [{name: a, endpoints: [http://x:1], strategy: null, pd: null}]")
    assert c.listen.port == 8888 and not c.auth.on and c.model("a").strategy is None
    assert c.pd_for("a") is c.pd


# -- engines' API keys -------------------------------------------------------------------------

ENGINE_KEYS = """
models:
  - name: m
    api_key_env: SY_TEST_ENGINE_KEY
    endpoints:
      - http://127.0.0.1:1
      - {url: "http://127.0.0.1:2", api_key: other-engine-key}
  - name: n
    endpoints: [http://127.0.0.1:3]
"""


def test_engine_keys_from_the_file_or_the_environment_never_in_a_repr(monkeypatch):
    from gateway.server.reload import declared_endpoints
    monkeypatch.setenv("SY_TEST_ENGINE_KEY", "engine-secret")
    c = parse_config(ENGINE_KEYS)
    assert c.model("m").api_key == "engine-secret" and c.model("n").api_key is None
    assert [e.api_key for e in c.model("m").endpoints] == [None, "other-engine-key"]
    # an endpoint takes its own key, else its model's
    assert [(ep.url, ep.api_key) for ep in declared_endpoints(c)] == [
        ("http://127.0.0.1:1", "engine-secret"), ("http://127.0.0.1:2", "other-engine-key"),
        ("http://127.0.0.1:3", None)]
    shown = repr(c) + repr(declared_endpoints(c))
    assert "engine-secret" not in shown and "other-engine-key" not in shown


@pytest.mark.parametrize("text,key", [
    ("models: [{name: m, endpoints: [http://h:1], api_key: a-secret, api_key_env: B}]", "models[0].api_key_env"),
    ("models: [{name: m, endpoints: [http://h:1], api_key_env: SY_TEST_SURELY_UNSET}]", "models[0].api_key_env"),
    ("models: [{name: m, endpoints: [http://h:1], api_key: ''}]", "models[0].api_key"),
    ("models: [{name: m, endpoints: [http://h:1], api_key: 'two words-secret'}]", "models[0].api_key"),
    ("models: [{name: m, endpoints: [http://h:1], api_key: \"line\\nbreak-secret\"}]", "models[0].api_key"),
    ("models: [{name: m, endpoints: [{url: 'http://h:1', api_key: \"tab\\tsecret\"}]}]",
     "models[0].endpoints[0].api_key"),
    ("models: [{name: m, endpoints: [{url: 'http://h:1', api_key: 5}]}]", "models[0].endpoints[0].api_key"),
])
def test_a_bad_engine_key_names_its_key_and_does_not_show_it(text, key):
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="conf.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert "secret" not in str(ei.value)


# -- clients' API keys and the admin token ------------------------------------------------------

@pytest.mark.parametrize("text,key", [
    ('auth: {api_keys: [{key: " sk-secret-1", user: a}]}', "auth.api_keys[0].key"),
    ('auth: {api_keys: [{key: sk-ok-1, user: a}, {key: "sk-secret-1\\n", user: b}]}', "auth.api_keys[1].key"),
    ('auth: {api_keys: [{key: "sk-secret\\r\\n-1", user: a}]}', "auth.api_keys[0].key"),
    ('auth: {api_keys: [{key: "sk-secret\\0-1", user: a}]}', "auth.api_keys[0].key"),
    ('auth: {admin_token: "admin-secret\\n"}', "auth.admin_token"),
    ('auth: {admin_token: "\\tadmin-secret"}', "auth.admin_token"),
    ("auth: {admin_token_env: SY_TEST_ADMIN_TOKEN}", "auth.admin_token_env"),
])
def test_a_client_key_or_admin_token_no_request_can_present_names_its_key_and_does_not_show_it(
        monkeypatch, text, key):
    """A header's value has no whitespace at its ends (RFC 9110 section 5.5: the gateway reads the
    key after ``Bearer`` and in ``x-api-key`` without it) and no line break or NUL: a key or admin
    token with one (a secret from a file or an environment variable that kept its final newline) is
    one no request matches, every request with it a 401. Refused with the config, as an engine's key
    is, naming the key and not showing it."""
    monkeypatch.setenv("SY_TEST_ADMIN_TOKEN", "admin-secret\n")
    with pytest.raises(ConfigError) as ei:
        parse_config(GOOD + text + "\n", source="conf.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert "secret" not in str(ei.value)


SHARED_SHA256 = hashlib.sha256(b"sk-shared-secret-1").hexdigest()


@pytest.mark.parametrize("text,key", [
    ('auth: {admin_token: sk-shared-secret-1, api_keys: [{key: sk-shared-secret-1, user: a}]}', "auth.api_keys[0].key"),
    ("auth: {admin_token: sk-shared-secret-1, api_keys: [{key: sk-ok-1, user: a}, "
     f'{{key_sha256: "{SHARED_SHA256}", user: b}}]}}', "auth.api_keys[1].key"),
    ("auth: {admin_token_env: SY_TEST_ADMIN_TOKEN, api_keys: [{key: sk-shared-secret-1, user: a}]}",
     "auth.api_keys[0].key"),
])
def test_a_client_key_that_is_the_admin_token_is_refused_and_not_shown(monkeypatch, text, key):
    """An API key is not an admin token (docs/tenancy.md): a client key that is the admin token too
    would open /admin/* and /status.json to every client holding it. Refused with the config, as a
    key given twice is, naming the key and showing neither."""
    monkeypatch.setenv("SY_TEST_ADMIN_TOKEN", "sk-shared-secret-1")
    with pytest.raises(ConfigError) as ei:
        parse_config(GOOD + text + "\n", source="conf.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert "secret" not in str(ei.value) and "admin token" in str(ei.value)


def test_a_client_key_with_a_space_inside_is_one_a_request_can_present():
    c = parse_config(GOOD + 'auth: {api_keys: [{key: "sk two words", user: a}], admin_token: "ad min"}\n')
    assert c.auth.api_keys[0].key_sha256 and c.auth.admin_token == "ad min"


def _alias_bomb(levels: int) -> str:
    """Anchors each listing the one before ten times: a few lines that expand to 10**levels values."""
    rows = ['  a0: &a0 [x, x, x, x, x, x, x, x, x, x]']
    rows += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "bomb:\n" + "\n".join(rows) + "\n"


@pytest.mark.timeout(20)
def test_anchors_that_expand_to_millions_of_values_are_refused_before_they_are_walked():
    """YAML aliases share what their anchor built, so a file of a few lines loads as ten million
    values (a billion with two more lines), which every walk of the config then expands: a start,
    --check-config or a reload would take seconds to minutes and gigabytes. Refused as the file's
    error, naming the key that holds them."""
    with pytest.raises(ConfigError) as e:
        parse_config(GOOD + _alias_bomb(7), source="gw.yaml")
    assert e.value.key_path == "bomb" and "YAML aliases expand" in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        parse_config(GOOD + _alias_bomb(30), source="gw.yaml")
    assert e.value.key_path == "bomb" and "YAML aliases expand" in str(e.value), e.value


def test_anchors_used_as_a_config_uses_them_still_load():
    """A block written once and reused (a list of endpoints, a merge key) is what anchors are for."""
    first = "  - {name: m0, endpoints: &e [http://127.0.0.1:8001, http://127.0.0.1:8002], watchdog: &w {idle_timeout_s: 3}}\n"
    rest = "".join(f"  - {{name: m{i}, endpoints: *e, watchdog: {{<<: *w, aggregated: true}}}}\n" for i in range(1, 2000))
    c = parse_config("models:\n" + first + rest, source="gw.yaml")
    assert len(c.models) == 2000 and len(c.models[-1].endpoints) == 2
    assert c.watchdog_for("m1999").idle_timeout_s == 3


@pytest.mark.parametrize("nested", ["\n      " + "- " * 500 + "1", "{a: " * 900 + "1" + "}" * 900])
def test_a_structure_nested_hundreds_deep_is_a_config_error_naming_where(nested):
    """YAML's parser takes up to a thousand levels; a config goes a handful deep. Refused as a
    config error naming where the nesting goes too deep, as --check-config, a start and a reload
    say config errors."""
    with pytest.raises(ConfigError) as e:
        parse_config(GOOD + "limits:\n  users:\n    u: " + nested + "\n", source="gw.yaml")
    assert e.value.key_path.startswith("limits.users.u") and "nested more than 64 deep" in str(e.value), e.value


@pytest.mark.parametrize(("block", "key_path"), [
    ("server: {header_timeout_s: .inf}", "server.header_timeout_s"),
    ("upstream: {connect_timeout_s: .Inf}", "upstream.connect_timeout_s"),
    ("health: {timeout_s: 1.0e+400}", "health.timeout_s"),
    ("models: [{name: m, endpoints: [http://127.0.0.1:1], watchdog: {first_chunk_timeout_s: .inf}}]",
     "models[0].watchdog.first_chunk_timeout_s"),
    ("routing: {slo_margin: .inf}", "routing.slo_margin"),
])
def test_an_infinite_number_is_refused_naming_its_key(block, key_path):
    """YAML's .inf (or a number past a double's range, 1.0e+400) is no duration: the timers and
    timeouts given it fail at run time (aiohttp's timeouts raise OverflowError, every health probe
    and scrape round failed with a traceback). 0 is what turns a limit off."""
    text = block if block.startswith("models") else f"models: [{{name: m, endpoints: [http://127.0.0.1:1]}}]\n{block}"
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="c.yaml")
    assert ei.value.key_path == key_path, str(ei.value)
    assert "finite" in str(ei.value) and str(ei.value).startswith("c.yaml: ")


@pytest.mark.parametrize(("model", "key_path", "first"), [
    ("endpoints: [http://127.0.0.1:1, 'http://127.0.0.1:1/']", "models[0].endpoints[1].url", "endpoints[0]"),
    ("endpoints: [http://Engine-A:80, http://engine-a]", "models[0].endpoints[1].url", "endpoints[0]"),
    ("endpoints: [http://127.0.0.1:1], rolesets: [{combined: [http://127.0.0.1:1]}]",
     "models[0].rolesets[0].combined[0].url", "endpoints[0]"),
    ("rolesets: [{prefill: [http://p:1], decode: [http://d:1]}, {prefill: [http://p:1], decode: [http://d:2]}]",
     "models[0].rolesets[1].prefill[0].url", "rolesets[0].prefill[0]"),
])
def test_one_engine_declared_twice_for_a_model_is_refused(model, key_path, first):
    """Two entries of one model at one URL are two endpoints of the pool with the engine's load
    split between their counters, and the same labels on two series of every per-endpoint metric
    (switchyard_endpoint_ready{endpoint, model} written twice: Prometheus refuses such a scrape)."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: [{{name: m, {model}}}]\n", source="c.yaml")
    assert ei.value.key_path == key_path, str(ei.value)
    assert f"also {first}" in str(ei.value)


@pytest.mark.parametrize(("model", "key_path", "first"), [
    ("endpoints: [http://127.0.0.1:1, http://127.0.0.1:1/b]", "models[0].endpoints[1].url", "endpoints[0]"),
    ("endpoints: [http://127.0.0.1:1, https://127.0.0.1:1]", "models[0].endpoints[1].url", "endpoints[0]"),
    ("endpoints: [http://engine-a/a], rolesets: [{combined: [http://Engine-A:80/b]}]",
     "models[0].rolesets[0].combined[0].url", "endpoints[0]"),
    ("rolesets: [{prefill: [http://p:1], decode: [http://d:1]}, {prefill: [https://p:1], decode: [http://d:2]}]",
     "models[0].rolesets[1].prefill[0].url", "rolesets[0].prefill[0]"),
])
def test_two_urls_of_one_host_and_port_in_a_model_role_are_refused(model, key_path, first):
    """An endpoint is named by its host and port, which the series of every per-endpoint metric
    carry with the model: two URLs of one model at one host and port (another scheme or path)
    loaded as two endpoints of one name, their series written twice on /metrics (which Prometheus
    refuses) and the target-pod header naming either."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: [{{name: m, {model}}}]\n", source="c.yaml")
    assert ei.value.key_path == key_path, str(ei.value)
    assert f"{first} (" in str(ei.value) and "endpoint name" in str(ei.value), str(ei.value)


def test_urls_of_one_host_and_port_may_serve_two_models_or_two_roles():
    c = parse_config("models: [{name: a, endpoints: [http://127.0.0.1:1]}, {name: b, endpoints: [http://127.0.0.1:1/b]},"
                     " {name: c, rolesets: [{prefill: [http://127.0.0.1:2], decode: [http://127.0.0.1:2/d]}]}]")
    assert [m.name for m in c.models] == ["a", "b", "c"]


def test_one_engine_may_serve_two_models():
    c = parse_config("models: [{name: a, endpoints: [http://127.0.0.1:1]}, {name: b, endpoints: [http://127.0.0.1:1]}]")
    assert [m.endpoints[0].url for m in c.models] == ["http://127.0.0.1:1"] * 2


@pytest.mark.parametrize(("block", "says"), [
    ("listen: {port: '8080'}", "listen.port: Expected `int`, got `str` '8080' (a number in quotes is a string: "
                               "write it without them)"),
    ("server: {fast_lane: 'true'}", "server.fast_lane: Expected `bool`, got `str` 'true' (true or false in quotes is "
                                    "a string: write it without them)"),
    ("server: {max_body_bytes: 1e6}", "server.max_body_bytes: Expected `int`, got `str` '1e6' (YAML reads a number "
                                      "with an exponent as one only with a dot and a sign, 1.0e+6: write 1000000)"),
    ("server: {shutdown_grace_s: 1e3}", "server.shutdown_grace_s: Expected `float`, got `str` '1e3' (YAML reads a "
                                        "number with an exponent as one only with a dot and a sign, 1.0e+3: "
                                        "write 1000)"),
])
def test_a_number_or_boolean_that_yaml_read_as_a_string_says_so(block, says):
    """A value that reads as a number or a boolean but is a string to YAML (quoted, or 1e6, which
    YAML 1.1 takes for a number only as 1.0e+6) says what was written and why it is a string:
    "got `str`" alone sends a user looking for a string they never wrote."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: [{{name: m, endpoints: [http://127.0.0.1:1]}}]\n{block}\n", source="c.yaml")
    assert str(ei.value) == f"c.yaml: {says}"


@pytest.mark.parametrize(("block", "says"), [
    ("limits: {users: {1: {rpm: 1}}}", "limits.users: the key 1 is a number to YAML, where a name goes: "
                                       "write it in quotes"),
    ("models: [{name: m, endpoints: [http://127.0.0.1:1], adapters: {yes: /a}}]",
     "models[0].adapters: the key true is a boolean to YAML (as yes, no, on and off are), where a name goes: "
     "write it in quotes"),
    ("8080: x", "<root>: the key 8080 is a number to YAML, where a name goes: write it in quotes"),
])
def test_a_key_yaml_read_as_no_string_is_named(block, says):
    """A user or adapter named 1 (or yes) is a number (or a boolean) to YAML: the error names the
    key and what to write, where it said Expected `str`, got `int` of the whole mapping."""
    text = block if block.startswith("models") else f"models: [{{name: m, endpoints: [http://127.0.0.1:1]}}]\n{block}"
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="c.yaml")
    assert str(ei.value) == f"c.yaml: {says}"


@pytest.mark.parametrize(("rolesets", "says"), [
    ("[{name: x, prefill: [http://p:1], decode: [http://d:1]}, {name: x, prefill: [http://p:2], decode: [http://d:2]}]",
     "models[0].rolesets[1].name: 'x' is also the name of rolesets[0]"),
    ("[{prefill: [http://p:1], decode: [http://d:1]}, {name: rs-0, prefill: [http://p:2], decode: [http://d:2]}]",
     "models[0].rolesets[1].name: 'rs-0' is also the name of rolesets[0]"),
])
def test_two_rolesets_of_a_model_with_one_name_are_refused(rolesets, says):
    """Prefill and decode are paired within a roleset, told by its name: two of one name (written
    twice, or written as the name another takes by default) would be one group, a prefill of one
    paired with a decode of the other."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: [{{name: m, rolesets: {rolesets}}}]\n", source="c.yaml")
    assert str(ei.value).startswith(f"c.yaml: {says}"), str(ei.value)


def test_one_engine_may_be_a_prefill_and_a_decode_of_a_model():
    c = parse_config("models: [{name: m, rolesets: [{prefill: [http://127.0.0.1:1], decode: [http://127.0.0.1:1]}]}]")
    assert c.models[0].rolesets[0].prefill[0].url == c.models[0].rolesets[0].decode[0].url


@pytest.mark.parametrize(("host", "says"), [
    ("0.0.0.0:8080", "no port"),
    ("http://0.0.0.0", "no scheme"),
    ("[::1]", "without brackets"),
    ("", "empty"),
])
def test_a_listen_host_that_is_no_address_is_refused(host, says):
    """listen.host is handed to the listener at start: a host with a port or a scheme passed
    --check-config and failed the start with a line naming no key (cannot listen on
    0.0.0.0:8080:8888: Name or service not known), and an empty one listened on every interface."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: [{{name: m, endpoints: [http://127.0.0.1:1]}}]\nlisten: {{host: '{host}'}}\n")
    assert ei.value.key_path == "listen.host", str(ei.value)
    assert says in str(ei.value)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "::1", "localhost", "gw-0.example.internal", "10.1.2.3"])
def test_a_listen_host_that_is_an_address_or_a_name_loads(host):
    assert parse_config(f"models: [{{name: m, endpoints: [http://127.0.0.1:1]}}]\nlisten: {{host: '{host}'}}\n") \
        .listen.host == host


_M = "models: [{name: m, endpoints: [http://127.0.0.1:1]}]\n"


@pytest.mark.parametrize(("text", "key", "name"), [
    ("models: [{name: 'm ', endpoints: [http://127.0.0.1:1]}]", "models[0].name", "'m '"),
    ("models: [{name: m, endpoints: [http://127.0.0.1:1]}, {name: \"\\tm2\", endpoints: [http://127.0.0.1:2]}]",
     "models[1].name", "'\\tm2'"),
    ("models: [{name: m, endpoints: [http://127.0.0.1:1], adapters: {ok: /a, ' lora': /b}}]",
     "models[0].adapters", "' lora'"),
    (_M + "aliases: [{name: 'a ', targets: [{model: m}]}]", "aliases[0].name", "'a '"),
    (_M + "aliases: [{name: a, targets: [{model: m}, {model: 'm '}]}]", "aliases[0].targets[1].model", "'m '"),
    (_M + "limits: {users: {bob-1: {models: [m, \"m\\n\"]}}}", "limits.users.bob-1.models[1]", "'m\\n'"),
    (_M + "limits: {default_user: {models: [' m']}}", "limits.default_user.models[0]", "' m'"),
    (_M + "limits: {models: {'m ': {rps: 1}}}", "limits.models", "'m '"),
    (_M + "kubernetes: {models: {' m': {combined: true}}}", "kubernetes.models", "' m'"),
])
def test_a_model_name_with_whitespace_at_its_ends_is_refused_naming_its_key(text, key, name):
    """A request's model is matched as it is written: a model, adapter or alias named 'm ' loaded,
    /v1/models listed 'm ', and a client asking for m was answered 404; an allowlist or a limit
    with such a name matched no request. Refused with the config, on one line naming the key."""
    with pytest.raises(ConfigError) as ei:
        parse_config(text, source="c.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert "\n" not in str(ei.value) and name in str(ei.value) and "whitespace at its ends" in str(ei.value)


def test_a_model_name_with_a_space_inside_loads():
    c = parse_config("models: [{name: 'my model', endpoints: [http://127.0.0.1:1], adapters: {'my lora': /a}}]\n"
                     "aliases: [{name: 'my alias', targets: [{model: 'my model'}]}]\n"
                     "limits: {users: {bob: {models: ['my alias']}}, models: {'my model': {rps: 1}}}\n")
    assert c.models[0].name == "my model" and c.limits.users["bob"].models == ("my alias",)


@pytest.mark.parametrize(("models", "key"), [
    ("[{name: m, endpoints: [http://127.0.0.1:1], adapters: {my-lora: ''}}]", "models[0].adapters.my-lora"),
    ("[{name: m, endpoints: [http://127.0.0.1:1], adapters: {org/lora-1.5: /a}}, "
     "{name: n, endpoints: [http://127.0.0.1:2], adapters: {org/lora-1.5: /b}}]", "models[1].adapters.org/lora-1.5"),
])
def test_an_error_about_a_name_with_a_dash_or_a_slash_names_its_key(models, key):
    """Names hold dashes, slashes and dots (meta-llama/Llama-3.1-8B-Instruct): an error of a check
    that names its key by such a name says that key, not <root> before the whole message."""
    with pytest.raises(ConfigError) as ei:
        parse_config(f"models: {models}\n", source="c.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert str(ei.value).startswith(f"c.yaml: {key}: "), str(ei.value)


def test_a_users_share_of_the_session_map_is_more_than_none_and_at_most_all_of_it():
    assert parse_config("").routing.session_user_share == 0.25
    assert parse_config("routing: {session_user_share: 1}").routing.session_user_share == 1.0
    for bad in ("0", "-0.5", "1.5"):
        with pytest.raises(ConfigError, match=r"^c.yaml: routing.session_user_share: "):
            parse_config(f"routing: {{session_user_share: {bad}}}", source="c.yaml")
