"""Pod discovery through kubernetes-asyncio against the API server emulator, on loopback.

Every test builds the ``kubernetes`` config block the way a user writes it, with a kubeconfig file
in tmp_path that points at the emulator with a bearer token. Changes are polled with a deadline of
a few seconds (never asserted as wall time).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.schema import ConfigError, config_from_dict
from gateway.endpoints import EndpointPool
from gateway.server.run import free_port
from k8s.discovery import KubernetesDiscovery
from tests.support.waiting import until

M = "model.aibrix.ai/name"


@pytest.fixture
async def discover(emu, tmp_path):
    started: list[KubernetesDiscovery] = []

    async def make(token: str | None = None, config_models: list[dict] | None = None, sync: bool = True,
                   registry: CollectorRegistry | None = None, kubeconfig: str | None = None,
                   **kube) -> tuple[KubernetesDiscovery, EndpointPool]:
        path = tmp_path / f"kubeconfig-{len(started)}"
        path.write_text(kubeconfig or emu.kubeconfig(token=token))
        block = {"enabled": True, "kubeconfig": str(path), "retry_backoff_s": 0.05, **kube}
        cfg = config_from_dict({"kubernetes": block, "models": config_models or []})
        pool = EndpointPool()
        d = KubernetesDiscovery(cfg.kubernetes, pool, {m.name: m for m in cfg.models}, registry=registry)
        await d.start()
        started.append(d)
        if sync:
            assert await d.wait_synced(5), "initial list did not complete"
        return d, pool

    yield make
    for d in started:
        await d.stop()


def names(pool: EndpointPool, model: str | None = None, ready_only: bool = False) -> set[str]:
    eps = pool.endpoints(model)
    return {e.name for e in eps if e.ready or not ready_only}


async def test_pod_lifecycle_is_reflected_in_the_pool(emu, discover):
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"])
    assert names(pool, "llama", ready_only=True) == {"a"}
    ep_a = pool.endpoints("llama")[0]
    assert (ep_a.source, ep_a.role, ep_a.url.startswith("http://10.")) == ("kubernetes", "aggregated", True)

    # added not ready: known (the model exists) but gets no requests
    emu.create_pod("llm", "b", {M: "llama"}, ready=False)
    await until(lambda: names(pool, "llama") == {"a", "b"})
    assert names(pool, "llama", ready_only=True) == {"a"}
    # readied
    emu.set_ready("llm", "b", True)
    await until(lambda: names(pool, "llama", ready_only=True) == {"a", "b"})
    ep_b = next(e for e in pool.endpoints("llama") if e.name == "b")
    # made not ready, then ready again: the same endpoint object (its counters survive)
    emu.set_ready("llm", "b", False)
    await until(lambda: names(pool, "llama", ready_only=True) == {"a"})
    emu.set_ready("llm", "b", True)
    await until(lambda: names(pool, "llama", ready_only=True) == {"a", "b"})
    assert next(e for e in pool.endpoints("llama") if e.name == "b") is ep_b
    # terminating: out of rotation at once, in-flight requests keep their endpoint
    ep_a.in_flight = 1                       # as if a stream were running on it
    emu.mark_terminating("llm", "a")
    await until(lambda: names(pool, "llama", ready_only=True) == {"b"})
    assert ep_a.draining and ep_a.in_flight == 1
    # deleted: gone from the pool
    emu.delete_pod("llm", "a")
    await until(lambda: names(pool, "llama") == {"b"})
    ep_a.in_flight = 0
    assert d.stats["lists"] == 1, "all of this came through the watch, no relist"
    assert d.stats["events"] >= 6


async def test_namespaces_and_label_selector_are_honoured(emu, discover):
    emu.create_pod("a", "p1", {M: "llama"})
    emu.create_pod("b", "p2", {M: "llama", "env": "prod"})
    emu.create_pod("c", "p3", {M: "llama"})               # namespace not watched
    emu.create_pod("a", "no-model", {"app": "db"})        # not selected by the default selector
    emu.create_pod("b", "canary", {M: "llama", "env": "canary"})
    d, pool = await discover(namespaces=["a", "b"], label_selector=f"{M},env!=canary")
    assert names(pool) == {"a/p1", "b/p2"}      # with several namespaces, an endpoint is namespace/name
    paths = {p for p, _ in emu.requests}
    assert paths == {"/api/v1/namespaces/a/pods", "/api/v1/namespaces/b/pods"}
    assert all(q.get("labelSelector") == f"{M},env!=canary" for _, q in emu.requests)
    # a pod that stops matching the selector leaves; one that starts matching arrives
    emu.set_labels("b", "p2", env="canary")
    emu.set_labels("b", "canary", env="prod")
    await until(lambda: names(pool) == {"a/p1", "b/canary"})


async def test_all_namespaces_uses_the_cluster_wide_path(emu, discover):
    emu.create_pod("x", "p1", {M: "llama"})
    emu.create_pod("y", "p2", {M: "qwen", "model.aibrix.ai/engine": "sglang"})
    d, pool = await discover()
    assert names(pool) == {"x/p1", "y/p2"}
    assert pool.endpoints("qwen")[0].engine == "sglang"
    assert {p for p, _ in emu.requests} == {"/api/v1/pods"}
    emu.create_pod("z", "p3", {M: "llama"})
    await until(lambda: names(pool, "llama") == {"x/p1", "z/p3"})


async def test_watch_uses_resource_version_and_bookmarks_and_resumes_without_relisting(emu, discover):
    d, pool = await discover(namespaces=["llm"], watch_timeout_s=1)
    await until(lambda: d.stats["watches"] >= 3 and d.stats["bookmarks"] >= 2, timeout=6)
    watches = [q for _, q in emu.requests if q.get("watch") in ("true", "True")]
    assert watches and all(q.get("allowWatchBookmarks") in ("true", "True") for q in watches)
    assert all(q.get("resourceVersion") for q in watches)
    emu.create_pod("llm", "late", {M: "llama"})
    await until(lambda: names(pool) == {"late"})
    assert d.stats["lists"] == 1 and d.stats["errors"] == 0


async def test_a_dropped_watch_is_survived(emu, discover):
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"])
    await until(lambda: len(emu.watchers) == 1)
    emu.break_watches()
    await until(lambda: d.stats["errors"] >= 1)
    emu.create_pod("llm", "b", {M: "llama"})
    emu.delete_pod("llm", "a")
    await until(lambda: names(pool) == {"b"})
    assert d.stats["lists"] >= 2


async def test_a_watch_that_goes_quiet_without_a_word_is_opened_again(emu, discover):
    """A watch connection whose peer vanished without a FIN or RST (a NAT entry expired) brings
    nothing more, not even its server-side end: after ``watch_idle_timeout_s`` with no event and
    no bookmark it is opened again from the last resourceVersion, which brings what it missed,
    with no relist; a watch that brings bookmarks is left alone."""
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0, watch_idle_timeout_s=0.5)
    await until(lambda: d.stats["bookmarks"] >= 10)            # ten bookmarks at 0.1 s: twice the idle bound
    assert (d.stats["watches"], d.stats["idle_watches"]) == (1, 0)
    emu.silence_watches()
    emu.create_pod("llm", "b", {M: "llama"})
    await until(lambda: names(pool) == {"a", "b"})
    assert d.stats["idle_watches"] == 1 and d.stats["watches"] == 2
    assert d.stats["lists"] == 1 and d.stats["errors"] == 0
    assert emu.stats["silenced_watches"] == 1


async def test_410_gone_on_watch_forces_a_relist(emu, discover):
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], watch_timeout_s=1)
    await until(lambda: len(emu.watchers) == 1)
    # while the client hears nothing, a pod arrives and history is compacted: when its watch
    # times out and resumes from its old resourceVersion, the server says 410 Gone
    emu.partition()
    emu.create_pod("llm", "b", {M: "llama"})
    emu.compact()
    await until(lambda: names(pool) == {"a", "b"}, timeout=5)
    assert emu.stats["gone"] >= 1 and d.stats["gone"] >= 1
    emu.heal()
    emu.delete_pod("llm", "a")
    await until(lambda: names(pool) == {"b"})


@pytest.mark.parametrize(("etype", "obj"), [("MODIFIED", None), ("DELETED", {}), ("DELETED", {"metadata": {"name": "b"}}),
                                            ("ADDED", {"metadata": {"namespace": "llm"}}), ("MODIFIED", "garbage"),
                                            ("DELETED", {"metadata": "x"}), ("MODIFIED", [1])],
                         ids=["null", "empty", "no-namespace", "no-name", "string", "metadata-string", "list"])
async def test_a_watch_event_whose_object_is_not_a_pod_is_skipped_and_counted(emu, discover, etype, obj):
    """A watch event whose object names no pod (null, no metadata, no name or namespace, not an
    object) cannot say what changed: it is skipped, counted and logged, the watch goes on, and a
    relist ``retry_backoff_s`` later reads what the event would have said. No watch is counted as
    failed, the pool keeps every pod till the relist, and no pod of no name is made up."""
    import structlog

    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    emu.partition()
    emu.delete_pod("llm", "b")          # its DELETED event is lost; what comes instead is not understood
    emu.heal()
    with structlog.testing.capture_logs() as logs:
        for w in emu.watchers:
            w.queue.put_nowait({"type": etype, "object": obj})
        await until(lambda: d.stats["lists"] == 2)
        await until(lambda: names(pool) == {"a"})
    assert names(pool, "llama", ready_only=True) == {"a"}
    st = d.status()
    assert st["skipped"] == [] and st["pods"] == {"routable": 1, "not_routable": 0, "skipped": 0}
    assert samples(reg, "switchyard_kubernetes_pods_skipped") == {(): 0}
    assert samples(reg, "switchyard_kubernetes_watch_events_skipped_total") == {("llm",): 1}
    assert samples(reg, "switchyard_kubernetes_requests_total")[("error", "watch")] == 0
    assert st["watches"][0]["last_error"] is None
    [noted] = [e for e in logs if e["event"] == "kubernetes watch event is not a pod; skipped, relisting"]
    assert noted["namespace"] == "llm" and noted["log_level"] == "warning" and etype in noted["item"]
    assert d.stats["errors"] == 0 and d.stats["skipped_events"] == 1
    # and it watches again
    emu.create_pod("llm", "c", {M: "llama"})
    await until(lambda: names(pool) == {"a", "c"})


async def test_a_watch_goes_on_past_events_that_name_no_pod_and_relists_once(emu, discover):
    """Events that name no pod do not end the watch: the events after them on the same connection
    are applied as they come, and however many such events come before it, one relist, no sooner
    than ``retry_backoff_s`` after the first, reads what they would have said (a proxy that mangles
    every event of a busy namespace costs a list now and then, not one per event)."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0, retry_backoff_s=1)
    await until(lambda: len(emu.watchers) == 1)
    emu.partition()
    emu.delete_pod("llm", "b")          # lost; two events that name no pod come instead
    emu.heal()
    [w] = emu.watchers
    w.queue.put_nowait({"type": "DELETED", "object": {}})
    w.queue.put_nowait({"type": "MODIFIED", "object": None})
    emu.create_pod("llm", "c", {M: "llama"})      # after them, on the same connection
    await until(lambda: "c" in names(pool))
    # applied from the watch that brought the bad events: no list, no other watch yet
    assert (d.stats["lists"], d.stats["watches"], emu.stats["watches"]) == (1, 1, 1)
    assert names(pool) == {"a", "b", "c"}
    await until(lambda: names(pool) == {"a", "c"}, timeout=10)
    assert d.stats["lists"] == 2 and d.stats["skipped_events"] == 2 and d.stats["errors"] == 0
    assert samples(reg, "switchyard_kubernetes_watch_events_skipped_total") == {("llm",): 2}
    assert samples(reg, "switchyard_kubernetes_requests_total")[("error", "watch")] == 0


