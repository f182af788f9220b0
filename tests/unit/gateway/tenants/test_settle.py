"""What ``Tenancy.settle`` charges a user's TPM window for answers that carried no usage. The case
here is one no loopback test makes at will: a client that leaves a stream as soon as the engine's
error event reaches it (the SDKs raise on it and close), while the gateway still relays the
stream's end, so the request ends as a 499 with the engine's error on its record (seen on a gateway
of two workers, about one stream in eight)."""

from __future__ import annotations

import pytest

from gateway.config.schema import config_from_dict
from gateway.endpoints import EndpointPool
from gateway.errors import ErrorClass
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.context import RequestRecord
from gateway.tenants.limits import AdmitQuery
from gateway.tenants.memory import MemoryState
from gateway.tenants.service import Tenancy, Ticket

LIMITS = {"alice": {"tpm": 1000, "max_concurrent": 2}}


def tenancy() -> Tenancy:
    cfg = config_from_dict({"models": [{"name": "m", "engine": "vllm", "endpoints": ["http://127.0.0.1:1"]}],
                            "limits": {"users": LIMITS}}, source="<test>")
    return Tenancy(cfg, GatewayMetrics(), EndpointPool(), MemoryState())


def ended(status: int, error_class: str | None, events: int = 0) -> RequestRecord:
    rec = RequestRecord("r", "/v1/chat/completions", 0.0)
    rec.endpoint, rec.status, rec.error_class, rec.streamed_events = "e", status, error_class, events
    return rec


@pytest.mark.parametrize(("status", "error_class", "events", "charged"), [
    (499, ErrorClass.UPSTREAM_STREAM_ERROR, 0, 0),      # the engine's error came first: nothing generated
    (200, ErrorClass.UPSTREAM_STREAM_ERROR, 0, 0),
    (499, ErrorClass.UPSTREAM_STREAM_ERROR, 2, 7),      # after two tokens: the estimate and the two
    (499, ErrorClass.CLIENT_CANCEL, 0, 5),              # the client left first: the engine was working
    (499, ErrorClass.CLIENT_CANCEL, 3, 8),
    (200, None, 0, 5),                                  # an answer without usage (a pass-through path)
])
async def test_an_answer_without_usage_is_charged_what_was_generated(status, error_class, events, charged):
    t = tenancy()
    ticket = Ticket(user="alice", limits=t.directory.limits_for("alice"), est_tokens=5)
    ticket.held = (await t.state.admit(AdmitQuery(ticket.user, ticket.limits, "m"))).acquired
    t.settle(ticket, ended(status, error_class, events))
    usage = await t.state.usage("alice")
    assert usage["tokens"] == charged and usage["concurrent"] == 0
