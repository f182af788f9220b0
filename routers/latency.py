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
engine reported running since it last restarted: what exceeds it waits. Queueing is the knee of an
engine's latency (nothing waits until the batch is full, then every request ahead costs a share of
a service time), and this split makes it a straight line in ``waiting``; counts alone would not.
An engine never scraped has no known batch: everything counts as running. The batch does not age
with time as the fits do: an engine running few requests says nothing of how many it has room
for, and a batch worn down to what a quiet hour ran would count the next burst's requests as
waiting; only a restart (``engine_restarted``: another process, perhaps with room for fewer)
forgets it. ``queue`` is the wait that queue
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

Why linear, and why an exponentially weighted least-squares fit with a ridge prior
(``OnlineRegression``): the engines' own latency is close to linear in these features over the
range a router sees (prefill time grows with uncached tokens, queueing with the requests ahead,
decode time with the batch); the latency predictor of llm-d and the Gateway API Inference
Extension reads the same features and offers a Bayesian ridge regression (a linear model) beside
gradient-boosted trees, trained in a sidecar process. The fit keeps the weighted means and centred
co-moments of its features (O(d²) per observation, d ≤ 5: a few dozen multiplications, no
dependency, no batch retraining) and solves for the weights after each observation. Memory is
bounded: a few small matrices per endpoint, at most ``MAX_ENDPOINTS`` endpoints (least recently
observed forgotten first); an endpoint that left the pool is forgotten (``forget``) with its
metric series (``gateway.observability.metrics.RetiredSeries``). A heavier learner (trees, a sidecar) would capture the queueing knee
better but costs a process, a dependency or milliseconds per decision.

The weights: the forgetting factor λ (``routing.slo_forgetting``) weighs an observation k requests
old by λᵏ, so the fit follows an engine that gets slower or faster (memory ≈ 1 / (1 − λ)
requests); and an observation t seconds old weighs 2^(−t / ``routing.slo_half_life_s``) besides.
Time matters because an endpoint the router stopped sending requests to (predicted too slow) is
observed only by the exploring ones, a few a minute: counted by observations alone, it would take
a hundred of those to outweigh what it showed before, and a recovered engine would wait tens of
minutes for its traffic. An endpoint no request observed for ``routing.slo_reobserve_s`` is sent
one (``stalest``, ``reobserving``) whatever its prediction.

The prior: the features are centred and each slope is pulled toward 0 by a prior worth ``RIDGE``
observations. Real traffic is often collinear (prompts of one length make the uncached tokens a
second intercept; KV usage moves with the running count), and a plain least-squares fit then has
weights the data does not determine, which drift apart (thousands of ms per ktoken) and predict 0
or seconds for a request that moves such a feature a little. Under the prior a feature that has
not spread is read as not moving: the prediction stays at the weighted mean of what was seen.

