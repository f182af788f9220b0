"""``switchyard_path_requests_total{path,status}``: finished requests by client path.

``switchyard_requests_total`` counts by model, status and strategy; a model that serves chat,
Messages, rerank and tokenize in one fleet needs the split by API as well. The counter is fed by
a pipeline observer (``Pipeline.observers``), so the request path itself is untouched. Only
routed paths reach the pipeline, and a path that holds an id (``GET /v1/responses/{id}``) counts
under its route's template (``RequestRecord.label_path``), so the label's values are a fixed, small
set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from gateway.observability.metrics import Counter

if TYPE_CHECKING:
    from gateway.pipeline.context import RequestRecord


class PathRequests:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter("switchyard_path_requests", "Client requests by path and final HTTP status",
                               ["path", "status"], registry=registry)
        self._children: dict[tuple[str, int], object] = {}

    def on_request(self, rec: RequestRecord, _duration: float) -> None:
        path = rec.label_path
        key = (path, rec.status)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self.counter.labels(path, str(rec.status))
        c.inc()  # type: ignore[attr-defined]
