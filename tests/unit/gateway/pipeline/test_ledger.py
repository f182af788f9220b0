"""The ledger: charges on endpoints, released exactly once, exported as gauges."""

from __future__ import annotations

from gateway.observability.metrics import GatewayMetrics
from gateway.pipeline.ledger import (
    NO_CHARGES,
    AdapterInFlight,
    PendingDecode,
    PrefillInFlight,
    RankInFlight,
    charge,
)
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


def test_an_aggregated_charge_and_its_later_adapter_and_rank_charges_release_once_each():
    """The usual one-charge release takes a shortcut; charges added after the decision (a LoRA
    adapter's, a data-parallel rank's) are still released, and a second release changes nothing."""
    e = ep(1, "decode")
    counts = [0, 0]
    c = charge(e)
    c.adapter = AdapterInFlight(e, "a1")
    c.rank = RankInFlight(e, counts, 1)
    assert (e.in_flight, e.adapters.in_flight, counts) == (1, {"a1": 1}, [0, 1])
    c.release()
    c.release()
    assert (e.in_flight, e.adapters.in_flight, counts) == (0, {}, [0, 0])
    lone = charge(e)
    lone.release()
    lone.release()
    assert e.in_flight == 0


def test_a_request_has_no_charges_until_it_is_routed_and_they_are_never_shared():
    from gateway.pipeline.context import RequestContext

    ctx = RequestContext(http=None, rec=None)      # type: ignore[arg-type]
    assert ctx.charges is NO_CHARGES
    ctx.charges.release()                           # an error before routing releases nothing
    assert all(getattr(NO_CHARGES, f) is None for f in NO_CHARGES.__slots__)
