"""The admin API: users and API keys at run time, JSON over HTTP, behind its own bearer token.

Routes exist only when ``auth.admin_token`` (or ``auth.admin_token_env``) is configured:

    GET    /admin/users                 list (config and store users; ``source`` says which)
    POST   /admin/users                 create {name, rpm, tpm, max_concurrent} (409 if it exists)
    GET    /admin/users/{name}          one user, with current window usage and key ids
    PUT    /admin/users/{name}          create or replace (a store record overrides a config user)
    PATCH  /admin/users/{name}          change some limits (merged into the store's record, atomically)
    DELETE /admin/users/{name}          delete the store record and every store key of the user, atomically
    GET    /admin/keys[?user=NAME]      list keys (never the key itself)
    POST   /admin/keys                  create {user, name?, key?}: the answer shows the key once
    GET    /admin/keys/{id}             one key
    PATCH  /admin/keys/{id}             change {user, name}
    DELETE /admin/keys/{id}             revoke

Writes go to the state backend (Redis: every replica's workers read the change's notice and take
it in at once, gateway/tenants/notices.py; the sync every ``state.sync_interval_s`` is the backstop);
every admin request first brings the directory up to date (with Redis, by what changed since its
version), so it always acts on the store's current state.
Config-defined keys are read-only here; a config user can be overridden (PUT) but not deleted.
A key's ``user`` is any valid name: a user needs no record (as a config key's user needs no
``limits.users`` entry), and one known only by keys gets ``limits.default_user``.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from gateway.config.schema import CONTROL_CHARACTER, UserLimits
from gateway.errors import ErrorClass, GatewayError, printable
from gateway.observability.logs import RequestLog
from gateway.observability.tracing import NO_TRACE, TRACE_KEY
from gateway.pipeline.context import MAX_LOG_CHARS, RequestRecord, log_answer
from gateway.request import given_request_id, request_id_from
from gateway.tenants import Tenancy
from gateway.tenants.directory import (
    LIMIT_FIELDS,
    PRIORITIES,
    USER_NAME,
    KeyRecord,
    admin_token_valid,
    bearer_token,
    header_field,
    key_digest,
    limits_from_stored,
    limits_view,
    new_key,
    now,
)
from gateway.tenants.redis_state import StateUnavailable, trouble

log = structlog.get_logger("switchyard.tenancy")

TENANCY_KEY = web.AppKey("tenancy", Tenancy)
MIN_KEY_LENGTH = 16
MAX_KEY_LENGTH = 1024
# what a client can send in an Authorization or x-api-key header: visible ASCII (no space, no control
# character, nothing a header's encoding could change), and no longer than a header line may be
KEY_TEXT = re.compile(rf"[\x21-\x7e]{{{MIN_KEY_LENGTH},{MAX_KEY_LENGTH}}}")
# the largest limit: past 2**53 a number is not exact in the store's scripts (Lua's doubles) nor
# in JSON readers that use doubles, so a larger one would be kept as another number
MAX_LIMIT = 2**53 - 1
# a user's model list: what a store record may hold (each name as long as a model name may be)
MAX_MODELS = 1000
MAX_MODEL_NAME = 1024
USER_FIELDS = (*LIMIT_FIELDS, "models", "priority")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# what the object an admin call changed or read is: a key's id, a user's name (the path's, or a
# created one's, which the handler sets)
ADMIN_OBJECT = web.RequestKey("admin_object", str)
# the admin fields of a line the error middleware writes (gateway/server/app.py ``_error_answers``)
ADMIN_LOG_FIELDS = web.RequestKey("admin_log_fields", dict)
# an admin answer's status as the result label of switchyard_admin_requests_total
ADMIN_RESULTS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 409: "conflict", 413: "too_large",
                 499: "cancelled", 503: "unavailable"}


def credential_id(authorization: str | None) -> str | None:
    """The bearer token an ``Authorization`` header carries, as the log names it: the first 16 hex
    digits of its SHA-256, as an API key's id is (so an API key sent as the admin token shows as its
    key id); None without a bearer token. Never the token itself."""
    token = bearer_token(authorization)
    return key_digest(token)[:16] if token is not None else None


class AdminAudit:
    """The admin API's audit trail: one request line per admin call (``POST /admin/reload``'s
    included), whatever its answer, a refused token's too, with ``admin_action``, ``admin_token``
    (``credential_id``: never the token), ``admin_object`` (never a key) and the status; and
    ``switchyard_admin_requests_total{action,result}``. A 404 of the admin API turned off by a reload,
    and a 413 of a body too large, keep the line the error middleware writes for them (one line a
    request), with the same fields."""

    def __init__(self, registry: CollectorRegistry | None, request_log: RequestLog | None) -> None:
        self.requests = Counter("switchyard_admin_requests", "Admin API calls (POST /admin/reload included), "
                                "by action and result", ["action", "result"], registry=registry)
        self.request_log = request_log

    def wrap(self, action: str, fn: Handler) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            given = given_request_id(request.headers)
            rid = request_id_from(given)
            obj = request.match_info.get("id") or request.match_info.get("name")
            if obj is not None:
                request[ADMIN_OBJECT] = obj
            fields = {"method": request.method, "admin_action": action,
                      "admin_token": credential_id(header_field(request.headers, "Authorization"))}
            if trace_id := request.get(TRACE_KEY, NO_TRACE).trace_id:     # a traced call's line names its trace
                fields["trace_id"] = trace_id
            status, error, error_class, logged = 499, "client went away", ErrorClass.CLIENT_CANCEL, False
            try:
                resp = await fn(request)
            except GatewayError as e:
                status, error, error_class = e.status, e.message, e.error_class
                # the error middleware's answer carries this line's request id
                e.headers.setdefault("request-id", rid)
                e.headers.setdefault("x-request-id", e.headers["request-id"])
                rid = e.headers["request-id"]
                logged = status == 413                  # the error middleware writes its line
                self._fields(request, fields, logged)
                raise
            except web.HTTPException as e:
                status, error, error_class = e.status, e.reason, ErrorClass.HTTP
                logged = status in (404, 405, 413, 501)     # the error middleware writes its line
                self._fields(request, fields, logged)
                raise
            except Exception:
                status, error, error_class = 500, "internal gateway error", ErrorClass.INTERNAL
                raise
            else:
                status, error, error_class = resp.status, None, None
                rid = resp.headers.setdefault("request-id", rid)
                return resp
            finally:
                self.requests.labels(action, ADMIN_RESULTS.get(status, "ok" if status < 400 else "error")).inc()
                if not logged and self.request_log is not None:
                    self._fields(request, fields)
                    rec = RequestRecord(rid, request.path, started, status=status, error_class=error_class,
                                        error=error, request_id_replaced=given is not None and given != rid)
                    rec.extra.update(fields)
                    log_answer(rec, time.perf_counter(), self.request_log)
        return handler

    @staticmethod
    def _fields(request: web.Request, fields: dict[str, Any], edge_line: bool = False) -> None:
        """``fields`` with the call's object; for a line the error middleware writes, on the request."""
        obj = request.get(ADMIN_OBJECT)
        if obj is not None:
            obj = printable(obj)
            fields["admin_object"] = obj if len(obj) <= MAX_LOG_CHARS else f"{obj[:MAX_LOG_CHARS]}… ({len(obj)} characters)"
        if edge_line:
            request[ADMIN_LOG_FIELDS] = fields