@pytest.mark.parametrize("obj", [{}, {"metadata": {}}, None, {"metadata": {"resourceVersion": 7}}],
                         ids=["empty", "no-rv", "null", "rv-not-a-string"])
async def test_a_bookmark_whose_resource_version_cannot_be_read_is_skipped_without_a_relist(emu, discover, obj):
    """A BOOKMARK carries no change, only how far the watch got: one whose resourceVersion cannot
    be read is skipped and counted, and the watch goes on from the last resourceVersion it had.
    Nothing was missed, so nothing is listed again (a relist of thousands of pods for nothing),
    no watch counts as failed and the status page names no error."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    [w] = emu.watchers
    w.queue.put_nowait({"type": "BOOKMARK", "object": obj})
    emu.create_pod("llm", "b", {M: "llama"})        # after it, on the same connection
    await until(lambda: names(pool) == {"a", "b"})
    assert (d.stats["lists"], d.stats["watches"], d.stats["errors"]) == (1, 1, 0)
    assert d.stats["skipped_events"] == 1
    assert samples(reg, "switchyard_kubernetes_watch_events_skipped_total") == {("llm",): 1}
    assert samples(reg, "switchyard_kubernetes_requests_total")[("error", "watch")] == 0
    assert d.status()["watches"][0]["last_error"] is None
    # and the watch goes on bringing what changes, with no list
    emu.delete_pod("llm", "a")
    await until(lambda: names(pool) == {"b"})
    assert d.stats["lists"] == 1


@pytest.mark.parametrize("item", [None, {}, {"metadata": {"namespace": "llm"}}, "garbage", {"metadata": "x"}],
                         ids=["null", "empty", "no-name", "string", "metadata-string"])
async def test_a_list_item_that_is_not_a_pod_is_skipped_alone(emu, discover, item):
    """A list whose items hold one that names no pod (a proxy that adds one to every list) takes
    the others: the namespace is listed and watched, its pods join, the item is counted among the
    skipped and logged once however many lists bring it. A pod such a list lacks may be the one the
    item stood for: it stays until a list that is whole (or its watch event) says it is gone."""
    import structlog

    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    emu.list_extra_items = [item]
    with structlog.testing.capture_logs() as logs:
        d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0)
        assert names(pool, "llama", ready_only=True) == {"a", "b"}
        emu.create_pod("llm", "c", {M: "llama"})                # the watch runs
        await until(lambda: names(pool) == {"a", "b", "c"})
        emu.partition()
        emu.delete_pod("llm", "b")          # its DELETED event is lost; the next list has the item
        emu.heal()
        emu.break_watches()
        await until(lambda: d.stats["lists"] == 2 and len(emu.watchers) == 1)
    assert names(pool) == {"a", "b", "c"}
    requests = samples(reg, "switchyard_kubernetes_requests_total")
    assert requests[("ok", "list")] == 2 and requests[("error", "list")] == 0
    assert samples(reg, "switchyard_kubernetes_pods_skipped") == {(): 1}
    st = d.status()
    assert st["pods"] == {"routable": 3, "not_routable": 0, "skipped": 1}
    [skipped] = st["skipped"]
    assert skipped["pod"] == "llm/?" and "not a pod" in skipped["reason"]
    assert st["watches"][0]["last_error"]["verb"] == "watch"            # the broken watch, no failed list
    noted = [e for e in logs if e["event"] == "kubernetes list item is not a pod; skipped"]
    assert len(noted) == 1 and noted[0]["namespace"] == "llm" and noted[0]["log_level"] == "warning"
    assert not any(e["event"] == "kubernetes list/watch failed; relisting" and "not a pod" in e.get("error", "")
                   for e in logs)
    # a whole list again: the pod it lacks is gone, and nothing is skipped
    emu.list_extra_items = []
    emu.break_watches()
    await until(lambda: names(pool) == {"a", "c"})
    assert samples(reg, "switchyard_kubernetes_pods_skipped") == {(): 0} and d.status()["skipped"] == []


async def test_a_pod_that_two_lists_with_an_unreadable_item_lack_is_gone(emu, discover):
    """A list with an item that names no pod keeps the pods it lacks (the item may be one of them),
    but only once: a pod whose deletion the watch missed, lacked again by the next list, is gone
    even though that list brings the item again (a proxy that adds one to every list would
    otherwise keep a deleted pod, whose address the next pod may get, in rotation for good). A pod
    the first list lacked that the second brings stays, and so does one the watch told of between."""
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    emu.create_pod("llm", "c", {M: "llama"})
    emu.create_pod("llm", "d", {M: "llama"})
    emu.list_extra_items = [{"metadata": {"namespace": "llm"}}]
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    assert names(pool) == {"a", "b", "c", "d"}
    await until(lambda: len(emu.watchers) == 1)
    emu.partition()
    emu.delete_pod("llm", "b")          # its DELETED event is lost
    emu.delete_pod("llm", "d")          # this one's too
    emu.heal()
    emu.break_watches()
    await until(lambda: d.stats["lists"] == 2 and len(emu.watchers) == 1)
    assert names(pool) == {"a", "b", "c", "d"}        # the item may be b or d
    emu.create_pod("llm", "d", {M: "llama"})          # d again, told by the watch
    await until(lambda: d.stats["events"] == 1)
    emu.break_watches()
    await until(lambda: d.stats["lists"] == 3 and len(emu.watchers) == 1)
    assert names(pool) == {"a", "c", "d"}
    assert d.status()["pods"]["skipped"] == 1


@pytest.mark.parametrize("body", [{}, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"},
                                  {"kind": "PodList", "metadata": {"resourceVersion": "5"}, "item": []}, [], "ok"],
                         ids=["empty-object", "status", "no-items", "array", "string"])
async def test_a_list_answer_that_holds_no_list_of_pods_fails_and_keeps_the_pool(emu, discover, body):
    """A list answered 200 with JSON that holds no ``items`` (a Status, an empty object, a proxy's
    own answer) says nothing of the pods: it is a failed list (``error``, retried with the
    backoff), not an empty one that would take every discovered pod out of the pool."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    emu.list_body = body
    emu.break_watches()
    await until(lambda: samples(reg, "switchyard_kubernetes_requests_total")[("error", "list")] >= 1)
    assert names(pool, "llama", ready_only=True) == {"a", "b"}
    assert d.status()["watches"][0]["last_error"]["verb"] == "list"
    emu.list_body = None                # a list of pods again: it is taken
    emu.delete_pod("llm", "b")
    await until(lambda: names(pool) == {"a"})


