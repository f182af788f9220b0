"""The pipeline's view of tenancy: ``authenticate`` → ``admit`` → ``settle``.

``Gateway.handle`` calls three hooks, and nothing else of this module:

- ``authenticate(request, rec)`` right after the draining check, before the body is read: with
  auth on, a missing or unknown bearer key is a 401 before the gateway spends anything on the
  request. Returns the request's ``Ticket`` (also kept in ``request[TICKET]``).
- ``admit(ticket, ireq, rec)`` once the model is known and has ready endpoints, before routing:
  fixes the user identity routers see, then checks model RPS and the user's RPM/TPM/concurrency
  (at most one Redis round trip), raising the 429.
- ``settle(ticket, rec)`` in the handler's ``finally``: charges the tokens the engine reported
  (streams included: the gateway always asks engines for usage) and releases the concurrency
  slot, exactly once per request.

The ``x-ratelimit-*`` headers, once the limits were checked, go in the request's record
(``rec.rate_headers``), whose ``response_headers`` every answer of the pipeline starts from: a
relayed stream, a body or an error, written by the gateway itself or by aiohttp. For an answer the
application makes without them, ``on_response_prepare`` (an aiohttp signal) adds whatever is
missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import Gauge

from gateway.apis.paths import COUNT_TOKENS
from gateway.config.schema import Config, UserLimits
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import ROUTING_BUCKETS, Counter, Histogram
from gateway.state.redis import COMMAND_REFUSALS
from gateway.state.urls import redact as _redact
from gateway.state.urls import redis_mode
from gateway.tenants.directory import AmbiguousKey, Directory, KeyRecord, key_digest, presented_key
from gateway.tenants.limits import AdmitQuery, rate_headers, rejection
from gateway.tenants.memory import MemoryState
from gateway.tenants.notices import DirectoryNotices
from gateway.tenants.redis_state import RedisState, StateUnavailable, trouble

if TYPE_CHECKING:
    from gateway.observability.metrics import GatewayMetrics
    from gateway.pipeline.context import RequestRecord
    from gateway.request import InferenceRequest

log = structlog.get_logger("switchyard.tenancy")

MAX_BACKOFF_S = 2.0
MAX_UNKNOWN_KEYS = 10_000
FAIL_OPEN_LOG_EVERY_S = 10.0
START_RETRY_S = 1.0          # start-up: how long a failing first sync is tried again
OUTAGE_LOG_S = 30.0          # an outage's warning is written at most this often (each is counted)
START_RETRY_GAP_S = 0.1
START_FINAL = COMMAND_REFUSALS | {"auth", "no_tls"}    # what a second try at start meets alike


@dataclass(slots=True)
class Ticket:
    """One request's tenancy state, from authentication to settlement."""

    user: str | None = None
    key_id: str | None = None
    limits: UserLimits | None = None
    held: bool = False                   # holds a concurrency slot in the state backend
    headers: dict[str, str] | None = None
    est_tokens: int = 0                  # prompt estimate, charged if the usage never arrives
    # the request windows it was counted in: (user's RPM window ends, model's RPS window ends, model),
    # monotonic times (None: not counted there); given back when no engine ever saw the request
    counted: tuple[float | None, float | None, str] | None = None
    # told, once settled, the tokens the request was charged (0 without a TPM limit) and whether it
    # holds a concurrency slot: a background response that goes on on its engine after its client
    # left owes the rest of its usage, and answers True when it keeps the slot until it ends
    settled: Callable[[int, bool], bool] | None = None


TICKET = web.RequestKey("tenancy_ticket", Ticket)
NO_TICKET = Ticket()       # every request's, with tenancy off (``NoTenancy`` never changes it)


NO_USER = "_none"          # the `user` label of a request that names no user
OTHER_USER = "_other"      # ... of a user the gateway has no record of (no key, no limits entry)


