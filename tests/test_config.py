"""Config loading: typed objects, defaults, and errors that name the key and the file."""

import pytest

from gateway.config import ConfigError, load_config, parse_config

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


def test_empty_config_has_defaults():
    c = parse_config("")
    assert c.listen.port == 8888 and c.routing.strategy == "least-request" and c.models == ()
    assert c.pd.prefill_timeout_s == 30.0 and c.watchdog.response_timeout_s == 0.0
