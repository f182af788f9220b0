"""What latency a request will meet on an endpoint: an online linear model of each endpoint's TTFT
and TPOT, learnt from the gateway's own observations.

The ``slo`` strategy (``routers.slo``) asks it, for each candidate, what TTFT and TPOT the request
would see there; the gateway feeds it (``gateway.pipeline.slo_learning``): when a request is
routed it takes the request's features on the chosen endpoint (``features``), and when the request
has finished, what the client saw (``observe``). One model per gateway lives in
``RouterContext.latency``, built like the prefix index from the routing settings.

The model, per endpoint (an ``Endpoint`` serves one model, so it is also per model):

* TTFT (ms) ≈ queue + w · [1, running, uncached prompt ktokens, KV usage]
* TPOT (ms) ≈ v · [1, running + 1, KV usage, prompt ktokens]

``waiting`` and ``running`` split the requests on the endpoint now — this gateway's in-flight,
plus other gateways' as the engine's last fresh scrape counted them (``running + waiting`` beyond
``EngineMetrics.gateway_in_flight``), as ``prefix-cache``'s fleet load — at the largest batch the
engine ever reported running: what exceeds it waits. Queueing is the knee of an engine's latency
(nothing waits until the batch is full, then every request ahead costs a share of a service
time), and this split makes it a straight line in ``waiting``; counts alone would not. An engine
never scraped has no known batch: everything counts as running. ``queue`` is the wait that queue
means, in ms: when the batch is full, this request waits for ``waiting + 1`` slots to free, one
every service time / batch, the service time being the endpoint's mean time from a request's
first token to its last (exponentially weighted like the fits). The queue is a term of known
form, not a learnt weight: the wait behind a full batch is noisy (it depends on how far the
running requests are), a fit of it from the few queued requests an SLO router lets through comes
out far too low, and an endpoint the router kept out of queueing has never shown what a queue
costs it — a learnt weight would call any queue free and let requests pile up there until the
first of them finished. The uncached
tokens are the prompt's estimate less what the prefix index (or the engine's KV events) says the
endpoint holds.

Why linear, and why recursive least squares with exponential forgetting (``OnlineRegression``):
the engines' own latency is close to linear in these features over the range a router sees
(prefill time grows with uncached tokens, queueing with the requests ahead, decode time with the
batch); the latency predictor of llm-d and the Gateway API Inference Extension reads the same
features and offers a Bayesian ridge regression (a linear model) beside gradient-boosted trees,
trained in a sidecar process. RLS gives the exact least-squares fit of everything seen, updated in O(d²) per
observation (d ≤ 5: a few dozen multiplications) with no dependency and no batch retraining; the
forgetting factor λ (``routing.slo_forgetting``) weighs an observation k requests old by λᵏ, so
the fit follows an engine that gets slower or faster (memory ≈ 1 / (1 − λ) requests). Memory is
bounded: two d×d matrices per endpoint, at most ``MAX_ENDPOINTS`` endpoints (least recently
observed forgotten first). A heavier learner (trees, a sidecar) would capture the queueing knee
better but costs a process, a dependency or milliseconds per decision.

Until an endpoint has ``routing.slo_min_samples`` observations of a quantity, its prediction is
``None``: the router then does without (see ``routers.slo``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.endpoints import Endpoint

# at most this many endpoints' models are kept; the least recently observed go first
MAX_ENDPOINTS = 4096
# the prior: w = 0 with covariance PRIOR · I (a ridge penalty of 1 / PRIOR, negligible after a few samples)
PRIOR = 1e4

TTFT_FEATURES = ("intercept", "running", "uncached_ktokens", "kv_usage")
TPOT_FEATURES = ("intercept", "running", "kv_usage", "prompt_ktokens")


class LatencySettings(Protocol):
    """The knobs the model reads (``routers.base.RoutingSettings`` has them)."""

    @property
    def slo_forgetting(self) -> float: ...
    @property
    def slo_min_samples(self) -> int: ...
    @property
    def metrics_max_age_s(self) -> float: ...


class OnlineRegression:
    """Recursive least squares with exponential forgetting: ``y ≈ w · x``.

    After each ``update`` the weights minimise Σ λ^(n−i) (y_i − w·x_i)² (plus a vanishing ridge
    term). ``p`` is the inverse of the weighted Gram matrix; with forgetting it grows along
    directions the features stop exploring (a constant feature), so its trace is capped: past the
    cap an update no longer divides by λ (no wind-up)."""

    __slots__ = ("w", "p", "lam", "cap", "n")

    def __init__(self, dim: int, forgetting: float = 1.0, prior: float = PRIOR) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        self.w = [0.0] * dim
        self.p = [[prior if i == j else 0.0 for j in range(dim)] for i in range(dim)]
        self.lam = forgetting
        self.cap = prior * dim
        self.n = 0

    def predict(self, x: Sequence[float]) -> float:
        w = self.w
        if len(w) == 4 and len(x) == 4:     # the gateway's models (unrolled, the same sums in the same order)
            return 0.0 + w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3]
        y = 0.0
        for wi, v in zip(w, x, strict=True):
            y += wi * v
        return y

    def update(self, x: Sequence[float], y: float) -> None:
        if len(self.w) == 4 and len(x) == 4:
            self._update4(x, y)
        else:
            self._update(x, y)

    def _update4(self, x: Sequence[float], y: float) -> None:
        """``_update`` for four features, unrolled onto local variables: every stream's end runs two
        of these (TTFT and TPOT), and the loops cost several times the arithmetic. The same
        operations in the same order, so the same floats (tests/unit/routers/test_latency.py holds
        it to that)."""
        p, w = self.p, self.w
        x0, x1, x2, x3 = x
        (a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33) = p
        v0 = 0.0 + a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
        v1 = 0.0 + a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
        v2 = 0.0 + a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
        v3 = 0.0 + a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3
        lam = self.lam
        denom = lam + x0 * v0 + x1 * v1 + x2 * v2 + x3 * v3
        err = y - w[0] * x0 - w[1] * x1 - w[2] * x2 - w[3] * x3
        if denom <= 0.0:            # only by rounding: skip rather than corrupt p
            return
        inv_denom = 1.0 / denom
        k0, k1, k2, k3 = v0 * inv_denom, v1 * inv_denom, v2 * inv_denom, v3 * inv_denom
        w[0] += k0 * err
        w[1] += k1 * err
        w[2] += k2 * err
        w[3] += k3 * err
        a00, a01, a02, a03 = a00 - k0 * v0, a01 - k0 * v1, a02 - k0 * v2, a03 - k0 * v3
        a10, a11, a12, a13 = a10 - k1 * v0, a11 - k1 * v1, a12 - k1 * v2, a13 - k1 * v3
        a20, a21, a22, a23 = a20 - k2 * v0, a21 - k2 * v1, a22 - k2 * v2, a23 - k2 * v3
        a30, a31, a32, a33 = a30 - k3 * v0, a31 - k3 * v1, a32 - k3 * v2, a33 - k3 * v3
        trace = 0.0 + a00 + a11 + a22 + a33
        if lam < 1.0 and trace / lam <= self.cap:
            inv = 1.0 / lam
            p[0] = [a00 * inv, a01 * inv, a02 * inv, a03 * inv]
            p[1] = [a10 * inv, a11 * inv, a12 * inv, a13 * inv]
            p[2] = [a20 * inv, a21 * inv, a22 * inv, a23 * inv]
            p[3] = [a30 * inv, a31 * inv, a32 * inv, a33 * inv]
        else:
            p[0] = [a00, a01, a02, a03]
            p[1] = [a10, a11, a12, a13]
            p[2] = [a20, a21, a22, a23]
            p[3] = [a30, a31, a32, a33]
        self.n += 1

    def _update(self, x: Sequence[float], y: float) -> None:
        # plain loops over short lists: generator expressions cost more than the arithmetic here
        p, w = self.p, self.w
        px = []
        denom = self.lam
        err = y
        for row, xi, wi in zip(p, x, w, strict=True):
            v = 0.0
            for a, b in zip(row, x, strict=True):
                v += a * b
            px.append(v)
            denom += xi * v
            err -= wi * xi
        if denom <= 0.0:            # only by rounding: skip rather than corrupt p
            return
        inv_denom = 1.0 / denom
        trace = 0.0
        for i, row in enumerate(p):
            ki = px[i] * inv_denom
            w[i] += ki * err
            for j, pj in enumerate(px):
                row[j] -= ki * pj
            trace += row[i]
        if self.lam < 1.0 and trace / self.lam <= self.cap:
            inv = 1.0 / self.lam
            for row in p:
                for j in range(len(row)):
                    row[j] *= inv
        self.n += 1


@dataclass(frozen=True, slots=True)
class Features:
    """A request's features on one endpoint, at the time it was routed: its expected wait for a
    slot in ms, and the regressors of the TTFT beyond that wait and of the TPOT."""

    queue_ms: float
    ttft: tuple[float, ...]
    tpot: tuple[float, ...]


class _EndpointModel:
    __slots__ = ("ttft", "tpot", "service_ms", "services")

    def __init__(self, forgetting: float) -> None:
        self.ttft = OnlineRegression(len(TTFT_FEATURES), forgetting)
        self.tpot = OnlineRegression(len(TPOT_FEATURES), forgetting)
        self.service_ms = 0.0           # mean time from first token to last, weighted as the fits
        self.services = 0


class LatencyModel:
    """The TTFT and TPOT models of every endpoint (bounded), and the features they read."""

    def __init__(self, settings: LatencySettings, clock: Callable[[], float]) -> None:
        self.forgetting = settings.slo_forgetting
        self.min_samples = max(1, settings.slo_min_samples)
        self.max_age = settings.metrics_max_age_s
        self.clock = clock
        self._models: OrderedDict[Endpoint, _EndpointModel] = OrderedDict()
        self._batch: dict[Endpoint, float] = {}     # the largest batch (running) each engine reported

    def load(self, ep: Endpoint, now: float, in_flight: int | None = None) -> tuple[float, float, float]:
        """``(waiting, running, kv_usage)`` on ``ep`` now (see the module docstring); ``in_flight``:
        the gateway's own requests on ``ep`` as they were at ``now`` (default: as they are)."""
        own = ep.in_flight if in_flight is None else in_flight
        total = own + ep.remote_in_flight
        kv = 0.0
        m = ep.metrics
        if m is not None and now - m.scraped_at <= self.max_age:
            kv = m.kv_usage or 0.0
            if m.running is not None:
                batch = self._batch
                if m.running > batch.get(ep, 0.0):
                    if len(batch) >= MAX_ENDPOINTS and ep not in batch:
                        batch.clear()
                    batch[ep] = m.running
                if m.gateway_in_flight is not None:       # other gateways' requests, as the engine counted them
                    others = m.running + (m.waiting or 0.0) - m.gateway_in_flight
                    total = own + max(others, ep.remote_in_flight)
        cap = self._batch.get(ep)
        if not cap:
            return 0.0, float(total), kv
        running = min(float(total), cap)
        return total - running, running, kv

    def features(self, prompt_tokens: int, ep: Endpoint, cached_tokens: float, now: float | None = None,
                 in_flight: int | None = None) -> Features:
        """The features of a request of ``prompt_tokens`` (estimated) whose first
        ``cached_tokens`` ``ep`` holds, if it went to ``ep`` now (or at ``now``, when the gateway's
        own requests on it were ``in_flight``)."""
        waiting, running, kv = self.load(ep, self.clock() if now is None else now, in_flight)
        queue = 0.0
        batch = self._batch.get(ep)
        if batch and running >= batch:         # a full batch: this request waits for waiting + 1 slots
            m = self._models.get(ep)
            if m is not None:
                queue = (waiting + 1.0) * m.service_ms / batch
        uncached = max(0.0, prompt_tokens - cached_tokens) / 1000.0
        return Features(queue, (1.0, running, uncached, kv), (1.0, running + 1.0, kv, prompt_tokens / 1000.0))

    def predict(self, ep: Endpoint, f: Features) -> tuple[float | None, float | None]:
        """Predicted ``(TTFT ms, TPOT ms)`` on ``ep``; ``None`` for a quantity with fewer than
        ``slo_min_samples`` observations there."""
        m = self._models.get(ep)
        if m is None:
            return None, None
        n = self.min_samples
        ttft = f.queue_ms + max(0.0, m.ttft.predict(f.ttft)) if m.ttft.n >= n else None
        tpot = max(0.0, m.tpot.predict(f.tpot)) if m.tpot.n >= n else None
        return ttft, tpot

    def observe(self, ep: Endpoint, f: Features, ttft_ms: float | None, tpot_ms: float | None,
                service_ms: float | None = None) -> None:
        """What a request with features ``f`` saw on ``ep`` (``None``: not observed): its TTFT,
        TPOT and the time from its first token to its last (how long it held its slot, bar the
        prefill)."""
        models = self._models
        m = models.get(ep)
        if m is None:
            m = models[ep] = _EndpointModel(self.forgetting)
            if len(models) > MAX_ENDPOINTS:
                models.popitem(last=False)
        else:
            models.move_to_end(ep)
        if ttft_ms is not None:
            m.ttft.update(f.ttft, ttft_ms - f.queue_ms)
        if tpot_ms is not None:
            m.tpot.update(f.tpot, tpot_ms)
        if service_ms is not None:
            m.services += 1
            # the mean of all so far, then exponentially weighted as the fits (memory 1 / (1 - forgetting))
            a = max(1.0 - self.forgetting, 1.0 / m.services)
            m.service_ms += a * (service_ms - m.service_ms)

    def ready(self, ep: Endpoint, ttft: bool, tpot: bool) -> bool:
        """Whether ``ep`` has the observations to predict the quantities asked for."""
        m = self._models.get(ep)
        if m is None:
            return not (ttft or tpot)
        n = self.min_samples
        return (not ttft or m.ttft.n >= n) and (not tpot or m.tpot.n >= n)

    def samples(self, ep: Endpoint) -> tuple[int, int]:
        """Observations of ``(TTFT, TPOT)`` on ``ep`` so far."""
        m = self._models.get(ep)
        return (m.ttft.n, m.tpot.n) if m is not None else (0, 0)

    def weights(self, ep: Endpoint) -> dict[str, dict[str, float]]:
        """The fitted coefficients on ``ep`` by feature name (for the status page and debugging)."""
        m = self._models.get(ep)
        if m is None:
            return {}
        return {"ttft": dict(zip(TTFT_FEATURES, m.ttft.w, strict=True)),
                "tpot": dict(zip(TPOT_FEATURES, m.tpot.w, strict=True))}

    def rebind(self, old: Endpoint, new: Endpoint) -> None:
        """What was learnt of ``old`` is ``new``'s (a reload declared ``old``'s engine again with
        other settings: the same engine); nothing when ``new`` has a model of its own."""
        if old in self._models and new not in self._models:
            self._models[new] = self._models.pop(old)
        if old in self._batch and new not in self._batch:
            self._batch[new] = self._batch.pop(old)

    def forget(self, ep: Endpoint) -> None:
        self._models.pop(ep, None)
        self._batch.pop(ep, None)

    def __len__(self) -> int:
        return len(self._models)
