"""APIs only some engines serve: the endpoints that may answer are those whose engine serves the path.

Engines differ in surface (vLLM answers the Anthropic Messages API and every pass-through path;
SGLang has no Messages API and serves rerank and score only under ``/v1``), and ``handlers/``
says which engine serves what (``EngineAdapter.serves``). In ``prepare``, before routing: a model
none of whose endpoints can answer the path is a clear 404 in the API's own error shape; a model
that mixes engines routes the request among those that can (503 when none of them is ready).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.apis.base import ApiShape
from gateway.endpoints import Endpoint, EndpointPool
from gateway.errors import ErrorClass, GatewayError
from handlers import adapter_for


def serves(ep: Endpoint, path: str) -> bool:
    return adapter_for(ep.engine).serves(path)


class EngineSpecificApi(ApiShape):
    """An API whose paths only some engines serve."""

    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool

    def when_queued(self, ctx: Any) -> Callable[[Endpoint], bool] | None:
        """Endpoints whose engine serves the path, as ``prepare`` keeps."""
        path = ctx.ireq.path
        return lambda ep: serves(ep, path)

    async def prepare(self, ctx: Any, candidates: list[Endpoint]) -> list[Endpoint]:
        ireq = ctx.ireq
        ok = [ep for ep in candidates if serves(ep, ireq.path)]
        if ok:
            return ok
        eps = self.pool.endpoints(ireq.model)
        if not any(serves(ep, ireq.path) for ep in eps):
            engines = ", ".join(sorted({ep.engine for ep in eps}))
            raise GatewayError(404, f"The model `{ireq.model}` is served by {engines}, which does not serve "
                                    f"POST {ireq.path}.", code="unsupported_path",
                               header=("x-error-unsupported-path", ireq.path), error_class=ErrorClass.UNSUPPORTED_PATH)
        raise GatewayError(503, f"no ready endpoint of model {ireq.model} serves POST {ireq.path}",
                           code="service_unavailable", headers={"Retry-After": "5"},
                           header=("x-error-no-model-backends", "true"), error_class=ErrorClass.NO_ENDPOINT)
