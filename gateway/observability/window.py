"""A few minutes of one model's traffic in fixed memory: time buckets, each with counts and two
latency histograms.

The status page wants "requests per second and TTFT p50/p99 over the last minutes" without
keeping one entry per request. A ``TimeWindow`` is a ring of ``slots`` buckets of ``bucket_s``
seconds; a bucket is reused (cleared) when the clock comes round to it again, so nothing ever
needs sweeping and memory is bounded by ``slots`` x the histograms' bucket count, whatever the
request rate. Quantiles come from ``LogHistogram``: buckets whose bounds grow by 10 % each, so a
reported quantile is within 5 % of a value that was observed near that rank, from 0.1 ms to
about 20 minutes.

Everything here is plain arithmetic on the caller's clock (monotonic seconds); no I/O, no time
source of its own, so tests drive it with any clock they like.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# bucket i holds [LOW * RATIO**i, LOW * RATIO**(i + 1)); values below LOW go to bucket 0 and
# values beyond the last bound to the last bucket
LOW = 1e-4
RATIO = 1.1
BUCKETS = 180                     # LOW * RATIO**180 ~ 2.8e3 s
_SCALE = 1.0 / math.log(RATIO)     # bucket = log(x / LOW) / log(RATIO) = log(x) * _SCALE + _SHIFT
_SHIFT = -math.log(LOW) * _SCALE
_LAST = BUCKETS - 1
_log = math.log


def bucket_of(seconds: float) -> int:
    if seconds <= LOW:
        return 0
    i = int(_log(seconds) * _SCALE + _SHIFT)
    return i if i < BUCKETS else _LAST


def bucket_value(i: int) -> float:
    """The value a bucket stands for: its geometric middle (within 5 % of anything in it)."""
    return LOW * RATIO ** (i + 0.5)


def quantiles(counts: dict[int, int], qs: Iterable[float]) -> list[float | None]:
    """Nearest-rank quantiles of a sparse histogram (bucket → count); ``None`` when it is empty."""
    qs = list(qs)
    total = sum(counts.values())
    if not total:
        return [None] * len(qs)
    keys = sorted(counts)
    out: list[float | None] = []
    for q in qs:
        rank = max(1, math.ceil(q * total))
        seen = 0
        for k in keys:
            seen += counts[k]
            if seen >= rank:
                out.append(bucket_value(k))
                break
    return out


def merge_into(into: dict[int, int], counts: dict[int, int]) -> None:
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n


class Slot:
    """One bucket of time: what finished in ``[index * bucket_s, (index + 1) * bucket_s)``."""

    __slots__ = ("index", "requests", "errors", "prompt_tokens", "completion_tokens", "ttft", "e2e")

    def __init__(self) -> None:
        self.index = -1
        self.requests = 0
        self.errors = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft: dict[int, int] = {}     # sparse LogHistogram: bucket → count
        self.e2e: dict[int, int] = {}

    def reset(self, index: int) -> None:
        self.index = index
        self.requests = self.errors = self.prompt_tokens = self.completion_tokens = 0
        self.ttft.clear()
        self.e2e.clear()


class Summary:
    """What a span of slots adds up to."""

    __slots__ = ("requests", "errors", "prompt_tokens", "completion_tokens", "ttft", "e2e", "seconds")

    def __init__(self) -> None:
        self.requests = self.errors = self.prompt_tokens = self.completion_tokens = 0
        self.ttft: dict[int, int] = {}
        self.e2e: dict[int, int] = {}
        self.seconds = 0.0                 # the time the span covers (the current bucket partly)

    def add(self, other: Summary) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        merge_into(self.ttft, other.ttft)
        merge_into(self.e2e, other.e2e)
        self.seconds = max(self.seconds, other.seconds)

    def add_slot(self, slot: Slot) -> None:
        self.requests += slot.requests
        self.errors += slot.errors
        self.prompt_tokens += slot.prompt_tokens
        self.completion_tokens += slot.completion_tokens
        merge_into(self.ttft, slot.ttft)
        merge_into(self.e2e, slot.e2e)

    def view(self) -> dict:
        """The JSON of the span: counts, rates, and p50/p99 of TTFT and end-to-end latency in ms."""
        secs = self.seconds
        ttft50, ttft99 = quantiles(self.ttft, (0.5, 0.99))
        e2e50, e2e99 = quantiles(self.e2e, (0.5, 0.99))
        return {
            "requests": self.requests,
            "errors": self.errors,
            "rps": round(self.requests / secs, 3) if secs > 0 else 0.0,
            "tokens_per_s": round((self.prompt_tokens + self.completion_tokens) / secs, 1) if secs > 0 else 0.0,
            "ttft_count": sum(self.ttft.values()),
            "ttft_p50_ms": _ms(ttft50), "ttft_p99_ms": _ms(ttft99),
            "e2e_p50_ms": _ms(e2e50), "e2e_p99_ms": _ms(e2e99),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class TimeWindow:
    """The last ``slots`` x ``bucket_s`` seconds of one model's finished requests."""

    __slots__ = ("bucket_s", "slots", "_ring", "_started", "_done")

    def __init__(self, bucket_s: float, slots: int, started: float) -> None:
        if bucket_s <= 0 or slots < 1:
            raise ValueError("bucket_s must be > 0 and slots >= 1")
        self.bucket_s = bucket_s
        self.slots = slots
        self._ring = [Slot() for _ in range(slots)]
        self._started = started            # rates never divide by time before this
        # (current bucket, spans, their finished buckets added up): see summaries()
        self._done: tuple[int, tuple[float, ...], list[Summary]] | None = None

    def observe(self, now: float, error: bool, ttft: float | None, e2e: float | None,
                prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """Count one finished request; this is on the request path, so it stays a few additions."""
        index = int(now // self.bucket_s)
        slot = self._ring[index % self.slots]
        if slot.index != index:
            slot.reset(index)
        slot.requests += 1
        if error:
            slot.errors += 1
        # bucket_of, inlined: this runs once per request
        if ttft is not None:
            b = int(_log(ttft) * _SCALE + _SHIFT) if ttft > LOW else 0
            if b > _LAST:
                b = _LAST
            h = slot.ttft
            h[b] = h.get(b, 0) + 1
        if e2e is not None:
            b = int(_log(e2e) * _SCALE + _SHIFT) if e2e > LOW else 0
            if b > _LAST:
                b = _LAST
            h = slot.e2e
            h[b] = h.get(b, 0) + 1
        if prompt_tokens:
            slot.prompt_tokens += prompt_tokens
        if completion_tokens:
            slot.completion_tokens += completion_tokens

    def summary(self, now: float, span_s: float) -> Summary:
        """The last ``span_s`` seconds (rounded up to whole buckets, at most the whole ring)."""
        return self.summaries(now, span_s)[0]

    def summaries(self, now: float, *spans_s: float) -> list[Summary]:
        """One ``Summary`` per span. The finished buckets of each span are added up once per bucket
        and kept (they cannot change any more: only the current bucket counts new requests), so a
        page polling every few seconds costs one merge of the current bucket per span."""
        index = int(now // self.bucket_s)
        if self._done is None or self._done[0] != index or self._done[1] != spans_s:
            self._done = (index, spans_s, self._finished(index, spans_s))
        current = self._ring[index % self.slots]
        out = []
        for span, done in zip(spans_s, self._done[2], strict=True):
            s = Summary()
            s.add(done)
            if current.index == index:
                s.add_slot(current)
            n = self._buckets(span)
            # n - 1 whole buckets plus the current one so far, but never before the window existed
            covered = (n - 1) * self.bucket_s + (now - index * self.bucket_s)
            s.seconds = max(0.0, min(covered, now - self._started))
            out.append(s)
        return out

    def _buckets(self, span_s: float) -> int:
        return max(1, min(self.slots, math.ceil(span_s / self.bucket_s - 1e-9)))

    def _finished(self, index: int, spans_s: tuple[float, ...]) -> list[Summary]:
        """Per span, the sum of its buckets before the current one (each slot read once)."""
        order = sorted(range(len(spans_s)), key=lambda i: spans_s[i])
        limits = [self._buckets(spans_s[i]) for i in order]
        parts = [Summary() for _ in order]          # parts[k]: ages in [limits[k-1], limits[k])
        for slot in self._ring:
            age = index - slot.index                # 0: the current bucket, left out here
            if 1 <= age < limits[-1]:
                parts[next(k for k, lim in enumerate(limits) if age < lim)].add_slot(slot)
        out: list[Summary] = [Summary() for _ in spans_s]
        acc = Summary()
        for k, i in enumerate(order):
            acc.add(parts[k])
            out[i].add(acc)
        return out

    def series(self, now: float) -> list[int]:
        """Requests per bucket over the whole ring, oldest first; the last bucket is the current one."""
        index = int(now // self.bucket_s)
        by_index = {s.index: s.requests for s in self._ring}
        return [by_index.get(i, 0) for i in range(index - self.slots + 1, index + 1)]
