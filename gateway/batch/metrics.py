"""The batch runner's Prometheus metrics.

- ``switchyard_batches{status}``: batches in the store by status (the runner's view, refreshed at
  each poll; workers that do not run batches export none);
- ``switchyard_batch_lines_total{model, outcome}``: lines answered (``completed``: a 200; ``failed``:
  anything else, including the unanswered lines of an expired batch; a cancelled batch's count
  nowhere), tries that will be tried again (``retried``) and lines stopped for an interactive
  request (``preempted``);
- ``switchyard_batch_lines_in_flight{model}``: lines running now, for the models served (0 between
  batches) and those a reload removed while their lines ran, until none runs;
- ``switchyard_batch_queue_age_seconds``: age of the oldest unfinished batch (0: none);
- ``switchyard_batch_stored_bytes``: bytes of the files in the store (uploads, output and error
  files), which ``batch.max_stored_bytes`` bounds (the runner's view, refreshed at each poll);
- ``switchyard_batches_finished_total{status}``: batches that reached a final state;
- ``switchyard_batch_runner_failures_total``: times the runner failed on a fault of its own and was
  started again from the job store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.observability.metrics import Counter

STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


class BatchMetrics(Collector):
    def __init__(self, registry, present: Callable[[], Iterable[str]] = tuple) -> None:
        self.lines_total = Counter("switchyard_batch_lines", "Batch lines answered (completed, failed) and "
                                   "tries to be tried again (retried)", ["model", "outcome"], registry=registry)
        self.finished = Counter("switchyard_batches_finished", "Batches that reached a final state",
                                ["status"], registry=registry)
        self.failures = Counter("switchyard_batch_runner_failures", "Times the batch runner failed on a fault "
                                "of its own (logged) and was started again from the job store", registry=registry)
        self.running = False                  # this process runs the batches
        self.counts: dict[str, int] = {}
        self.oldest: float | None = None      # created_at of the oldest unfinished batch (unix seconds)
        self.stored = 0                       # bytes of the files in the store
        self.lines_in_flight: dict[str, int] = {}
        self.present = present                # the models served now: a gone one's series goes at 0
        registry.register(self)

    def set_overview(self, counts: dict[str, int], oldest: float | None, stored: int = 0) -> None:
        self.running = True
        self.counts, self.oldest, self.stored = counts, oldest, stored

    def lines(self, model: str, outcome: str, n: int = 1) -> None:
        self.lines_total.labels(model or "-", outcome).inc(n)

    def in_flight(self, model: str, delta: int) -> None:
        key = model or "-"
        self.lines_in_flight[key] = self.lines_in_flight.get(key, 0) + delta

    def runner_failed(self) -> None:
        self.failures.inc()

    def batch_done(self, status: str) -> None:
        self.finished.labels(status).inc()

    def collect(self):
        by_status = GaugeMetricFamily("switchyard_batches", "Batches in the job store by status (exported by "
                                      "the worker that runs batches)", labels=["status"])
        flying = GaugeMetricFamily("switchyard_batch_lines_in_flight", "Batch lines running now",
                                   labels=["model"])
        age = GaugeMetricFamily("switchyard_batch_queue_age_seconds",
                                "Age of the oldest unfinished batch, in seconds (0: none)")
        stored = GaugeMetricFamily("switchyard_batch_stored_bytes", "Bytes of the files in the job store: "
                                   "uploads, output and error files (exported by the worker that runs batches)")
        if self.running:
            for s in STATUSES:
                by_status.add_metric([s], self.counts.get(s, 0))
            age.add_metric([], max(0.0, time.time() - self.oldest) if self.oldest is not None else 0.0)
            stored.add_metric([], self.stored)
        gone = [m for m, n in self.lines_in_flight.items() if not n]
        if gone:
            present = set(self.present())
            for model in gone:
                if model not in present:      # removed (or '-', no model), none of its lines running
                    del self.lines_in_flight[model]
        for model, n in self.lines_in_flight.items():
            flying.add_metric([model], n)
        yield from (by_status, flying, age, stored)

    def describe(self):
        return []