class TenancyMetrics:
    """The ``user`` label is bounded by what operators configured: a user known by an API key, a
    ``limits.users`` entry or an admin-API record is named; any other name a client puts in the
    ``user`` header (unbounded without auth) is counted as ``_other``."""

    def __init__(self, registry) -> None:
        r = registry
        self.auth_failures = Counter("switchyard_auth_failures",
                                     "Requests refused by API-key auth, or for a model not on their user's list "
                                     "(model_not_allowed)",
                                     ["reason"], registry=r)
        self.rate_limited = Counter("switchyard_rate_limited", "Requests refused with 429 by a limit",
                                    ["model", "limit", "user"], registry=r)
        self.user_tokens = Counter("switchyard_user_tokens",
                                   "Tokens the engines reported for each user's requests (prompt, completion)",
                                   ["user", "kind"], registry=r)
        self.state_up = Gauge("switchyard_state_up",
                              "1 when the shared state backend is reachable and takes writes and the "
                              "gateway's commands", registry=r)
        self.unavailable = Counter("switchyard_state_unavailable",
                                   "Requests that met an unreachable shared state (served if the policy is "
                                   "open, 503 if closed), by why: unreachable, or Redis refusing writes (oom, "
                                   "readonly, misconf, noreplicas) or the gateway's commands (noperm, "
                                   "wrongtype) or its credentials (auth), answering another error, or every connection "
                                   "busy (busy)", ["policy", "reason"],
                                   registry=r)
        self.outages = Counter("switchyard_state_outages",
                               "Times the shared state became unreachable or started refusing writes: an "
                               "outage, a Sentinel or Cluster failover in progress, a full or read-only Redis",
                               ["mode"], registry=r)
        self.uncharged_tokens = Counter("switchyard_state_uncharged_tokens",
                                        "Tokens engines reported that no TPM window was charged: a standalone "
                                        "Redis unreachable or refusing writes when the request ended",
                                        registry=r)
        self.heartbeat_lost = Counter("switchyard_state_heartbeat_lost",
                                      "Syncs that found the replica's heartbeat gone from the shared state "
                                      "(Redis restarted empty or was flushed, or the replica was silent past "
                                      "replica_ttl_s): its concurrency slots published again", ["mode"],
                                      registry=r)
        self.notices = Counter("switchyard_directory_notices",
                               "Directory change notices (an API key or user made, changed or revoked on any "
                               "replica) read from the shared state and applied to this gateway's mirror",
                               registry=r)
        self.admin_token_refused = Gauge(
            "switchyard_admin_token_refused",
            "1 while the admin token is an API key the admin API stored (a replica started with such a "
            "token, or another replica stored the key): the admin API, POST /admin/reload and the status "
            "page refuse the token with a 403 until auth.admin_token is changed", registry=r)
        self.latency = Histogram("switchyard_state_admit_seconds",
                                 "Time of the limit check (one Redis round trip with the Redis backend)",
                                 buckets=ROUTING_BUCKETS, registry=r)


def endpoint_key(ep: Endpoint) -> str:
    """How replicas name an endpoint to each other: same config or discovery → same string."""
    return f"{ep.model}|{ep.url}"