@pytest.mark.parametrize("ip", ["10.0.0.9:8000", "10.0.0.9/24", "fd00::9]"], ids=["with-port", "cidr", "bracket"])
async def test_a_pod_whose_ip_is_not_an_address_is_skipped_alone(emu, discover, ip):
    """A pod whose ``status.podIP`` is not an IP address (the API server checks it; a proxy or a
    hand-made object need not) is skipped with why, in a list and in a watch event alike: the
    namespace's other pods are listed and watched, and no endpoint is made of a URL that names some
    other address."""
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "bad", {M: "llama"}, ip=ip)
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    assert names(pool) == {"a"}
    emu.create_pod("llm", "bad-too", {M: "llama"}, ip=ip)
    emu.create_pod("llm", "c", {M: "llama"})
    await until(lambda: names(pool) == {"a", "c"})
    st = d.status()
    assert [s["pod"] for s in st["skipped"]] == ["llm/bad", "llm/bad-too"]
    assert all("not an IP address" in s["reason"] for s in st["skipped"])
    assert (d.stats["lists"], d.stats["errors"]) == (1, 0)


async def test_a_pod_whose_model_label_is_not_a_string_is_skipped_and_the_metrics_still_render(emu, discover):
    """A pod whose model label is a number (labels are strings on the API server; an object a
    proxy made up need not hold them) is skipped with why: it was a model 7, whose pod count's
    ``model`` label made every scrape of the gateway's /metrics fail."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "bad", {M: "x"})
    emu.update_pod("llm", "bad", lambda p: p["metadata"]["labels"].__setitem__(M, 7))
    d, pool = await discover(namespaces=["llm"], registry=reg)
    assert names(pool) == {"a"} and pool.models() == ["llama"]
    assert samples(reg, "switchyard_kubernetes_pods") == {("llama", "routable"): 1}
    assert samples(reg, "switchyard_kubernetes_pods_skipped") == {(): 1}


async def test_a_namespace_the_service_account_may_not_read_stops_no_other(emu, discover):
    """RBAC refuses one watched namespace (403, no RoleBinding there): the other is listed, watched
    and served; the refused one is retried with the backoff, shown on the status page with its
    error and counted; the discovery is not synced (a model it does not know may be one of that
    namespace's pods) until a RoleBinding lets the list in, and then its pods join."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("other", "x", {M: "qwen"})
    emu.forbidden_namespaces = {"other"}
    d, pool = await discover(namespaces=["llm", "other"], registry=reg, sync=False)
    await until(lambda: samples(reg, "switchyard_kubernetes_requests_total")[("forbidden", "list")] >= 2)
    await until(lambda: len(emu.watchers) == 1)
    assert names(pool, ready_only=True) == {"llm/a"} and not d.synced.is_set() and pool.listed is False
    emu.create_pod("llm", "b", {M: "llama"})
    await until(lambda: names(pool) == {"llm/a", "llm/b"})
    watches = {w["namespace"]: w for w in d.status()["watches"]}
    assert watches["llm"]["state"] == "watching" and watches["llm"]["last_error"] is None
    err = watches["other"]["last_error"]
    assert watches["other"]["state"] in ("backing_off", "listing") and (err["verb"], err["result"]) == ("list", "forbidden")
    assert "forbidden" in err["message"]
    emu.forbidden_namespaces = set()
    await until(lambda: names(pool) == {"llm/a", "llm/b", "other/x"}, timeout=15)   # the backoff has grown meanwhile
    assert d.synced.is_set() and pool.listed is True
    await until(lambda: len(emu.watchers) == 2)


async def test_watches_that_end_at_once_with_nothing_back_off_and_relist(emu, discover):
    """An API server or proxy that answers every watch 200 and ends its body at once, with no
    event and no bookmark: such a watch is not a server-side timeout's end (that comes after its
    ``timeoutSeconds``, at least a second), so it is taken for a failed one, as client-go's
    reflector takes a watch under a second with no event: counted as a watch error, backed off
    and relisted, rather than watch after watch opened in a loop; a watch that then holds is
    served as ever."""
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    emu.empty_watches = True
    emu.break_watches()
    await until(lambda: emu.stats["empty_watches"] >= 3)
    # every watch that ended at once was followed by a list, after a backoff
    assert emu.stats["empty_watches"] <= emu.stats["lists"] - 1
    requests = samples(reg, "switchyard_kubernetes_requests_total")
    assert requests[("ok", "watch")] == 0 and requests[("error", "watch")] >= 2
    err = d.status()["watches"][0]["last_error"]
    assert (err["verb"], err["result"]) == ("watch", "error") and "ended at once" in err["message"]
    assert err["message"].startswith("ApiError: watch ended at once")   # no HTTP status: none was given
    emu.empty_watches = False
    emu.create_pod("llm", "b", {M: "llama"})
    await until(lambda: names(pool) == {"a", "b"}, timeout=15)     # the backoff has grown meanwhile
    await until(lambda: len(emu.watchers) == 1)
    emu.create_pod("llm", "c", {M: "llama"})
    await until(lambda: names(pool) == {"a", "b", "c"})


async def test_a_relist_the_api_server_leaves_hanging_keeps_the_pool_and_is_given_up(emu, discover, monkeypatch):
    """A relist (here the resync's) that the API server does not answer: the pool keeps the pods it
    had and serves them, the namespace shows ``relisting``; after the list's own timeout it is
    counted as a ``timeout`` with its error on the status page and tried again, and the list then
    answered brings what changed meanwhile."""
    import k8s.discovery as discovery

    monkeypatch.setattr(discovery, "LIST_TIMEOUT_S", 0.5)
    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], registry=reg, resync_interval_s=1)
    emu.hold_lists()
    await until(lambda: emu.stats["held_lists"] >= 1)
    assert d.status()["watches"][0]["state"] == "relisting"
    await until(lambda: samples(reg, "switchyard_kubernetes_requests_total")[("timeout", "list")] >= 1)
    assert names(pool, "llama", ready_only=True) == {"a", "b"}
    err = d.status()["watches"][0]["last_error"]
    assert (err["verb"], err["result"]) == ("list", "timeout")
    emu.delete_pod("llm", "b")
    emu.release_lists()
    await until(lambda: names(pool) == {"a"})
    await until(lambda: d.status()["watches"][0]["state"] == "watching")


