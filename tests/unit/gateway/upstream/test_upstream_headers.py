"""The headers a leg carries: the gateway's own, then the client's but those the gateway drops,
as a dict takes them (the last of a repeated name wins; names differing in case are two)."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.upstream.upstream import upstream_headers
from tests.support.factories import inference_request


def test_the_clients_headers_go_in_order_but_the_dropped_ones_in_any_case():
    sent = CIMultiDict([("Host", "gw"), ("User-Agent", "sdk"), ("content-length", "2"), ("X-Trace", "a"),
                        ("Routing-Strategy", "random"), ("X-Data-Parallel-Rank", "1"), ("X-Trace", "b"),
                        ("x-other", "1"), ("X-Other", "2"),
                        ("Authorization", "Bearer k"), ("TE", "trailers"), ("Content-Type", "text/plain")])
    h = upstream_headers(inference_request(headers=CIMultiDictProxy(sent), request_id="r1"))
    assert list(h.items()) == [("Content-Type", "application/json"), ("X-Request-Id", "r1"),
                               ("Accept-Encoding", "identity"), ("User-Agent", "sdk"), ("X-Trace", "b"),
                               ("x-other", "1"), ("X-Other", "2"), ("Authorization", "Bearer k")]
    # a plain dict of lower-cased names (the batch runner's lines) reads the same
    h = upstream_headers(inference_request(headers={"user-agent": "sdk", "host": "gw", "x-request-id": "theirs"},
                                           request_id="r2"))
    assert h == {"Content-Type": "application/json", "X-Request-Id": "r2", "Accept-Encoding": "identity",
                 "user-agent": "sdk"}