class Tenancy:
    def __init__(self, config: Config, metrics: GatewayMetrics, pool: EndpointPool,
                 state: MemoryState | RedisState | None = None) -> None:
        self.config = config
        self.cfg = config.state
        self.pool = pool
        self.auth_on = config.auth.on
        self.forward_auth = config.auth.forward_authorization
        self.admin_digest = key_digest(config.auth.admin_token) if config.auth.admin_token else None
        self.model_rps = {m: lim.rps for m, lim in config.limits.models.items() if lim.rps}
        self.policy = self.cfg.failure_policy
        self.directory = Directory(config.auth, config.limits)
        self.m = TenancyMetrics(metrics.registry)
        # the stored key the admin token is, when it is one: the admin API refuses the token then
        self.admin_clash: KeyRecord | None = None
        self._token_children: dict[str, tuple] = {}
        if state is None:
            state = (RedisState(self.cfg, on_transition=self._on_transition,
                                on_pool_timeout=metrics.state_pool_timeouts.labels("tenancy").inc,
                                on_uncharged=self.m.uncharged_tokens.inc,
                                on_heartbeat_lost=self.m.heartbeat_lost.labels(redis_mode(self.cfg.redis_url)).inc)
                     if self.cfg.redis_url
                     else MemoryState())
        self.state = state
        if isinstance(state, RedisState):       # published with each heartbeat, for the others' key checks
            state.admin_digest = self.admin_digest or ""
        self._publishing: asyncio.Task | None = None
        # with Redis, what another replica writes to the directory is read as it is written
        self.notices = (DirectoryNotices(self.cfg, state.k_notes, self._on_notices,
                                         on_pool_timeout=metrics.state_pool_timeouts.labels("tenancy").inc)
                        if isinstance(state, RedisState) else None)
        self.m.state_up.set(1 if state.healthy else 0)
        self._version: str | None = None          # the store's directory version the mirror has
        self._tag: str | None = None              # ... and the tag of the write that made it
        self._reload_all = False                  # read the whole directory next (after an outage)
        self._outage_logged = True                # the last outage was logged (the first up is, too)
        self._outage_logged_at = -OUTAGE_LOG_S
        self._outages_quiet = 0                   # outages not logged since the last warning
        self._mirrored = 0                        # counts the mirror's updates
        self._refreshing = asyncio.Lock()
        self._sync_error = ""       # why the last sync failed, for the log
        self._sync_reason = ""      # ... as StateUnavailable.reason says it
        self._unknown: set[str] = set()            # digests the store did not know (until it changes)
        self._sync_task: asyncio.Task | None = None
        self._fail_open_count = 0
        self._fail_open_logged = 0.0

    @property
    def directory_version(self) -> int | None:
        """The store's directory version this process's mirror has (None: not read yet)."""
        v = self._version
        return int(v) if v is not None and v.isdigit() else None

    def set_worker(self, index: int, count: int) -> None:
        """This process is worker ``index`` of ``count`` (``--workers``), before it starts: each worker
        is a replica of its own in the shared state, so a configured ``state.replica_id`` names each
        with its index (``<id>/<index>``); one name for all would be one heartbeat and one in-flight
        hash that each worker overwrites, and one worker's slot repair or exit would take its
        siblings' slots. The default id (host, pid, random) differs per process already."""
        if count > 1 and self.cfg.replica_id and isinstance(self.state, RedisState):
            self.state.replica_id = f"{self.cfg.replica_id}/{index}"

    def reconfigure(self, config: Config) -> None:
        """A reloaded config (gateway/server/reload.py): API keys, users' and models' limits and the admin
        token apply to the next request; the state backend (``state:``) stays as started, and so
        do the counters (a request admitted before settles as it was admitted)."""
        self.config = config
        self.auth_on = config.auth.on
        self.forward_auth = config.auth.forward_authorization
        self.admin_digest = key_digest(config.auth.admin_token) if config.auth.admin_token else None
        self.model_rps = {m: lim.rps for m, lim in config.limits.models.items() if lim.rps}
        self.directory.reconfigure(config.auth, config.limits)
        self._check_admin_clash()
        if isinstance(self.state, RedisState) and self.state.admin_digest != (self.admin_digest or ""):
            self._publish_admin()

    def _publish_admin(self) -> None:
        """The reloaded admin token's SHA-256 to the other replicas now, not at the next heartbeat:
        a key that is the new token is refused there from then on (``admin_digests``)."""
        state = self.state
        assert isinstance(state, RedisState)
        digest = self.admin_digest or ""
        state.admin_digest = digest             # the next heartbeat's, should this write fail
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        async def publish() -> None:
            try:
                await state.publish_admin(digest)
            except StateUnavailable as e:
                log.warning("the admin token's digest could not be published; the next heartbeat does",
                            error=str(e))
        self._publishing = loop.create_task(publish(), name="tenancy-admin-token")

    async def admin_token_of_a_replica(self, digest: str) -> bool:
        """Whether ``digest`` is the SHA-256 of the admin token of a replica that heartbeats in the
        shared state (this one's included); False with the in-memory state (one replica)."""
        if not isinstance(self.state, RedisState):
            return False
        return digest in await self.state.admin_digests()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.state.start()
        if not self.state.remote:
            await self.refresh()
            return
        # a Redis that refuses for a moment (restarting beside the gateway, a failover under way)
        # is tried again for up to a second before the gateway serves without it; a Redis that
        # does not answer at all has used that second already, and one that refuses the gateway's
        # commands (NOPERM, WRONGTYPE) or its password refuses the next try alike: not tried again
        deadline = time.monotonic() + START_RETRY_S
        ok = await self.sync_once()
        while not ok and self._sync_reason not in START_FINAL and time.monotonic() < deadline:
            await asyncio.sleep(START_RETRY_GAP_S)
            ok = await self.sync_once()
        if not ok:
            log.warning(f"{trouble(self._sync_reason)} at start; failure policy applies until it is back",
                        redis_url=_redact(self.cfg.redis_url), policy=self.policy,
                        reason=self._sync_reason or "unreachable", error=self._sync_error)
        self._sync_task = asyncio.create_task(self._sync_loop(), name="tenancy-sync")
        if self.notices is not None:
            self.notices.start()

    async def stop(self) -> None:
        if self._publishing is not None and not self._publishing.done():
            self._publishing.cancel()           # before leave() takes this replica's token out
            await asyncio.wait([self._publishing], timeout=max(1.0, self.cfg.timeout_s * 4))
        if self.notices is not None:
            await self.notices.stop()
        if self._sync_task is not None:
            self._sync_task.cancel()
            await asyncio.wait([self._sync_task], timeout=max(1.0, self.cfg.timeout_s * 4))
            self._sync_task = None
        if isinstance(self.state, RedisState) and self.state.up:
            await self.state.leave()
        await self.state.stop()

    def _on_transition(self, up: bool, why: str, reason: str = "") -> None:
        """Each outage is counted; its warning is written at most once per ``OUTAGE_LOG_S`` (a
        Redis at its memory limit refuses one write and takes the next: down and up again with
        each), the next one saying how many were not (``since_last``). The line that the state is
        back follows an outage that was logged."""
        self.m.state_up.set(1 if up else 0)
        mode = redis_mode(self.cfg.redis_url or "")
        if up:
            # a store that was unreachable may have lost writes and made others since (a restart,
            # a failover): its change log cannot be trusted against the mirror, read it whole
            self._reload_all = True
            if self._outage_logged:
                log.info("shared state reachable", redis_url=_redact(self.cfg.redis_url), mode=mode)
            return
        self.m.outages.labels(mode).inc()
        now = time.monotonic()
        self._outage_logged = now - self._outage_logged_at >= OUTAGE_LOG_S
        if not self._outage_logged:
            self._outages_quiet += 1
            return
        quiet = {"since_last": self._outages_quiet} if self._outages_quiet else {}
        self._outage_logged_at, self._outages_quiet = now, 0
        if reason in COMMAND_REFUSALS:
            log.warning("shared state refuses the gateway's commands; failure policy applies",
                        policy=self.policy, reason=reason, error=why, redis_url=_redact(self.cfg.redis_url),
                        mode=mode, **quiet)
        elif reason == "auth":
            log.warning("shared state refuses the gateway's credentials; failure policy applies",
                        policy=self.policy, reason=reason, error=why, redis_url=_redact(self.cfg.redis_url),
                        mode=mode, **quiet)
        elif reason and reason not in ("unreachable", "no_tls"):
            log.warning("shared state refuses writes; failure policy applies", policy=self.policy, reason=reason,
                        error=why, redis_url=_redact(self.cfg.redis_url), mode=mode, **quiet)
        else:
            log.warning(f"{trouble(reason)}; failure policy applies", policy=self.policy, error=why,
                        redis_url=_redact(self.cfg.redis_url), mode=mode, **quiet)

    async def refresh(self) -> None:
        """Bring the local directory to the store's current users and keys: with Redis, the
        records changed since the mirror's version, read from the store's change log, so that
        the cost of a change does not grow with the number of keys; the whole directory at start,
        after an outage, or when the log cannot say what changed. One at a time, so that an
        older read is never put in place over a newer one."""
        async with self._refreshing:
            state = self.state
            if isinstance(state, RedisState) and self._version is not None and not self._reload_all:
                changes = await state.directory_changes(self._version, self._tag)
                if changes is not None and not self._reload_all:
                    version, users, keys, tag = changes
                    self.directory.apply_store(users, keys)
                    self._unknown.difference_update(keys)
                    self._version, self._tag = version, tag
                    self._mirrored += 1
                    self._check_admin_clash()
                    return
            self._reload_all = False
            version, users, keys, tag = await state.load_directory()
            self.directory.replace_store(users, keys)
            self._version, self._tag = version, tag
            self._mirrored += 1
            self._unknown.clear()
            self._check_admin_clash()

    def _check_admin_clash(self) -> None:
        """Whether the admin token is a key the store holds, after each read of the store's keys
        and each reload: a gateway started with such a token (a reload with one is refused,
        gateway/server/reload.py), or whose token another replica, with another token, stored as
        a key. Every holder of that key would be an admin: the admin API refuses the token
        (``admin_refusal``) while it is one, and says so once in the log and in
        ``switchyard_admin_token_refused``. Refusing to start instead would have every worker, and a
        fleet restarted together, exit over and over; the gateway serves, its admin API does not."""
        digest = self.admin_digest
        rec = self.directory.store_keys.get(digest) if digest is not None else None
        before, self.admin_clash = self.admin_clash, rec
        self.m.admin_token_refused.set(1 if rec is not None else 0)
        if rec is not None and (before is None or before.digest != rec.digest):
            path = "auth.admin_token_env" if self.config.auth.admin_token_env is not None else "auth.admin_token"
            log.error(f"the admin token is an API key the admin API stored; the admin API refuses it until "
                      f"{path} is changed", key_id=rec.id, user=rec.user, key_path=path)
        elif rec is None and before is not None:
            log.info("the admin token is no longer a stored API key; the admin API takes it again",
                     key_id=before.id)

    def admin_refusal(self) -> GatewayError | None:
        """The 403 of a request that carries the admin token while that token is a stored API key
        (/admin/*, POST /admin/reload, the status page); a new error each time."""
        rec = self.admin_clash
        if rec is None:
            return None
        path = "auth.admin_token_env" if self.config.auth.admin_token_env is not None else "auth.admin_token"
        return GatewayError(403, f"the admin token is the API key {rec.id} (user {rec.user}) the admin API stored, "
                                 f"so every holder of that key could use it: the admin API refuses it until {path} is "
                                 "changed. Set another admin token and reload the config (SIGHUP) or restart, then "
                                 f"revoke the key with DELETE /admin/keys/{rec.id} if it should go",
                            code="admin_token_refused", error_class=ErrorClass.AUTH)

    async def _on_notices(self, n: int) -> None:
        """``n`` directory change notices read (0: reading the notices starts, or starts again):
        the mirror is brought up to date, whoever wrote the change."""
        before = self._version
        await self.refresh()
        if n:
            self.m.notices.inc(n)
            if self._version != before:
                log.info("directory change applied from a notice", version=self._version, notices=n)

    async def _sync_loop(self) -> None:
        interval = self.cfg.sync_interval_s
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                ok = await self.sync_once()
            except Exception:   # never let the loop die: the fleet view would silently freeze
                log.exception("tenancy sync failed")
                ok = False
            delay = interval if ok else min(MAX_BACKOFF_S, max(interval, delay * 2))

    async def sync_once(self) -> bool:
        """One heartbeat: publish local in-flight, read the others', reload the directory if it
        changed. Also the reconnect probe while the backend is down."""
        state = self.state
        assert isinstance(state, RedisState)
        share = self.cfg.share_in_flight
        published = ({endpoint_key(ep): ep.in_flight for ep in self.pool.endpoints() if ep.in_flight > 0}
                      if share else None)
        try:
            version, remote = await state.sync(published)
            if version != self._version or self._reload_all:
                await self.refresh()
        except StateUnavailable as e:
            self._sync_error, self._sync_reason = str(e), e.reason
            if share and time.monotonic() - state.last_ok > self.cfg.replica_ttl_s:
                self._apply_remote({})      # the others' counts are stale by now
            return False
        if share:
            self._apply_remote(remote)
        return True

    def _apply_remote(self, remote: dict[str, int]) -> None:
        for ep in self.pool.endpoints():
            ep.remote_in_flight = remote.get(endpoint_key(ep), 0)

    # -- hook 1: authenticate ----------------------------------------------------------------

    async def authenticate(self, request: web.Request, rec: RequestRecord | None) -> Ticket:
        t = Ticket()
        request[TICKET] = t
        if not self.auth_on:
            return t
        # a request the gateway makes itself on a user's behalf (a batch line, gateway/batch): the user
        # it acts for, an attribute set in-process only, so no header or body can forge it
        owner = getattr(request, "acting_for", None)
        if owner is not None:           # the gateway's own request for the user who made the batch
            t.user, t.key_id = owner, "batch"
            if rec is not None:
                rec.user = owner
            return t
        try:
            token = presented_key(request.headers)
        except AmbiguousKey:
            self.m.auth_failures.labels("ambiguous").inc()
            raise _auth_error("The request carries two different API keys, in 'Authorization: Bearer' and in "
                              "'x-api-key': send one key (or the same key in both).") from None
        if token is None:
            self.m.auth_failures.labels("missing").inc()
            raise _auth_error("Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
        digest = key_digest(token)
        key = self.directory.key(digest)
        if key is None and self.state.remote:
            key = await self._lookup_remote(digest)
        if key is None:
            self.m.auth_failures.labels("invalid").inc()
            raise _auth_error("Incorrect API key provided.")
        t.user, t.key_id = key.user, key.id
        if rec is not None:             # the key says who sent it: a line refused from here on names them
            rec.user = key.user
        return t

    async def _lookup_remote(self, digest: str) -> KeyRecord | None:
        """A key created on another replica in the last sync interval is not mirrored yet."""
        if digest in self._unknown:
            return None
        mirrored = self._mirrored
        try:
            key = await self.state.get_key(digest)
        except StateUnavailable:
            self.m.auth_failures.labels("state_unavailable").inc()
            raise GatewayError(503, "the API key cannot be verified: the shared state is unavailable",
                               code="service_unavailable", headers={"Retry-After": "1"},
                               header=("x-error-state-unavailable", "true"), error_class=ErrorClass.STATE_UNAVAILABLE) from None
        if key is None:
            if len(self._unknown) >= MAX_UNKNOWN_KEYS:
                self._unknown.clear()
            self._unknown.add(digest)
            return None
        if self._mirrored == mirrored:
            # kept only if the mirror was not updated meanwhile: a delete it took in while this
            # read was on its way must not be undone by it (the change log would not say it again)
            self.directory.store_keys[digest] = key
        return key

    # -- the user's models -------------------------------------------------------------------

    def models_for(self, t: Ticket, named: str | None) -> tuple[str, ...] | None:
        """The names the user may ask for (``limits.users.<name>.models``, an admin-API record's,
        ``default_user``'s), or None: every model. With auth on the key's user, else ``named``,
        the user the request names."""
        return self.directory.models_for(t.user if self.auth_on else named)

    def refused_model(self) -> None:
        """A name the user may not ask for was asked for: counted."""
        self.m.auth_failures.labels("model_not_allowed").inc()

    def allows(self, t: Ticket, ireq: InferenceRequest) -> bool:
        """Whether the request's user may ask for the model it names, as it names it (an alias,
        an adapter: before either is resolved). With auth on, the key's user; without, the user
        the request names. A refusal counts in ``switchyard_auth_failures_total{reason="model_not_allowed"}``."""
        allowed = self.models_for(t, ireq.user)
        if allowed is None or ireq.model in allowed:
            return True
        self.refused_model()
        return False

    # -- hook 2: admit -----------------------------------------------------------------------

    async def admit(self, t: Ticket, ireq: InferenceRequest, rec: RequestRecord) -> None:
        if self.auth_on:
            # the key decides who is calling: a `user` header or body field cannot impersonate
            ireq.user = ireq.tenant = t.user
            ireq.headers = self._engine_headers(ireq.headers, t.user)
        else:
            t.user = ireq.user
        limits = self.directory.limits_for(t.user)
        rps = self.model_rps.get(ireq.model, 0)
        if limits is None and not rps:
            return
        t.limits = limits
        # the prompt's estimate, charged when a generating request's usage never comes; a
        # Messages count_tokens generates nothing and reports no usage: it charges nothing
        t.est_tokens = ireq.prompt_tokens_est if ireq.path != COUNT_TOKENS else 0
        q = AdmitQuery(t.user, limits, ireq.model, rps)
        started = time.perf_counter()
        try:
            r = await self.state.admit(q)
        except StateUnavailable as e:
            self._unavailable(e.reason)
            if isinstance(self.state, RedisState):
                self.state.served_unchecked(q)     # (policy open: served) counted once it is back
            return
        self.m.latency.observe(time.perf_counter() - started)
        t.held = r.acquired
        if limits is not None:
            t.headers = rec.rate_headers = rate_headers(limits, r)     # on every answer (RequestRecord.response_headers)
        if r.reason is not None:
            self.m.rate_limited.labels(ireq.model, r.reason, self._user_label(t)).inc()
            raise rejection(q, r, t.headers or {})
        now = time.monotonic()
        rpm_end = now + r.requests_reset_ms / 1000 if limits is not None and limits.rpm else None
        rps_end = now + r.model_reset_ms / 1000 if rps else None
        if rpm_end is not None or rps_end is not None:
            t.counted = (rpm_end, rps_end, ireq.model)

    def _user_label(self, t: Ticket) -> str:
        if t.user is None:
            return NO_USER
        if t.key_id is not None or self.directory.user_source(t.user) is not None:
            return t.user
        return OTHER_USER

    def _unavailable(self, reason: str) -> None:
        self.m.unavailable.labels(self.policy, reason).inc()
        if self.policy == "closed":
            raise GatewayError(503, "rate limits cannot be checked: the shared state is unavailable",
                               code="service_unavailable", headers={"Retry-After": "1"},
                               header=("x-error-state-unavailable", "true"), error_class=ErrorClass.STATE_UNAVAILABLE)
        self._fail_open_count += 1
        now = time.monotonic()
        if now - self._fail_open_logged >= FAIL_OPEN_LOG_EVERY_S:
            log.warning(f"serving without rate limits: {trouble(reason)} (failure_policy: open)",
                        requests=self._fail_open_count, reason=reason)
            self._fail_open_logged, self._fail_open_count = now, 0

    def _engine_headers(self, headers, user: str | None) -> CIMultiDict[str]:
        """The client's headers for the engine: without its ``user`` (the key's user replaces it)
        or, unless forwarded, its key (a copy and three removals in C, not a loop over the headers)."""
        out = CIMultiDict(headers)
        out.popall("user", None)
        if not self.forward_auth:
            for name in _AUTH_HEADERS:
                out.popall(name, None)
        if user is not None:
            out["user"] = user
        return out

    # -- hook 3: settle ----------------------------------------------------------------------

    def settle(self, t: Ticket, rec: RequestRecord) -> None:
        if rec.prompt_tokens or rec.completion_tokens:
            user = self._user_label(t)
            tokens = self._token_children.get(user)
            if tokens is None:
                tokens = self._token_children[user] = (self.m.user_tokens.labels(user, "prompt"),
                                                       self.m.user_tokens.labels(user, "completion"))
            tokens[0].inc(rec.prompt_tokens or 0)
            tokens[1].inc(rec.completion_tokens or 0)
        counted, t.counted = t.counted, None
        if counted is not None and rec.status >= 400 and (not rec.endpoint or _unreached(rec)):
            # refused before any engine saw it (shed by admission, a P/D body refused, its client
            # gone while it queued), or answered by the gateway as no engine took its last leg
            # (after retries too): it gives back its count in the request windows
            self.state.uncount(t.user or "", counted)
        lim = t.limits
        tokens = 0
        if lim is not None and lim.tpm:
            if rec.prompt_tokens is not None or rec.completion_tokens is not None:
                completion = rec.completion_tokens or 0
                if not rec.delivered and rec.streamed_events > completion:
                    # a stream cut before its final usage, whose usage so far came early (a Messages
                    # stream's message_start: the prompt, no output yet): the chunks sent count too
                    completion = rec.streamed_events
                tokens = (rec.prompt_tokens or 0) + completion
            elif rec.endpoint and rec.status in (200, 499) and (
                    rec.streamed_events or rec.error_class in _NO_FAULT):
                # the engine worked but no usage came back (client left mid-stream): charge the
                # prompt estimate and a token for each generated chunk the client was sent, so
                # dropping a stream just before its end is not a way around TPM. A stream the
                # engine (or the gateway's watchdog) ended with an error before any token has
                # nothing generated and no usage: not charged, as an engine's error answer, also
                # when its client left on reading that error (a 499 with the error on its record)
                tokens = t.est_tokens + rec.streamed_events
        kept = False
        if t.settled is not None:
            told, t.settled = t.settled, None
            kept = told(tokens, t.held)     # a response still generating keeps the slot until it ends
        release, t.held = t.held and not kept, False
        if tokens or release:
            self.state.settle(t.user or "", tokens, release)

    def charge_ended(self, user: str | None, keyed: bool, prompt: int, completion: int, charged: int) -> None:
        """A response that went on on its engine after its request's answer (``background: true``),
        read once it ended: its usage, less what its request was charged then (its prompt's
        estimate), into the user's TPM window and ``switchyard_user_tokens_total``."""
        label = self._user_label(Ticket(user=user, key_id="-" if keyed else None))
        tokens = self._token_children.get(label)
        if tokens is None:
            tokens = self._token_children[label] = (self.m.user_tokens.labels(label, "prompt"),
                                                    self.m.user_tokens.labels(label, "completion"))
        tokens[0].inc(prompt)
        tokens[1].inc(completion)
        lim = self.directory.limits_for(user)
        if lim is not None and lim.tpm and prompt + completion > charged:
            self.state.settle(user or "", prompt + completion - charged, False)

    def release(self, user: str) -> None:
        """The concurrency slot a request kept after its answer (a background response, until it
        ended) given back."""
        self.state.settle(user, 0, True)

    # -- response headers --------------------------------------------------------------------

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        t = request.get(TICKET)
        if t is not None and t.headers:
            for k, v in t.headers.items():
                response.headers.setdefault(k, v)


class NoTenancy:
    """Tenancy off (no keys, no limits, no shared state): nobody is authenticated, nothing is
    limited or charged; the ``user`` a client names is taken as is."""

    __slots__ = ()

    async def authenticate(self, request: web.Request, rec: RequestRecord | None) -> Ticket:
        return NO_TICKET

    async def admit(self, t: Ticket, ireq: InferenceRequest, rec: RequestRecord) -> None:
        pass

    def models_for(self, t: Ticket, named: str | None) -> None:
        return None

    def refused_model(self) -> None:
        pass

    def allows(self, t: Ticket, ireq: InferenceRequest) -> bool:
        return True

    def settle(self, t: Ticket, rec: RequestRecord) -> None:
        pass


NO_TENANCY = NoTenancy()


# what a request's record says when nothing went wrong on the engine's side (its client may have left)
_NO_FAULT = (None, ErrorClass.CLIENT_CANCEL)

# the headers a client's API key arrives in (kept from engines unless auth.forward_authorization)
_AUTH_HEADERS = ("authorization", "x-api-key")


# the client's answer when no engine took the request's last leg: its connection was refused, or
# this process could make no socket for it
_UNREACHED = frozenset({ErrorClass.UPSTREAM_CONNECT, ErrorClass.GATEWAY_RESOURCES})


def _unreached(rec: RequestRecord) -> bool:
    """The request was routed but its client got no engine's answer, only the gateway's: its last
    leg reached no engine. The tries retried before it do not matter: an engine's 5xx (or a reset)
    the gateway retried elsewhere never reached the client, which will send the request again."""
    return rec.error_class in _UNREACHED


def _auth_error(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key", param="api_key",
                        headers={"WWW-Authenticate": "Bearer"}, error_class=ErrorClass.AUTH)


def needs_tenancy(config: Config) -> bool:
    a, lim, st = config.auth, config.limits, config.state
    return bool(a.on or a.admin_token or lim.users or lim.models or lim.default_user or st.redis_url)


def build_tenancy(config: Config, metrics: GatewayMetrics, pool: EndpointPool) -> Tenancy | None:
    """None when nothing is configured: the pipeline then skips every hook."""
    if not needs_tenancy(config):
        return None
    return Tenancy(config, metrics, pool)
