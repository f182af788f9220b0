"""How many batch lines a model's endpoints can take now without delaying interactive traffic (pure).

A batch line goes only into a *free running slot*: one the engine would otherwise leave idle, so
an interactive request never waits behind a batch line in the engine's queue. Per ready endpoint:

    free = capacity - reserve_slots - occupancy

- ``capacity``: admission's view of the engine's running slots (gateway/admission/saturation.py),
  read whether admission is on or not: the cap the engine tells (SGLang), or its running count when
  it was seen queueing; else ``batch.endpoint_capacity``.
- ``occupancy``: what the engine runs or queues now: the last scrape's running + waiting, moved by
  what this gateway sent or finished since (admission's estimate), and never less than the
  gateway's own requests on it plus its siblings' and other replicas' (``remote_in_flight``).
  Without engine metrics (``scrape.enabled: false``), the gateway's counts alone.
- ``reserve_slots`` stay free for interactive requests that arrive before the next line ends.

An endpoint gives no room when its engine queues anything (interactive traffic is waiting), its
KV-cache usage is at ``batch.max_kv_usage``, or its metrics are stale (a silent engine is not an
idle one). A model gives no room while admission holds any of its requests in its queue (with
``--workers N``, any worker's: ``RoutingView.sibling_queued``). So the
batch fills idle slots and stops taking new ones the moment interactive traffic needs them; the
lines in flight end on their own (each is one request).

A model routed as prefill/decode pairs (the ``pd`` strategy) runs a line on a prefill and a decode
of one roleset, or on a whole-request (combined) endpoint: a roleset gives the smaller of its
prefill and decode sides' room, so one whose decodes are all unready gives none, however free its
prefill is (``serves``: whether the model can run a line at all). A model routed whole counts every
ready endpoint, as before: prefill or decode pods routed whole are refused by the routing, and
their lines spend their attempts rather than wait for what cannot come.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.admission.saturation import baseline, gateway_load
from gateway.endpoints import Endpoint


def endpoint_room(ep: Endpoint, capacity: int, reserve: int, max_kv: float, max_age: float,
                  engine_signals: bool, now: float) -> int:
    """Free running slots on ``ep`` a batch line may take (0 or more)."""
    if not ep.ready:
        return 0
    ours = gateway_load(ep) + ep.remote_in_flight
    cap = float(capacity)
    occupied = float(ours)
    if engine_signals:
        b = baseline(ep)
        m = b.snapshot
        if m is None or now - m.scraped_at > max_age:
            return 0
        if m.waiting:                       # the engine queues: interactive requests are waiting
            return 0
        if m.kv_usage is not None and m.kv_usage >= max_kv:
            return 0
        if b.capacity is not None:          # told by the engine, or seen when it queued
            cap = b.capacity
        est = b.occupancy(gateway_load(ep))
        if est is not None and est > occupied:
            occupied = est
    return max(0, math.floor(cap - reserve - occupied))


PAIRED_ROLES = ("prefill", "decode")


def model_room(eps: Sequence[Endpoint], capacity: int, reserve: int, max_kv: float, max_age: float,
               engine_signals: bool, now: float, pairs: bool = False) -> int:
    """Lines the ready endpoints ``eps`` of one model take now; ``pairs``: it routes as
    prefill/decode pairs, each line needing room on both sides of one roleset."""
    if not pairs:
        return sum(endpoint_room(ep, capacity, reserve, max_kv, max_age, engine_signals, now) for ep in eps)
    whole = 0
    sides: dict[str, list[int]] = {}       # roleset → [prefill room, decode room]
    for ep in eps:
        room = endpoint_room(ep, capacity, reserve, max_kv, max_age, engine_signals, now)
        if ep.role in PAIRED_ROLES:
            sides.setdefault(ep.roleset or "", [0, 0])[ep.role == "decode"] += room
        else:
            whole += room
    return whole + sum(min(side) for side in sides.values())


def serves(eps: Sequence[Endpoint], pairs: bool) -> bool:
    """Whether the ready endpoints ``eps`` of one model can run a line at all, room or not: any of
    them for a model routed whole; a whole-request endpoint, or a ready prefill and a ready decode
    of one roleset, for a model routed as pairs."""
    if not pairs:
        return bool(eps)
    roles: dict[str, set[str]] = {}
    for ep in eps:
        if not ep.ready:
            continue
        if ep.role not in PAIRED_ROLES:
            return True
        seen = roles.setdefault(ep.roleset or "", set())
        seen.add(ep.role)
        if len(seen) == 2:
            return True
    return False



def free_slots(ep: Endpoint, capacity: int, engine_signals: bool) -> float:
    """Running slots ``ep`` has free now (negative: requests wait in its queue), on the same view."""
    cap, occupied = float(capacity), float(gateway_load(ep) + ep.remote_in_flight)
    if engine_signals:
        b = baseline(ep)
        if b.capacity is not None:
            cap = b.capacity
        est = b.occupancy(gateway_load(ep))
        if est is not None and est > occupied:
            occupied = est
    return cap - occupied
