"""The per-API seam of the request path.

One ``ApiShape`` object serves every request on its paths. The pipeline asks it to parse the body
(validation before routing), to adjust the candidates before routing (``prepare``: state, pinning)
and to finish after the answer is ready (``finish``: remember what the answer created). The relay
asks it for a scanner of the event stream (the same interface as ``gateway.pipeline.sse.SSEScanner``), for
the usage of a non-streaming body, and for the error event that ends a stream it cannot complete.
Errors before headers are shaped by ``error_body``.

The object keeps nothing per request itself: what it must remember between the relay and
``finish`` lives on the request's context (``ctx.api_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.errors import GatewayError, normalize_upstream_error
from gateway.request import InferenceRequest, body_bytes


class StreamScanner(Protocol):
    """What the relay reads off a stream scanner (``gateway.pipeline.sse.SSEScanner`` is one)."""

    first_token_at: float | None
    last_token_at: float | None     # the last event that carried generated content
    token_events: int               # events that carried generated content (a token, a delta)
    usage: dict | None
    finish_reason: str | None
    model: str | None               # the model the engine's events named, where the scanner reads it
    error: dict | None
    done: bool                      # the stream's own end marker was seen
    moved: bool                     # the last ``feed`` held more than comments: the engine's progress

    def feed(self, chunk: bytes, now: float) -> bytes: ...

    def finish(self) -> bytes: ...

    def drain_itl(self) -> list[float]: ...


class ApiShape:
    """Defaults: OpenAI-shaped errors, no state, no P/D. Subclasses override what differs."""

    name = "openai"
    paths: tuple[str, ...] = ()

    def pd_refusal(self, path: str, engines: set[str]) -> str | None:
        """Why a P/D strategy may not serve POST ``path`` on pairs of ``engines`` (their P/D legs do
        not carry the request), ``""`` when there is nothing more to say; None: it may. Asked only
        of a request whose model routes as pairs. Default: no P/D (the engines' legs take no
        ``kv_transfer_params`` or bootstrap fields on the API's paths)."""
        return ""

    def generates(self, path: str) -> bool:
        """Whether a request on ``path`` generates (a P/D pair splits it); one that does not (a
        count of tokens) is run whole on the chosen decode (gateway/pd/decide.py)."""
        return True

    async def read_body(self, request: web.Request, max_bytes: int) -> bytes | None:
        """The body, when the API reads it its own way (multipart audio); ``None``: the pipeline
        reads it (``request.read()`` within ``server.max_body_bytes``)."""
        return None

    def parse(self, path: str, body: bytes, headers: Any, request_id: str) -> InferenceRequest:
        raise NotImplementedError

    def with_model(self, ireq: InferenceRequest, model: str) -> None:
        """Make ``ireq`` a request for ``model`` (an alias's target): the parsed request, its data
        and the body bytes the engine receives. Default: a JSON body, re-encoded once."""
        ireq.data["model"] = model
        ireq.model = model
        ireq.body = body_bytes(ireq.data, ireq.body)

    def error_body(self, e: GatewayError) -> bytes:
        """The body of an error answered before the response headers."""
        return e.body_bytes()

    def own_error(self, e: GatewayError) -> GatewayError:
        """An error the gateway answers itself, before the response headers, with the status this
        API gives it (the status its answer, log line and metrics carry); default as it is."""
        return e

    def upstream_error(self, status: int, raw: bytes, ctx: Any = None) -> tuple[int, bytes, str]:
        """An engine's error answer to the request of ``ctx`` re-shaped for the client: (status, body,
        message for the log). Default: OpenAI's nested shape, whatever envelope the engine used."""
        status, err = normalize_upstream_error(status, raw)
        return status, orjson.dumps(err), str(err["error"].get("message"))

    def scanner(self, ctx: Any) -> StreamScanner:
        raise NotImplementedError

    def stream_error(self, ctx: Any, status: int, message: str, code: str | None) -> bytes:
        """The bytes that end a stream the gateway cannot complete (after headers went out)."""
        raise NotImplementedError

    def stream_errored(self, ctx: Any) -> bytes:
        """The bytes that end a stream its engine ended with an error event of its own and without
        its API's terminal event (the Responses API's ``response.failed``); default none: the
        engine's error event is the stream's end. When there are some, ``failed`` follows."""
        return b""

    async def failed(self, ctx: Any) -> None:
        """After ``stream_error`` (or ``stream_errored``) made a stream's last bytes, before they are
        written: what the failure leaves (the Responses API keeps the failed response)."""

    async def closed_early(self, ctx: Any) -> bool:
        """A stream its engine closed before its terminal event (and without an error event): True
        when that close is the answer's own end, no failure (the Responses API's background
        response cancelled meanwhile); default False, the engine's failure."""
        return False

    # the top-level members of a whole answer that ``body_usage``, ``answer_body`` and ``finish``
    # read, when they read no other: a large answer is then decoded into those alone (the relay's
    # ``members_view``); empty: they read it all, and it is decoded whole
    answer_members: tuple[str, ...] = ()
    # every whole 200 answer on the API's paths is a JSON object: one that is not is the engine's
    # protocol fault, a 502 (as on chat); False: relayed as it came (an API of lists or other bodies)
    object_answers = False

    def body_usage(self, ctx: Any, data: dict[str, Any]) -> dict | None:
        """Usage of a non-streaming answer (decoded JSON object); may note what ``finish`` needs."""
        usage = data.get("usage")
        return usage if isinstance(usage, dict) else None

    def answer_body(self, ctx: Any, data: dict[str, Any], body: bytes) -> bytes:
        """The bytes sent for a non-streaming answer whose decoded object is ``data`` (after
        ``body_usage``); default the engine's ``body`` as it came."""
        return body

    def list_usage(self, ctx: Any, data: list[Any]) -> dict | None:
        """Usage of a non-streaming answer that is a JSON list; default none."""
        return None

    async def prepare(self, ctx: Any, candidates: list) -> list:
        """Before routing, after validation and admission: the candidates this request may use."""
        return candidates

    def when_queued(self, ctx: Any) -> Callable[[Any], bool] | None:
        """For a request ``prepare`` let through that waits in the admission queue: which of its
        model's endpoints ready when its turn comes it may go to (a test of each, as ``prepare``
        chose them), so an engine a reload, a restart or discovery brought takes it too; None: only
        the candidates it was given (its state chose them). Default None."""
        return None

    def unserved_while_queued(self, ctx: Any) -> GatewayError | None:
        """For a request that waited in the admission queue with the candidates its state chose, all
        gone unready or out of the pool meanwhile: the error it gets (what it would be told arriving
        now); None: the model's 503, no ready endpoint."""
        return None

    def ending(self, ctx: Any) -> None:
        """As the request ends, whatever its outcome, before it gives back its place on its endpoint
        (synchronous: no other request runs between): what goes on on the engine after it keeps
        its own (the Responses API's background stream its client left)."""

    async def finish(self, ctx: Any) -> None:
        """After the answer is ready (a non-streaming body is not yet written)."""
