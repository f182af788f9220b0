"""Assembling and running one simulated engine: the aiohttp app, the socket, the test hooks.

``start_sim`` works inside a running event loop (tests, the gateway's demo mode) and can run many
engines side by side: each has its own app, engine state and metrics registry. The socket is bound
first, so the URL is known at once; a vLLM engine with a startup delay keeps it bound but not
listening, which is exactly "connection refused until ready".

Handlers are cancelled when their client disconnects (``handler_cancellation``), which is how the
engine learns that a request was abandoned, even while it is stalled and writing nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import socket
from typing import Any

import orjson
from aiohttp import web

from enginesim.config import SimConfig
from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle
from enginesim.faults import FaultSpecError, parse_fault
from enginesim.more_apis import more_routes
from enginesim.responses_api import ResponsesApi
from enginesim.sglang_api import SglangApi
from enginesim.vllm_api import VllmApi
from enginesim.wire import json_response, read_json

ENGINE_KEY = web.AppKey("enginesim_engine", Engine)
CONFIG_KEY = web.AppKey("enginesim_config", SimConfig)
RECEIVED_KEY = web.AppKey("enginesim_received", collections.deque)
REFUSED_KEY = web.AppKey("enginesim_refused", collections.deque)
TRACEPARENTS_KEY = web.AppKey("enginesim_traceparents", collections.deque)

# how many received requests `/_sim/state` remembers (a test hook, not an access log)
_RECEIVED_KEPT = 256
# the largest body `/_sim/state` shows a received request's JSON object of, as it came
_BODY_KEPT = 8192
# how many received W3C trace headers it remembers (newest last)
_TRACEPARENTS_KEPT = 64

# Long enough for streams to write their final frames after the shutdown abort, short enough that
# closing a sim with a hung connection does not stall a test run.
_SHUTDOWN_TIMEOUT_S = 1.0


def build_app(cfg: SimConfig) -> web.Application:
    """The aiohttp application of one engine (engine, role, routes, lifecycle hooks)."""
    engine = Engine(cfg)
    received: collections.deque[dict[str, Any]] = collections.deque(maxlen=_RECEIVED_KEPT)
    traceparents: collections.deque[dict[str, Any]] = collections.deque(maxlen=_TRACEPARENTS_KEPT)
    refused: collections.deque[dict[str, Any]] = collections.deque(maxlen=_RECEIVED_KEPT)
    middlewares = [_recorder(received, traceparents), _method_not_allowed]
    if cfg.api_key:
        middlewares.insert(0, _api_key_check(cfg, refused))
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    app[CONFIG_KEY] = cfg
    app[RECEIVED_KEY] = received
    app[REFUSED_KEY] = refused
    app[TRACEPARENTS_KEY] = traceparents
    api: VllmApi | SglangApi = VllmApi(engine) if cfg.engine == "vllm" else SglangApi(engine)
    app.add_routes(api.routes())
    app.add_routes(ResponsesApi(engine).routes())     # /v1/responses, in the engine's own style
    app.add_routes(more_routes(engine))     # Messages, rerank, score, tokenize, audio
    app.add_routes(engine.role.routes())
    app.add_routes(_sim_routes(engine, received, traceparents, refused))

    async def on_startup(_: web.Application) -> None:
        await engine.start()

    async def on_shutdown(_: web.Application) -> None:
        engine.shutdown()

    async def on_cleanup(_: web.Application) -> None:
        await engine.close()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def protected(engine: str, path: str) -> bool:
    """Whether the engine started with --api-key wants the key on ``path``: vLLM's authentication
    middleware guards the paths under /v1 (its /health, /metrics, /tokenize, /ping... are open);
    SGLang's guards every path but those starting with /health or /metrics."""
    if path.startswith("/_sim/"):
        return False
    if engine == "vllm":
        return path.startswith("/v1")
    return not path.startswith(("/health", "/metrics"))


def _key_matches(engine: str, header: str | None, key: str) -> bool:
    """vLLM takes the scheme in any case and compares what follows its first space; SGLang
    compares the whole header with ``Bearer <key>``."""
    if header is None:
        return False
    if engine == "vllm":
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(errors="surrogateescape"), key.encode())
    return secrets.compare_digest(header.encode(errors="surrogateescape"), f"Bearer {key}".encode())


def _api_key_check(cfg: SimConfig, refused: collections.deque) -> Any:
    """--api-key: a request to a protected path without the key is answered 401 with the body
    both engines send, before any handler (nor the recorder) sees it; ``refused`` remembers it."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" and protected(cfg.engine, request.path) \
                and not _key_matches(cfg.engine, request.headers.get("Authorization"), cfg.api_key):
            refused.append({"method": request.method, "path": request.path_qs})
            return json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


@web.middleware
async def _method_not_allowed(request: web.Request, handler: Any) -> web.StreamResponse:
    """A method a route does not serve: both engines are FastAPI apps, which answer it with a JSON
    body, ``{"detail": "Method Not Allowed"}``, and the route's methods in ``Allow`` (aiohttp's
    own answer is plain text)."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        return json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": e.headers["Allow"]})