Until an endpoint has ``routing.slo_min_samples`` observations of a quantity, its prediction is
``None``: the router then does without (see ``routers.slo``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import sqrt
from typing import Protocol

from gateway.endpoints import Endpoint

# at most this many endpoints' models are kept; the least recently observed go first
MAX_ENDPOINTS = 4096
# the prior's weight on each slope, in observations at a spread of one unit of its feature (a request
# running, a ktoken, the whole KV cache): a feature that spread less than this is read as not moving
RIDGE = 0.1

TTFT_FEATURES = ("intercept", "running", "uncached_ktokens", "kv_usage")
TPOT_FEATURES = ("intercept", "running", "kv_usage", "prompt_ktokens")


class LatencySettings(Protocol):
    """The knobs the model reads (``routers.base.RoutingSettings`` has them)."""

    @property
    def slo_forgetting(self) -> float: ...
    @property
    def slo_min_samples(self) -> int: ...
    @property
    def slo_half_life_s(self) -> float: ...
    @property
    def metrics_max_age_s(self) -> float: ...


class OnlineRegression:
    """Weighted least squares, exponentially forgetting, with a ridge prior toward the mean model:
    ``y ≈ w · x``, the first feature being the intercept (always 1).

    After each ``update`` the weights minimise Σ ωᵢ (yᵢ − w·xᵢ)² + ``ridge`` · Σⱼ₌₁ wⱼ², where ωᵢ
    is λ^(n−i) (times the ``decay`` of every later update): the slopes (every weight but the
    intercept) are solved on centred features, and the intercept is the weighted mean of y less the
    slopes at the weighted means of the features. What the model keeps is those weighted means,
    the centred co-moments of the features and of the features with y (updated as Welford's
    algorithm does, so a feature with a large mean and a small spread loses no precision), and the
    total weight. A slope whose feature has not spread beyond the prior's ``ridge`` (in
    observations at a spread of one unit) stays near 0: prompts all of one length, a KV gauge that
    hardly moves, leave the prediction at the mean of what was seen, rather than at weights that
    cancel on the data and diverge anywhere else (the intercept and such a feature are collinear).
    The prior does not fade with forgetting, so neither does the conditioning."""

    __slots__ = ("w", "lam", "ridge", "n", "mass", "mean_x", "mean_y", "cxx", "cxy")

    def __init__(self, dim: int, forgetting: float = 1.0, ridge: float = RIDGE) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        if ridge <= 0.0:
            raise ValueError("ridge must be positive")
        k = dim - 1
        self.w = [0.0] * dim
        self.lam = forgetting
        self.ridge = ridge
        self.n = 0
        self.mass = 0.0                                  # Σ ω
        self.mean_x = [0.0] * k                          # weighted means of the features but the intercept
        self.mean_y = 0.0
        self.cxx = [[0.0] * k for _ in range(k)]         # Σ ω (x − x̄)(x − x̄)ᵀ
        self.cxy = [0.0] * k                             # Σ ω (x − x̄)(y − ȳ)

    def predict(self, x: Sequence[float]) -> float:
        w = self.w
        if len(w) == 4 and len(x) == 4:     # the gateway's models (unrolled, the same sums in the same order)
            return 0.0 + w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3]
        y = 0.0
        for wi, v in zip(w, x, strict=True):
            y += wi * v
        return y

    def update(self, x: Sequence[float], y: float, decay: float = 1.0) -> None:
        """One observation; ``decay`` (at most 1) weighs every earlier one down by that much beside
        the forgetting factor (``LatencyModel``: by the time since the previous one)."""
        if len(self.w) == 4 and len(x) == 4:
            self._update4(x, y, decay)
        else:
            self._update(x, y, decay)

    def _update4(self, x: Sequence[float], y: float, decay: float = 1.0) -> None:
        """``_update`` for four features, unrolled onto local variables: every stream's end runs two
        of these (TTFT and TPOT), and the loops cost several times the arithmetic. The same
        operations in the same order, so the same floats (tests/unit/routers/test_latency.py holds
        it to that)."""
        d = self.lam * decay
        old = self.mass * d
        mass = old + 1.0
        share, keep = 1.0 / mass, old / mass
        mx, (r0, r1, r2), cy = self.mean_x, self.cxx, self.cxy
        dy = y - self.mean_y
        mean_y = self.mean_y = self.mean_y + dy * share
        _, x1, x2, x3 = x
        d0, d1, d2 = x1 - mx[0], x2 - mx[1], x3 - mx[2]
        m0, m1, m2 = mx[0] + d0 * share, mx[1] + d1 * share, mx[2] + d2 * share
        self.mean_x = [m0, m1, m2]
        k0, k1, k2 = keep * d0, keep * d1, keep * d2
        c00, c01, c02 = r0[0] * d + k0 * d0, r0[1] * d + k0 * d1, r0[2] * d + k0 * d2
        c10, c11, c12 = r1[0] * d + k1 * d0, r1[1] * d + k1 * d1, r1[2] * d + k1 * d2
        c20, c21, c22 = r2[0] * d + k2 * d0, r2[1] * d + k2 * d1, r2[2] * d + k2 * d2
        self.cxx = [[c00, c01, c02], [c10, c11, c12], [c20, c21, c22]]
        y0, y1, y2 = cy[0] * d + k0 * dy, cy[1] * d + k1 * dy, cy[2] * d + k2 * dy
        self.cxy = [y0, y1, y2]
        self.mass = mass
        self.n += 1
        # the solve of _solve, for three slopes
        ridge = self.ridge
        s = c00 + ridge
        l00 = sqrt(s) if s > 0.0 else sqrt(ridge)
        l10 = c10 / l00
        s = c11 + ridge
        s -= l10 * l10
        l11 = sqrt(s) if s > 0.0 else sqrt(ridge)
        l20 = c20 / l00
        s = c21
        s -= l20 * l10
        l21 = s / l11
        s = c22 + ridge
        s -= l20 * l20
        s -= l21 * l21
        l22 = sqrt(s) if s > 0.0 else sqrt(ridge)
        z0 = y0 / l00
        s = y1
        s -= l10 * z0
        z1 = s / l11
        s = y2
        s -= l20 * z0
        s -= l21 * z1
        z2 = s / l22
        b2 = z2 / l22
        s = z1
        s -= l21 * b2
        b1 = s / l11
        s = z0
        s -= l10 * b1
        s -= l20 * b2
        b0 = s / l00
        intercept = mean_y
        intercept -= b0 * m0
        intercept -= b1 * m1
        intercept -= b2 * m2
        self.w = [intercept, b0, b1, b2]

    def _update(self, x: Sequence[float], y: float, decay: float = 1.0) -> None:
        # plain loops over short lists: generator expressions cost more than the arithmetic here
        d = self.lam * decay
        old = self.mass * d
        mass = old + 1.0
        share, keep = 1.0 / mass, old / mass
        mean_x, cxx, cxy = self.mean_x, self.cxx, self.cxy
        dy = y - self.mean_y
        self.mean_y += dy * share
        dx = [x[i + 1] - m for i, m in enumerate(mean_x)]
        for i, di in enumerate(dx):
            mean_x[i] += di * share
            row = cxx[i]
            kdi = keep * di
            for j, dj in enumerate(dx):
                row[j] = row[j] * d + kdi * dj
            cxy[i] = cxy[i] * d + kdi * dy
        self.mass = mass
        self.n += 1
        self._solve()

    def _solve(self) -> None:
        """The slopes: (C + ridge · I) β = c by Cholesky (C + ridge · I is positive definite); the
        intercept: ȳ − β · x̄."""
        cxx, cxy, k, ridge = self.cxx, self.cxy, len(self.cxy), self.ridge
        low: list[list[float]] = []
        for i in range(k):
            row = cxx[i]
            li = [0.0] * k
            for j in range(i + 1):
                lj = low[j] if j < i else li
                s = row[j] + ridge if i == j else row[j]
                for m in range(j):
                    s -= li[m] * lj[m]
                if i == j:
                    li[i] = sqrt(s) if s > 0.0 else sqrt(ridge)
                else:
                    li[j] = s / lj[j]
            low.append(li)
        z = [0.0] * k
        for i in range(k):
            s = cxy[i]
            li = low[i]
            for m in range(i):
                s -= li[m] * z[m]
            z[i] = s / li[i]
        beta = [0.0] * k
        for i in reversed(range(k)):
            s = z[i]
            for m in range(i + 1, k):
                s -= low[m][i] * beta[m]
            beta[i] = s / low[i][i]
        w = self.w
        intercept = self.mean_y
        for i, b in enumerate(beta):
            w[i + 1] = b
            intercept -= b * self.mean_x[i]
        w[0] = intercept


