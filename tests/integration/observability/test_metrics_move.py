"""Metrics of docs/observability.md, each moved by the event it counts, on one gateway with API keys,
a user's limits and an admin token: a table of (what happens, the series, by how much it moves),
each row scraped before and after its event, so a series that stays still (or moves for another
event) fails its row. Among them ``switchyard_status_build_seconds`` and ``switchyard_state_admit_seconds``,
which no other test reads."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest

from tests.support.factories import model_block
from tests.support.gateway_process import metric_total
from tests.support.http import openai_client
from tests.support.tenancy import ALICE, CHAT, KEYS

ADMIN = "admin-token-0123456789"


async def _status(gw, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/status.json", headers=headers) as r:
        return r.status


async def _chat(gw, **kw) -> None:
    await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT, max_tokens=2, **kw)


async def _stream(gw) -> None:
    async for _ in await openai_client(gw, ALICE).chat.completions.create(model="m", messages=CHAT, max_tokens=3,
                                                                         stream=True):
        pass


async def _refused(gw, key: str, model: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        await openai_client(gw, key).chat.completions.create(model=model, messages=CHAT, max_tokens=1)


async def _keyless(gw) -> None:
    async with aiohttp.ClientSession() as s, s.post(gw.base_url + "/chat/completions",
                                                    json={"model": "m", "messages": CHAT}) as r:
        assert r.status == 401


Event = Callable[..., Awaitable[object]]
# (what happens, the series and its labels, how much it moves: a number, or ">0")
ROWS: list[tuple[str, Event, str, dict[str, str], float | str]] = [
    ("a chat answered", _chat, "switchyard_requests_total", {"model": "m", "status": "200",
                                                             "strategy": "least-request"}, 1),
    ("a chat answered", _chat, "switchyard_path_requests_total", {"path": "/v1/chat/completions", "status": "200"}, 1),
    ("a chat answered", _chat, "switchyard_e2e_request_latency_seconds_count", {"model": "m"}, 1),
    ("a chat answered", _chat, "switchyard_routing_decision_seconds_count", {"strategy": "least-request"}, 1),
    ("a limited user's chat", _chat, "switchyard_state_admit_seconds_count", {}, 1),
    ("a limited user's chat", _chat, "switchyard_user_tokens_total", {"user": "alice", "kind": "completion"}, ">0"),
    ("a chat answered", _chat, "switchyard_completion_tokens_total", {"model": "m"}, ">0"),
    ("a stream", _stream, "switchyard_time_to_first_token_seconds_count", {"model": "m"}, 1),
    ("an unknown model", lambda gw: _refused(gw, ALICE, "nope", openai.NotFoundError),
     "switchyard_requests_total", {"model": "-", "status": "404", "strategy": ""}, 1),
    ("no API key", _keyless,
     "switchyard_auth_failures_total", {"reason": "missing"}, 1),
    ("a wrong API key", lambda gw: _refused(gw, "sk-wrong", "m", openai.AuthenticationError),
     "switchyard_auth_failures_total", {"reason": "invalid"}, 1),
    ("the status page read", lambda gw: _status(gw, ADMIN), "switchyard_status_build_seconds_count", {}, 1),
    ("the status page read", lambda gw: _status(gw, ADMIN), "switchyard_status_requests_total", {"result": "ok"}, 1),
    ("the status page without the token", lambda gw: _status(gw, None), "switchyard_status_requests_total",
     {"result": "unauthorized"}, 1),
]


async def test_each_metric_moves_by_its_event(sims, gateway):
    sim = await sims("vllm", "m", eos_probability=0.0)
    gw = await gateway([model_block("m", "vllm", [sim.url])], auth={**KEYS, "admin_token": ADMIN},
                       limits={"users": {"alice": {"rpm": 1000}}})
    wrong = []
    for what, event, name, labels, moves in ROWS:
        before = metric_total(await gw.metrics_text(), name, **labels)
        await event(gw)
        moved = metric_total(await gw.metrics_text(), name, **labels) - before
        if not (moved > 0 if moves == ">0" else moved == moves):
            wrong.append(f"{what}: {name}{labels} moved {moved}, not {moves}")
    assert not wrong, "\n".join(wrong)
