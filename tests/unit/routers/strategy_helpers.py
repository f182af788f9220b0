"""Requests, endpoints and a context for the power-of-two, session, vtc and built-in registry tests."""

from __future__ import annotations

from functools import partial

from tests.support.factories import endpoints, inference_request, router_ctx

make_req = inference_request
make_eps = partial(endpoints, url="http://10.0.0.{n1}:8000")
ctx_for = router_ctx
