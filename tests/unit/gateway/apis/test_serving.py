"""Which endpoints may answer an engine-specific API, and which API each path gets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.apis.anthropic import AnthropicApi
from gateway.apis.passthrough import AudioApi, PassthroughApi
from gateway.config.schema import config_from_dict
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import GatewayError
from gateway.server.app import GATEWAY_KEY, build_app
from handlers import ADAPTERS


def test_engines_declare_their_surface():
    vllm, sglang = ADAPTERS["vllm"], ADAPTERS["sglang"]
    for path in ("/rerank", "/v2/rerank", "/score", "/v1/audio/translations", "/classify", "/pooling", "/v2/embed"):
        assert vllm.serves(path) and not sglang.serves(path)
    assert sglang.serves("/v1/classify") and not vllm.serves("/v1/classify")
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize",
                 "/v1/audio/transcriptions", "/v1/messages", "/v1/messages/count_tokens"):
        assert vllm.serves(path) and sglang.serves(path)


def test_every_path_gets_its_api():
    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:1"]}]},
                           source="<test>")
    apis = build_app(cfg)[GATEWAY_KEY].apis
    assert type(apis["/v1/messages"]) is AnthropicApi and apis["/v1/messages/count_tokens"] is apis["/v1/messages"]
    assert {type(apis[p]) for p in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/tokenize",
                                    "/detokenize", "/classify", "/v1/classify", "/pooling", "/v2/embed")} == {PassthroughApi}
    assert type(apis["/v1/audio/transcriptions"]) is AudioApi and "/v1/chat/completions" not in apis


def _prepare(api, path: str, candidates: list[Endpoint]):
    ctx = SimpleNamespace(ireq=SimpleNamespace(path=path, model="m"))
    return asyncio.run(api.prepare(ctx, candidates))


def test_prepare_keeps_the_engines_that_serve_the_path():
    pool = EndpointPool()
    v = pool.add(Endpoint(url="http://v:1", model="m", engine="vllm"))
    s = pool.add(Endpoint(url="http://s:1", model="m", engine="sglang"))
    api = PassthroughApi(pool)
    assert _prepare(api, "/v2/rerank", [v, s]) == [v]
    with pytest.raises(GatewayError) as ei:           # the vLLM endpoint exists but is not ready
        _prepare(api, "/v2/rerank", [s])
    assert ei.value.status == 503
    assert _prepare(AnthropicApi(pool), "/v1/messages", [v, s]) == [v, s]
    assert _prepare(PassthroughApi(pool), "/v1/rerank", [v, s]) == [v, s]
    only_sglang = EndpointPool()
    s2 = only_sglang.add(Endpoint(url="http://s:1", model="m", engine="sglang"))
    with pytest.raises(GatewayError) as ei:
        _prepare(PassthroughApi(only_sglang), "/v2/rerank", [s2])
    assert ei.value.status == 404 and ei.value.code == "unsupported_path"
    assert ei.value.message == "The model `m` is served by sglang, which does not serve POST /v2/rerank."
