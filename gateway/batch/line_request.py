"""A batch line as the pipeline's handler reads a request, made in-process: no socket, no HTTP hop.

The inference handler reads little of an aiohttp request: the path, the headers, the body (its
``content`` or ``read()``), its per-request mapping (the tenancy ticket, the trace) and the peer
address. ``LineRequest`` offers exactly that, so a line runs through the same stages a client's
request does (tenancy, aliases, admission, routing and charges, breakers and retries, the relay,
usage and the log line) and its answer comes back as the handler's ``web.Response``. A line
never streams (``stream`` is removed from its body), so nothing writes to a transport.
"""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.request import WholeBody


class LineRequest(dict):
    """What the handler reads of an ``aiohttp.web.Request``; the mapping holds its request keys."""

    method = "POST"
    remote: str | None = None
    transport = None
    protocol = None
    own_priority = True     # its x-priority (sheddable) is the gateway's, honoured with priority_header off

    def __init__(self, path: str, body: bytes, headers: dict[str, str], keys: dict[Any, Any], *,
                 log_fields: dict[str, Any] | None = None, acting_for: str | None = None) -> None:
        super().__init__(keys)
        self.log_fields = log_fields        # added to the line's log line (its batch_id, custom_id)
        self.acting_for = acting_for        # the batch's owner, when API keys are on (gateway/tenants)
        # why its runner stopped it, set before the cancel: (its log line's error_class and error,
        # the trace's abort.by), not a client's cancel (None: its batch was cancelled, by its owner)
        self.stopped_as: tuple[Any, str, str] | None = None
        self.path = path
        self._body = body
        self.content = WholeBody(body)
        self.headers = CIMultiDictProxy(CIMultiDict(headers))

    @property
    def content_length(self) -> int:
        return len(self._body)

    async def read(self) -> bytes:
        return self._body

    def __hash__(self) -> int:          # aiohttp keys requests by identity (weak references, sets)
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other