@pytest.mark.parametrize(("status", "counted", "result"), [
    ({"kind": "Status", "code": 410}, "gone", "gone"),
    ({"kind": "Status", "code": 500}, "errors", "server_error"),
    ({"code": 403, "message": "watch denied"}, "errors", "forbidden"),
], ids=["410", "500", "403"])
async def test_an_error_event_of_few_words_is_read_by_its_code(emu, discover, status, counted, result):
    """An ERROR event in a watch whose Status holds its code but not its reason or message (an
    aggregated API server or a proxy that writes them short) is read by its code, as the full one
    is: a 410 lists again at once as any 410 does, another code is that status's failure, and the
    status page names it, not the client library's ``KeyError: 'reason'``."""
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    [w] = emu.watchers
    w.queue.put_nowait({"type": "ERROR", "object": status})
    await until(lambda: d.stats["lists"] == 2)
    emu.create_pod("llm", "b", {M: "llama"})
    await until(lambda: names(pool) == {"a", "b"})
    assert d.stats[counted] == 1 and d.stats["gone"] + d.stats["errors"] == 1
    err = d.status()["watches"][0]["last_error"]
    assert err["result"] == result and "KeyError" not in err["message"]
    assert str(status["code"]) in err["message"] or status["code"] == 410


async def test_410_and_500_on_list_are_retried(emu, discover):
    emu.fail_next_lists = [410, 500]
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"])
    assert names(pool) == {"a"}
    assert emu.stats["lists"] == 3 and d.stats["gone"] == 1 and d.stats["errors"] == 1


async def test_a_delete_missed_during_a_partition_is_repaired_by_the_periodic_relist(emu, discover):
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"})
    d_resync, pool_resync = await discover(namespaces=["llm"], resync_interval_s=1, watch_timeout_s=60)
    d_never, pool_never = await discover(namespaces=["llm"], resync_interval_s=0, watch_timeout_s=60)
    assert names(pool_resync) == names(pool_never) == {"a", "b"}
    await until(lambda: len(emu.watchers) == 2)     # both are watching now

    emu.partition()
    emu.delete_pod("llm", "a")          # the DELETED event is lost for good
    emu.heal()
    # bookmarks now carry both clients past the lost event: no watch will ever replay it
    b0 = d_never.stats["bookmarks"]
    await until(lambda: d_never.stats["bookmarks"] >= b0 + 2)
    await until(lambda: names(pool_resync) == {"b"}, timeout=5)
    assert d_resync.stats["lists"] >= 2
    # without the relist the dead pod would stay in rotation
    assert names(pool_never, ready_only=True) == {"a", "b"}
    assert d_never.stats["lists"] == 1


