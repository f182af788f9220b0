"""``GET /v1/models`` and ``GET /v1/models/{id}`` as Anthropic's SDK asks for them (with the
``anthropic-version`` header it always sends): Anthropic's Models API shape, the same models as
the OpenAI listing, in its order, paged by ``limit``, ``after_id`` and ``before_id``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import aiohttp
import anthropic
import orjson
import pytest

from gateway.apis.anthropic import error_type as anthropic_error_type
from tests.support.edge import assert_openai_error, exchange, request
from tests.support.factories import model_block, sim_pod
from tests.support.gateway_process import gateway_process
from tests.support.http import anthropic_client, openai_client
from tests.support.lora import LORA_SIM
from tests.support.ports import listen_port
from tests.support.waiting import wait_for

VERSION = {"anthropic-version": "2023-06-01"}
ALICE = "sk-alice-0123456789"


async def _fleet(sims, gateway, **blocks):
    """Three models (one with a slash in its name, one on SGLang), an alias and a LoRA adapter."""
    a = await sims("vllm", "llama", **LORA_SIM)
    b = await sims("vllm", "org/mistral")
    c = await sims("sglang", "qwen")
    return await gateway([model_block("llama", "vllm", [a.url], adapters={"sql": "org/sql-lora"}),
                          model_block("org/mistral", "vllm", [b.url]), model_block("qwen", "sglang", [c.url])],
                         aliases=[{"name": "chat", "targets": [{"model": "llama"}, {"model": "qwen"}]}],
                         lora={"discovery_interval_s": 0}, **blocks)


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        return r.status, dict(r.headers), orjson.loads(await r.read())


def _ids(listing: dict) -> list[str]:
    return [m["id"] for m in listing["data"]]


async def test_the_anthropic_sdk_lists_and_retrieves_the_openai_listings_models_in_anthropics_shape(sims, gateway):
    gw = await _fleet(sims, gateway)
    status, _, openai_listing = await _get(gw.url + "/v1/models")      # no anthropic-version: OpenAI's shape
    assert status == 200 and openai_listing["object"] == "list"
    ids = _ids(openai_listing)
    assert set(ids) == {"llama", "org/mistral", "qwen", "chat", "sql"}
    created = {m["id"]: datetime.fromtimestamp(m["created"], UTC) for m in openai_listing["data"]}

    c = anthropic_client(gw)
    page = await c.models.list()
    assert [m.id for m in page.data] == ids
    for m in page.data:
        assert m.type == "model" and m.display_name == m.id and m.created_at == created[m.id], m
        assert m.created_at.tzinfo is not None
    assert page.first_id == ids[0] and page.last_id == ids[-1] and page.has_more is False

    for m in page.data:     # retrieve: the same entry, a name with a slash included
        assert await c.models.retrieve(m.id) == m
    with pytest.raises(anthropic.NotFoundError) as ei:
        await c.models.retrieve("org/nope")
    assert ei.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                        "message": "The model `org/nope` does not exist or you do not have access to it."}}
    assert ei.value.request_id and ei.value.request_id == ei.value.response.headers["request-id"]

    # the raw answer: only Anthropic's fields, created_at an RFC 3339 string
    status, _, raw = await _get(gw.url + "/v1/models", VERSION)
    assert status == 200 and set(raw) == {"data", "first_id", "last_id", "has_more"}
    first = raw["data"][0]
    assert set(first) == {"type", "id", "display_name", "created_at"}
    assert first["created_at"] == created[first["id"]].strftime("%Y-%m-%dT%H:%M:%SZ")
    status, _, one = await _get(gw.url + "/v1/models/org%2Fmistral", VERSION)
    assert status == 200 and one == next(m for m in raw["data"] if m["id"] == "org/mistral")

    # the openai SDK's listing is as before
    listed = await openai_client(gw).models.list()
    assert [m.id for m in listed.data] == ids
    assert all(m.object == "model" and m.owned_by == "switchyard" and m.created for m in listed.data)


@pytest.mark.parametrize("limit", [1, 2, 4, 5])
async def test_the_sdks_auto_pagination_walks_every_model_once(sims, gateway, limit):
    gw = await _fleet(sims, gateway)
    ids = _ids((await _get(gw.url + "/v1/models"))[2])
    c = anthropic_client(gw)
    assert [m.id async for m in c.models.list(limit=limit)] == ids

    def sync_walk() -> list[str]:       # the synchronous client, as the same requests
        with anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0) as client:
            return [m.id for m in client.models.list(limit=limit)]
    assert await asyncio.to_thread(sync_walk) == ids
    # backwards from the end: pages of the models before the cursor, each page in the listing's order
    walked = []
    async for page in (await c.models.list(before_id=ids[-1], limit=limit)).iter_pages():
        walked = [m.id for m in page.data] + walked
    assert walked == ids[:-1]


async def test_a_page_names_its_ends_and_whether_more_follow_in_its_direction(sims, gateway):
    gw = await _fleet(sims, gateway)
    ids = _ids((await _get(gw.url + "/v1/models"))[2])
    cases = [("?limit=2", ids[:2], True), (f"?limit=2&after_id={ids[0]}", ids[1:3], True),
             (f"?limit=3&after_id={ids[1]}", ids[2:5], False), (f"?after_id={ids[-1]}", [], False),
             (f"?limit=2&before_id={ids[-1]}", ids[2:4], True), (f"?limit=2&before_id={ids[2]}", ids[:2], False),
             (f"?before_id={ids[0]}", [], False), ("?limit=1000", ids, False)]
    for query, want, more in cases:
        status, _, got = await _get(gw.url + "/v1/models" + query.replace("/", "%2F"), VERSION)
        assert status == 200, (query, got)
        assert _ids(got) == want, query
        assert got["first_id"] == (want[0] if want else None) and got["last_id"] == (want[-1] if want else None)
        assert got["has_more"] is more, query


async def test_bad_list_parameters_are_anthropic_400s(sims, gateway):
    gw = await _fleet(sims, gateway)
    ids = _ids((await _get(gw.url + "/v1/models"))[2])
    for query, param in (("limit=0", "limit"), ("limit=1001", "limit"), ("limit=-1", "limit"),
                         ("limit=abc", "limit"), ("limit=1.5", "limit"), ("limit=", "limit"),
                         ("limit=" + "9" * 5000, "limit"), ("limit=%EF%BC%91", "limit"), ("limit=1&limit=2", "limit"),
                         ("after_id=nope", "after_id"), ("before_id=nope", "before_id"),
                         (f"after_id={ids[0]}&before_id={ids[2]}", "before_id")):
        status, headers, body = await _get(gw.url + "/v1/models?" + query, VERSION)
        assert status == 400, (query, body)
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert param in body["error"]["message"] and headers["request-id"], body
    c = anthropic_client(gw)
    with pytest.raises(anthropic.BadRequestError) as ei:
        await c.models.list(limit=0)
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    assert [m.id for m in (await c.models.list()).data] == ids       # and nothing changed


async def test_auth_on_the_models_paths_answers_in_the_asking_sdks_shape(sims, gateway):
    gw = await _fleet(sims, gateway, auth={"api_keys": [{"key": ALICE, "user": "alice"}]})
    with pytest.raises(anthropic.AuthenticationError) as ei:
        await anthropic_client(gw, "sk-wrong").models.list()
    assert ei.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "Incorrect API key provided."}}
    with pytest.raises(anthropic.AuthenticationError) as ei:
        await anthropic_client(gw, "sk-wrong").models.retrieve("llama")
    assert ei.value.body["error"]["type"] == "authentication_error"
    status, _, body = await _get(gw.url + "/v1/models", VERSION)
    assert status == 401 and body["error"]["type"] == "authentication_error" and body["type"] == "error"
    # the SDK's key (x-api-key) lists the models; OpenAI's clients still get OpenAI's shape
    assert [m.id async for m in anthropic_client(gw, ALICE).models.list(limit=2)][0] == "llama"
    status, _, body = await _get(gw.url + "/v1/models")
    assert status == 401 and body["error"]["type"] == "authentication_error" and "type" not in body
    status, _, body = await _get(gw.url + "/v1/models/nope", {"Authorization": f"Bearer {ALICE}"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


@pytest.mark.timeout(120)
async def test_pages_asked_of_either_worker_walk_every_model_once(sims, tmp_path):
    """``--workers 2``: each page on a new connection, so the kernel hands them to either worker."""
    a = await sims("vllm", "llama", **LORA_SIM)
    b = await sims("sglang", "qwen")
    port = listen_port()
    path = tmp_path / "gw.yaml"
    path.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                    "server: {drain_delay_s: 0, shutdown_grace_s: 5, log_level: warning}\n"
                    "lora: {discovery_interval_s: 0}\n"
                    f"models: [{{name: llama, engine: vllm, endpoints: ['{a.url}'], adapters: {{sql: org/sql, tone: org/tone}}}},"
                    f" {{name: qwen, engine: sglang, endpoints: ['{b.url}']}}]\n"
                    "aliases: [{name: chat, targets: [{model: llama}]}]\n")
    url = f"http://127.0.0.1:{port}/v1/models"

    async def fresh(query: str = "", headers: dict[str, str] | None = None) -> dict:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.get(url + query, headers=headers or {}) as r:
            assert r.status == 200
            return orjson.loads(await r.read())

    async with gateway_process(path, port, "--workers", "2", ready_workers=2):
        ids = _ids(await fresh())
        assert set(ids) == {"llama", "qwen", "chat", "sql", "tone"}
        whole = (await fresh("", VERSION))["data"]
        assert [m["id"] for m in whole] == ids
        for _ in range(4):       # each page from either worker: the same entries, created_at included
            walked, query = [], "?limit=1"
            while True:
                page = await fresh(query, VERSION)
                walked += page["data"]
                if not page["has_more"]:
                    break
                query = f"?limit=1&after_id={page['last_id']}"
            assert walked == whole
        sdk = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
        try:
            assert [m.id async for m in sdk.models.list(limit=1)] == ids
        finally:
            await sdk.close()


async def test_a_walk_meets_every_model_once_while_an_adapter_is_loaded_between_its_pages(sims, gateway):
    """Loading an adapter moves nothing in the listing: a walk whose next page is asked after the
    load still meets every model listed all along, once."""
    a = await sims("vllm", "llama", **LORA_SIM)
    gw = await gateway([model_block("llama", "vllm", [a.url], adapters={"sql": "org/sql", "tone": "org/tone"})],
                       lora={"discovery_interval_s": 0})
    ids = _ids((await _get(gw.url + "/v1/models"))[2])
    assert sorted(ids) == ["llama", "sql", "tone"]
    c = anthropic_client(gw)
    first = await c.models.list(limit=2)
    done = await openai_client(gw).chat.completions.create(
        model=ids[-1], messages=[{"role": "user", "content": "hi"}], max_tokens=2)     # loads the last one
    assert done.choices[0].message.content
    walked = [m.id for m in first.data] + [m.id async for m in c.models.list(limit=2, after_id=first.last_id)]
    assert walked == ids
    assert _ids((await _get(gw.url + "/v1/models"))[2]) == ids


async def test_the_edges_own_answers_on_the_models_paths_take_the_asking_sdks_shape(sims, gateway):
    """Hostile bytes on the models paths with anthropic-version: the edge's 417 (an ``Expect:`` other
    than ``100-continue``) and aiohttp's 404 and 405 are Anthropic-shaped, with a request id; the
    same without the header, and a path that only starts like it, stay OpenAI's."""
    gw = await _fleet(sims, gateway)
    anthropic_cases = [("GET", "/v1/models", {"Expect": "200-ok"}, 417), ("GET", "/v1/models/m", {"Expect": "200-ok"}, 417),
                       ("POST", "/v1/models", {}, 405), ("GET", "/v1/models/", {}, 404)]
    for method, target, headers, status in anthropic_cases:
        ex = await exchange(gw.port, request(method, target, b"{}" if method == "POST" else None,
                                             {**headers, **VERSION}, close=True))
        assert ex.first.status == status and ex.first.headers["request-id"], (target, ex.first.body)
        body = ex.first.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", (target, body)
        assert body["error"]["type"] == anthropic_error_type(status) and body["error"]["message"], (target, body)
    for method, target, headers, status in [*anthropic_cases, ("GET", "/v1/modelsx", VERSION, 404)]:
        ex = await exchange(gw.port, request(method, target, b"{}" if method == "POST" else None, headers, close=True))
        assert_openai_error(ex.first, status)
    # and the gateway serves the SDK after them
    assert [m.id for m in (await anthropic_client(gw).models.list()).data] == _ids((await _get(gw.url + "/v1/models"))[2])


