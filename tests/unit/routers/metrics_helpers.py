"""Requests, endpoints, a context and engine snapshots for the metric strategies."""

from __future__ import annotations

from functools import partial

from gateway.endpoints import EngineMetrics
from tests.support.factories import endpoints, inference_request, router_ctx

make_req = partial(inference_request, tokens=100)
make_eps = endpoints
ctx_for = partial(router_ctx, metrics_max_age_s=10.0)


def snap(t: float = 1000.0, **fields) -> EngineMetrics:
    return EngineMetrics(scraped_at=t, **fields)