def _recorder(received: collections.deque, traceparents: collections.deque) -> Any:
    """Remember what each request that reached the engine looked like on the wire (method, path,
    body size, whether the body is one JSON object, and that object when it is small; an
    ``X-Vllm-Priority`` header, which vLLM reads over the body's priority), so a test
    can prove what a gateway let through; and the W3C trace headers of those that carried a ``traceparent`` (trace propagation)."""

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/_sim/"):
            tp = request.headers.get("traceparent")
            if tp is not None:
                traceparents.append({"path": request.path, "traceparent": tp,
                                     "tracestate": request.headers.get("tracestate"),
                                     "request_id": request.headers.get("X-Request-Id")})
            entry: dict[str, Any] = {"method": request.method, "path": request.path_qs, "bytes": 0,
                                     "json_object": None}
            if (prio := request.headers.get("X-Vllm-Priority")) is not None:
                entry["vllm_priority"] = prio       # vLLM reads it over the body's priority
            received.append(entry)
            if request.body_exists:
                try:
                    raw = await request.read()
                except web.HTTPException:
                    raw = None
                except Exception:           # undecodable (a Content-Encoding that lies): as the engine would
                    entry["json_object"] = False
                    raise
                if raw is not None:
                    entry["bytes"] = len(raw)
                    try:
                        obj = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        entry["json_object"] = False
                    else:
                        entry["json_object"] = isinstance(obj, dict)
                        if entry["json_object"] and len(raw) <= _BODY_KEPT:
                            try:                    # and one /_sim/state can write (orjson nests 254 deep)
                                orjson.dumps(obj)
                            except orjson.JSONEncodeError:
                                pass
                            else:
                                entry["body"] = obj     # what the engine was asked (a gateway's P/D legs)
        return await handler(request)

    return record


def _sim_routes(engine: Engine, received: collections.deque, traceparents: collections.deque,
                refused: collections.deque) -> list[web.RouteDef]:
    """Test-only introspection and control, under ``/_sim/``."""

    async def state(request: web.Request) -> web.Response:
        return json_response({**engine.snapshot(), "received": list(received),
                              "traceparents": list(traceparents), "refused": list(refused)})

    async def reset(request: web.Request) -> web.Response:
        engine.reset()
        received.clear()
        traceparents.clear()
        refused.clear()
        return json_response(engine.snapshot())

    async def configure(request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=False)
            if "dead" in body:
                engine.dead = bool(body["dead"])
            if "fault" in body:
                engine.default_fault = parse_fault(body["fault"], engine.cfg.role)
        except FaultSpecError as exc:
            return ApiError(400, f"invalid fault: {exc}").response(ErrorStyle.VLLM)
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        return json_response(engine.snapshot())

    return [web.get("/_sim/state", state), web.post("/_sim/reset", reset),
            web.post("/_sim/config", configure)]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class SimServer:
    """A running simulated engine. ``url`` is usable at once; ``wait_ready()`` waits for startup."""

    def __init__(self, cfg: SimConfig, app: web.Application, runner: web.AppRunner,
                 sock: socket.socket) -> None:
        self.cfg = cfg
        self.app = app
        self.engine = app[ENGINE_KEY]
        self._runner = runner
        self._sock: socket.socket | None = sock
        self._listening = asyncio.Event()
        self._starter: asyncio.Task[None] | None = None
        self.host, self.port = sock.getsockname()[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        # P/D listeners, bound when the app started: vLLM prefill's NIXL side channel, SGLang
        # prefill's bootstrap server (None on other roles).
        self.side_channel_port: int | None = self.engine.role.side_channel_port
        self.bootstrap_port: int | None = self.engine.role.bootstrap_port

    async def _listen(self, delay: float = 0.0) -> None:
        if delay:
            await asyncio.sleep(delay)
        assert self._sock is not None
        site = web.SockSite(self._runner, self._sock)
        await site.start()
        self._sock = None  # owned by the site now
        self._listening.set()

    async def wait_ready(self) -> None:
        """Until the engine accepts connections and (SGLang) reports healthy."""
        await self._listening.wait()
        while not self.engine.ready:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        if self._starter is not None:
            self._starter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._starter
        await self._runner.cleanup()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> SimServer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def start_sim(cfg: SimConfig) -> SimServer:
    """Start one engine in the current event loop; port 0 binds a free port."""
    app = build_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
                           keepalive_timeout=cfg.keepalive_timeout_s or 10.0 ** 7)
    await runner.setup()
    try:
        sock = _bind(cfg.host, cfg.port)
    except OSError:
        await runner.cleanup()
        raise
    server = SimServer(cfg, app, runner, sock)
    if cfg.engine == "vllm" and cfg.startup_delay_s > 0:
        # Bound but not listening: connects are refused until the engine is "ready".
        server._starter = asyncio.get_running_loop().create_task(server._listen(cfg.startup_delay_s))
    else:
        await server._listen()
    return server
