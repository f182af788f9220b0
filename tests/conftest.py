"""Shared fixtures: simulated engines and gateways on real loopback sockets.

``sims`` starts ``enginesim`` servers in-process on free ports; ``gateway`` starts the gateway
in front of them; ``emu``, ``redis_server``, ``redis_cluster``, ``redis_sentinel`` and ``helm_render`` bring up the fakes of
tests/support/. Helpers (HTTP, metrics, waiting, factories) live in tests/support/, not here. After every test an autouse check waits briefly for handlers to settle, then
asserts that every lease and in-flight gauge is back to zero.

Hypothesis profiles: ``ci`` (loaded when ``CI=true``) is derandomized, keeps no example database
and has no deadline, so two CI runs of one commit draw the same examples. Elsewhere ``dev`` is
Hypothesis's randomized default with a fresh seed per session, without the deadline too (a
wall-clock bound a busy machine breaks); the seed is printed in the header
and under every failed test, with the ``@reproduce_failure`` blob of the failing example.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.web_app
import pytest
from hypothesis import HealthCheck, is_hypothesis_test, settings

from enginesim import SimConfig, start_sim
from gateway.config.schema import config_from_dict
from gateway.observability.logs import LineWriter
from gateway.pipeline.pipeline import Pipeline
from gateway.server.app import GATEWAY_KEY
from gateway.server.run import start

# re-exported: test files written before tests/support/ import these from here
from tests.support.factories import model_block as model_block
from tests.support.http import close_sdk_clients
from tests.support.http import sim_state as sim_state
from tests.support.http import sse_events as sse_events
from tests.support.waiting import wait_for as wait_for

settings.register_profile("ci", derandomize=True, print_blob=True, database=None, deadline=None,
                          max_examples=200, suppress_health_check=[HealthCheck.too_slow])
# no deadline in either: it is a wall-clock bound, and an example slowed by a busy machine is no defect
settings.register_profile("dev", parent=settings.get_profile("default"), print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "dev")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Runs before Hypothesis's own plugin reads --hypothesis-seed: outside CI, pick the session's
    # seed here so it can be printed, and a failure rerun with exactly the same draws.
    profile = config.getoption("hypothesis_profile", None)
    if profile:
        settings.load_profile(profile)
    if not settings.default.derandomize and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(random.SystemRandom().randrange(1 << 32))


def pytest_collection_finish(session):
    # what the imports and the collection built lives as long as the session: out of the
    # collector's full passes, which would otherwise walk it again every time
    gc.collect()
    gc.freeze()


def _reproduce_hint(config) -> str:
    if settings.default.derandomize:
        return f"profile {settings.get_current_profile_name()!r}, derandomized: rerun with --hypothesis-profile=ci"
    seed = config.getoption("hypothesis_seed", None)
    return f"profile {settings.get_current_profile_name()!r}, seed {seed}: rerun with --hypothesis-seed={seed}"


def pytest_report_header(config):
    return "hypothesis: " + _reproduce_hint(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call" and is_hypothesis_test(getattr(item, "obj", None)):
        report.sections.append(("Hypothesis: reproduce", (
            f"{_reproduce_hint(item.config)} '{item.nodeid}'\n"
            "or add the @reproduce_failure(...) line printed above to the test (same code and Hypothesis version)")))


# fixtures that start servers, processes or binaries on loopback: only integration tests use them
INTEGRATION_FIXTURES = frozenset({"sims", "gateway", "emu", "redis_server", "redis_cluster", "redis_sentinel",
                                  "helm_render"})


def pytest_collection_modifyitems(items) -> None:
    """Everything under tests/integration/ carries the ``integration`` marker; a test under tests/unit/
    that asks for a loopback server (an engine, a gateway, redis-server, ...) is an integration test
    in the wrong place, and the run stops and says so (``make test-unit`` must need nothing installed)."""
    misplaced = []
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
        elif "unit" in item.path.parts and INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("unit tests using integration fixtures (move them under tests/integration/): "
                                + ", ".join(misplaced))


FAST_SIM = {"ttft_base_ms": 2.0, "prefill_ms_per_token": 0.0, "itl_ms": 1.0}

_live_gateways: list[Pipeline] = []
_DEVNULL = os.open(os.devnull, os.O_WRONLY)


@dataclass
class RunningGateway:
    url: str
    port: int
    gw: Pipeline
    runner: Any

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            return await r.text()


@pytest.fixture
async def sims():
    started = []

    async def make(engine: str = "vllm", model: str = "m", **kw):
        opts = {**FAST_SIM, **kw}
        sim = await start_sim(SimConfig(engine=engine, model=model, port=0, host="127.0.0.1", **opts))
        started.append(sim)
        return sim

    yield make
    for s in started:
        with contextlib.suppress(Exception):
            await s.close()


@pytest.fixture
async def gateway():
    runners = []

    async def make(models: list[dict], **blocks) -> RunningGateway:
        raw: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": 0},
                               "health": {"interval_s": 0.2, "timeout_s": 1.0},
                               "scrape": {"interval_s": 0.2},
                               "server": {"shutdown_grace_s": 2.0},
                               "models": models}
        for k, v in blocks.items():
            raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v     # a list block: aliases
        pd = raw.setdefault("pd", {})
        if "abort_retry_delay_s" not in pd:     # a test giving the deprecated spelling keeps its own
            # SGLang P/D's second abort, 2 s after the first by default, is a task the gateway's stop
            # waits for: a test whose decode leg was aborted would end 2 s later for nothing (a
            # test's own pd.sglang block, spread last, keeps its value)
            pd["sglang"] = {"abort_retry_delay_s": 0.2, **pd.get("sglang", {})}
        cfg = config_from_dict(raw, source="<test>")
        runner, app, port = await start(cfg)
        runners.append(runner)
        gw = app[GATEWAY_KEY]
        # request lines are still rendered, but written to /dev/null: the writer thread flushes
        # after pytest has given stderr back, so they would land in the run's output
        gw.request_log.writer = LineWriter(fd=_DEVNULL)
        _live_gateways.append(gw)
        return RunningGateway(url=f"http://127.0.0.1:{port}", port=port, gw=gw, runner=runner)

    yield make
    for r in runners:
        with contextlib.suppress(Exception):
            await r.cleanup()


@pytest.fixture
async def emu():
    """A Kubernetes API server emulator on loopback (tests/support/kube_emulator.py)."""
    from tests.support.kube_emulator import KubeEmulator

    e = KubeEmulator(bookmark_interval=0.1)
    await e.start()
    yield e
    await e.close()


@pytest.fixture
def redis_server():
    """A real redis-server on a free loopback port (tests/support/redis_server.py)."""
    from tests.support.redis_server import RedisServer

    srv: RedisServer | None = None
    for _ in range(3):       # a free port can be taken between choosing and binding it
        srv = RedisServer()
        try:
            srv.start()
            break
        except RuntimeError:
            srv.cleanup()
            srv = None
    if srv is None:
        pytest.fail("could not start redis-server on a free loopback port")
    yield srv
    srv.cleanup()


def _started(s):
    try:
        return s.start()
    except BaseException:
        s.cleanup()
        raise


class _Ahead:
    """The Redis set (a Cluster, a Sentinel set) of a test that asks for one, started while the test
    right before it runs when that one asked for one too: a cluster's primaries take writes only two
    seconds after their start, and Sentinels take about as long to find each other and the replica,
    most of a short test's time. Each test still gets a set of its own that no test used before it."""

    def __init__(self, fixture: str, make: Callable[[], Any]) -> None:
        self.fixture = fixture
        self.make = make
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ahead-{fixture}")
        self.next: concurrent.futures.Future | None = None
        self.next_for: str | None = None    # the test it was started for

    def start(self) -> concurrent.futures.Future:
        return self.pool.submit(_started, self.make())     # its ports picked here, in the tests' thread

    def take(self, request) -> Any:
        ahead, self.next = self.next, None
        if ahead is not None and self.next_for != request.node.nodeid:    # its test did not run
            with contextlib.suppress(Exception):
                ahead.result().cleanup()
            ahead = None
        started = (ahead or self.start()).result()
        # only for the test right after this one: a set left idle through other tests on a busy
        # machine could see a server miss its 1 s timeout and fail over before its test began
        items = request.session.items
        later = items[items.index(request.node) + 1:][:1] if request.node in items else []
        if later and self.fixture in getattr(later[0], "fixturenames", ()):
            self.next, self.next_for = self.start(), later[0].nodeid
        return started

    def close(self) -> None:
        if self.next is not None:
            with contextlib.suppress(Exception):
                self.next.result().cleanup()
            self.next = None
        self.pool.shutdown()