def add_tenancy(app: web.Application, tenancy: Tenancy, audit: AdminAudit | None = None) -> None:
    """Wire tenancy into the app: rate-limit headers on every answer, the state backend's
    lifecycle, and the admin routes when an admin token is configured (each call written to
    ``audit``'s log and counted there)."""
    app[TENANCY_KEY] = tenancy
    app.on_response_prepare.append(tenancy.on_response_prepare)

    async def start(_app: web.Application) -> None:
        await tenancy.start()

    async def stop(_app: web.Application) -> None:
        await tenancy.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    if tenancy.admin_digest is not None:
        AdminAPI(tenancy, audit).register(app.router)


def require_admin(request: web.Request, digest: str | None, tenancy: Tenancy | None = None) -> None:
    """401 unless the request carries the admin token (``digest``: its digest, None when unset).
    Unset (a reload removed it): the admin API is off, a 404 as on a gateway started without one.
    The token while ``tenancy`` finds it is an API key the store holds: a 403 saying so."""
    if digest is None:
        raise web.HTTPNotFound()
    if not admin_token_valid(header_field(request.headers, "Authorization"), digest):
        raise GatewayError(401, "a valid admin token is required ('Authorization: Bearer <token>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}, error_class=ErrorClass.AUTH)
    refusal = tenancy.admin_refusal() if tenancy is not None else None
    if refusal is not None:
        raise refusal


def _json(status: int, payload: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, error_class=ErrorClass.ADMIN)


def _not_found(what: str) -> GatewayError:
    return GatewayError(404, f"{what} not found", code="not_found", error_class=ErrorClass.ADMIN)


def _conflict(message: str) -> GatewayError:
    return GatewayError(409, message, code="conflict", type_="invalid_request_error", error_class=ErrorClass.ADMIN)


def _changes(data: dict[str, Any]) -> dict[str, Any]:
    """The limits a body sets, checked: a 400 naming the first field that is not one or not valid.
    ``models``: a non-empty list of names, or null (every model); ``priority``: an admission class,
    or null (the default user's, else ``admission.default_priority``)."""
    out: dict[str, Any] = {}
    for key, v in data.items():
        if key == "models":
            if v is not None and (not isinstance(v, list) or not v or len(v) > MAX_MODELS or not all(
                    isinstance(m, str) and 0 < len(m) <= MAX_MODEL_NAME and m == m.strip()
                    and not CONTROL_CHARACTER.search(m) for m in v)):
                # a name with whitespace at its ends matches no request's model, and a control character
                # in one would split the log lines it goes into (the config refuses both too)
                raise _bad(f"'models' must be null (every model) or a list of 1 to {MAX_MODELS} model names "
                           f"(each a non-empty string of at most {MAX_MODEL_NAME} characters, without "
                           "whitespace at its ends or control characters)", key)
            out[key] = list(dict.fromkeys(v)) if v is not None else None
            continue
        if key == "priority":
            if v is not None and v not in PRIORITIES:
                raise _bad(f"'priority' must be null (the default's class) or one of {', '.join(PRIORITIES)}", key)
            out[key] = v
            continue
        if key not in LIMIT_FIELDS:
            raise _bad(f"unknown field '{key}' (known: {', '.join(USER_FIELDS)})", key)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LIMIT:
            raise _bad(f"'{key}' must be an integer from 0 (unlimited) to {MAX_LIMIT}", key)
        out[key] = v
    return out


def _path_user(data: dict[str, Any], name: str) -> None:
    """A body's ``name`` on ``/admin/users/{name}`` may repeat the path's, never name another user:
    a user is not renamed (its keys and counters are under its name), and a PATCH or PUT that
    looked like a rename must not change the path's user instead."""
    if "name" in data and data.pop("name") != name:
        raise _bad(f"'name' in the body must be the path's user, '{name}': a user cannot be renamed "
                   "(create the new user, move its keys with PATCH /admin/keys/{id}, delete the old one)", "name")


def _limits(data: dict[str, Any]) -> UserLimits:
    """A whole record: the fields a body gives, 0 (unlimited) for the others, no model list, no class."""
    return limits_from_stored(_changes(data))


def _user_name(v: Any, param: str = "name") -> str:
    if not isinstance(v, str) or not USER_NAME.fullmatch(v):
        raise _bad(f"'{param}' must be 1-128 characters of letters, digits and . _ @ : + -", param)
    return v


class AdminAPI:
    def __init__(self, tenancy: Tenancy, audit: AdminAudit | None = None) -> None:
        self.t = tenancy
        self.dir = tenancy.directory
        self.audit = audit

    def register(self, router: web.UrlDispatcher) -> None:
        for method, path, action, fn in (
            ("GET", "/admin/users", "list_users", self.list_users),
            ("POST", "/admin/users", "create_user", self.create_user),
            ("GET", "/admin/users/{name}", "get_user", self.get_user),
            ("PUT", "/admin/users/{name}", "replace_user", self.put_user),
            ("PATCH", "/admin/users/{name}", "update_user", self.patch_user),
            ("DELETE", "/admin/users/{name}", "delete_user", self.delete_user),
            ("GET", "/admin/keys", "list_keys", self.list_keys),
            ("POST", "/admin/keys", "create_key", self.create_key),
            ("GET", "/admin/keys/{id}", "get_key", self.get_key),
            ("PATCH", "/admin/keys/{id}", "update_key", self.patch_key),
            ("DELETE", "/admin/keys/{id}", "revoke_key", self.delete_key),
        ):
            handler = self._guard(fn)
            router.add_route(method, path, self.audit.wrap(action, handler) if self.audit is not None else handler)

    def _guard(self, fn):
        async def handler(request: web.Request) -> web.Response:
            require_admin(request, self.t.admin_digest)
            try:
                await self.t.refresh()
                require_admin(request, self.t.admin_digest, self.t)     # the store's keys as they are now
                return await fn(request)
            except StateUnavailable as e:
                # the client is told the store is unavailable; what Redis said (an ACL's refusal, a
                # key's type, a script's digest) is the operator's, in the log
                log.warning(f"admin API: {trouble(e.reason)}", reason=e.reason, error=str(e),
                            method=request.method, path=request.path)
                raise GatewayError(503, "the shared state is unavailable", code="service_unavailable",
                                   headers={"Retry-After": "1"}, header=("x-error-state-unavailable", "true"),
                                   error_class=ErrorClass.STATE_UNAVAILABLE) from None
        return handler

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            data = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            raise _bad("request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise _bad("request body must be a JSON object")
        return data

    # -- users -------------------------------------------------------------------------------

    async def list_users(self, request: web.Request) -> web.Response:
        d = self.dir.default_user
        return _json(200, {"object": "list", "data": self.dir.users(),
                           "default_user": limits_view(d) if d is not None else None})

    async def _user_answer(self, name: str, status: int = 200) -> web.Response:
        view = self.dir.user_view(name)
        if view is None:                    # deleted meanwhile, by a request that ran after this one
            raise _not_found(f"user {name}")
        try:
            view["usage"] = await self.t.state.usage(name)
        except StateUnavailable as e:
            # a change made is answered as made: a 503 here would tell the client it failed. The
            # usage is unknown (null), as it is on the status page: Redis went away after the
            # change, or a window of the user's holds a key of another type
            log.warning(f"admin API: {trouble(e.reason)}; the user's usage is unknown", user=name,
                        reason=e.reason, error=str(e))
            view["usage"] = None
        view["keys"] = [k.id for k in self.dir.keys(name)]
        return _json(status, view)

    async def create_user(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        name = _user_name(data.pop("name", None))
        request[ADMIN_OBJECT] = name
        if self.dir.user_source(name) is not None:
            raise _conflict(f"user {name} exists (PUT /admin/users/{name} replaces it)")
        limits = _limits(data)
        # a config user has no store record yet; either way the store decides, atomically, so two
        # creates of one name (on two replicas, or interleaved in one) cannot both succeed
        if not await self.t.state.put_user(name, limits, only="absent"):
            await self.t.refresh()
            raise _conflict(f"user {name} exists (PUT /admin/users/{name} replaces it)")
        await self.t.refresh()
        return await self._user_answer(name, 201)

    async def get_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if self.dir.user_source(name) is None:
            raise _not_found(f"user {name}")
        return await self._user_answer(name)

    async def put_user(self, request: web.Request) -> web.Response:
        name = _user_name(request.match_info["name"])
        data = await self._body(request)
        _path_user(data, name)
        created = self.dir.user_source(name) is None
        await self.t.state.put_user(name, _limits(data))
        await self.t.refresh()
        return await self._user_answer(name, 201 if created else 200)

    async def patch_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if self.dir.user_source(name) is None:
            raise _not_found(f"user {name}")
        data = await self._body(request)
        _path_user(data, name)
        changes = _changes(data)
        # the store sets the fields in the record as it is when the change runs (a configured
        # user's limits if it has none), so two PATCHes of one user, on two replicas or
        # interleaved in one, both land; a user deleted meanwhile stays deleted
        if changes and not await self.t.state.patch_user(name, changes, self.dir.config_users.get(name)):
            await self.t.refresh()
            raise _not_found(f"user {name}")
        await self.t.refresh()
        return await self._user_answer(name)

    async def delete_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        src = self.dir.user_source(name)
        if src is None:
            raise _not_found(f"user {name}")
        if src == "config":
            raise _conflict(f"user {name} is defined in the config file; edit the config to remove it")
        # the store deletes the record and every key of the user it holds when the delete runs,
        # a key made a moment ago on another replica included
        deleted = await self.t.state.delete_user(name)
        await self.t.refresh()
        if deleted is None:                 # deleted meanwhile
            raise _not_found(f"user {name}")
        return _json(200, {"deleted": name, "keys_deleted": deleted, "now": self.dir.user_view(name)})

    # -- keys --------------------------------------------------------------------------------

    async def list_keys(self, request: web.Request) -> web.Response:
        user = request.query.get("user")
        return _json(200, {"object": "list", "data": [k.public() for k in self.dir.keys(user)]})

    def _key(self, request: web.Request) -> KeyRecord:
        key = self.dir.key_by_id(request.match_info["id"])
        if key is None:
            raise _not_found(f"key {request.match_info['id']}")
        return key

    async def create_key(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        for k in data:
            if k not in ("user", "name", "key"):
                raise _bad(f"unknown field '{k}' (known: user, name, key)", k)
        user = _user_name(data.get("user"), "user")
        name = data.get("name", "")
        if not isinstance(name, str) or len(name) > 256:
            raise _bad("'name' must be a string of at most 256 characters", "name")
        plain = data.get("key")
        if plain is None:
            plain = new_key()
        elif not isinstance(plain, str) or not KEY_TEXT.fullmatch(plain):
            raise _bad(f"'key' must be {MIN_KEY_LENGTH} to {MAX_KEY_LENGTH} visible ASCII characters, no space or "
                       "control character, as a client can send it in a header (omit it to have one generated)", "key")
        digest = key_digest(plain)
        admin = self.t.admin_digest
        if admin is not None and hmac.compare_digest(digest, admin):
            raise _bad("'key' must not be the admin token: an API key is not an admin token", "key")
        if await self.t.admin_token_of_a_replica(digest):
            # replicas may have different admin tokens (one reloaded before the others): each
            # publishes its token's SHA-256 in the shared state
            raise _bad("'key' must not be the admin token of a replica sharing this state: an API key is not an "
                       "admin token", "key")
        if self.dir.key(digest) is not None:
            raise _conflict("this key already exists")
        rec = KeyRecord(digest=digest, user=user, name=name, created=now())
        request[ADMIN_OBJECT] = rec.id
        if not await self.t.state.put_key(rec, only="absent"):      # created meanwhile elsewhere
            await self.t.refresh()
            raise _conflict("this key already exists")
        await self.t.refresh()
        return _json(201, {**rec.public(), "key": plain})

    async def get_key(self, request: web.Request) -> web.Response:
        return _json(200, self._key(request).public())

    async def patch_key(self, request: web.Request) -> web.Response:
        key = self._key(request)
        if key.source == "config":
            raise _conflict(f"key {key.id} is defined in the config file")
        data = await self._body(request)
        user, name = key.user, key.name
        for k, v in data.items():
            if k == "user":
                user = _user_name(v, "user")
            elif k == "name":
                if not isinstance(v, str) or len(v) > 256:
                    raise _bad("'name' must be a string of at most 256 characters", "name")
                name = v
            else:
                raise _bad(f"unknown field '{k}' (known: user, name)", k)
        rec = KeyRecord(digest=key.digest, user=user, name=name, created=key.created)
        if not await self.t.state.put_key(rec, only="present"):     # revoked meanwhile: stays revoked
            await self.t.refresh()
            raise _not_found(f"key {key.id}")
        await self.t.refresh()
        return _json(200, self.dir.store_keys[key.digest].public())

    async def delete_key(self, request: web.Request) -> web.Response:
        key = self._key(request)
        if key.source == "config":
            raise _conflict(f"key {key.id} is defined in the config file")
        await self.t.state.delete_key(key.digest)
        await self.t.refresh()
        return _json(200, {"deleted": key.id})