@dataclass(frozen=True, slots=True)
class Features:
    """A request's features on one endpoint, at the time it was routed: its expected wait for a
    slot in ms, and the regressors of the TTFT beyond that wait and of the TPOT."""

    queue_ms: float
    ttft: tuple[float, ...]
    tpot: tuple[float, ...]


class _EndpointModel:
    __slots__ = ("ttft", "tpot", "service_ms", "services", "ttft_at", "tpot_at", "service_at", "reobserved_at",
                 "again")

    def __init__(self, forgetting: float) -> None:
        self.ttft = OnlineRegression(len(TTFT_FEATURES), forgetting)
        self.tpot = OnlineRegression(len(TPOT_FEATURES), forgetting)
        self.service_ms = 0.0           # mean time from first token to last, weighted as the fits
        self.services = 0.0             # the observations behind it, each aged by time as in the fits
        # when each quantity was last observed (the model's clock)
        self.ttft_at = self.tpot_at = self.service_at = 0.0
        self.reobserved_at = float("-inf")      # when a request was last sent to observe it (``reobserving``)
        self.again = False              # one such request observed nothing, and another may go at once


class LatencyModel:
    """The TTFT and TPOT models of every endpoint (bounded), and the features they read."""

    def __init__(self, settings: LatencySettings, clock: Callable[[], float]) -> None:
        self.forgetting = settings.slo_forgetting
        self.min_samples = max(1, settings.slo_min_samples)
        self.half_life = settings.slo_half_life_s
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
        now = self.clock()
        m.again = False
        if ttft_ms is not None:
            m.ttft.update(f.ttft, ttft_ms - f.queue_ms, self._aged(m.ttft_at, now) if m.ttft.n else 1.0)
            m.ttft_at = now
        if tpot_ms is not None:
            m.tpot.update(f.tpot, tpot_ms, self._aged(m.tpot_at, now) if m.tpot.n else 1.0)
            m.tpot_at = now
        if service_ms is not None:
            # the mean of all so far, then exponentially weighted as the fits (memory 1 / (1 - forgetting)
            # observations, and what came before a pause weighs less by the pause's length)
            services = m.services * self._aged(m.service_at, now) if m.services else 0.0
            a = max(1.0 - self.forgetting, 1.0 / (services + 1.0))
            m.services = services + 1.0
            m.service_at = now
            m.service_ms += a * (service_ms - m.service_ms)

    def _aged(self, then: float, now: float) -> float:
        """What an observation made at ``then`` weighs at ``now``: halved every ``slo_half_life_s``."""
        if now <= then:
            return 1.0
        return 0.5 ** ((now - then) / self.half_life)

    def ready(self, ep: Endpoint, ttft: bool, tpot: bool) -> bool:
        """Whether ``ep`` has the observations to predict the quantities asked for."""
        m = self._models.get(ep)
        if m is None:
            return not (ttft or tpot)
        n = self.min_samples
        return (not ttft or m.ttft.n >= n) and (not tpot or m.tpot.n >= n)

    def stalest(self, candidates: Sequence[Endpoint], ttft: bool, tpot: bool, before: float) -> Endpoint | None:
        """The candidate whose quantities asked for were observed longest ago, when that and the
        last request sent to observe it (``reobserving``) were both before ``before``; ``None``
        when every candidate was observed (or sent such a request) since, or has no model."""
        models = self._models
        stalest, oldest = None, before
        for ep in candidates:
            m = models.get(ep)
            if m is None:
                continue
            if ttft:
                seen = min(m.ttft_at, m.tpot_at) if tpot else m.ttft_at
            elif tpot:
                seen = m.tpot_at
            else:
                continue
            at = max(seen, m.reobserved_at)
            if at < oldest:
                stalest, oldest = ep, at
        return stalest

    def reobserving(self, ep: Endpoint, now: float) -> None:
        """A request was sent to ``ep`` at ``now`` to observe it: ``stalest`` passes it over until
        that request's observation is due, one at a time however many requests come meanwhile."""
        m = self._models.get(ep)
        if m is not None:
            m.reobserved_at = now

    def reobserved(self, ep: Endpoint) -> float | None:
        """When the last request to observe ``ep`` was sent (``reobserving``); None: never."""
        m = self._models.get(ep)
        return m.reobserved_at if m is not None and m.reobserved_at > float("-inf") else None

    def unobserved(self, ep: Endpoint, at: float) -> None:
        """The request sent at ``at`` to observe ``ep`` observed nothing (the engine refused it and
        a retry took it elsewhere, it failed or its client left before its first token): ``stalest``
        may pick ``ep`` again at once, for the next request, rather than ``slo_reobserve_s`` later.
        Once: when that one observes nothing either, ``ep`` waits ``slo_reobserve_s`` (an engine
        that keeps refusing is sent two requests each ``slo_reobserve_s``, not the first try of
        every request). Nothing when another was sent since."""
        m = self._models.get(ep)
        if m is None or m.reobserved_at != at:
            return
        if m.again:                 # the second in a row: it waits
            m.again = False
        else:
            m.reobserved_at = float("-inf")
            m.again = True

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

    def take_over(self, previous: LatencyModel) -> None:
        """What ``previous`` learnt of the engines (the models of a routing context a reload with
        other routing settings replaced): the engines are the same, so are their latency. The
        models are shared, not copied, so that what the requests ``previous`` saw routed observe
        when they end still reaches them; from now on they are read and updated with this model's
        settings."""
        if previous is self:
            return
        self._models = previous._models
        self._batch = previous._batch
        for m in self._models.values():
            m.ttft.lam = m.tpot.lam = self.forgetting

    def engine_restarted(self, ep: Endpoint) -> None:
        """``ep``'s engine restarted: the largest batch it ran was its previous process's, which may
        have had room for more (another ``--max-num-seqs``, less KV cache); it is learnt again from
        the new one's reports. The fits stay: they age with time, and the engine is the same."""
        self._batch.pop(ep, None)

    def forget(self, ep: Endpoint) -> None:
        """``ep`` is gone for good (it left the pool some time ago): nothing learnt of it is kept."""
        self._models.pop(ep, None)
        self._batch.pop(ep, None)

    def __len__(self) -> int:
        return len(self._models)