@pytest.fixture(scope="session")
def _clusters_ahead():
    from tests.support.redis_cluster import RedisCluster

    a = _Ahead("redis_cluster", RedisCluster)
    yield a
    a.close()


@pytest.fixture
def redis_cluster(request, _clusters_ahead):
    """A Redis Cluster on loopback: 3 primaries, 1 replica each (tests/support/redis_cluster.py),
    started while the test right before this one ran when that one had a cluster too."""
    c = _clusters_ahead.take(request)
    yield c
    c.cleanup()


@pytest.fixture(scope="session")
def _sentinels_ahead():
    from tests.support.redis_sentinel import RedisSentinel

    a = _Ahead("redis_sentinel", RedisSentinel)
    yield a
    a.close()


@pytest.fixture
def redis_sentinel(request, _sentinels_ahead):
    """A primary, a replica and 3 Sentinels on loopback (tests/support/redis_sentinel.py), started
    while the test right before this one ran when that one had a Sentinel set too."""
    s = _sentinels_ahead.take(request)
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def helm_render():
    """The chart renderer's binary (tests/support/helm.py), built once per machine and Go version."""
    from tests.support.helm import build_helm_render

    return build_helm_render()


def _idle(ep) -> bool:
    return ep.in_flight == 0 and ep.prefill_in_flight == 0 and ep.pending_decode == 0 \
        and ep.token_active == 0 and ep.token_kv == 0