async def test_the_models_answers_say_they_vary_with_anthropic_version(sims, gateway):
    """The answer's shape follows the anthropic-version header, so every answer of the models paths
    names it in Vary (RFC 9110 §12.5.5), as a shared cache must not hand one client's shape to the
    other; with CORS on, next to Origin."""
    gw = await _fleet(sims, gateway, server={"cors_allowed_origins": ["https://app.example.com"]})
    for target, status in (("/v1/models", 200), ("/v1/models/qwen", 200), ("/v1/models/nope", 404),
                           ("/v1/models?limit=0", 200)):
        for headers in ({}, VERSION, {**VERSION, "Origin": "https://app.example.com"}):
            got, answer_headers, _ = await _get(gw.url + target, headers)
            if target.endswith("limit=0") and headers:
                assert got == 400
            else:
                assert got == status, (target, headers)
            vary = [v.strip().lower() for v in answer_headers.get("Vary", "").split(",")]
            assert "anthropic-version" in vary and "origin" in vary, (target, headers, answer_headers.get("Vary"))
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/health") as r:
        assert "anthropic-version" not in r.headers.get("Vary", "").lower()


async def test_a_walk_meets_every_model_once_while_a_configured_models_last_pod_leaves(emu, sims, gateway, tmp_path):
    """Kubernetes discovery: a model the config declares keeps its place in the listing when its
    last pod leaves (it is still listed, a request for it a 503), so a walk whose next page is
    asked after that still meets each model once."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emu.kubeconfig())
    llama, qwen = await sims("vllm", "llama"), await sims("vllm", "qwen")
    sim_pod(emu, "llama-0", llama, "llama")
    sim_pod(emu, "qwen-0", qwen, "qwen")        # a model the config does not name
    gw = await gateway([{"name": "llama", "engine": "vllm"}],
                       kubernetes={"enabled": True, "kubeconfig": str(kubeconfig), "namespaces": ["llm"],
                                   "retry_backoff_s": 0.05})
    assert await wait_for(lambda: gw.gw.pool.ready("llama") and gw.gw.pool.ready("qwen"), timeout=5)
    ids = _ids((await _get(gw.url + "/v1/models"))[2])
    assert ids == ["llama", "qwen"]         # the configured model first
    c = anthropic_client(gw)
    first = await c.models.list(limit=1)
    emu.delete_pod("llm", "llama-0")
    assert await wait_for(lambda: not gw.gw.pool.endpoints("llama"), timeout=5)
    walked = [m.id for m in first.data] + [m.id async for m in c.models.list(limit=1, after_id=first.last_id)]
    assert walked == ids
    assert _ids((await _get(gw.url + "/v1/models"))[2]) == ids
