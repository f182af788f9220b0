"""CORS: web pages on the origins ``server.cors_allowed_origins`` lists may call the API from a browser.

Off (the list empty, the default), nothing here runs: no request pays for it. On, the edge
(gateway/server/edge.py ``EdgeServer``) does three things, each chosen once at start, not per request:

- **Preflights.** An ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method`` to an API
  path (``/v1/...`` and the other inference paths) is answered by the edge before the application,
  so without an API key (browsers send none with a preflight): a 204 with the allowed origin, the
  methods the API's routes serve, the headers the page asked for, ``Access-Control-Max-Age`` and
  ``Vary: Origin``. A preflight from an origin not listed gets a 403 in the path's API shape and no
  CORS header, which the browser reports to the page as a CORS failure. A preflight to a path outside
  the API (``/status``, ``/metrics``, an unknown path) is not one CORS allows: the application gives
  it that path's answer to an ``OPTIONS``, a 405 naming its methods or a 404, without CORS's headers
  (``CorsRequest._prepare_hook``), counted and logged as ``preflight_refused``.
- **Other requests with an Origin** are made a ``CorsRequest`` (the application's request factory
  takes the class): the pipeline writes no answer to one whole (gateway/pipeline/whole.py writes for
  the request classes it knows), so every answer to it, a stream's and every error's included, goes
  through aiohttp's response objects, whose ``prepare`` calls the request's ``_prepare_hook``. There
  the allowed origin, the response headers a page may read (``EXPOSED``) and ``Vary: Origin`` are
  added, to the answers of the API's paths (``is_api_path``); an answer of another path (a plain
  ``GET /status.json`` or ``/metrics`` needs no preflight) gets ``Vary: Origin`` alone, so the
  browser keeps it from the page. The fast lane leaves a request with an ``Origin`` to aiohttp (``lane.parse``'s ``decline``).
  The few answers the edge writes to the socket itself, with no response object (a 408 of a body
  that stopped coming, the 400 of a body whose framing breaks), get the same headers
  (``head_lines``) when the request's head was read (``Vary: Origin`` alone for a path outside
  the API); a head that never came whole, or did not
  parse, names no Origin, and its answer has none of them.
- A request without an ``Origin`` (any client that is not a browser) is served as with CORS off,
  its answers with ``Vary: Origin`` added, so that a shared cache does not hand one of them, made
  without CORS's headers, to a browser: aiohttp's request path makes it a ``VaryRequest``, the fast
  lane a ``CorsLaneRequest`` (gateway/server/lane.py); an answer the pipeline writes whole to either
  gets the line with the end of its head, made once at import (``whole.writes_for``).

Each request with an ``Origin`` is counted by its outcome (``OUTCOMES``) in
``switchyard_cors_requests_total`` as its handler starts (gateway/server/edge.py), and its request
log line says the outcome in ``cors``: ``CorsRequest.log_fields`` for a request the pipeline serves,
and the edge's own line for a preflight it answers (``_log_preflight``).

aiohttp hooks used (semi-private in 3.14, pinned by tests/unit/gateway/server/test_cors.py):
``Application._make_request``'s ``_cls`` (the class of the request it makes) and
``Request._prepare_hook`` (awaited by ``StreamResponse.prepare`` before the head is written).

Credentials (cookies, HTTP authentication the browser keeps) are never allowed: the gateway reads
its API keys from the ``Authorization`` or ``x-api-key`` header, which a page sets itself, and
``Access-Control-Allow-Origin: *`` could not go with them anyway.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable
from typing import Any, ClassVar

from aiohttp import hdrs, web

from gateway.pipeline import whole
from gateway.request import given_request_id, request_id_from

MAX_AGE_S = 7200        # how long a browser may keep a preflight's answer (Chromium's own bound)

# the headers of the gateway's answers a page may read besides the safelisted ones (Content-Type, ...)
EXPOSED = ", ".join((
    "request-id", "x-request-id", "target-pod", "prefill-target-pod", "routing-strategy", "x-served-model",
    "x-retries", "x-pd-decision", "x-session-id", "retry-after", "retry-after-ms", "www-authenticate",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
    "x-ratelimit-limit-queue", "x-ratelimit-remaining-queue", "x-ratelimit-reset-queue",
    "x-error-request-body-processing", "x-error-no-model-backends", "x-error-routing", "x-error-rpm-exceeded",
    "x-error-tpm-exceeded", "x-error-concurrency-exceeded", "x-error-model-rps-exceeded", "x-error-admission",
    "x-error-unsupported-path", "x-error-upstream", "x-error-state-unavailable", "x-error-lora-load",
    "x-error-pd-prefill", "x-error-pd-decode",
    "metadata",             # vLLM's binary embeddings: where each vector is in the bytes (relay.py)
))

# what became of a request with an Origin: a preflight answered 204 or 403, another request from an
# origin listed (its answers carry CORS's headers) or not (served as before, without them)
OUTCOMES = ("preflight_allowed", "preflight_refused", "allowed", "refused")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class CorsPolicy:
    """The allowed origins: ``allow_origin`` is what ``Access-Control-Allow-Origin`` says to a request
    from ``origin``, or None when the origin is not allowed."""

    __slots__ = ("origins", "any")

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origins)
        self.any = "*" in self.origins

    def allow_origin(self, origin: str | None) -> str | None:
        if origin is None:
            return None
        if self.any:
            return "*"
        return origin if origin in self.origins else None


def allowed_headers(policy: CorsPolicy, origin: str | None) -> tuple[tuple[str, str], ...]:
    """The headers that let a page on ``origin`` read an answer: ``Access-Control-Allow-Origin``
    and the headers it may read (``EXPOSED``); none when ``origin`` is not allowed, or None."""
    allowed = policy.allow_origin(origin)
    if allowed is None:
        return ()
    return (hdrs.ACCESS_CONTROL_ALLOW_ORIGIN, allowed), (hdrs.ACCESS_CONTROL_EXPOSE_HEADERS, EXPOSED)


def outcome(policy: CorsPolicy, origin: str | None, api: bool = True) -> str:
    """A request's outcome that is no preflight: ``allowed`` when its origin is and its path is the
    API's (``api``), else ``refused``."""
    return "refused" if not api or policy.allow_origin(origin) is None else "allowed"


