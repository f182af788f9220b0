"""The ledger: charges on endpoints, released exactly once, exported as gauges."""

from __future__ import annotations

from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.ledger import PendingDecode, PrefillInFlight, charge
from tests.support.factories import pd_endpoint as ep


def test_tracker_charges_release_exactly_once():
    m = GatewayMetrics()
    e, d = ep(1, "prefill"), ep(2, "decode")
    m.attach_live_state(lambda: [e, d], {})
    pair = charge(d, e, 100.0)
    charges = [pair, PrefillInFlight(e), PendingDecode(e)]
    assert (e.prefill_in_flight, e.pending_decode, e.token_active, e.token_kv) == (2, 1, 100.0, 100.0)
    assert (d.in_flight, d.pending_decode) == (1, 1)
    assert 'switchyard_pd_prefill_in_flight{endpoint="127.0.0.1:8000",model="m"} 2.0' in m.render().decode()
    pair.prefill_done()
    assert (e.prefill_in_flight, e.token_active, e.token_kv) == (1, 0.0, 100.0)
    for c in charges + charges:
        c.release()
    assert (e.prefill_in_flight, e.pending_decode, e.token_active, e.token_kv) == (0, 0, 0.0, 0.0)
    assert (d.in_flight, d.pending_decode) == (0, 0)
    text = m.render().decode()
    assert 'switchyard_pd_prefill_in_flight{endpoint="127.0.0.1:8000",model="m"} 0.0' in text
