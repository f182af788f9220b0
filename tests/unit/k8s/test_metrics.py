"""How discovery's requests are told apart in ``switchyard_kubernetes_requests_total{result}``."""

from __future__ import annotations

import ssl

import aiohttp
from aiohttp.client_reqrep import ConnectionKey

from k8s.metrics import RESULTS, status_result, transport_result


def test_api_answers_are_named_by_their_status():
    got = {code: status_result(code) for code in (401, 403, 404, 410, 422, 429, 500, 503, 0)}
    assert got == {401: "unauthorized", 403: "forbidden", 404: "client_error", 410: "gone", 422: "client_error",
                   429: "throttled", 500: "server_error", 503: "server_error", 0: "error"}
    assert set(got.values()) <= set(RESULTS)


def test_requests_without_an_answer_are_named_by_what_went_wrong():
    key = ConnectionKey("api", 443, True, True, None, None, None)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))
    assert transport_result(refused) == "connect"
    untrusted = aiohttp.ClientConnectorCertificateError(key, ssl.SSLCertVerificationError(1, "unable to get issuer"))
    assert transport_result(untrusted) == "tls"
    assert transport_result(aiohttp.ClientConnectorSSLError(key, ssl.SSLError(1, "wrong version number"))) == "tls"
    assert transport_result(aiohttp.ServerTimeoutError("read")) == "timeout"
    assert transport_result(TimeoutError()) == "timeout"
    assert transport_result(aiohttp.ServerDisconnectedError()) == "disconnected"
    assert transport_result(aiohttp.ClientPayloadError("cut")) == "disconnected"
    assert transport_result(ConnectionResetError()) == "disconnected"
    assert transport_result(ValueError("a line not understood")) == "error"