async def test_a_list_of_many_pods_orders_each_models_endpoints_once(emu, discover, monkeypatch):
    """A list is applied in one synchronous step on the event loop, thousands of pods at once: each
    model's endpoints are ordered (their turns, whether it has P/D roles, its strategy hint) once
    per list, not once per pod added or removed, which made a list O(pods²) (measured: the first
    list of 8000 pods of one model held the loop 25 s, serving nothing, a relist that finds them
    all gone as long)."""
    from collections import Counter

    for i in range(300):
        emu.create_pod("llm", f"p{i}", {M: "llama"})
    ordered: Counter[str] = Counter()
    summarize = EndpointPool._summarize

    def counted(self, model):
        ordered[model] += 1
        summarize(self, model)

    monkeypatch.setattr(EndpointPool, "_summarize", counted)
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    assert len(pool.endpoints("llama")) == 300 and ordered == {"llama": 1}
    assert sorted(ep.turn for ep in pool.endpoints("llama")) == list(range(300))
    # the namespace emptied while the watch heard nothing: the relist takes every pod out at once
    await until(lambda: len(emu.watchers) == 1)
    ordered.clear()
    emu.partition()
    for i in range(300):
        emu.delete_pod("llm", f"p{i}")
    emu.create_pod("llm", "q", {M: "qwen"})
    emu.compact()
    emu.heal()
    emu.break_watches()
    await until(lambda: names(pool) == {"q"})
    assert d.stats["lists"] == 2 and ordered == {"llama": 1, "qwen": 1}
    assert pool.models() == ["qwen"] and not pool.has_model("llama") and pool.awaited("llama")


async def test_pods_that_come_and_go_one_watch_event_at_a_time_are_not_ordered_per_event(emu, discover, monkeypatch):
    """A watch brings pods one event at a time (a Deployment scaled from 0 to hundreds, a namespace
    emptied): each is applied alone, as it comes, and must not walk every endpoint of its model
    (ordering them for their turns, looking for P/D roles, shared names and a strategy hint), which
    made a burst O(pods²) (measured: 2000 pods added through the watch held the loop 3.5 s in all,
    and as long again when they were deleted). The summaries still follow every change."""
    from collections import Counter

    walked: Counter[str] = Counter()
    summarize = EndpointPool._summarize

    def counted(self, model):
        walked[model] += len(self._by_model.get(model, ()))
        summarize(self, model)

    monkeypatch.setattr(EndpointPool, "_summarize", counted)
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    hint = json.dumps({"profiles": {"default": {"routingStrategy": "least-request"}}})
    for i in range(300):
        labels = {M: "llama", **({"role-name": "prefill", "roleset-name": "rs"} if i == 150 else {})}
        emu.create_pod("llm", f"p{i}", labels, annotations={"model.aibrix.ai/config": hint} if i == 200 else None)
    await until(lambda: len(pool.endpoints("llama")) == 300)
    assert sorted(ep.turn for ep in pool.endpoints("llama")) == list(range(300))
    assert [ep.turn for ep in sorted(pool.endpoints("llama"), key=lambda e: e.url)] == list(range(300))
    assert pool.has_pd("llama") and pool.strategy_hint("llama") == "least-request" and not pool.shares_names()
    for i in range(0, 300, 2):
        emu.delete_pod("llm", f"p{i}")
    await until(lambda: len(pool.endpoints("llama")) == 150)
    assert [ep.turn for ep in sorted(pool.endpoints("llama"), key=lambda e: e.url)] == list(range(150))
    assert not pool.has_pd("llama") and pool.strategy_hint("llama") is None
    assert d.stats["lists"] == 1 and d.stats["events"] == 450
    assert sum(walked.values()) <= 600, f"the watch's changes walked {dict(walked)} endpoints"


async def test_a_burst_of_pod_changes_is_logged_in_summaries_and_a_rare_one_line_by_line(emu, discover):
    """Each endpoint added, removed, or made (not) routable was one info line: a Deployment scaled
    to hundreds gave hundreds of lines in a second. A change alone still has its own line; in a
    burst the first few have theirs, and the rest are summed up, how many, of which models, the
    first pods named, so that no change goes untold."""
    import structlog

    def told(logs, single, summary):
        lines = [e for e in logs if e["event"] in (single, summary)]
        return lines, sum(1 if e["event"] == single else e["count"] for e in lines)

    n = 300
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0)
    await until(lambda: len(emu.watchers) == 1)
    with structlog.testing.capture_logs() as logs:
        emu.create_pod("llm", "solo", {M: "llama"})
        await until(lambda: len(pool.endpoints("llama")) == 1)
        assert [(e["event"], e["pod"]) for e in logs] == [("kubernetes endpoint added", "llm/solo")]
    with structlog.testing.capture_logs() as logs:
        for i in range(n):
            emu.create_pod("llm", f"p{i}", {M: "llama"})
        await until(lambda: len(pool.endpoints("llama")) == n + 1)
        await until(lambda: told(logs, "kubernetes endpoint added", "kubernetes endpoints added")[1] == n)
        lines, _ = told(logs, "kubernetes endpoint added", "kubernetes endpoints added")
        assert len(lines) <= n // 5, f"{len(lines)} lines for {n} pods added"
        summary = next(e for e in lines if e["event"] == "kubernetes endpoints added")
        assert summary["models"] == {"llama": summary["count"]} and 0 < len(summary["pods"]) <= 5
        for i in range(n):
            emu.set_ready("llm", f"p{i}", False)
        await until(lambda: told(logs, "kubernetes endpoint not routable", "kubernetes endpoints not routable")[1] == n)
        lines, _ = told(logs, "kubernetes endpoint not routable", "kubernetes endpoints not routable")
        assert len(lines) <= n // 5, f"{len(lines)} lines for {n} pods made not routable"
        for i in range(n):
            emu.delete_pod("llm", f"p{i}")
        await until(lambda: len(pool.endpoints("llama")) == 1)
        await until(lambda: told(logs, "kubernetes endpoint removed", "kubernetes endpoints removed")[1] == n)
        lines, _ = told(logs, "kubernetes endpoint removed", "kubernetes endpoints removed")
        assert len(lines) <= n // 5, f"{len(lines)} lines for {n} pods removed"
        assert all(e["reasons"] == {"deleted": e["count"]} for e in lines if e["event"].endswith("endpoints removed"))


