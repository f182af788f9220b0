"""Kubernetes pod discovery: list + watch Pods with kubernetes-asyncio and keep the endpoint pool
in step with them.

One loop per namespace (or one for all namespaces) runs the informer pattern by hand:

1. **list** the pods matching the label selector; reconcile the pool with the full list (pods
   that vanished while we were not watching are removed here) and remember the list's
   ``resourceVersion``;
2. **watch** from that resourceVersion with bookmarks, applying ADDED / MODIFIED / DELETED as they
   come; a watch that ends cleanly (its server-side timeout; one that ends within a second with
   nothing, not even a bookmark, is not that, but a failed watch) is resumed from the last
   resourceVersion seen, events or bookmarks alike, and so is one that brought nothing, not even
   a bookmark, for ``watch_idle_timeout_s``: its connection is taken for dead (a peer gone without
   a FIN or RST says nothing until the request's own timeout, minutes later);
3. **relist** when the watch says 410 Gone (the resourceVersion was compacted away), when the
   connection breaks or the API errs (after a capped exponential backoff; a list's item that
   names no pod is skipped alone, and the pods such a list lacks are kept, the item being maybe
   one of them, but only through one list: a pod the next list lacks as well is gone, whatever
   that list holds, unless its watch told of it in between), ``retry_backoff_s`` after a watch event whose object names no pod (the event is
   skipped and counted, the watch goes on; such events until that relist bring no other, and the
   delay doubles, up to 30 s, while every watch brings some; a bookmark whose resourceVersion
   cannot be read is skipped and counted too, and brings no relist: it tells of no change), and every
   ``resync_interval_s`` in any case: a watch can lose an event without noticing (a proxy that
   swallowed it, a bug), and the periodic full relist is what keeps a deleted pod from staying in
   rotation for hours.

Every change to the pool is a synchronous step on the event loop, so routing never sees a half
applied update. A pod that stops being routable (not Ready, terminating) stays in the pool marked
``draining`` — the model stays known, requests get 503 rather than 404 while pods roll — and
goes when the pod is deleted; either way requests already on it keep their endpoint and finish.
A model with no endpoint left stays awaited (a 503, ``EndpointPool.awaited``) while a pod of it
waits for its address and for ``LEFT_GRACE_S`` after its last pod left.
A pod whose labels or annotations change in place is a new endpoint; at the same address, for the
same model, it is the same engine, which the pool's replacement listeners are told of (its
requests in flight, sessions, prefix entries and latency models go to the new endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import heapq
import json
import math
import os
import random
import ssl
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import structlog
from prometheus_client import CollectorRegistry

from gateway.config.schema import ConfigError, KubernetesConfig, ModelConfig
from gateway.endpoints import Endpoint, EndpointPool
from k8s.metrics import DiscoveryMetrics, status_result, transport_result
from k8s.pods import ANNO_KV_EVENTS, PodView, Skipped, map_pod, pod_key

log = structlog.get_logger("switchyard.k8s")

MAX_BACKOFF_S = 30.0
MAX_LISTED = 20           # pods named on the status page per list (not routable, skipped); the rest are counted
HEALTHY_WATCH_S = 60.0    # a watch that held this long (or brought a line) before failing: the retries start over
LIST_TIMEOUT_S = 60.0
FIRST_LIST_WAIT_S = 10.0  # how long a starting worker waits for its first list before it serves anyway
SHORT_WATCH_S = 1.0       # a watch that ends sooner having brought nothing failed (client-go's reflector: the same)
LEFT_GRACE_S = 30.0       # a model whose last pod left is awaited this long (a 503, not a 404): its pod may come again
# endpoint changes of one kind: the first LOG_BURST within LOG_WINDOW_S have a line each, the rest
# one line at the window's end (``_Changes``), naming its first LOG_NAMED pods
LOG_WINDOW_S = 1.0
LOG_BURST = 5
LOG_NAMED = 5


class Gone(Exception):
    """The resourceVersion we hold is too old (HTTP 410 / ERROR event with code 410): relist."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        # status 0: an answer the API server gave with a 200 that discovery cannot take (no status to name)
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.retry_after = retry_after      # the answer's Retry-After, in seconds from now


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds (a number of seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


async def load_client_configuration(kcfg: KubernetesConfig):
    """A kubernetes-asyncio ``Configuration`` from ``kubernetes.kubeconfig`` (and ``context``),
    or from the pod's service account when no kubeconfig is set."""
    from kubernetes_asyncio import config as kconfig
    from kubernetes_asyncio.client import Configuration

    cfg = Configuration()
    if kcfg.kubeconfig:
        path = os.path.expanduser(kcfg.kubeconfig)
        if not os.path.isfile(path):
            raise ConfigError("kubernetes.kubeconfig", f"file not found: {path}")
        try:
            await kconfig.load_kube_config(config_file=path, context=kcfg.context,
                                           client_configuration=cfg, persist_config=False)
        except (kconfig.ConfigException, ValueError, KeyError, TypeError) as e:
            raise ConfigError("kubernetes.kubeconfig", f"cannot use {path}: {e}") from None
    else:
        try:
            kconfig.load_incluster_config(client_configuration=cfg)
        except kconfig.ConfigException as e:
            raise ConfigError("kubernetes.kubeconfig",
                              f"not set, and this process has no in-cluster service account ({e})") from None
    return cfg


@dataclass
class _Tracked:
    view: PodView
    ep: Endpoint


@dataclass(slots=True)
class WatchState:
    """Where one namespace's loop is, for the status page: ``listing`` (its first list, until one
    succeeds), ``watching``, ``relisting`` (a resync, a 410, or the next try after a failure) or
    ``backing_off`` (waiting ``retry_at`` out after ``last_error``). Times are unix seconds."""

    state: str = "listing"
    since: float = 0.0
    retry_at: float | None = None
    # the last failed list or watch: (verb, result as in switchyard_kubernetes_requests_total, message, time)
    last_error: tuple[str, str, str, float] | None = None

    def enter(self, state: str, retry_at: float | None = None) -> None:
        self.state, self.since, self.retry_at = state, time.time(), retry_at


class _Changes:
    """The info lines of one kind of endpoint change (added, removed, made routable or not). While
    they are rare, one line per change, as it is made. In a burst (a Deployment scaled to hundreds,
    a namespace emptied: a line each was hundreds in a second) the first ``LOG_BURST`` within
    ``LOG_WINDOW_S`` of the first have their lines, and the rest one line at the window's end: how
    many, of which models, for which reasons, the first ``LOG_NAMED`` pods named (and what ``sums``
    counts, the requests in flight on those removed), so that no change goes untold."""

    def __init__(self, single: str, summary: str) -> None:
        self.single, self.summary = single, summary
        self.opened = -math.inf     # the loop time the window opened
        self.logged = 0             # lines of their own within it
        self.count = 0              # the changes summed up since
        self.pods: list[str] = []
        self.models: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.sums: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, pod: str, model: str, reason: str | None, sums: Mapping[str, int] | None = None,
             **fields: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:        # no loop (a pool fed outside the server): a line each
            log.info(self.single, pod=pod, model=model, reason=reason, **(sums or {}), **fields)
            return
        now = loop.time()
        if now - self.opened >= LOG_WINDOW_S:
            self.flush()
            self.opened, self.logged = now, 0
        if self.logged < LOG_BURST:
            self.logged += 1
            log.info(self.single, pod=pod, model=model, reason=reason, **(sums or {}), **fields)
            return
        self.count += 1
        if len(self.pods) < LOG_NAMED:
            self.pods.append(pod)
        self.models[model] += 1
        if reason:
            self.reasons[reason] += 1
        if sums:
            self.sums.update(sums)
        if self._timer is None:
            self._timer = loop.call_at(self.opened + LOG_WINDOW_S, self.flush)

    def flush(self) -> None:
        """The line of the changes summed up so far, if any."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.count:
            return
        log.info(self.summary, count=self.count, models=dict(self.models), reasons=dict(self.reasons),
                 pods=self.pods, **self.sums)
        self.count, self.pods = 0, []
        self.models, self.reasons, self.sums = Counter(), Counter(), Counter()


class KubernetesDiscovery:
    """Feeds ``pool`` with the pods that ``kcfg`` selects; see the module docstring."""

    def __init__(self, kcfg: KubernetesConfig, pool: EndpointPool,
                 models: Mapping[str, ModelConfig] | None = None, registry: CollectorRegistry | None = None) -> None:
        self.kcfg = kcfg
        self.pool = pool
        self.models = dict(models or {})
        self.scopes: list[str | None] = list(kcfg.namespaces) or [None]   # None: all namespaces
        self.stats: Counter[str] = Counter()     # lists, watches, events, bookmarks, gone, errors
        self.synced = asyncio.Event()            # every scope has completed its first list
        self._tracked: dict[str, _Tracked] = {}
        self._skipped: dict[str, str] = {}
        self._unreadable: dict[str | None, list[str]] = {}  # per scope, its last list's items that name no pod
        self._scope_keys: dict[str | None, set[str]] = {s: set() for s in self.scopes}
        # per scope, the pods its last list lacked and kept (the list had an item that names no pod)
        self._lacked: dict[str | None, set[str]] = {}
        self._listed: set[str | None] = set()
        self._heard: dict[str | None, float] = {}  # per scope, the loop time of its watch's last line
        # per scope, the delay of the relist that the next watch event naming no pod brings forward
        self._skip_backoff: dict[str | None, float] = {}
        self.watch_states: dict[str | None, WatchState] = {s: WatchState(since=time.time()) for s in self.scopes}
        # the models awaited though the pool has no endpoint of them (``EndpointPool.awaited``): of
        # the pods waiting for their address (key -> model), and since when the last pod of a model left
        self._waiting: dict[str, str] = {}
        self._waiting_models: Counter[str] = Counter()
        self._left_at: dict[str, float] = {}
        pool.awaited = self._awaits
        # each kind's events, a change alone and a burst's summary, written out whole: the manual
        # quotes them and operators grep for them
        self._changes = {
            "added": _Changes("kubernetes endpoint added", "kubernetes endpoints added"),
            "removed": _Changes("kubernetes endpoint removed", "kubernetes endpoints removed"),
            "routable": _Changes("kubernetes endpoint routable", "kubernetes endpoints routable"),
            "not routable": _Changes("kubernetes endpoint not routable", "kubernetes endpoints not routable"),
        }
        self._tasks: list[asyncio.Task] = []       # one per scope, in the order of ``scopes``
        self._ending: list[asyncio.Task] = []      # the loops stopped for a relist (``_relist_watching``)
        self._api_client: Any = None
        self._core: Any = None
        self.metrics = DiscoveryMetrics(registry, self.scopes, self._pod_counts)

    def reconfigure(self, kcfg: KubernetesConfig, models: Iterable[ModelConfig]) -> None:
        """A reloaded config (gateway/server/reload.py): the model blocks (a pod's default engine) and
        ``kubernetes.models``. When what a pod is mapped with changed, the namespaces being watched
        are listed again at once, so the new settings apply to the pods held, not only to those that
        change later (or at the next resync, never with none); an endpoint they change is the same
        engine under its new settings, as a pod changed in place. The client, namespaces and
        selector stay as started; the pods found so far stay in the pool."""
        before = self._mapping()
        self.kcfg = msgspec.structs.replace(self.kcfg, models=kcfg.models)
        self.models = {m.name: m for m in models}
        for t in self._tracked.values():            # a model's engine key applies at once
            t.ep.api_key = self._api_key(t.view.model)
        if self._mapping() != before:
            self._relist_watching()

    def _mapping(self) -> tuple:
        """What ``map_pod`` reads of the config: ``kubernetes.models`` and each model's engine."""
        return self.kcfg.models, {name: m.engine for name, m in self.models.items()}

    def _relist_watching(self) -> None:
        """List again now each namespace whose loop is watching (one listing, or waiting to, lists
        with the settings of now anyway): its task is stopped, and one that waits for it to end
        lists and watches in its place."""
        self._ending = [t for t in self._ending if not t.done()]    # (one stopped before it took over)
        for i, task in enumerate(self._tasks):
            scope = self.scopes[i]
            if self.watch_states[scope].state != "watching":
                continue
            task.cancel()
            self._ending.append(task)
            self._tasks[i] = asyncio.create_task(self._run(scope, after=task),
                                                 name=f"switchyard-k8s-{scope or 'all'}")

    def _api_key(self, model: str) -> str | None:
        """The key of the engines of ``model`` (its block's ``api_key``), or None."""
        mc = self.models.get(model)
        return mc.api_key if mc is not None else None

    def _awaits(self, model: str) -> bool:
        """Whether ``model``, of which the pool has no endpoint, is one whose pods are expected: one
        of them waits for its address (Pending), or its last pod left under ``LEFT_GRACE_S`` ago (a
        StatefulSet deletes a pod before it makes it again; a Recreate rollout, all of them)."""
        if self._waiting_models.get(model):
            return True
        left = self._left_at.get(model)
        if left is None:
            return False
        if time.monotonic() - left < LEFT_GRACE_S:
            return True
        del self._left_at[model]
        return False

    def _wait(self, key: str, model: str | None) -> None:
        """Pod ``key`` waits for its address to serve ``model`` (None: it does not, or no longer)."""
        before = self._waiting.pop(key, None)
        if before is not None:
            self._waiting_models[before] -= 1
            if not self._waiting_models[before]:
                del self._waiting_models[before]
        if model:
            self._waiting[key] = model
            self._waiting_models[model] += 1

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the client configuration (a bad kubeconfig fails here, naming the key) and start
        the loops. Does not wait for the API server: an unreachable one is retried forever."""
        from kubernetes_asyncio.client import ApiClient, CoreV1Api

        cfg = await load_client_configuration(self.kcfg)
        self.pool.listed = False
        self._api_client = ApiClient(configuration=cfg)
        self._core = CoreV1Api(self._api_client)
        for scope in self.scopes:
            self._tasks.append(asyncio.create_task(self._run(scope), name=f"switchyard-k8s-{scope or 'all'}"))
        log.info("kubernetes discovery started", host=cfg.host, namespaces=self.scopes if self.kcfg.namespaces
                 else "all", label_selector=self.kcfg.label_selector)

    async def stop(self) -> None:
        tasks = self._tasks + self._ending
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self._ending.clear()
        for changes in self._changes.values():
            changes.flush()
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    async def wait_synced(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self.synced.wait()
            return True
        except TimeoutError:
            return False

    async def before_serving(self, timeout: float | None = None) -> None:
        """Wait, up to ``timeout`` s, until every scope has been listed: a worker that listened before
        it knew the pods would tell its share of the clients that a model served by pods does not
        exist (a restarted worker among siblings that serve gets new connections at once). An API
        server that answers no list in that time is waited for no longer: the worker serves what
        the config gives, and ``/ready`` says 503 while no endpoint is ready."""
        if self.synced.is_set():
            return
        timeout = FIRST_LIST_WAIT_S if timeout is None else timeout
        log.info("kubernetes discovery: waiting for the first list of pods before serving", timeout_s=timeout)
        if not await self.wait_synced(timeout):
            log.warning("kubernetes discovery: serving before the first list of pods", waited_s=timeout)

    def endpoints(self) -> list[Endpoint]:
        """The endpoints this discovery currently holds in the pool (routable or not)."""
        return [t.ep for t in self._tracked.values()]

    def _pod_counts(self) -> tuple[dict[tuple[str, str], int], int]:
        """The pods held, by (model, routable or not_routable), and how many are skipped."""
        counts: Counter[tuple[str, str]] = Counter(
            (t.view.model, "routable" if t.view.routable else "not_routable") for t in self._tracked.values())
        return dict(counts), self._skipped_count()

    def _skipped_count(self) -> int:
        """The selected pods not routed to at all: those skipped, and the list items that name no pod."""
        return len(self._skipped) + sum(map(len, self._unreadable.values()))

    def status(self) -> dict[str, Any]:
        """This discovery as the status page shows it (JSON-ready): its pods (those not routable
        and the skipped ones named, with why, up to ``MAX_LISTED`` each), its requests to the API
        server by how they ended, and each watched namespace's loop with when it last heard from
        the API server. O(pods) to make, and only when the page asks."""
        routable = 0
        unready: list[tuple[str, str, str]] = []
        for key, t in self._tracked.items():
            if t.view.routable:
                routable += 1
            else:
                unready.append((key, t.view.model, t.view.not_routable_reason))
        skipped = heapq.nsmallest(MAX_LISTED, self._skipped.items())
        skipped += [(f"{scope or '*'}/?", f"list item that is not a pod: {text}")
                    for scope, texts in self._unreadable.items() for text in texts][:MAX_LISTED - len(skipped)]
        sync = self.metrics.last_sync
        watches = []
        for scope, w in self.watch_states.items():
            err = w.last_error
            heard = sync.get(scope or "*") or None
            watches.append({"namespace": scope or "*", "state": w.state, "since": round(w.since, 3),
                            "retry_at": None if w.retry_at is None else round(w.retry_at, 3),
                            "last_sync": None if heard is None else round(heard, 3),
                            "last_error": None if err is None else {"verb": err[0], "result": err[1], "message": err[2],
                                                                    "time": round(err[3], 3)}})
        return {"pods": {"routable": routable, "not_routable": len(unready), "skipped": self._skipped_count()},
                "not_routable": [{"pod": k, "model": m, "reason": r} for k, m, r in heapq.nsmallest(MAX_LISTED, unready)],
                "skipped": [{"pod": k, "reason": r} for k, r in skipped],
                "requests": self.metrics.counts(), "watches": watches}

    # -- the loop ----------------------------------------------------------------------------

    async def _run(self, scope: str | None, after: asyncio.Task | None = None) -> None:
        if after is not None:       # the loop this one takes over from, stopped: it is left first
            await asyncio.wait([after])
            with contextlib.suppress(ValueError):
                self._ending.remove(after)
        first = self.kcfg.retry_backoff_s
        backoff = first
        loop = asyncio.get_running_loop()
        state = self.watch_states[scope]
        while True:
            watching = None
            state.enter("relisting" if scope in self._listed else "listing")
            try:
                rv = await self._list(scope)
                watching = loop.time()
                state.enter("watching")
                await self._watch(scope, rv)
                self.stats["resyncs"] += 1
                backoff = first             # a watch that ended as watches do: the API is well
            except asyncio.CancelledError:
                raise
            except Exception as e:  # API down, connection broken, 410 Gone, a bug: relist
                gone = isinstance(e, Gone)
                self.stats["gone" if gone else "errors"] += 1
                verb = "list" if watching is None else "watch"
                result = ("gone" if gone else status_result(e.status) if isinstance(e, ApiError)
                          else transport_result(e))
                self.metrics.ended(verb, result)
                state.last_error = (verb, result, _error_text(e), time.time())
                if isinstance(e, ApiError) and e.status == 401:
                    await self._read_credentials_again()
                # a list that succeeds does not make the API well: a watch that keeps failing at
                # once (a 500, a 429, a 410 right after the list) backs off as a failing list
                # does, until one holds a while or brings an event or a bookmark (a proxy that
                # cuts every stream after a few seconds would otherwise leave the pool unwatched
                # for up to 30 s out of every 30-odd)
                if watching is not None and (loop.time() - watching >= HEALTHY_WATCH_S
                                             or self._heard.get(scope, -1.0) >= watching):
                    backoff = first
                    if gone:            # a watch that had been served outlived its resourceVersion
                        log.info("kubernetes resourceVersion expired; relisting", namespace=scope or "*")
                        continue
                delay = backoff * random.uniform(0.8, 1.2)
                if isinstance(e, ApiError) and e.retry_after is not None:
                    # the API server (its priority and fairness, its graceful shutdown) or a proxy
                    # said when to come back: not sooner, and not later than the backoff's cap
                    delay = max(delay, min(e.retry_after, max(MAX_BACKOFF_S, first)))
                state.enter("backing_off", time.time() + delay)
                if gone:
                    log.info("kubernetes resourceVersion expired; relisting", namespace=scope or "*",
                             retry_in_s=round(delay, 2))
                elif result == "tls":
                    log.warning(_tls_failure(e), namespace=scope or "*", server=self._api_client.configuration.host,
                                error=f"{type(e).__name__}: {e}".strip(), retry_in_s=round(delay, 2))
                else:
                    log.warning("kubernetes list/watch failed; relisting", namespace=scope or "*",
                                error=f"{type(e).__name__}: {e}".strip(), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, max(MAX_BACKOFF_S, first))

    async def _read_credentials_again(self) -> None:
        """A 401: the token this client holds was refused, most likely rotated (a projected
        service-account token, a kubeconfig's ``tokenFile`` or its ``token`` rewritten). The
        credentials are read again from where they came, so the next try sends the new token;
        kubernetes-asyncio reads a kubeconfig's token once, and the service account's file at most
        once a minute. What cannot be read now leaves the client as it was."""
        live = self._api_client.configuration
        try:
            fresh = await load_client_configuration(self.kcfg)
        except ConfigError as e:
            log.warning("kubernetes credentials could not be read again", error=str(e))
            return
        if fresh.api_key != live.api_key:
            self.stats["credentials_reread"] += 1
            log.info("kubernetes credentials changed; retrying with them")
        live.api_key = dict(fresh.api_key)
        live.api_key_prefix = dict(fresh.api_key_prefix)
        live.refresh_api_key_hook = fresh.refresh_api_key_hook

    def _call(self, scope: str | None, checked: bool = False, **kwargs):
        """The request for ``scope``'s pods: (function, args, kwargs). ``checked``: the function
        refuses an answer that is not a 200 (see ``_opened``) before its body is read as events."""
        kwargs["label_selector"] = self.kcfg.label_selector
        if scope is None:
            fn, args = self._core.list_pod_for_all_namespaces, ()
        else:
            fn, args = self._core.list_namespaced_pod, (scope,)
        return (_opened(fn) if checked else fn), args, kwargs

    async def _list(self, scope: str | None) -> str:
        fn, args, kw = self._call(scope, _preload_content=False,
                                  _request_timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT_S))
        resp = await fn(*args, **kw)
        try:
            body = await resp.read()
            status = resp.status
        finally:
            resp.release()
        if status == 410:
            raise Gone()
        if status != 200:
            raise ApiError(status, _status_message(body), retry_after_s(resp.headers.get("Retry-After")))
        data = json.loads(body)
        # no ``items`` at all (a Status, an empty object, a proxy's own answer) is no list of pods:
        # taken for an empty one, it would take every pod out of the pool (``null`` is an empty list)
        if not isinstance(data, dict) or not isinstance(data.get("items", ()), list | None):
            raise ApiError(0, f"list answer that is not a list of pods: {str(data)[:200]}")
        items = data["items"]
        pods, unreadable = [], []
        for obj in items or ():
            (pods if _names_a_pod(obj) else unreadable).append(obj)
        md = data.get("metadata")
        rv = str((md.get("resourceVersion") if isinstance(md, dict) else None) or "")
        self.stats["lists"] += 1
        self.metrics.ended("list", "ok")
        self.metrics.heard(scope)
        self._note_unreadable(scope, unreadable)
        # a list with an item that names no pod is not the whole truth: a pod the item stood for
        # would be taken for one gone, so the pods it lacks stay through that list (not the next)
        with self.pool.batch():         # each model's endpoints ordered once, not once per pod
            self._reconcile(scope, pods, whole=not unreadable)
        if scope not in self._listed:
            self._listed.add(scope)
            if len(self._listed) == len(self.scopes):
                self.synced.set()
                self.pool.listed = True
        return rv

    async def _watch(self, scope: str | None, rv: str) -> None:
        """Watch from ``rv`` until a relist is due; raises ``Gone`` or the transport's error."""
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.watch import Watch

        loop = asyncio.get_running_loop()
        resync = self.kcfg.resync_interval_s
        deadline = loop.time() + resync if resync > 0 else float("inf")
        skipped = False                 # an event that named no pod came: the relist is brought forward
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            timeout = max(1, int(min(self.kcfg.watch_timeout_s, remaining)))
            fn, args, kw = self._call(
                scope, checked=True, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=timeout,
                # the server ends the watch at `timeout`; a connection that silently died is
                # given up a little later
                _request_timeout=aiohttp.ClientTimeout(total=timeout + 15, sock_connect=10))
            self.stats["watches"] += 1
            watch = Watch(return_type="object")    # events as plain dicts, as lists are read
            read = watch.unmarshal_event
            # a bookmark whose resourceVersion cannot be read: kubernetes-asyncio raises, which
            # would end the watch and list again for a line that changes nothing (``_bookmark_rv``); an
            # ERROR event is read by its status code (``_error_event``)
            watch.unmarshal_event = lambda data, rtype, read=read: (_unreadable_bookmark(data) or _error_event(data)
                                                                    or read(data, rtype))
            idle = self.kcfg.watch_idle_timeout_s or None
            opened, lines = loop.time(), 0
            bad_bookmark = False            # one logged per watch, not one a minute
            try:
                async with watch:
                    stream = watch.stream(fn, *args, **kw)
                    while True:
                        # silent for `idle`, or the relist an event naming no pod brought forward is due
                        due = deadline - loop.time() if skipped else None
                        if due is not None and due <= 0:
                            self.metrics.ended("watch", "ok")
                            return
                        quiet = asyncio.timeout(due if idle is None or due is not None and due < idle else idle)
                        try:
                            async with quiet:
                                event = await anext(stream)
                        except StopAsyncIteration:
                            if not lines and loop.time() - opened < SHORT_WATCH_S:
                                # not the server's end at `timeout` (a second at least): a proxy or
                                # an API server that ends every watch at once, which would
                                # otherwise be opened again and again in a loop
                                raise ApiError(0, "watch ended at once with nothing (no event, no "
                                                  f"bookmark, under {SHORT_WATCH_S:g} s)") from None
                            self.metrics.ended("watch", "ok")
                            self.metrics.heard(scope)
                            if not skipped:
                                self._skip_backoff.pop(scope, None)
                            break
                        except TimeoutError:
                            if not quiet.expired():
                                raise               # the request's own timeout
                            if skipped and loop.time() >= deadline:
                                self.metrics.ended("watch", "ok")
                                return
                            self.stats["idle_watches"] += 1
                            self.metrics.ended("watch", "idle")
                            log.warning("kubernetes watch brought nothing; watching again", namespace=scope or "*",
                                        idle_s=idle)
                            break
                        if not isinstance(event, dict) or "type" not in event:
                            raise ApiError(0, f"unexpected watch line: {str(event)[:200]}")
                        obj = event.get("raw_object")
                        if event.get(_UNREADABLE):
                            # it says only how far the watch got: skipped, the watch goes on from the
                            # last resourceVersion it had, and nothing is listed again (none was missed)
                            lines += 1
                            self._heard[scope] = loop.time()
                            self.metrics.heard(scope)
                            self.stats["skipped_events"] += 1
                            self.metrics.skipped_event(scope)
                            if not bad_bookmark:
                                bad_bookmark = True
                                log.warning("kubernetes watch bookmark has no resourceVersion; skipped",
                                            namespace=scope or "*", item=str(obj)[:200])
                            continue
                        if event["type"] != "BOOKMARK" and not _names_a_pod(obj):
                            # what changed cannot be told: skipped, and a relist reads it soon (not
                            # taken as a sign of a well API: a watch that brings only these backs off)
                            if not skipped:
                                skipped = True
                                deadline = min(deadline, loop.time() + self._skip_delay(scope, event["type"], obj))
                            self.stats["skipped_events"] += 1
                            self.metrics.skipped_event(scope)
                            continue
                        lines += 1
                        self._on_event(scope, event["type"], obj or {})
                        rv = watch.resource_version or rv
            except ApiException as e:
                if e.status == 410:
                    raise Gone() from None
                raise ApiError(e.status or 0, str(e.reason)) from None

    def _skip_delay(self, scope: str | None, etype: Any, obj: Any) -> float:
        """The first watch event since the last list whose object names no pod: logged, and how long
        until the relist that reads what it would have said (``retry_backoff_s``, doubling up to
        30 s while each list's watch brings such events, so that a proxy that mangles them costs a
        list now and then, not one per event)."""
        first = self.kcfg.retry_backoff_s
        backoff = self._skip_backoff.get(scope, first)
        self._skip_backoff[scope] = min(backoff * 2, max(MAX_BACKOFF_S, first))
        delay = backoff * random.uniform(0.8, 1.2)
        log.warning("kubernetes watch event is not a pod; skipped, relisting", namespace=scope or "*",
                    item=f"{etype} {str(obj)[:200]}", relist_in_s=round(delay, 2))
        return delay

    # -- applying state ----------------------------------------------------------------------

    def _on_event(self, scope: str | None, etype: str, obj: Mapping[str, Any]) -> None:
        self._heard[scope] = asyncio.get_running_loop().time()
        self.metrics.heard(scope)
        if etype == "BOOKMARK":
            self.stats["bookmarks"] += 1
            return
        self.stats["events"] += 1
        key = pod_key(obj)
        if (lacked := self._lacked.get(scope)) is not None:
            lacked.discard(key)         # told of since the list that lacked it: as if that list had it
        if etype in ("ADDED", "MODIFIED"):
            self._scope_keys[scope].add(key)
            self._apply(key, obj)
        elif etype == "DELETED":
            self._scope_keys[scope].discard(key)
            self._skipped.pop(key, None)
            self._wait(key, None)
            self._drop(key, "deleted")

    def _reconcile(self, scope: str | None, items: list[Mapping[str, Any]], whole: bool = True) -> None:
        seen: set[str] = set()
        for obj in items:
            key = pod_key(obj)
            seen.add(key)
            self._apply(key, obj)
        lacked = self._scope_keys[scope] - seen
        kept: set[str] = set()
        if not whole:
            # the pods it lacks are kept, as they were, unless the list before lacked them too: an
            # item that named no pod in every list (a proxy that adds one) kept a pod whose delete
            # the watch missed for good
            before = self._lacked.get(scope, set())
            kept = lacked - before
            if kept:
                log.info("kubernetes pods a list lacks are kept: it has an item that names no pod",
                         namespace=scope or "*", pods=sorted(kept)[:MAX_LISTED], kept=len(kept))
        for key in lacked - kept:
            self._skipped.pop(key, None)
            self._wait(key, None)
            self._drop(key, "gone at relist")
        if kept:
            self._lacked[scope] = kept
        else:
            self._lacked.pop(scope, None)
        self._scope_keys[scope] = seen | kept

    def _note_unreadable(self, scope: str | None, items: list[Any]) -> None:
        """The items of ``scope``'s last list that name no pod (skipped, each alone): counted among
        the skipped pods and logged when they change, not at every list that brings them again."""
        texts = [str(obj)[:200] for obj in items]
        if texts and texts != self._unreadable.get(scope):
            log.warning("kubernetes list item is not a pod; skipped", namespace=scope or "*", items=len(texts),
                        item=texts[0])
        if texts:
            self._unreadable[scope] = texts
        else:
            self._unreadable.pop(scope, None)

    def _apply(self, key: str, obj: Mapping[str, Any]) -> None:
        try:
            view = map_pod(obj, self.models, self.kcfg.models)
        except Exception as e:          # one pod the mapping cannot read must not stop the others
            view = Skipped(key, f"not understood: {type(e).__name__}: {str(e)[:200]}")
        if isinstance(view, Skipped):
            if self._skipped.get(key) != view.reason:
                log.info("kubernetes pod not used", pod=key, reason=view.reason)
            self._skipped[key] = view.reason
            self._wait(key, view.model)
            self._drop(key, view.reason)
            return
        self._skipped.pop(key, None)
        self._wait(key, None)
        cur = self._tracked.get(key)
        if cur is not None and cur.view == view:      # same endpoint; maybe readiness changed
            if cur.view.routable != view.routable:
                self._set_routable(cur.ep, view)
            cur.view = view
            return
        # the same pod (uid) at the same address serving the same model: the same engine, still
        # running its requests and holding its conversations (EndpointPool.replaced, as a reload's)
        was = cur.ep if cur is not None and (cur.view.uid, cur.view.url, cur.view.model) == (
            view.uid, view.url, view.model) else None
        if cur is not None and was is None:
            self._drop(key, "pod changed")
        ep = Endpoint(url=view.url, model=view.model, engine=view.engine, role=view.role,
                      roleset=None if view.roleset is None else self._name(view, view.roleset),
                      bootstrap_port=view.bootstrap_port, min_prompt_tokens=view.min_prompt_tokens,
                      max_prompt_tokens=view.max_prompt_tokens, source="kubernetes", name=self._name(view),
                      api_key=self._api_key(view.model),
                      extra={"namespace": view.namespace, "pod": view.key, "uid": view.uid,
                             "metrics_url": view.metrics_url, "routing_strategy": view.routing_strategy,
                             "kv_events": view.kv_events, "kv_events_error": view.kv_events_error})
        ep.draining = not view.routable
        if view.kv_events_error:
            self.stats["kv_events_refused"] += 1
            log.warning("kubernetes annotation refused; the pod is routed without KV events", pod=key,
                        annotation=ANNO_KV_EVENTS, reason=view.kv_events_error)
        self.pool.add(ep)
        if was is not None:
            # taken out once the new one is in: the engine's URL never leaves the pool, so its
            # connections stay open (gateway/upstream/upstream.py ``follow``) and its model known
            self._drop(key, "pod changed")
            self.pool.replaced(was, ep)
        self._tracked[key] = _Tracked(view, ep)
        self._changes["added"].note(key, view.model, view.not_routable_reason or None, url=view.url,
                                    engine=view.engine, role=view.role, roleset=view.roleset,
                                    routable=view.routable)

    def _name(self, view: PodView, name: str | None = None) -> str:
        """The endpoint's name (or, given ``name``, its roleset's): the pod's name, or
        ``namespace/name`` when several namespaces (or all) are watched, where a name is unique only
        within its namespace (a StatefulSet's ``engine-0``, a roleset ``rs-0``, in two of them): the
        ``target-pod`` header and the ``endpoint`` metric label must tell two pods apart, what is
        kept per endpoint name too, and P/D must not pair a prefill with another roleset's decode."""
        name = view.name if name is None else name
        return name if self.scopes != [None] and len(self.scopes) == 1 else f"{view.namespace}/{name}"

    def _set_routable(self, ep: Endpoint, view: PodView) -> None:
        if view.routable:
            # the kubelet's readiness probe passed: trust it over an older failed probe of ours
            ep.draining = False
            ep.healthy = True
            ep.consecutive_failures = 0
        else:
            ep.draining = True
        self._changes["routable" if view.routable else "not routable"].note(
            view.key, view.model, view.not_routable_reason or None)

    def _drop(self, key: str, reason: str) -> None:
        cur = self._tracked.pop(key, None)
        if cur is None:
            return
        self.pool.remove(cur.ep)
        if not self.pool.has_model(cur.view.model):     # its last endpoint: awaited a while (``_awaits``)
            now = time.monotonic()
            self._left_at = {m: t for m, t in self._left_at.items() if now - t < LEFT_GRACE_S}
            self._left_at[cur.view.model] = now
        self._changes["removed"].note(key, cur.view.model, reason, {"in_flight": cur.ep.in_flight},
                                      url=cur.view.url)


def _opened(fn):
    """``fn`` (a list call with ``_preload_content=False``, as a watch makes it) whose answer is
    refused unless it is a 200: kubernetes-asyncio reads a watch's body line by line whatever its
    status, so an error a proxy or load balancer answers with (a text or HTML page, or no body)
    was read as a line not understood, or as a watch that ended with nothing, its status lost.
    Raises ``Gone`` on a 410, else ``ApiError`` with the status and the body's message."""
    @functools.wraps(fn)
    async def call(*args, **kwargs):
        resp = await fn(*args, **kwargs)
        if resp.status == 200:
            return resp
        try:
            body = await resp.read()
        finally:
            resp.release()
        if resp.status == 410:
            raise Gone()
        raise ApiError(resp.status, _status_message(body) or resp.reason or "",
                       retry_after_s(resp.headers.get("Retry-After")))
    return call


_UNREADABLE = "switchyard_unreadable_bookmark"


def _unreadable_bookmark(data: str | bytes) -> dict[str, Any] | None:
    """A watch line that is a BOOKMARK whose object holds no resourceVersion (a non-empty string):
    the event, marked ``_UNREADABLE``; None for any other line (read as kubernetes-asyncio reads it)."""
    if ("BOOKMARK" if isinstance(data, str) else b"BOOKMARK") not in data:
        return None
    try:
        js = json.loads(data)
    except ValueError:
        return None
    if not isinstance(js, dict) or js.get("type") != "BOOKMARK" or "object" not in js:
        return None
    obj = js["object"]
    md = obj.get("metadata") if isinstance(obj, dict) else None
    rv = md.get("resourceVersion") if isinstance(md, dict) else None
    if isinstance(rv, str) and rv:
        return None
    return {"type": "BOOKMARK", "object": obj, "raw_object": obj, _UNREADABLE: True}


def _error_event(data: str | bytes) -> None:
    """Raises what a watch line that is an ERROR event says: ``Gone`` for a 410, else ``ApiError``
    with its code and its reason and message, those it has. kubernetes-asyncio reads an ERROR's
    object as a full ``Status``: one with a code but no reason or message (an aggregated API
    server's, a proxy's) raised ``KeyError``, a failure that named neither the code nor a 410.
    Returns None for any other line (read as kubernetes-asyncio reads it)."""
    if ("ERROR" if isinstance(data, str) else b"ERROR") not in data:
        return None
    try:
        js = json.loads(data)
    except ValueError:
        return None
    if not isinstance(js, dict) or js.get("type") != "ERROR" or "object" not in js:
        return None
    obj = js["object"]
    code = obj.get("code") if isinstance(obj, dict) else None
    if not isinstance(code, int) or isinstance(code, bool):
        raise ApiError(0, f"watch ERROR event with no status code: {str(obj)[:200]}")
    if code == 410:
        raise Gone()
    words = [str(obj[k]) for k in ("reason", "message") if obj.get(k)]
    raise ApiError(code, ": ".join(words)[:300])


def _names_a_pod(obj: Any) -> bool:
    """Whether a list item or a watch event's object is a pod's: an object whose metadata names it
    and its namespace (the API server's always do)."""
    md = obj.get("metadata") if isinstance(obj, dict) else None
    return (isinstance(md, dict) and isinstance(md.get("name"), str) and isinstance(md.get("namespace"), str)
            and bool(md["name"]) and bool(md["namespace"]))


def _tls_failure(e: BaseException) -> str:
    """The warning of a list or watch whose TLS handshake with the API server failed."""
    if isinstance(e, aiohttp.ClientConnectorCertificateError | ssl.SSLCertVerificationError):
        return ("kubernetes API server's certificate failed verification (the kubeconfig's certificate-authority, "
                "or the service account's ca.crt, did not sign it); relisting")
    return "kubernetes API server's TLS handshake failed (does the server speak TLS at this address?); relisting"


def _error_text(e: BaseException) -> str:
    """A failed request's error for the status page: its type and message, cut to 300 characters."""
    if isinstance(e, Gone):
        return "410 Gone: the resourceVersion is too old"
    text = f"{type(e).__name__}: {e}".strip().removesuffix(":")
    return text if len(text) <= 300 else text[:300] + "…"


def _status_message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace").strip()
    if isinstance(doc, dict):
        return str(doc.get("message") or doc.get("reason") or doc)[:300]
    return str(doc)[:300]
