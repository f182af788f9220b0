"""CORS's pieces without sockets: ``server.cors_allowed_origins`` as the config loader checks and
spells it, and the aiohttp hooks gateway/server/cors.py leans on (semi-private in 3.14)."""

from __future__ import annotations

import inspect

import pytest
from aiohttp import web

from gateway.config.schema import ConfigError, config_from_dict, parse_config
from gateway.server.edge import EdgeLimits


def origins(*given: str) -> tuple[str, ...]:
    return config_from_dict({"server": {"cors_allowed_origins": list(given)}, "models": []}).server.cors_allowed_origins


def test_off_by_default():
    cfg = config_from_dict({"models": []})
    assert cfg.server.cors_allowed_origins == ()
    assert EdgeLimits.from_config(cfg.server).cors_allowed_origins == ()


@pytest.mark.parametrize(("given", "kept"), [
    ("https://app.example.com", "https://app.example.com"),
    ("http://127.0.0.1:5173", "http://127.0.0.1:5173"),
    ("http://localhost:3000", "http://localhost:3000"),
    ("http://[::1]:8080", "http://[::1]:8080"),
    ("tauri://localhost", "tauri://localhost"),
    # as a browser sends it: lower case, without the scheme's default port
    ("HTTPS://App.Example.COM", "https://app.example.com"),
    ("https://app.example.com:443", "https://app.example.com"),
    ("http://app.example.com:80", "http://app.example.com"),
    ("https://app.example.com:8443", "https://app.example.com:8443"),
    ("*", "*"),
])
def test_an_origin_is_kept_as_a_browser_spells_it(given, kept):
    assert origins(given) == (kept,)
    assert EdgeLimits.from_config(config_from_dict(
        {"server": {"cors_allowed_origins": [given]}, "models": []}).server).cors_allowed_origins == (kept,)


def test_an_origin_written_twice_is_kept_once():
    assert origins("https://a.example", "https://A.example:443", "http://b.example") == (
        "https://a.example", "http://b.example")


@pytest.mark.parametrize(("text", "key", "words"), [
    ("server: {cors_allowed_origins: ['https://app.example.com/']}", "server.cors_allowed_origins[0]", "no path"),
    ("server: {cors_allowed_origins: ['https://a.example', 'https://app.example.com/chat']}",
     "server.cors_allowed_origins[1]", "no path"),
    ("server: {cors_allowed_origins: ['https://app.example.com?x=1']}", "server.cors_allowed_origins[0]", "no path"),
    ("server: {cors_allowed_origins: ['app.example.com']}", "server.cors_allowed_origins[0]", "scheme://host"),
    ("server: {cors_allowed_origins: ['https://']}", "server.cors_allowed_origins[0]", "scheme://host"),
    ("server: {cors_allowed_origins: ['https://user@app.example.com']}", "server.cors_allowed_origins[0]",
     "scheme://host"),
    ("server: {cors_allowed_origins: ['https://app.example.com:0']}", "server.cors_allowed_origins[0]", "port"),
    ("server: {cors_allowed_origins: ['https://app.example.com:70000']}", "server.cors_allowed_origins[0]", "port"),
    ("server: {cors_allowed_origins: ['https://*.example.com']}", "server.cors_allowed_origins[0]", "'*'"),
    ("server: {cors_allowed_origins: ['*', 'https://a.example']}", "server.cors_allowed_origins", "alone"),
    ("server: {cors_allowed_origins: ['null']}", "server.cors_allowed_origins[0]", "null"),
    ("server: {cors_allowed_origins: ['']}", "server.cors_allowed_origins[0]", "scheme://host"),
    ("server: {cors_allowed_origins: https://a.example}", "server.cors_allowed_origins", "array"),
    ("server: {cors_allowed_origins: [8080]}", "server.cors_allowed_origins[0]", "str"),
])
def test_a_bad_origin_is_refused_at_load_naming_its_key(text, key, words):
    with pytest.raises(ConfigError) as ei:
        parse_config(text + "\nmodels: []", source="conf.yaml")
    assert ei.value.key_path == key, str(ei.value)
    assert words in str(ei.value) and str(ei.value).startswith(f"conf.yaml: {key}: ")


# -- the aiohttp hooks gateway/server/cors.py relies on (semi-private in 3.14) -------------------

def test_aiohttp_makes_requests_of_a_class_it_is_given():
    """A request with an Origin is made a ``CorsRequest`` by the application's request factory."""
    assert "_cls" in inspect.signature(web.Application._make_request).parameters
    assert "return _cls(" in inspect.getsource(web.Application._make_request)


def test_aiohttp_calls_the_requests_prepare_hook_before_the_head_is_written():
    """Every answer aiohttp writes, a stream's included, goes through ``request._prepare_hook``
    after its own headers are set and before the head is written: CORS's headers are added there."""
    start = inspect.getsource(web.StreamResponse._start)
    assert start.index("await self._prepare_headers()") < start.index("await request._prepare_hook(self)") \
        < start.index("await self._write_headers()")
    assert "self._start(request)" in inspect.getsource(web.StreamResponse.prepare)
    assert list(inspect.signature(web.Request._prepare_hook).parameters) == ["self", "response"]