async def test_pd_rolesets_are_assembled_from_labels(emu, discover):
    prof = json.dumps({"profiles": {"default": {"combined": True, "promptLenBucketMaxLength": 512}}})
    sg = {M: "qwen", "model.aibrix.ai/engine": "sglang", "model.aibrix.ai/port": "30000"}
    emu.create_pod("llm", "rs1-prefill-0", {**sg, "role-name": "prefill", "roleset-name": "rs1"},
                   annotations={"model.aibrix.ai/sglang-bootstrap-port": "8999"})
    emu.create_pod("llm", "rs1-decode-0", {**sg, "role-name": "decode", "roleset-name": "rs1"})
    emu.create_pod("llm", "rs2-prefill-0", {**sg, "role-name": "prefill", "roleset-name": "rs2"})
    emu.create_pod("llm", "rs2-decode-0", {**sg, "role-name": "decode", "roleset-name": "rs2"})
    emu.create_pod("llm", "rs3-all-0", {**sg, "role-name": "all", "roleset-name": "rs3"},
                   annotations={"model.aibrix.ai/config": prof})
    emu.create_pod("llm", "rs4-all-0", {**sg, "role-name": "all", "roleset-name": "rs4"})   # not combined: unused
    emu.create_pod("llm", "plain-0", {**sg})
    emu.create_pod("llm", "vllm-p", {M: "llama", "role-name": "prefill", "roleset-name": "r"})
    emu.create_pod("llm", "vllm-x", {M: "llama", "role-name": "both", "roleset-name": "r"})  # config: combined
    d, pool = await discover(namespaces=["llm"], config_models=[{"name": "llama"}],
                             models={"llama": {"combined": True, "min_prompt_tokens": 100}})
    got = {e.name: (e.role, e.roleset, e.engine, e.bootstrap_port, e.port) for e in pool.endpoints("qwen")}
    assert got == {
        "rs1-prefill-0": ("prefill", "rs1", "sglang", 8999, 30000),
        "rs1-decode-0": ("decode", "rs1", "sglang", None, 30000),
        "rs2-prefill-0": ("prefill", "rs2", "sglang", None, 30000),
        "rs2-decode-0": ("decode", "rs2", "sglang", None, 30000),
        "rs3-all-0": ("combined", "rs3", "sglang", None, 30000),
        "plain-0": ("aggregated", None, "sglang", None, 30000),
    }
    combined = next(e for e in pool.endpoints("qwen") if e.name == "rs3-all-0")
    assert (combined.min_prompt_tokens, combined.max_prompt_tokens) == (0, 512)
    llama = {e.name: (e.role, e.roleset, e.min_prompt_tokens) for e in pool.endpoints("llama")}
    assert llama == {"vllm-p": ("prefill", "r", 100), "vllm-x": ("combined", "r", 100)}
    # a pod moving to another roleset is a new endpoint in that roleset
    emu.set_labels("llm", "rs2-decode-0", roleset_name="rs1")
    await until(lambda: {e.roleset for e in pool.endpoints("qwen") if e.name == "rs2-decode-0"} == {"rs1"})


async def test_bearer_token_is_required(emu, discover):
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(token="wrong", sync=False, namespaces=["llm"])
    # the discovery's own count, not the server's: a 401 the server has sent may not be read yet
    await until(lambda: emu.stats["unauthorized"] >= 2 and d.stats["errors"] >= 2)
    assert not d.synced.is_set() and names(pool) == set()


async def test_a_token_rotated_on_disk_is_read_again_after_a_401(emu, tmp_path):
    """A kubeconfig whose user reads its token from a file (as a projected service-account token
    is): the file and the server's token change together, the next request is refused, and
    discovery goes on with the new token rather than being refused for ever."""
    token = tmp_path / "token"
    token.write_text("first-token")
    emu.token = "first-token"
    kube = json.loads(emu.kubeconfig())
    kube["users"][0]["user"] = {"tokenFile": str(token)}
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kube))
    cfg = config_from_dict({"kubernetes": {"enabled": True, "kubeconfig": str(path), "namespaces": ["llm"],
                                           "retry_backoff_s": 0.05}})
    pool = EndpointPool()
    d = KubernetesDiscovery(cfg.kubernetes, pool)
    await d.start()
    try:
        emu.create_pod("llm", "a", {M: "llama"})
        assert await d.wait_synced(5)
        await until(lambda: names(pool) == {"a"})
        emu.token = "second-token"
        token.write_text("second-token")
        emu.break_watches()
        emu.create_pod("llm", "b", {M: "llama"})
        await until(lambda: names(pool) == {"a", "b"})
        assert emu.stats["unauthorized"] >= 1 and d.stats["credentials_reread"] == 1
    finally:
        await d.stop()


async def test_unusable_kubeconfig_fails_at_start_naming_the_key(tmp_path):
    pool = EndpointPool()
    cfg = config_from_dict({"kubernetes": {"enabled": True, "kubeconfig": str(tmp_path / "missing")}})
    with pytest.raises(ConfigError) as e:
        await KubernetesDiscovery(cfg.kubernetes, pool).start()
    assert e.value.key_path == "kubernetes.kubeconfig"
    (tmp_path / "bad").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    cfg = config_from_dict({"kubernetes": {"enabled": True, "kubeconfig": str(tmp_path / "bad")}})
    with pytest.raises(ConfigError) as e:
        await KubernetesDiscovery(cfg.kubernetes, pool).start()
    assert e.value.key_path == "kubernetes.kubeconfig"


