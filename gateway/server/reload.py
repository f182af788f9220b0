"""Reload without restart: ``SIGHUP`` and ``POST /admin/reload`` re-read the config file.

What a reload changes, for requests that arrive after it: the models and their endpoints,
aliases, routing strategies and their settings, ``pd``, ``watchdog``, ``breaker``, ``retry``,
``admission`` and ``lora`` settings, API keys, user and model limits, the admin token, and
``kubernetes.models``. What needs a restart: ``listen``,
``server``, ``upstream``, ``health``, ``scrape``, ``state``, ``view`` (the workers' bus and
the replicas' stream), ``status``, ``tracing``, ``responses`` (its stores), ``batch`` (its routes,
job store and runner), the rest of ``kubernetes``, a model's ``kv_events`` (its subscriptions
and tokenizer) and, while it is on them, its ``tokenizer``, and turning tenancy or the admin API
on when the gateway started without them. A new config that changes one of those is refused as
a whole, so that after a successful reload the file and what runs are the same thing.

A reload has two steps. *Prepare* reads and validates the file (every error names its key path;
the file is read and parsed in a thread, ``reload_off_loop``, so requests are answered while a large
one parses, one reload at a time in the order they came),
checks what needs a restart, and builds the new generation with the builder start-up used
(``gateway.pipeline.generation.build_generation``: its strategies are resolved now, so a typo
fails here); nothing has changed yet, and a failure leaves the old config
serving. *Commit* is one synchronous step, with no ``await`` in it, so no request sees half of it:

- the endpoint pool is brought to the new config's endpoints. An endpoint the new config still
  declares identically keeps its object (health, in-flight counts, engine metrics); a removed one
  leaves the pool and drains (requests on it finish, their leases are released on it); a new one
  joins. Endpoints found by Kubernetes discovery are not the config's and are left alone;
- discovery gets the new model settings, tenancy the new keys and limits, the shared services
  (Responses, breakers, retries, LoRA, admission) the new settings (``Services.follow``);
- the new ``Live`` generation (config, pipeline, routing, aliases) takes new requests. A request
  runs to its end on the generation it entered with: its model, strategy, watchdog and timeouts.

Routing state (prefix index, round-robin positions, session pins, VTC counts) carries over when
the ``routing`` and ``pd`` settings are unchanged, and starts afresh when they changed.

With ``--workers N`` the parent reads the file once (in a thread, its loop watching the workers
meanwhile), hands every worker the text it read
(gateway/server/handoff.py) and forwards ``SIGHUP`` to them (gateway/server/workers.py): each worker
applies that text, so a file rewritten meanwhile cannot leave them on different configs. A worker
that receives ``POST /admin/reload`` signals the parent, so every worker reloads, and answers with
its own result (202 ``in_progress`` when, ``server.admin_reload_wait_s`` after the ask, the parent
still reads the file or this worker applies it: a large file parsing; 202 ``queued`` when the
parent has not begun it, stopped or busy: the ask stays counted and its SIGHUP pending, so it
applies once the parent gets to it) once every sibling that serves has applied that reload too (so an API key the
reload removed is refused by every worker once the answer came; a sibling that has not within
``server.admin_reload_wait_s`` of the ask, its loop stalled or a large file parsing there, is left
behind with a warning, and an applied reload is answered 202 ``in_progress``). A worker's generation is then the parent's count of applied reloads (in the
workers' shared memory, gateway/server/heartbeat.py), not its own, and its log line names the
trigger of the parent's reload it applies, which the parent tells the workers with that reload; a
SIGHUP sent to a worker itself, with no reload of the parent's to apply, reloads nothing there (a
warning names the parent to send it to). A POST /admin/reload is answered by the first reload of the parent's
that the parent began after the ask (and so read the file as the ask found it): the SIGHUP of one
it began before can reach the worker after the ask, and that reload, applied, leaves the ask waiting
for its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
import structlog
from aiohttp import web
from prometheus_client import Counter, Gauge

from gateway.aliases import Aliases, NoAliases
from gateway.config.schema import Config, ConfigError, check_strategies, log_no_effect, read_settled
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError
from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.generation import Entry, Generation
from gateway.pipeline.routing import Routing
from gateway.server.admin import AdminAudit, require_admin
from gateway.tenants import Tenancy
from gateway.tenants.service import needs_tenancy

if TYPE_CHECKING:
    from gateway.server.heartbeat import Told

log = structlog.get_logger("switchyard.reload")

# blocks read once at start: changing them needs a restart
RESTART_BLOCKS = ("listen", "server", "upstream", "health", "scrape", "state", "view", "status", "tracing",
                  "responses", "batch")
RESULTS = ("ok", "invalid", "restart_required")
SIBLINGS_POLL_S = 0.005     # how often a worker asked POST /admin/reload looks whether its siblings applied it


def declared_endpoints(config: Config) -> list[Endpoint]:
    """The endpoints the config file declares (static ones; discovery adds its own)."""
    out: list[Endpoint] = []

    def add(e, m, role: str, roleset: str | None = None, bootstrap_port: int | None = None) -> None:
        out.append(Endpoint(url=e.url, model=m.name, engine=e.engine or m.engine, role=role, roleset=roleset,
                            bootstrap_port=e.bootstrap_port or bootstrap_port,
                            min_prompt_tokens=e.min_prompt_tokens, max_prompt_tokens=e.max_prompt_tokens,
                            api_key=e.api_key or m.api_key,
                            extra={"kv_events": e.kv_events.items()} if e.kv_events is not None else {}))

    for m in config.models:
        for e in m.endpoints:
            add(e, m, "aggregated")
        for rs in m.rolesets:
            for role, eps in (("prefill", rs.prefill), ("decode", rs.decode), ("combined", rs.combined)):
                for e in eps:
                    add(e, m, role, rs.name, rs.bootstrap_port)
    return out


def _identity(ep: Endpoint) -> tuple:
    return (ep.model, ep.url, ep.engine, ep.role, ep.roleset, ep.bootstrap_port, ep.min_prompt_tokens,
            ep.max_prompt_tokens, ep.extra.get("kv_events"))


def sync_pool(pool: EndpointPool, config: Config) -> tuple[list[Endpoint], list[Endpoint]]:
    """Bring the pool's static endpoints to ``config``'s; returns (added, removed)."""
    have: dict[tuple, list[Endpoint]] = {}
    for ep in pool.endpoints():
        if ep.source == "static":
            have.setdefault(_identity(ep), []).append(ep)
    added: list[Endpoint] = []
    for ep in declared_endpoints(config):
        kept = have.get(_identity(ep))
        if kept:
            kept.pop(0).api_key = ep.api_key        # a new key applies at once, the endpoint's state kept
        else:
            added.append(pool.add(ep))
    removed = [ep for eps in have.values() for ep in eps]
    # one declared again at its URL with other settings (its max_prompt_tokens, say) is the same
    # engine: what routing knows of the conversations it holds goes to the endpoint in its place
    successors = {(ep.model, ep.url): ep for ep in added}
    for ep in removed:
        pool.remove(ep)         # drains: requests on it finish and release their leases on it
        successor = successors.get((ep.model, ep.url))
        if successor is not None:
            pool.replaced(ep, successor)
    # one an earlier reload removed, declared again while requests from before still run on its
    # engine (a prefill's are in its P/D trackers only): the new endpoint counts them until they
    # end (what else routing knew of it went then)
    for old, _ in pool.retired:
        if old.source == "static" and old.charged and old.successor is None:
            successor = successors.get((old.model, old.url))
            if successor is not None:
                pool.succeeded(old, successor)
    return added, removed


def _difference(old: Any, new: Any, path: str) -> str | None:
    """The key path of the first difference between two config values, or None."""
    if old == new:
        return None
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        for name in old.__struct_fields__:
            found = _difference(getattr(old, name), getattr(new, name), f"{path}.{name}")
            if found:
                return found
    return path


def restart_needed(old: Config, new: Config, *, tenancy: bool, admin: bool) -> str | None:
    """The key path of a change only a restart applies (see the module docstring), or None."""
    for key in RESTART_BLOCKS:
        found = _difference(getattr(old, key), getattr(new, key), key)
        if found:
            return found
    found = _difference(msgspec.structs.replace(old.kubernetes, models={}),
                        msgspec.structs.replace(new.kubernetes, models={}), "kubernetes")
    if found:
        return found
    found = _kv_events_change(old, new)
    if found:
        return found
    if not tenancy and needs_tenancy(new):
        return "auth" if new.auth.on or new.auth.admin_token else "limits"
    if not admin and new.auth.admin_token:
        return "auth.admin_token"
    return None


def _kv_events_change(old: Config, new: Config) -> str | None:
    """``models[i].kv_events`` of a model that is in both and whose events block changed, or that
    gained one, and ``models[i].tokenizer`` of one in both whose tokenizer the gateway loaded (its
    events on, or pods that may announce them) and that names another: the subscriptions and
    tokenizers are set up at start (a model that leaves takes its endpoints' subscriptions with it)."""
    before = {m.name: m for m in old.models}
    for i, m in enumerate(new.models):
        was = before.get(m.name)
        if was is not None and was.kv_events != m.kv_events or was is None and m.kv_events is not None:
            return f"models[{i}].kv_events"
        if (was is not None and was.tokenizer != m.tokenizer
                and (was.wants_kv_events or old.kubernetes.enabled)):
            return f"models[{i}].tokenizer"
    return None


class RestartRequired(ConfigError):
    """A new config that changes what only a restart applies (``check_offline``)."""


def check_offline(started: Config, old: Config, new: Config) -> None:
    """What a reload checks before it builds anything, for a process that serves nothing itself
    (the ``--workers`` parent, keeping the config it starts workers with in step with theirs):
    raises ``ConfigError`` as the workers, started with ``started`` and running ``old``, would
    refuse ``new``."""
    path = restart_needed(old, new, tenancy=needs_tenancy(started), admin=started.auth.admin_token is not None)
    if path is not None:
        raise RestartRequired(path, "changing this needs a restart; the running config is kept")
    check_strategies(new)


def changed_blocks(old: Config, new: Config) -> list[str]:
    return [k for k in old.__struct_fields__ if getattr(old, k) != getattr(new, k)]


@dataclass(frozen=True, eq=False)
class Live:
    """The generation new requests enter: its pipeline (a ``gateway.pipeline.pipeline.Pipeline``,
    which only gateway.server.app imports; its type here is the protocol it meets) and its number.
    Every generation's pipeline shares the services (``gateway.pipeline.generation.Services``) and
    has its own config, routing, P/D orchestrator and aliases."""

    pipeline: Entry
    generation: int = 1

    @property
    def gen(self) -> Generation:
        return self.pipeline.gen

    @property
    def config(self) -> Config:
        return self.pipeline.gen.config

    @property
    def routing(self) -> Routing:
        return self.pipeline.gen.routing

    @property
    def aliases(self) -> Aliases | NoAliases:
        return self.pipeline.gen.aliases


# builds a generation's pipeline from a config and the generation before it (None at start-up):
# the app's, around ``gateway.pipeline.generation.build_generation``
Build = Callable[[Config, Generation | None], Entry]




class ReloadMetrics:
    def __init__(self, registry) -> None:
        self.reloads = Counter("switchyard_config_reload", "Config reloads (SIGHUP, POST /admin/reload) by result",
                               ["result"], registry=registry)
        self.last_ok = Gauge("switchyard_config_last_reload_successful",
                             "1 if the last config reload was applied (or none was tried), 0 if it was refused",
                             registry=registry)
        self.generation = Gauge("switchyard_config_generation",
                                "The config generation serving new requests (1 at start, +1 per applied reload)",
                                registry=registry)
        self.deferred = Counter("switchyard_config_reload_deferred",
                                "Config reloads that waited for the file to be left unchanged (server.reload_settle_s)",
                                registry=registry)
        self.deferred_count = 0
        self.counts = dict.fromkeys(RESULTS, 0)
        for r in RESULTS:
            self.reloads.labels(r)
        self.last_ok.set(1)
        self.generation.set(1)

    def count(self, result: str) -> None:
        self.reloads.labels(result).inc()
        self.counts[result] += 1

    def take_deferred(self, n: int) -> None:
        """The deferred reloads brought up to ``n`` (never down): a --workers parent's."""
        if n > self.deferred_count:
            self.deferred.inc(n - self.deferred_count)
            self.deferred_count = n

    def take(self, counts: dict[str, int]) -> None:
        """The counter brought up to ``counts`` (never down)."""
        for result, n in counts.items():
            if n > self.counts[result]:
                self.reloads.labels(result).inc(n - self.counts[result])
                self.counts[result] = n


@dataclass
class ReloadResult:
    result: str                          # ok | invalid | restart_required (and, answers only: in_progress | queued)
    generation: int
    trigger: str
    error: str | None = None
    key_path: str | None = None
    changed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# told of every applied reload with the new generation (status page sources, discovery)
Listener = Callable[[Live], None]


# the key of ``config_digest``: drawn once in the process that starts the gateway, which imports
# this module before it forks any worker (gateway/server/run.py), so a restarted worker has it too
_DIGEST_KEY = os.urandom(16)


def warn_shadowed_adapters(config: Config, pool: EndpointPool) -> None:
    """Warn of each alias named as an adapter the engines serve (discovery found it, or the gateway
    loaded it): the file's check refuses an alias named as an adapter ``models[].adapters`` lists,
    but cannot see these. The alias is resolved first, so its targets answer that name, without
    the adapter."""
    for alias in config.aliases:
        eps = [ep for ep in pool.endpoints() if alias.name in ep.adapters.served]
        if eps:
            log.warning("alias shadows a lora adapter the engines serve", alias=alias.name, adapter_model=eps[0].model,
                        endpoints=[ep.name for ep in eps if ep.model == eps[0].model])


def config_digest(config: Config) -> str:
    """A short digest of ``config`` as this process runs it (the file with the command line's
    overrides): two workers of one gateway with the same digest run the same config. Keyed, so
    that it tells nothing of the config (its secrets included) to whoever reads it."""
    return hmac.new(_DIGEST_KEY, msgspec.json.encode(config), hashlib.sha256).hexdigest()[:16]


HANDED_TRIES = 100      # reads of the parent's last told reload while its text is replaced under the reader


def _parent_gone(pid: int) -> GatewayError:
    log.warning("POST /admin/reload refused: the parent process is gone", parent_pid=pid)
    return GatewayError(503, f"the gateway's parent process ({pid}) is gone (killed; this worker is stopping): "
                             "there is no one to read the config file for every worker, nothing was reloaded",
                        code="reload_unavailable", error_class=ErrorClass.ADMIN)


def _not_handed() -> Config:
    raise ConfigError("<file>", "the parent handed no config text for this reload; the running config is kept")


class Reloader:
    """Re-reads the config with ``loader`` and swaps the generation; see the module docstring."""

    def __init__(self, live: Live, pool: EndpointPool, metrics: GatewayMetrics, build: Build,
                 tenancy: Tenancy | None, loader: Callable[[], Config] | None = None) -> None:
        self.live = live
        self.pool = pool
        self.metrics = metrics
        self.build = build               # the same builder as at start-up
        self.tenancy = tenancy
        self.loader = loader             # None: no config file (the demo, tests) — nothing to re-read
        self.admin = tenancy is not None and tenancy.admin_digest is not None
        self.m = ReloadMetrics(metrics.registry)
        self.m.generation.set(live.generation)
        self.listeners: list[Listener] = []
        self.last: ReloadResult | None = None
        self.last_at: float | None = None        # when ``last`` was decided, unix seconds
        self._digest: tuple[Config, str] | None = None
        self.parent_pid: int | None = None       # set in a --workers worker: reloads go through the parent
        # set in a --workers worker: the last reload the parent told the workers of, with its
        # trigger, generation and the count of this worker's asks it came after, and telling the
        # parent that this worker asks for one, which gives the ask's number
        # (gateway/server/heartbeat.py); ``told_seen``: the number of the last one this worker applied
        self.parent_told: Callable[[], Told] | None = None
        self.told_seen = 0
        self.parent_asked: Callable[[], int] | None = None
        # set in a --workers worker: the loader of the config text the parent read for its reload
        # number n, None when it has none (gateway/server/handoff.py)
        self.handed: Callable[[int], Callable[[], Config] | None] | None = None
        self.source: str | None = None           # the config file's path, for the log's lines
        # set in a --workers worker: the parent's reloads by result, and those counted before
        # this worker started (gateway/server/heartbeat.py)
        self.parent_results: Callable[[], dict[str, int]] | None = None
        self.results_base: dict[str, int] = {}
        # set in a --workers worker: note that this worker applied the parent's told reload number n
        # (or started on its config), and whether every sibling that serves has applied reload n
        self.mark_applied: Callable[[int], None] | None = None
        self.siblings_applied: Callable[[int], bool] | None = None
        # set in a --workers worker: whether the parent is reading and checking a reload's file
        self.parent_reloading: Callable[[], bool] | None = None
        # POST /admin/reload in a worker: the ask's number (None: no parent counts them), and its
        # answer with the number of the parent's told reload it is (None: not one the parent told)
        self._waiters: list[tuple[int | None, asyncio.Future[tuple[ReloadResult, int | None]]]] = []
        self._one_at_a_time = asyncio.Lock()     # reloads read and parse their file off the loop
        # set once the gateway stopped serving: a reload's wait for its file (in a thread) ends, so
        # that the loop's executor, which the loop's close waits for, is free at once
        self.stopping = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def reload(self, trigger: str, config: Config | None = None, parent_generation: int | None = None,
               loader: Callable[[], Config] | None = None) -> ReloadResult:
        """Re-read the file (or take ``config``, or what ``loader`` gives) and apply it, or refuse
        it; never raises. ``parent_generation``: in a --workers worker, the generation of the
        parent's reload this is, whose text the parent read (``loader``)."""
        live = self.live
        try:
            if config is None:
                loader = loader or self.loader
                if loader is None:
                    raise ConfigError("<file>", "the gateway was started without a config file (--config)")
                config = loader()
            path = restart_needed(live.config, config, tenancy=self.tenancy is not None, admin=self.admin)
            if path is not None:
                return self._refused(trigger, "restart_required", path,
                                     f"{path}: changing this needs a restart; the running config is kept")
            check_strategies(config)     # every error names its key
            self._check_admin_token(config)
            pipeline = self.build(config, live.gen)   # beside the live one: changes nothing of it
        except Exception as e:           # nothing has changed yet: refused, never raised into the signal handler
            return self._refused_for(trigger, e)
        # commit: one synchronous step
        changed = changed_blocks(live.config, config)
        added, removed = sync_pool(self.pool, config)
        if self.tenancy is not None:
            self.tenancy.reconfigure(config)
        self.live = Live(pipeline, self._next_generation(live.generation, parent_generation))
        for listener in self.listeners:
            listener(self.live)
        result = ReloadResult("ok", self.live.generation, trigger, changed=changed,
                              added=[f"{ep.model} {ep.url}" for ep in added],
                              removed=[f"{ep.model} {ep.url}" for ep in removed])
        self._count("ok")
        self.m.last_ok.set(1)
        self.m.generation.set(self.live.generation)
        log.info("config reloaded", trigger=trigger, generation=result.generation, changed=changed,
                 endpoints_added=result.added, endpoints_removed=result.removed,
                 draining_in_flight=sum(ep.in_flight + ep.prefill_in_flight for ep in removed))
        if self.parent_told is None:    # what a start warns of (a --workers parent logs it once for all)
            log_no_effect(config, self.source)
        warn_shadowed_adapters(config, self.pool)
        return self._finish(result)

    def _check_admin_token(self, config: Config) -> None:
        """A ConfigError when the new admin token is a key the admin API stored (the config's own
        check sees only ``auth.api_keys``): every holder of that key would be an admin. The store's
        keys as this process holds them (brought up to date first by ``reload_off_loop``)."""
        token = config.auth.admin_token
        if self.tenancy is None or token is None:
            return
        rec = self.tenancy.directory.store_keys.get(hashlib.sha256(token.encode()).hexdigest())
        if rec is not None:
            path = "auth.admin_token_env" if config.auth.admin_token_env is not None else "auth.admin_token"
            raise ConfigError(path, f"the admin token is the API key {rec.id} (user {rec.user}) the admin API "
                                    "stored: an API key is not an admin token (revoke the key, DELETE "
                                    f"/admin/keys/{rec.id}, or choose another token)")

    def _refused_for(self, trigger: str, e: Exception) -> ReloadResult:
        if isinstance(e, ConfigError):
            return self._refused(trigger, "invalid", e.key_path, str(e))
        if isinstance(e, ValueError):    # a check no key path came with (none is known today)
            return self._refused(trigger, "invalid", None, str(e))
        return self._refused(trigger, "invalid", None, f"{type(e).__name__}: {e}")

    async def reload_off_loop(self, trigger: str, parent_generation: int | None = None,
                              loader: Callable[[], Config] | None = None) -> ReloadResult:
        """``reload`` with the file read and parsed in a thread (``loader``, else the reloader's):
        a file near ``MAX_CONFIG_BYTES`` takes seconds to parse, and the event loop goes on serving
        meanwhile (and, in a --workers worker, ticking for the parent, which restarts a worker
        whose loop stalls). The rest (the checks, the build, the commit) runs on the loop as before.
        One reload at a time, in the order they came: a later one reads the file after an earlier
        one, and so is never overtaken by it."""
        async with self._one_at_a_time:
            loader = loader or self.loader
            if loader is None:          # refused, as ``reload`` says why
                return self.reload(trigger, parent_generation=parent_generation)
            try:
                config = await self._read_whole(trigger, loader)
            except Exception as e:      # nothing has changed
                return self._refused_for(trigger, e)
            if self.tenancy is not None and config.auth.admin_token is not None:
                # the store's keys as they are now, for the admin token's check (``_check_admin_token``);
                # with the store out of reach, the keys as last read
                try:
                    await self.tenancy.refresh()
                except Exception as e:
                    log.warning("config reload: the stored keys could not be read; checked against "
                                "those last read", error=str(e))
            return self.reload(trigger, config, parent_generation)

    async def _read_whole(self, trigger: str, loader: Callable[[], Config]) -> Config:
        """``loader``'s config, read once the file is whole (``server.reload_settle_s``,
        ``gateway.config.schema.read_settled``, the --workers parent's wait too) when it reads the
        file: in one process (a --workers worker parses the text its parent read, once whole). In a
        thread, as the read itself: the loop goes on serving while it waits."""
        if self.parent_told is not None or loader is not self.loader or self.source is None:
            return await asyncio.to_thread(loader)
        settle_s = self.live.config.server.reload_settle_s
        return await asyncio.to_thread(read_settled, self.source, settle_s, loader, self.stopping.is_set,
                                       lambda: self._deferred(trigger, settle_s))

    def _deferred(self, trigger: str, settle_s: float) -> None:
        self.m.take_deferred(self.m.deferred_count + 1)
        log.info("config reload deferred", trigger=trigger, file=self.source, settle_s=settle_s,
                 reason="the file changed within reload_settle_s: it is read once left unchanged")

    def _spawn(self, reloading: Coroutine[Any, Any, None]) -> None:
        """A reload a signal asked for, run as a task of the loop (kept until it ends)."""
        task = asyncio.get_running_loop().create_task(reloading)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_generation(self, current: int, parent: int | None) -> int:
        """+1, or in a --workers worker the parent's count: SIGHUPs sent close together reach the
        parent and each worker a different number of times (one that comes while another is pending
        is one), and a count of its own left a worker behind its siblings for good."""
        if self.parent_told is None:
            return current + 1
        return max(current, parent if parent is not None else current)

    def _count(self, result: str) -> None:
        """This reload counted: in a --workers worker, as the parent counted the gateway's reloads
        since this worker started (one told reload after another can reach a worker as one SIGHUP,
        and so be applied there once); else this one."""
        if self.parent_results is None:
            self.m.count(result)
            return
        now = self.parent_results()
        self.m.take({r: now.get(r, 0) - self.results_base.get(r, 0) for r in RESULTS})
        self.m.take_deferred(now.get("deferred", 0) - self.results_base.get("deferred", 0))

    def _refused(self, trigger: str, result: str, key_path: str | None, error: str) -> ReloadResult:
        self._count(result)
        self.m.last_ok.set(0)
        log.error("config reload refused; the running config is kept", trigger=trigger, result=result,
                  key_path=key_path, error=error, generation=self.live.generation)
        return self._finish(ReloadResult(result, self.live.generation, trigger, error=error, key_path=key_path))

    def _finish(self, result: ReloadResult) -> ReloadResult:
        self.last = result
        self.last_at = time.time()
        return result

    def status(self) -> dict[str, Any]:
        """This process's config for ``/status.json`` (``gateway.config``): its generation, the digest
        of the config it runs (computed once per config), and its last reload (null until one)."""
        config = self.live.config
        if self._digest is None or self._digest[0] is not config:
            self._digest = (config, config_digest(config))
        last = self.last
        return {"generation": self.live.generation, "digest": self._digest[1],
                "last_reload": None if last is None else {
                    "result": last.result, "trigger": last.trigger,
                    "at": round(self.last_at, 3) if self.last_at is not None else None,
                    "key_path": last.key_path, "error": last.error}}

    def _answer(self, result: ReloadResult, told: Told | None = None) -> None:
        """This worker's POST /admin/reload requests waiting for the parent's reload: this one, for
        those whose ask the parent's reload ``told`` came after (every one, without ``told``); the
        others wait for the parent's next."""
        waiting: list[tuple[int | None, asyncio.Future[tuple[ReloadResult, int | None]]]] = []
        for ask, w in self._waiters:
            if w.done():
                continue
            if told is not None and ask is not None and not told.after(ask):
                waiting.append((ask, w))
            else:       # the answer to a POST /admin/reload, whatever else the reload answered too
                w.set_result((result if result.trigger == "admin" else replace(result, trigger="admin"),
                              told.seq if told is not None else None))
        self._waiters = waiting

    async def live_handle(self, request: web.Request) -> web.StreamResponse:
        """The inference routes' handler: the request enters the live generation and stays on it."""
        return await self.live.pipeline.handle(request)

    def on_signal(self, starting: bool = False) -> None:
        """A SIGHUP: the reload runs as a task, its file read and parsed off the loop
        (``reload_off_loop``). ``starting``: one that came while the gateway started, applied here
        at once, before the loop serves its first request (which so sees the new config)."""
        if self.loader is None:          # the demo: its config is built in, there is no file
            log.warning("SIGHUP ignored: the gateway was started without a config file (--config)")
            return
        if self.parent_told is None:     # one process (or a worker told nothing: its waiters' own)
            trigger = "admin" if self._waiters else "signal"
            if starting:
                self._answer(self.reload(trigger))
            else:
                self._spawn(self._reload_and_answer(trigger))
            return
        # a --workers worker: a reload the parent told of and this worker has not applied yet is
        # the parent's, whose trigger (a POST /admin/reload to any worker, or a signal) and
        # generation it names, and which answers the POST /admin/reload requests waiting here;
        # none: a SIGHUP sent to this worker itself (``kill -HUP`` to the process group)
        for _ in range(HANDED_TRIES):
            told = self.parent_told()
            if told.seq == self.told_seen:
                # the parent reads the file for every worker: one read here alone would leave this
                # worker on another config than its siblings under the same generation
                log.warning("SIGHUP to a worker with no reload of the parent's to apply: the config file is "
                            "read by the parent for every worker, SIGHUP it to reload", parent_pid=self.parent_pid,
                            generation=self.live.generation)
                return
            loader = self.handed(told.seq) if self.handed is not None else None
            if loader is not None or self.handed is None:
                break
            if self.parent_told().seq == told.seq:      # the parent wrote none for it: refused below
                break
        # else: the parent told reload after reload faster than this worker read them
        self.told_seen = told.seq
        if self.handed is not None and loader is None:
            loader = _not_handed
        if starting:
            self._applied(told, self.reload(told.trigger, parent_generation=told.generation, loader=loader))
        else:
            self._spawn(self._apply_told(told, loader))

    async def _reload_and_answer(self, trigger: str) -> None:
        self._answer(await self.reload_off_loop(trigger))

    async def _apply_told(self, told: Told, loader: Callable[[], Config] | None) -> None:
        """The parent's reload ``told``, the text it read parsed off the loop."""
        self._applied(told, await self.reload_off_loop(told.trigger, parent_generation=told.generation, loader=loader))

    def _applied(self, told: Told, result: ReloadResult) -> None:
        if self.mark_applied is not None:       # before any answer: a sibling's may wait for it
            self.mark_applied(told.seq)
        self._answer(result, told)

    # -- POST /admin/reload --------------------------------------------------------------------

    def register(self, router: web.UrlDispatcher, audit: AdminAudit | None = None) -> None:
        router.add_post("/admin/reload", audit.wrap("reload", self.handle_admin) if audit is not None else self.handle_admin)

    async def handle_admin(self, request: web.Request) -> web.Response:
        """The admin token as for the rest of /admin (gateway/server/admin.py)."""
        require_admin(request, self.tenancy.admin_digest if self.tenancy is not None else None, self.tenancy)
        if self.loader is None:
            raise GatewayError(409, "the gateway was started without a config file (--config): nothing to reload",
                               code="no_config_file", error_class=ErrorClass.ADMIN)
        if self.parent_pid is not None:
            result = await self._reload_every_worker()
        else:
            result = await self.reload_off_loop("admin")
        if result.result == "ok":
            return web.Response(status=200, body=orjson.dumps(result.body()), content_type="application/json")
        if result.result in ("in_progress", "queued"):  # accepted: it applies once parsed, its result logged
            body = {"result": result.result, "generation": result.generation, "trigger": result.trigger,
                    "message": result.error}
            return web.Response(status=202, body=orjson.dumps(body), content_type="application/json")
        status, code = (409, "restart_required") if result.result == "restart_required" else (400, "config_invalid")
        raise GatewayError(status, result.error or result.result, param=result.key_path, code=code,
                           error_class=ErrorClass.ADMIN)

    def _under_way(self, ask: int | None) -> bool:
        """Whether the reload a POST /admin/reload asked for (its number ``ask``) is under way: the
        parent reads and checks a reload (this one, or one before it, after which it reads the file
        again for this one), or it told one begun after the ask that this worker is applying."""
        if self.parent_reloading is not None and self.parent_reloading():
            return True
        if ask is None or self.parent_told is None:
            return False
        return self.parent_told().after(ask)

    async def _reload_every_worker(self) -> ReloadResult:
        """Ask the parent to signal every worker, this one included, and wait for this one's
        reload, then for its siblings to have applied it too."""
        assert self.parent_pid is not None
        # a parent killed outright (SIGKILL, the OOM killer) leaves its workers draining: no one
        # reads the file for them, and its pid may name another process by now (the worker's
        # parent is then init, or a subreaper)
        if os.getppid() != self.parent_pid:
            raise _parent_gone(self.parent_pid)
        loop = asyncio.get_running_loop()
        wait_s = self.live.config.server.admin_reload_wait_s
        deadline = loop.time() + wait_s
        waiter = loop.create_future()
        ask = self.parent_asked() if self.parent_asked is not None else None
        try:
            os.kill(self.parent_pid, signal.SIGHUP)
        except ProcessLookupError:      # gone since it was looked at
            raise _parent_gone(self.parent_pid) from None
        self._waiters.append((ask, waiter))
        try:
            async with asyncio.timeout_at(deadline):
                result, seq = await asyncio.shield(waiter)
        except TimeoutError:
            if self._under_way(ask):
                # a large file still parsing in the parent or here: it applies once parsed, so the
                # answer says so rather than that it did not happen
                log.info("POST /admin/reload answered while its reload is under way", waited_s=wait_s,
                         generation=self.live.generation)
                return ReloadResult("in_progress", self.live.generation, "admin",
                                    error=f"the reload is under way after {wait_s:g}s (server.admin_reload_wait_s): "
                                          "its result is logged, and in /status.json (gateway.config)")
            # the parent has not begun it (stopped, or busy): the ask is counted and its SIGHUP
            # pending, so the parent applies it once it gets to it; the answer says so rather
            # than that it failed
            log.warning("POST /admin/reload answered before the parent began its reload", waited_s=wait_s,
                        parent_pid=self.parent_pid, generation=self.live.generation)
            return ReloadResult("queued", self.live.generation, "admin",
                                error=f"the parent process has not begun this reload after {wait_s:g}s "
                                      "(server.admin_reload_wait_s; stopped or busy): it is queued and applies "
                                      "once the parent gets to it; its result is logged, and in /status.json "
                                      "(gateway.config)")
        finally:
            self._waiters = [(a, w) for a, w in self._waiters if w is not waiter]
        # the siblings got the same reload: the answer goes once they applied it too
        if seq is not None and self.siblings_applied is not None:
            while not self.siblings_applied(seq):
                if loop.time() >= deadline:
                    log.warning("POST /admin/reload answered before every worker applied the reload",
                                generation=result.generation, waited_s=wait_s)
                    if result.result != "ok":       # refused: the siblings keep the running config too
                        break
                    # applied here, not yet there (a large file parsing, a stalled loop the parent
                    # restarts on the new config): an API key it removed still works there
                    return ReloadResult("in_progress", result.generation, "admin",
                                        error=f"applied by this worker; another has not applied it after {wait_s:g}s "
                                              "(server.admin_reload_wait_s): its result is logged, and in "
                                              "/status.json (gateway.workers.config)")
                await asyncio.sleep(SIBLINGS_POLL_S)
        return result