def is_api_path(path: str, api: Container[str]) -> bool:
    """Whether CORS lets a page call ``path``: ``/v1/...`` or an inference path (``api``: the paths
    the edge hands to their handler). The gateway's own pages (``/status``, ``/status.json``,
    ``/metrics``, ``/health``, ``/ready``), ``/admin/*`` and unknown paths are not."""
    return path.startswith("/v1/") or path in api


def head_lines(policy: CorsPolicy, origin: str | None) -> str:
    """CORS's header lines, each ended by CRLF, for an answer the edge writes to the socket itself
    (a 408, a broken body's 400) to a request whose head it read: as every other answer gets them,
    ``allowed_headers`` and ``Vary: Origin`` (only ``Vary: Origin`` without an ``Origin``). An
    allowed origin is one the config lists (checked at load) or ``*``: no byte a client chose goes
    into the answer."""
    return "".join(f"{name}: {value}\r\n" for name, value in allowed_headers(policy, origin)) + "Vary: Origin\r\n"


def add_vary(headers: Any, name: str = "Origin") -> None:
    """``name`` added to the answer's ``Vary``, once."""
    vary = headers.get(hdrs.VARY)
    if not vary:
        headers[hdrs.VARY] = name
    elif name.lower() not in (v.strip().lower() for v in vary.split(",")) and vary.strip() != "*":
        headers[hdrs.VARY] = f"{vary}, {name}"


class CorsRequest(web.Request):
    """A request that carries an ``Origin`` while CORS is on: its answer gets CORS's headers as
    aiohttp prepares it. A subclass per policy (``request_class``) holds the policy."""

    policy: ClassVar[CorsPolicy]
    api: ClassVar[frozenset[str]]

    @property
    def log_fields(self) -> dict[str, str]:
        """Fields of its request log line (``RequestContext.start`` reads them, and the line of an
        unknown path's or a method's refusal): ``cors``, the outcome; a preflight that gets here,
        to a path outside the API (the edge answers the API's), is ``preflight_refused``, and
        another request to such a path ``refused``."""
        if is_preflight(self):
            return {"cors": "preflight_refused"}
        return {"cors": outcome(self.policy, self.headers.get(hdrs.ORIGIN), is_api_path(self.path, self.api))}

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        headers = response.headers
        # a preflight's answer has its own; one to a path outside the API (the edge answers the API's)
        # gets that path's 404 or 405 without them: the browser keeps the page from calling it. So
        # does any other answer of a path outside the API (a plain GET of /status.json or /metrics
        # needs no preflight): the browser keeps it from the page
        if (hdrs.ACCESS_CONTROL_ALLOW_ORIGIN not in headers and not is_preflight(self)
                and is_api_path(self.path, self.api)):
            headers.update(allowed_headers(self.policy, self.headers.get(hdrs.ORIGIN)))
        add_vary(headers)
        await super()._prepare_hook(response)


class VaryRequest(web.Request):
    """A request without an ``Origin`` while CORS is on: its answers say ``Vary: Origin``, those
    aiohttp prepares through this hook, and those the pipeline writes whole (``writes_for``)."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        add_vary(response.headers)
        await super()._prepare_hook(response)


whole.writes_for(VaryRequest, b"Vary: Origin\r\n")


def request_class(policy: CorsPolicy, api: Iterable[str] = ()) -> type[CorsRequest]:
    """The request class for ``policy``; ``api``: the inference paths besides ``/v1/...`` (``is_api_path``)."""
    return type("CorsRequest", (CorsRequest,), {"policy": policy, "api": frozenset(api)})


def is_preflight(request: web.BaseRequest) -> bool:
    headers = request.headers
    return (request.method == hdrs.METH_OPTIONS and hdrs.ORIGIN in headers
            and hdrs.ACCESS_CONTROL_REQUEST_METHOD in headers)


def asked_headers(value: str) -> str | None:
    """The header names a preflight asks for (``Access-Control-Request-Headers``), as given when
    each is a token; None when it asks for none (or names something that is no header name)."""
    names = [n.strip() for n in value.split(",")]
    names = [n for n in names if n]
    if not names or not all(_TOKEN.fullmatch(n) for n in names):
        return None
    return ", ".join(names)


def preflight(request: web.BaseRequest, policy: CorsPolicy, methods: str, refused: Any) -> web.Response:
    """The answer to a preflight: 204 with CORS's headers for an allowed origin, else ``refused``
    (the path's 403, without them)."""
    allowed = policy.allow_origin(request.headers.get(hdrs.ORIGIN))
    if allowed is None:
        return refused(request)
    rid = request_id_from(given_request_id(request.headers))
    headers = {"request-id": rid, "x-request-id": rid, hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: allowed, hdrs.ACCESS_CONTROL_ALLOW_METHODS: methods,
               hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S),
               hdrs.VARY: "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"}
    asked = asked_headers(request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, ""))
    if asked is not None:
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
    return web.Response(status=204, headers=headers)