async def test_no_kubeconfig_outside_a_cluster_says_so(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = config_from_dict({"kubernetes": {"enabled": True}})
    with pytest.raises(ConfigError, match="in-cluster"):
        await KubernetesDiscovery(cfg.kubernetes, EndpointPool()).start()


async def test_watches_that_keep_failing_back_off_though_the_lists_succeed(emu, discover):
    """``retry_backoff_s`` doubles up to 30 s: a watch refused at once (a 500, a 429) after each
    successful list is an API error like any other, so the relists slow down rather than go on
    at the first delay."""
    import structlog

    emu.fail_watches = 500
    with structlog.testing.capture_logs() as logs:
        d, _ = await discover()
        delays = lambda: [e["retry_in_s"] for e in logs if "retry_in_s" in e]     # noqa: E731
        await until(lambda: len(delays()) >= 5, timeout=20)
    emu.fail_watches = None
    first, fifth = delays()[0], delays()[4]
    # doubled four times from 0.05 s (each ±20 %): about 16 times the first, never near it
    assert fifth >= 8 * first, delays()


async def test_watches_cut_after_they_brought_bookmarks_are_retried_at_the_first_delay(emu, discover):
    """A proxy that cuts every watch stream a few seconds in: each watch was served (it brought
    bookmarks) before it broke, so the retry is at ``retry_backoff_s`` every time, not doubled up
    to 30 s as for an API that refuses watches, during which no change would be seen."""
    import structlog

    with structlog.testing.capture_logs() as logs:
        d, pool = await discover(namespaces=["llm"])
        delays = lambda: [e["retry_in_s"] for e in logs if "retry_in_s" in e]     # noqa: E731
        for cut in range(5):
            await until(lambda: len(emu.watchers) == 1)
            b0 = d.stats["bookmarks"]
            await until(lambda b0=b0: d.stats["bookmarks"] > b0)
            emu.break_watches()
            await until(lambda cut=cut: len(delays()) == cut + 1)
        emu.create_pod("llm", "late", {M: "llama"})
        await until(lambda: names(pool) == {"late"})
    # each at 0.05 s ±20 %; doubling would have made the fifth about 16 times the first
    assert max(delays()) <= 1.5 * min(delays()), delays()


async def test_watches_gone_right_after_each_list_back_off(emu, discover):
    """An API server that answers every watch from a fresh list's resourceVersion with 410 Gone (a
    watch cache behind the list it served): the relists back off as for any failing watch, not
    list after list as fast as it answers, with a log line each."""
    import structlog

    emu.fail_watches = 410
    with structlog.testing.capture_logs() as logs:
        d, _ = await discover(namespaces=["llm"])
        delays = lambda: [e["retry_in_s"] for e in logs if "retry_in_s" in e]     # noqa: E731
        await until(lambda: len(delays()) >= 5, timeout=20)
        lists = emu.stats["lists"]
    emu.fail_watches = None
    assert d.stats["gone"] >= 5 and lists <= len(delays()) + 1
    first, fifth = delays()[0], delays()[4]
    assert fifth >= 8 * first, delays()


@pytest.mark.parametrize(("status", "body", "result"), [
    (503, "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
     "server_error"),
    (502, "<html><body><h1>502 Bad Gateway</h1></body></html>\n", "server_error"),
    (429, "", "throttled")], ids=["envoy-503", "html-502", "empty-429"])
async def test_a_watch_refused_by_a_proxy_counts_by_its_status(emu, discover, status, body, result):
    """A watch answered with an HTTP error whose body is no ``Status`` (a proxy's or load balancer's
    own page, or nothing): counted by its status as the promise of
    ``switchyard_kubernetes_requests_total`` says, and the status page names it."""
    reg = CollectorRegistry()
    d, _ = await discover(namespaces=["llm"], registry=reg)
    emu.failure_body = body
    emu.fail_watches = status
    await until(lambda: d.stats["watches"] >= 1)
    emu.break_watches()
    await until(lambda: sum(v for (r, verb), v in samples(reg, "switchyard_kubernetes_requests_total").items()
                            if verb == "watch" and r not in ("ok", "disconnected")) >= 1)
    emu.fail_watches = None
    got = {r: v for (r, verb), v in samples(reg, "switchyard_kubernetes_requests_total").items()
           if verb == "watch" and v and r not in ("ok", "disconnected")}
    assert set(got) == {result}, got
    err = next(w["last_error"] for w in d.status()["watches"] if w["last_error"]["result"] != "disconnected")
    assert (err["verb"], err["result"], str(status) in err["message"]) == ("watch", result, True), err


@pytest.mark.parametrize(("verb", "retry_after"), [("list", "20"), ("watch", "20"), ("list", "date")])
async def test_a_retry_after_of_the_api_server_is_waited_out(emu, discover, verb, retry_after):
    """A 429 or 503 with ``Retry-After`` (the API server's priority and fairness, or its graceful
    shutdown, or a proxy): the next try waits that long at least (up to 30 s), not the first
    ``retry_backoff_s`` of the backoff."""
    import email.utils
    import time

    if retry_after == "date":
        retry_after = email.utils.formatdate(time.time() + 25, usegmt=True)
    emu.failure_headers = {"Retry-After": retry_after}
    if verb == "list":
        emu.fail_next_lists = [429]
    else:
        emu.fail_watches = 503
    d, _ = await discover(namespaces=["llm"], sync=False)
    watch = lambda: d.status()["watches"][0]        # noqa: E731
    await until(lambda: watch()["state"] == "backing_off")
    w = watch()
    assert (w["last_error"]["verb"], w["last_error"]["result"]) == (
        verb, "throttled" if verb == "list" else "server_error"), w
    assert w["retry_at"] - w["last_error"]["time"] >= 19.9, w


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    """``name``'s samples in the registry's exposition, by their label values."""
    return {tuple(v for _, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples if s.name == name}


async def test_list_and_watch_requests_are_counted_by_how_they_ended(emu, discover):
    """``switchyard_kubernetes_requests_total{verb, result}``: the API's refusals by kind, a watch
    broken mid-stream, a watch's clean end, and an API server nobody answers at."""
    reg = CollectorRegistry()
    emu.fail_next_lists = [503, 403, 429]
    d, _ = await discover(namespaces=["llm"], registry=reg, watch_timeout_s=1)
    requests = lambda: samples(reg, "switchyard_kubernetes_requests_total")     # noqa: E731
    got = requests()
    assert len(got) == 2 * 13 and {k: v for k, v in got.items() if v} == {
        ("server_error", "list"): 1, ("forbidden", "list"): 1, ("throttled", "list"): 1, ("ok", "list"): 1}
    await until(lambda: requests()[("ok", "watch")] >= 1, timeout=5)          # the watch's server-side end
    await until(lambda: len(emu.watchers) == 1)
    emu.break_watches()
    await until(lambda: requests()[("disconnected", "watch")] == 1)
    emu.fail_watches = 401
    await until(lambda: requests()[("unauthorized", "watch")] >= 1)
    emu.fail_watches = None
    assert d.stats["lists"] == requests()[("ok", "list")]

    nobody = f"http://127.0.0.1:{free_port()}"
    reg2 = CollectorRegistry()
    await discover(registry=reg2, sync=False, kubeconfig=emu.kubeconfig().replace(emu.url, nobody))
    await until(lambda: samples(reg2, "switchyard_kubernetes_requests_total")[("connect", "list")] >= 1)
    assert samples(reg2, "switchyard_kubernetes_last_sync_timestamp_seconds") == {("*",): 0.0}


async def test_the_last_sync_time_and_the_pods_are_exported(emu, discover):
    """``switchyard_kubernetes_last_sync_timestamp_seconds`` moves with every list and watch line
    (bookmarks too) and stops while the watch is silent; ``switchyard_kubernetes_pods`` counts the
    pods by model and state, ``..._pods_skipped`` the ones not routed to."""
    import time

    reg = CollectorRegistry()
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "llama"}, ready=False)
    emu.create_pod("llm", "c", {M: "qwen"})
    emu.create_pod("llm", "odd", {M: "llama", "model.aibrix.ai/engine": "trtllm"})
    emu.create_pod("other", "x", {M: "llama"})
    before = time.time()
    d, _ = await discover(namespaces=["llm", "other"], registry=reg, resync_interval_s=0)
    sync = lambda: samples(reg, "switchyard_kubernetes_last_sync_timestamp_seconds")     # noqa: E731
    assert set(sync()) == {("llm",), ("other",)} and min(sync().values()) >= before
    assert samples(reg, "switchyard_kubernetes_pods") == {
        ("llama", "routable"): 2, ("llama", "not_routable"): 1, ("qwen", "routable"): 1}
    assert samples(reg, "switchyard_kubernetes_pods_skipped") == {(): 1}
    emu.set_ready("llm", "b", True)
    emu.delete_pod("llm", "c")
    await until(lambda: samples(reg, "switchyard_kubernetes_pods") == {("llama", "routable"): 3})
    first = sync()[("llm",)]
    await until(lambda: sync()[("llm",)] > first)                # bookmarks
    emu.silence_watches()
    await until(lambda: emu.stats["silenced_watches"] == 2)
    quiet = sync()
    b0 = d.stats["bookmarks"]
    await asyncio.sleep(1.0)                                     # ten bookmark intervals
    assert sync() == quiet and d.stats["bookmarks"] == b0