@pytest.fixture(autouse=True)
async def _sdk_clients_closed():
    """The SDK clients a test made with ``openai_client`` / ``anthropic_client`` are closed after it,
    on its own loop (tests/support/http.py)."""
    yield
    await close_sdk_clients()


@pytest.fixture(autouse=True)
async def _leases_balance():
    """Every lease and in-flight gauge returns to zero after each test."""
    _live_gateways.clear()
    yield
    for gw in list(_live_gateways):
        for _ in range(200):
            if gw.lifecycle.in_flight == 0 and all(_idle(ep) for ep in gw.pool.endpoints()):
                break
            await asyncio.sleep(0.01)
        assert gw.lifecycle.in_flight == 0, "gateway requests still in flight after the test"
        for ep in gw.pool.endpoints():
            assert _idle(ep), (f"lease leak on {ep.name}: in_flight={ep.in_flight} prefill={ep.prefill_in_flight} "
                               f"pending_decode={ep.pending_decode} tokens={ep.token_active}/{ep.token_kv}")
        kv = gw.routing.ctx.precise_index
        for st in (kv.index.ranked.values() if kv is not None else ()):
            assert not any(st.rank_in_flight), f"rank lease leak on {st.ep.name}: {st.rank_in_flight}"
        text = gw.metrics.render().decode()
        for line in text.splitlines():
            if line.startswith(("switchyard_in_flight_requests{", "switchyard_endpoint_in_flight_requests{",
                                "switchyard_pd_prefill_in_flight{", "switchyard_pd_pending_decode{",
                                "switchyard_pd_token_load_active_tokens{", "switchyard_pd_token_load_kv_tokens{")):
                assert float(line.rsplit(" ", 1)[1]) == 0.0, f"gauge not back to zero: {line}"
    _live_gateways.clear()


@pytest.fixture(autouse=True)
def _release_finished_apps():
    """aiohttp keeps each handler composed with its application's middlewares in an LRU cache of
    1,024 entries (``aiohttp.web_app._cached_build_middleware``), and an entry holds its handler's
    application: every gateway and simulated engine a test started (an engine with its KV block
    pool, tens of thousands of objects) stayed alive for hundreds of tests after it. The session's
    full garbage collections then grew to seconds (3 s by the end of the suite), stalling the
    event loop that serves the in-process engines: a gateway process's health probes of one timed
    out. Emptied after each test."""
    yield
    cache = getattr(aiohttp.web_app, "_cached_build_middleware", None)
    if cache is not None and hasattr(cache, "cache_clear"):
        cache.cache_clear()
