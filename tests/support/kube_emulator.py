"""A Kubernetes API server emulator for Pods, on aiohttp, speaking the wire protocol that
kubernetes-asyncio (and client-go) speak:

- ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods``: a ``PodList`` whose
  ``metadata.resourceVersion`` is the store's current revision; ``labelSelector`` (existence,
  ``=``/``==``/``!=``, ``in``/``notin``, ``>``/``<``); ``resourceVersion`` with
  ``resourceVersionMatch=Exact`` answers HTTP 410 ``Expired`` when it was compacted away.
- the same paths with ``watch=true``: a chunked stream of one JSON event per line —
  ``ADDED``/``MODIFIED``/``DELETED`` with the pod, ``BOOKMARK`` with only
  ``metadata.resourceVersion`` (when ``allowWatchBookmarks``), and, for a ``resourceVersion``
  older than the last compaction, a single ``ERROR`` event carrying a ``Status`` with code 410,
  as the real server does. Without a resourceVersion (or with ``"0"``) the stream starts with
  synthetic ``ADDED`` events for the current state. Label-selector transitions are translated
  like the watch cache does: a pod that starts matching arrives as ``ADDED``, one that stops
  matching as ``DELETED``. ``timeoutSeconds`` ends the stream cleanly.
- ``GET /api/v1/namespaces/{ns}/pods/{name}``.
- bearer-token authentication: anything else is a 401 ``Status``.

Test knobs: ``partition()`` drops events (and bookmarks) on their way to live watchers — the
events are lost for good, as on a broken proxy; ``heal()`` ends it, and the next bookmark moves
the clients past what they missed. ``break_watches()`` aborts every watch connection mid-stream.
``silence_watches()`` makes every open watch connection go quiet for good, as one whose peer
vanished without a FIN or RST (a NAT entry expired, the node was cut off): nothing more is sent on
it, not even the end its ``timeoutSeconds`` would bring; watches opened after it are served.
``compact()`` forgets history: a watch resuming from an older resourceVersion gets 410.
``fail_watches = 500`` answers every watch with that status while lists go on working.
``fail_next_lists`` makes the next list calls fail with the given HTTP statuses. ``hold_lists()``
keeps every list waiting, as a slow API server does (``held_lists`` counts them), until
``release_lists()``. ``list_extra_items`` are put in every list's ``items`` as they are (objects
that are not pods, as a broken proxy in front of the API server could answer). ``list_body``, when
set, is every list's answer instead, with status 200 (a proxy that answers with something else).
``forbidden_namespaces`` answers lists and watches in those namespaces 403 ``Forbidden``, as the
API server does for a service account with no RoleBinding there. ``empty_watches`` answers every
watch 200 with a body that ends at once (no event, no bookmark), as a proxy that closes streams does.
``failure_headers`` are sent with every injected failure (``fail_next_lists``, ``fail_watches``),
``Retry-After`` say, as the API server's priority and fairness sends with its 429s; and
``failure_body``, when set, is their body in place of the ``Status`` (text/plain; ``""``: none),
as a proxy or load balancer in front of the API server answers (a 502 page, Envoy's
``upstream connect error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import ssl
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from k8s.selector import SelectorError, matches, parse_selector

_TRUE = {"1", "t", "T", "true", "TRUE", "True"}


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _now() -> str:
    return "2025-01-01T00:00:00Z"


@dataclass
class _Watcher:
    namespace: str | None
    selector: tuple
    bookmarks: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    silent: asyncio.Event = field(default_factory=asyncio.Event)


_BREAK = object()


class KubeEmulator:
    def __init__(self, token: str = "test-token", bookmark_interval: float = 0.2) -> None:
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.rv = 1000
        self.compacted_rv = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []  # rv, type, obj, old
        self.watchers: list[_Watcher] = []
        self.partitioned = False
        self.fail_next_lists: list[int] = []
        self.fail_watches: int | None = None      # every watch answered with this status (lists work)
        self.list_extra_items: list[Any] = []     # added to every list's items as they are
        self.list_body: Any = None                # when set: every list's whole answer (200), as it is
        self.forbidden_namespaces: set[str] = set()   # lists and watches there: 403 (no RoleBinding)
        self.empty_watches = False                # every watch: 200 and an empty body at once
        self.failure_headers: dict[str, str] = {}   # sent with every injected failure
        self.failure_body: str | None = None        # the injected failures' body (text) in place of a Status
        self._lists_open: asyncio.Event | None = None   # set: lists are answered; None: not held
        self.stats: Counter[str] = Counter()
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._ips = itertools.count(2)
        self._runner: web.AppRunner | None = None
        self._watch_tasks: set[asyncio.Task] = set()
        self.url = ""

    # -- server ------------------------------------------------------------------------------

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> str:
        """Serve on loopback (``ssl_context``: over TLS, at an ``https://`` URL); returns the URL."""
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._collection)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._collection)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=ssl_context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if ssl_context is not None else 'http'}://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        self.break_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, token: str | None = None, namespace: str = "default", ca: str | None = None) -> str:
        """A kubeconfig (YAML text) pointing at this emulator with a bearer token; ``ca``: the
        certificate-authority file its client trusts (served over TLS)."""
        cluster: dict[str, Any] = {"server": self.url}
        if ca is not None:
            cluster["certificate-authority"] = ca
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": cluster}],
            "users": [{"name": "emu", "user": {"token": token or self.token}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": namespace}}],
        })

    # -- store operations (tests call these) -------------------------------------------------

    def create_pod(self, namespace: str, name: str, labels: dict[str, str] | None = None, *,
                   annotations: dict[str, str] | None = None, ip: str | None = "auto", ready: bool = True,
                   phase: str = "Running", port: int = 8000) -> dict[str, Any]:
        if (namespace, name) in self.pods:
            raise ValueError(f"pod {namespace}/{name} exists")
        if ip == "auto":
            n = next(self._ips)
            ip = f"10.1.{n // 250}.{n % 250}"
        pod = {
            "kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                         "creationTimestamp": _now(), "labels": dict(labels or {}),
                         "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai:latest",
                                     "ports": [{"containerPort": port, "protocol": "TCP"}]}],
                     "nodeName": "node-1"},
            "status": {"phase": phase, "hostIP": "192.0.2.10", "startTime": _now(),
                       "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]},
        }
        if ip:
            pod["status"]["podIP"] = ip
            pod["status"]["podIPs"] = [{"ip": ip}]
        _set_ready(pod, ready)
        self._commit("ADDED", pod, None)
        return pod

    def update_pod(self, namespace: str, name: str, mutate) -> dict[str, Any]:
        old = self.pods[(namespace, name)]
        new = copy.deepcopy(old)
        mutate(new)
        self._commit("MODIFIED", new, old)
        return new

    def set_ready(self, namespace: str, name: str, ready: bool) -> dict[str, Any]:
        return self.update_pod(namespace, name, lambda p: _set_ready(p, ready))

    def set_labels(self, namespace: str, name: str, **changes: str | None) -> dict[str, Any]:
        def mutate(p):
            labels = p["metadata"].setdefault("labels", {})
            for k, v in changes.items():
                k = k.replace("__", "/").replace("_", "-")
                if v is None:
                    labels.pop(k, None)
                else:
                    labels[k] = v
        return self.update_pod(namespace, name, mutate)

    def mark_terminating(self, namespace: str, name: str) -> dict[str, Any]:
        def mutate(p):
            p["metadata"]["deletionTimestamp"] = _now()
            p["metadata"]["deletionGracePeriodSeconds"] = 30
        return self.update_pod(namespace, name, mutate)

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self.pods[(namespace, name)]
        final = copy.deepcopy(old)
        self._commit("DELETED", final, old)

    def hold_lists(self) -> None:
        self._lists_open = asyncio.Event()

    def release_lists(self) -> None:
        if self._lists_open is not None:
            self._lists_open.set()
            self._lists_open = None

    def partition(self) -> None:
        self.partitioned = True

    def heal(self) -> None:
        self.partitioned = False

    def break_watches(self) -> None:
        for w in list(self.watchers):
            w.queue.put_nowait(_BREAK)

    def silence_watches(self) -> None:
        for w in list(self.watchers):
            w.silent.set()

    def compact(self) -> None:
        """Forget all history up to now: watches from an older resourceVersion get 410."""
        self.compacted_rv = self.rv
        self.log = [e for e in self.log if e[0] > self.compacted_rv]

    # -- internals ---------------------------------------------------------------------------

    def _commit(self, etype: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if etype == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = obj
        self.log.append((self.rv, etype, copy.deepcopy(obj), old))
        self.stats[f"commit_{etype}"] += 1
        if self.partitioned:
            self.stats["dropped_events"] += len(self.watchers)
            return
        for w in self.watchers:
            ev = _translate(w, etype, obj, old)
            if ev is not None:
                w.queue.put_nowait(ev)

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization", "") == f"Bearer {self.token}"

    @staticmethod
    def _error(code: int, reason: str, message: str) -> web.Response:
        return web.json_response(status_object(code, reason, message), status=code)

    def _injected(self, code: int, reason: str) -> web.Response:
        """An injected failure: a ``Status`` (or ``failure_body``) with ``failure_headers``."""
        if self.failure_body is not None:
            return web.Response(status=code, text=self.failure_body, headers=self.failure_headers)
        resp = self._error(code, reason, f"injected failure {code}")
        resp.headers.update(self.failure_headers)
        return resp

    async def _get(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "Unauthorized", "Unauthorized")
        pod = self.pods.get((request.match_info["ns"], request.match_info["name"]))
        if pod is None:
            return self._error(404, "NotFound", f'pods "{request.match_info["name"]}" not found')
        return web.json_response(pod)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        self.requests.append((request.path, dict(q)))
        if not self._authorized(request):
            self.stats["unauthorized"] += 1
            return self._error(401, "Unauthorized", "Unauthorized")
        if "fieldSelector" in q:
            return self._error(400, "BadRequest", "the emulator does not implement fieldSelector")
        try:
            selector = parse_selector(q.get("labelSelector", ""))
        except SelectorError as e:
            return self._error(400, "BadRequest", f"unable to parse requirement: {e}")
        ns = request.match_info.get("ns")
        if ns in self.forbidden_namespaces:
            self.stats["forbidden"] += 1
            return self._error(403, "Forbidden", f'pods is forbidden: User "system:serviceaccount:llm:sy" cannot '
                                                 f'list resource "pods" in API group "" in the namespace "{ns}"')
        if q.get("watch") in _TRUE:
            if self.fail_watches is not None:
                self.stats["failed_watches"] += 1
                return self._injected(self.fail_watches, "InternalError")
            return await self._watch(request, ns, selector)
        self.stats["lists"] += 1
        if self._lists_open is not None:
            self.stats["held_lists"] += 1
            await self._lists_open.wait()
        if self.fail_next_lists:
            code = self.fail_next_lists.pop(0)
            reason = {410: "Expired", 500: "InternalError", 503: "ServiceUnavailable"}.get(code, "Failure")
            return self._injected(code, reason)
        if self.list_body is not None:
            return web.json_response(self.list_body)
        rv = q.get("resourceVersion")
        if rv and q.get("resourceVersionMatch") == "Exact" and int(rv) < self.compacted_rv:
            return self._error(410, "Expired", f"too old resource version: {rv} ({self.compacted_rv})")
        items = []
        for (pns, _), pod in sorted(self.pods.items()):
            if (ns is None or pns == ns) and matches(selector, pod["metadata"].get("labels")):
                item = copy.deepcopy(pod)
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        items += copy.deepcopy(self.list_extra_items)
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, ns: str | None, selector: tuple) -> web.StreamResponse:
        q = request.query
        self.stats["watches"] += 1
        w = _Watcher(namespace=ns, selector=selector, bookmarks=q.get("allowWatchBookmarks") in _TRUE)
        rv = q.get("resourceVersion", "")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if self.empty_watches:
            self.stats["empty_watches"] += 1
            await resp.write_eof()
            return resp

        async def send(ev: dict) -> None:
            if w.silent.is_set():
                self.stats["silenced_watches"] += 1
                with contextlib.suppress(ValueError):
                    self.watchers.remove(w)
                await asyncio.Event().wait()        # the connection stays open, and says nothing
            await resp.write(json.dumps(ev).encode() + b"\n")

        if rv not in ("", "0") and int(rv) < self.compacted_rv:
            self.stats["gone"] += 1
            await send({"type": "ERROR", "object": status_object(
                410, "Expired", f"too old resource version: {rv} ({self.compacted_rv})")})
            await resp.write_eof()
            return resp
        # snapshot and subscribe in one synchronous step: nothing can fall in between
        backlog: list[dict] = []
        if rv in ("", "0"):
            for (pns, _), pod in sorted(self.pods.items()):
                if (ns is None or pns == ns) and matches(selector, pod["metadata"].get("labels")):
                    backlog.append({"type": "ADDED", "object": copy.deepcopy(pod)})
        else:
            for erv, etype, obj, old in self.log:
                if erv > int(rv):
                    ev = _translate(w, etype, obj, old)
                    if ev is not None:
                        backlog.append(ev)
        self.watchers.append(w)
        loop = asyncio.get_running_loop()
        timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else 1800.0
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval
        task = asyncio.current_task()
        if task is not None:
            self._watch_tasks.add(task)
        try:
            for ev in backlog:
                await send(ev)
            while True:
                if w.silent.is_set():           # says nothing more, and does not end at its timeout
                    await send({})
                now = loop.time()
                if now >= deadline:
                    break
                try:
                    async with asyncio.timeout(max(0.0, min(deadline, next_bookmark) - now)):
                        item = await w.queue.get()
                except TimeoutError:
                    if loop.time() >= next_bookmark:
                        next_bookmark = loop.time() + self.bookmark_interval
                        if w.bookmarks and not self.partitioned and w.queue.empty():
                            self.stats["bookmarks"] += 1
                            await send({"type": "BOOKMARK", "object": {
                                "kind": "Pod", "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(self.rv)}}})
                    continue
                if item is _BREAK:
                    self.stats["broken_watches"] += 1
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await send(item)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(ValueError):
                self.watchers.remove(w)
            if task is not None:
                self._watch_tasks.discard(task)
        return resp


def _set_ready(pod: dict[str, Any], ready: bool) -> None:
    conds = [c for c in pod["status"].get("conditions", []) if c["type"] not in ("Ready", "ContainersReady")]
    s = "True" if ready else "False"
    conds += [{"type": "ContainersReady", "status": s, "lastTransitionTime": _now()},
              {"type": "Ready", "status": s, "lastTransitionTime": _now()}]
    pod["status"]["conditions"] = conds


def _translate(w: _Watcher, etype: str, obj: dict, old: dict | None) -> dict | None:
    """What a watcher with a namespace and label selector sees of one change."""
    if w.namespace is not None and obj["metadata"]["namespace"] != w.namespace:
        return None
    now_m = matches(w.selector, obj["metadata"].get("labels"))
    was_m = old is not None and matches(w.selector, old["metadata"].get("labels"))
    if etype == "ADDED":
        t = "ADDED" if now_m else None
    elif etype == "DELETED":
        t = "DELETED" if was_m else None
    elif now_m and was_m:
        t = "MODIFIED"
    elif now_m:
        t = "ADDED"
    elif was_m:
        t = "DELETED"
    else:
        t = None
    return None if t is None else {"type": t, "object": copy.deepcopy(obj)}
