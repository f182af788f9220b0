"""A cleared endpoint's old entries are unlinked from the index by a task, a stretch at a time. A
stretch that raises (a bug) does not leave the rest of them in memory until some later clear: the
failure is logged with its traceback and counted, and the task goes on with the next stretch,
trying again no more than once a second while the same one keeps failing, so the entries are
dropped in the end and the event loop is never held."""

from __future__ import annotations

import asyncio

import structlog
from prometheus_client import CollectorRegistry

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv import events as kv_events
from gateway.kv.events import KVEventsManager
from gateway.kv.index import CLEAR_STRETCH
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer
from gateway.kv.wire import Batch, BlockStored

BLOCKS = 5 * CLEAR_STRETCH          # the cleared endpoint's entries: several stretches
TOK = ModelTokenizer(TINY_DIR)
IDS = [(7 * i + i // 16) % 40 for i in range(16 * BLOCKS)]
FAILED = "kv events: a stretch of a cleared endpoint's entries could not be unlinked; tried again"


def _manager() -> tuple[KVEventsManager, CollectorRegistry, Endpoint]:
    settings = KVEventsConfig(enabled=True, replay_port=None, stall_timeout_s=1000)
    pool = EndpointPool()
    registry = CollectorRegistry()
    manager = KVEventsManager(lambda model: settings, pool, registry, {"m": TOK})
    ep = pool.add(Endpoint(url="http://127.0.0.1:8000", model="m"))
    st = manager.index.track(ep, settings)
    manager.index.apply(st, Batch(0.0, [BlockStored(list(range(10_000, 10_000 + BLOCKS)), None, IDS, 16)], None))
    return manager, registry, ep


def _faulty(manager: KVEventsManager, fail_on: set[int]) -> list[int]:
    """The index's ``drain`` raising on the calls numbered in ``fail_on`` (from 1), before it does
    anything; returns the list the calls are numbered in as they come."""
    calls: list[int] = []
    real = manager.index.drain

    def drain(entries: int = CLEAR_STRETCH) -> bool:
        calls.append(len(calls) + 1)
        if len(calls) in fail_on:
            raise RuntimeError(f"injected fault in stretch {len(calls)}")
        return real(entries)

    manager.index.drain = drain             # type: ignore[method-assign]
    return calls


async def _drained(manager: KVEventsManager, turns: int = 100_000, pause: float = 0.0) -> bool:
    for _ in range(turns):                  # a hang guard, not a timing
        if not manager.index.retiring:
            return True
        await asyncio.sleep(pause)
    return not manager.index.retiring


def _errors(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("switchyard_kv_events_drain_errors_total")


async def test_a_stretch_that_raises_once_is_logged_counted_and_the_draining_goes_on():
    manager, registry, ep = _manager()
    idx = manager.index
    st = idx.states[ep]
    old_slot = st.slot
    calls = _faulty(manager, {3})
    try:
        with structlog.testing.capture_logs() as logs:
            idx.clear(st)
            assert idx.retiring == 1
            assert await _drained(manager), "the old entries were left after the failed stretch"
        assert len(calls) > 3                       # stretches after the failed one ran
        assert not any(m >> old_slot & 1 for m in idx._holders.values())
        assert not idx._holders and not idx._children and not idx._parent_of
        assert old_slot in idx._free
        failed = [x for x in logs if x["event"] == FAILED]
        assert len(failed) == 1
        assert failed[0]["log_level"] == "error" and failed[0].get("exc_info") is True
        assert _errors(registry) == 1
    finally:
        await manager.close()


async def test_a_stretch_that_keeps_raising_is_tried_again_at_most_once_a_second_and_logged_once(monkeypatch):
    monkeypatch.setattr(kv_events, "DRAIN_RETRY_S", 0.5)
    manager, registry, ep = _manager()
    idx = manager.index
    st = idx.states[ep]
    calls = _faulty(manager, {2, 3, 4, 5})
    try:
        with structlog.testing.capture_logs() as logs:
            idx.clear(st)
            for _ in range(200):                    # loop turns: far less than the pause between tries
                await asyncio.sleep(0)
            # the first failure is tried again at the next turn, then the task waits: no busy loop
            assert len(calls) == 3
            assert idx.retiring == 1
            assert await _drained(manager, 1000, 0.01), "the old entries were never dropped"
        assert len(calls) > 5
        assert not idx._holders and not idx._children and not idx._parent_of
        failed = [x for x in logs if x["event"] == FAILED]
        assert len(failed) == 1 and failed[0].get("exc_info") is True     # one line for the four failures
        assert _errors(registry) == 4
        resumed = [x for x in logs if x["event"] == "kv events: cleared entries unlinked again"]
        assert [x["failures"] for x in resumed] == [4]
    finally:
        await manager.close()