async def test_a_pod_changed_in_place_is_the_same_engine_to_routing(emu, discover):
    """A pod whose labels or annotations change (here its routing profile) is a new endpoint of the
    pool, but the same engine at the same address, still running its requests and holding its
    conversations: the endpoint in its place counts its requests in flight, and the pool's
    replacement listeners (the routing view: sessions, prefix entries, latency models, adapters)
    are told, as for an endpoint a reload declares anew."""
    emu.create_pod("llm", "a", {M: "llama"})
    d, pool = await discover(namespaces=["llm"])
    (old,) = pool.endpoints("llama")
    told: list[tuple] = []
    pool.replacement_listeners.append(lambda was, now: told.append((was, now)))
    old.in_flight = 2                           # as if two streams were running on it
    prof = json.dumps({"profiles": {"default": {"routingStrategy": "least-request"}}})
    emu.update_pod("llm", "a", lambda p: p["metadata"].setdefault("annotations", {}).__setitem__(
        "model.aibrix.ai/config", prof))
    await until(lambda: pool.endpoints("llama") and pool.endpoints("llama")[0] is not old)
    (new,) = pool.endpoints("llama")
    assert new.url == old.url and new.extra["routing_strategy"] == "least-request"
    assert told == [(old, new)] and new.in_flight == 2


async def test_a_reload_applies_the_model_settings_to_the_pods_at_once(emu, discover):
    """A reload's ``kubernetes.models`` and model blocks (the engine of pods without the engine
    label) apply to the pods discovery holds at once, not only to pods that change later: the pods
    are listed again, and each whose endpoint they change is the same engine under its new settings
    (its requests in flight counted there), even with no periodic resync."""
    emu.create_pod("llm", "a", {M: "llama"})
    emu.create_pod("llm", "b", {M: "qwen"})
    d, pool = await discover(namespaces=["llm"], resync_interval_s=0, config_models=[{"name": "qwen"}])
    (old,) = pool.endpoints("llama")
    (qwen,) = pool.endpoints("qwen")
    old.in_flight = 1
    assert (old.max_prompt_tokens, qwen.engine) == (0, "vllm")
    cfg = config_from_dict({"kubernetes": {**_BLOCK, "models": {"llama": {"max_prompt_tokens": 4096}}},
                            "models": [{"name": "qwen", "engine": "sglang"}]})
    d.reconfigure(cfg.kubernetes, cfg.models)
    await until(lambda: [e.max_prompt_tokens for e in pool.endpoints("llama")] == [4096]
                and [e.engine for e in pool.endpoints("qwen")] == ["sglang"])
    (new,) = pool.endpoints("llama")
    assert new is not old and new.url == old.url and new.in_flight == 1
    assert d.stats["errors"] == 0


_BLOCK = {"enabled": True, "kubeconfig": "unused", "namespaces": ["llm"]}


async def test_an_api_server_whose_certificate_is_not_trusted_counts_tls_and_says_so(emu, discover, tmp_path):
    """An API server over TLS whose certificate the kubeconfig's certificate-authority did not sign
    (a cluster's CA rotated, the wrong kubeconfig): its lists count ``tls``, not ``connect`` (which
    says refused, no route, DNS), and the log line says the certificate failed verification, naming
    the server; with the CA that signed it the same server is listed."""
    import structlog

    from tests.support.kube_emulator import KubeEmulator
    from tests.support.tls import CertificateAuthority

    cluster_ca, other_ca = CertificateAuthority(tmp_path, "cluster CA"), CertificateAuthority(tmp_path, "other CA")
    api = KubeEmulator(bookmark_interval=0.1)
    await api.start(ssl_context=cluster_ca.issue().server_context())
    try:
        reg = CollectorRegistry()
        with structlog.testing.capture_logs() as logs:
            d, _ = await discover(registry=reg, sync=False, kubeconfig=api.kubeconfig(ca=str(other_ca.cert)))
            requests = lambda: samples(reg, "switchyard_kubernetes_requests_total")     # noqa: E731
            assert await until(lambda: any(v for (r, verb), v in requests().items() if verb == "list" and r != "ok"))
            await until(lambda: d.status()["watches"][0]["last_error"] is not None)
        failures = {k: v for k, v in requests().items() if v}
        assert set(failures) == {("tls", "list")}, failures
        assert d.status()["watches"][0]["last_error"]["result"] == "tls"
        failed = [e for e in logs if e["log_level"] == "warning" and "kubernetes" in e["event"]]
        assert failed and "certificate" in failed[0]["event"] and failed[0]["server"] == api.url, failed

        api.create_pod("llm", "a", {M: "llama"})
        _, pool = await discover(kubeconfig=api.kubeconfig(ca=str(cluster_ca.cert)))   # the CA that signed it
        assert names(pool, "llama") == {"llm/a"}

        # https:// to a server that speaks no TLS: a failed handshake, also tls
        reg = CollectorRegistry()
        https = emu.url.replace("http:", "https:")
        with structlog.testing.capture_logs() as logs:
            await discover(registry=reg, sync=False, kubeconfig=emu.kubeconfig(ca=str(cluster_ca.cert)).replace(
                emu.url, https))
            assert await until(lambda: samples(reg, "switchyard_kubernetes_requests_total")[("tls", "list")] >= 1)
        # (the discovery of the untrusted server still runs: its lines are told apart by their server)
        failed = [e for e in logs if e["log_level"] == "warning" and e.get("server") == https]
        assert failed and "TLS handshake" in failed[0]["event"], failed
    finally:
        await api.close()
