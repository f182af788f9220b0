"""``GET /status`` (one self-contained HTML page) and ``GET /status.json`` (what it reads).

Access: when auth is configured (``auth.api_keys``/``auth.enabled``, or ``auth.admin_token``),
``/status.json`` needs ``Authorization: Bearer <admin token>``, since it shows internal addresses,
users and request ids; an API key is not enough. Without auth it is open, as ``/metrics`` is.
Refusals are OpenAI-shaped 401s with ``WWW-Authenticate: Bearer``.

``/status`` itself is the same static bytes for everyone and holds no data: with auth on, the
page asks for the admin token (or takes it from ``#token=`` / ``?token=`` in its address, which
it then removes), keeps it in the tab's ``sessionStorage`` and sends it as a bearer token with
each poll. A Content-Security-Policy with the hashes of its one inline script and style lets the
page load nothing else and talk only to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from importlib import resources
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import Counter, Histogram

from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.status import StatusBoard, StatusSources
from gateway.tenants.directory import admin_token_valid, header_field, key_digest

if TYPE_CHECKING:
    from gateway.server.siblings import Siblings
    from gateway.server.workers import WorkerInfo

STATUS_KEY = web.AppKey("status_board", StatusBoard)

NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
STATUS_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _page() -> tuple[bytes, str]:
    """The page's bytes and the Content-Security-Policy that fits them."""
    html = resources.files("gateway").joinpath("static/status.html").read_bytes()

    def sha(tag: str) -> str:
        found = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), html, re.S)
        if len(found) != 1:
            raise RuntimeError(f"gateway/static/status.html must hold exactly one <{tag}> block")
        return "'sha256-" + base64.b64encode(hashlib.sha256(found[0]).digest()).decode() + "'"

    csp = (f"default-src 'none'; script-src {sha('script')}; style-src {sha('style')}; connect-src 'self'; "
           "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, csp


class StatusMetrics:
    def __init__(self, registry) -> None:
        self.requests = Counter("switchyard_status_requests", "GET /status.json answers, by result",
                                ["result"], registry=registry)
        self.build = Histogram("switchyard_status_build_seconds", "Time to compute one /status.json",
                               buckets=STATUS_BUCKETS, registry=registry)


class StatusPage:
    def __init__(self, board: StatusBoard, sources: StatusSources, metrics: GatewayMetrics) -> None:
        self.board = board
        self.sources = sources
        self._follow_auth()
        self.m = StatusMetrics(metrics.registry)
        self.html, self.csp = _page()
        # --workers N (gateway/server/siblings.py): the siblings whose parts the document adds up
        self.siblings: Siblings | None = None
        self.worker: WorkerInfo | None = None

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_get("/status", self.page)
        router.add_get("/status.json", self.document)

    async def page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.html, content_type="text/html", charset="utf-8",
                            headers={**NO_STORE, "Content-Security-Policy": self.csp, "X-Frame-Options": "DENY"})

    async def document(self, request: web.Request) -> web.Response:
        self._check(request)
        if self.siblings is None or self.worker is None:
            started = time.perf_counter()
            doc = await self.board.document(self.sources)
        else:       # the siblings' parts first (their wait is not this worker's build time)
            answers, kept = await self.siblings.status_parts()
            parts = [orjson.loads(b) for b in answers]
            started = time.perf_counter()
            self.siblings.keep_status(self.board.counts())
            beats = self.worker.heartbeats
            doc = await self.board.document(self.sources, parts, (self.worker.index, self.worker.count),
                                            beats.restarts() if beats is not None else None, kept)
        body = orjson.dumps(doc)
        self.m.build.observe(time.perf_counter() - started)
        self.m.requests.labels("ok").inc()
        return web.Response(body=body, content_type="application/json", headers=NO_STORE)

    def _follow_auth(self) -> None:
        """Protection as the sources' config says: the one at start, then each reload's."""
        auth = self._auth = self.sources.config.auth
        self.protected = auth.on or auth.admin_token is not None
        self.admin_digest = key_digest(auth.admin_token) if auth.admin_token else None

    def _check(self, request: web.Request) -> None:
        if self.sources.config.auth is not self._auth:
            self._follow_auth()
        if not self.protected:
            return
        if self.admin_digest is None:
            self.m.requests.labels("unauthorized").inc()
            raise _unauthorized("the status page needs the admin token, and none is configured: "
                                "set auth.admin_token (or auth.admin_token_env)")
        if not admin_token_valid(header_field(request.headers, "Authorization"), self.admin_digest):
            self.m.requests.labels("unauthorized").inc()
            raise _unauthorized("a valid admin token is required ('Authorization: Bearer <admin token>')")
        tenancy = self.sources.tenancy
        refusal = tenancy.admin_refusal() if tenancy is not None else None
        if refusal is not None:         # the admin token is an API key the store holds, as /admin/* says
            self.m.requests.labels("forbidden").inc()
            refusal.headers.update(NO_STORE)
            raise refusal


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer", **NO_STORE},
                        error_class=ErrorClass.AUTH)


def add_status(app: web.Application, sources: StatusSources, metrics: GatewayMetrics,
               board: StatusBoard) -> StatusPage:
    page = StatusPage(board, sources, metrics)
    page.register(app.router)
    app[STATUS_KEY] = board
    return page

