"""The ``view:`` config block: how the routing view is shared between workers and replicas
(gateway/view/service.py reads it).

A module of its own so that gateway/config/schema.py can import it without importing the runtime.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from gateway.config.block import Block

_Positive = Annotated[float, Meta(gt=0)]


class ViewConfig(Block):
    """One routing view (prefix index, in-flight counts, sessions) for all workers and replicas."""

    workers: Annotated[bool, Meta(description="With server.workers > 1, the workers share their routing facts over a local bus (one Unix datagram socket per worker): prefix-index insertions, sessions, circuit breakers' ejections and closes, tokenized prompt segments (share_tokens), and, without state.redis_url, in-flight counts.")] = True
    replicas: Annotated[bool, Meta(description="With state.redis_url, every process also shares its prefix-index insertions and sessions with the other replicas through a Redis stream.")] = True
    share_tokens: Annotated[bool, Meta(description="Workers, with KV-events routing: the token ids of the prompt segments one worker tokenizes go to its siblings, so a conversation continued on another worker, or a system prompt met there first, is not tokenized again (they leave with the next batch, or within load_interval_s).")] = True
    share_monitoring: Annotated[bool, Meta(description="Workers: each endpoint's health probes, /metrics scrapes and LoRA discovery reads (/v1/models) are made by one worker (chosen by a hash of the endpoint), which tells its siblings each outcome, snapshot and adapter list over the local bus, so an engine is probed, scraped and asked for its adapters once per interval by the gateway, not once per worker; each worker also tells the others of the LoRA adapters it loads and unloads, as it does so, of those it used, at each idle pass, and of those it has requests in flight for on each endpoint, as the first starts or the last ends there (none is unloaded there while it has: see heartbeat_s and peer_ttl_s), and of each load it starts (a sibling that needs the adapter meanwhile waits for its end instead of loading it too) and how it ended: a failure with its cooldown's end (none asks that endpoint for that adapter until then: lora.failure_cooldown_s). A worker that has heard nothing of an endpoint from its watcher for two intervals plus the timeout (a worker restarting) does so itself until it hears again.")] = True
    load_interval_s: Annotated[_Positive, Meta(description="Workers: a worker's in-flight counts go to its siblings with each routing decision, and within this many seconds of a request's end (a worker where nothing starts or ends wakes only every heartbeat_s).")] = 0.02
    flush_delay_s: Annotated[float, Meta(ge=0, le=1, description="Workers: after a message to the siblings, the next one that a routing decision (or a watched engine's probe, scrape or adapter list) calls for waits until this many seconds have passed, and carries everything that came meanwhile (a burst of requests then costs a message every flush_delay_s, not one per loop turn; a lone request's facts still leave at once). Prefix-index insertions and sessions are not held: they leave at the end of the loop turn, with whatever was held. 0: every loop turn that has something sends it.")] = 0.01
    heartbeat_s: Annotated[_Positive, Meta(description="Workers: while a worker has requests in flight, it re-sends its in-flight counts (and the LoRA adapters it has requests in flight for) at least this often, changed or not, in seconds (once nothing is in flight, it says so once and sends nothing more until a request starts).")] = 0.25
    peer_ttl_s: Annotated[_Positive, Meta(description="Workers: a sibling silent this long no longer counts in the in-flight view, nor holds back the unloading of the LoRA adapters it had requests in flight for (it stopped or restarted), in seconds (at least twice heartbeat_s).")] = 1.0
    max_datagram_bytes: Annotated[int, Meta(ge=1024, le=200_000, description="Workers: largest message on the local bus; a batch beyond it is sent in several.")] = 60_000
    stream_maxlen: Annotated[int, Meta(ge=100, description="Replicas: entries kept in the Redis stream (approximately; each entry is one batch of facts from one process), so Redis memory stays bounded; a replica that starts or reconnects catches up on them.")] = 10_000
    flush_interval_s: Annotated[_Positive, Meta(description="Replicas: a process's facts are written to the stream in one batch at most this often, in seconds.")] = 0.005
    read_block_s: Annotated[_Positive, Meta(description="Replicas: longest wait of one stream read before it is issued again, in seconds.")] = 1.0
    outbox_max: Annotated[int, Meta(ge=100, description="Replicas: most facts waiting for Redis (while it is slow or unreachable); older ones are dropped and counted.")] = 20_000
    retry_s: Annotated[_Positive, Meta(description="Replicas: after Redis was lost, how often reconnecting is tried, in seconds.")] = 0.5

    def __post_init__(self) -> None:
        if self.peer_ttl_s < 2 * self.heartbeat_s:
            raise ValueError("peer_ttl_s: must be at least twice view.heartbeat_s")
        if self.flush_delay_s > self.load_interval_s:
            raise ValueError("flush_delay_s: must be at most view.load_interval_s")
