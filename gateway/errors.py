"""OpenAI-shaped errors.

Every error the gateway returns has the body ``{"error": {"message", "type", "param", "code"}}``
and a status that says what happened. ``type`` follows what OpenAI clients expect for the status.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ErrorClass(enum.StrEnum):
    """How a request failed, in one short label: the ``error_class`` of its log line and the label
    of the metrics that count failures. A ``StrEnum``: each value is the exact string logs and
    metrics have always carried, and compares equal to it."""

    # the request itself
    VALIDATION = "validation"
    HTTP = "http"                                   # aiohttp's own 404/405/413
    ROUTING = "routing"                             # an unknown strategy, a path P/D cannot serve
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_ALLOWED = "model_not_allowed"         # a model not on the user's list (answered as not found)
    UNSUPPORTED_PATH = "unsupported_path"
    AUTH = "auth"
    ADMIN = "admin"
    RESPONSE_NOT_FOUND = "response_not_found"
    RESPONSE_OWNER_GONE = "response_owner_gone"
    CLIENT = "client"                               # any other 4xx
    CLIENT_CANCEL = "client_cancel"                 # the client went away
    # a batch line its runner stopped to give its slot to an interactive request (it runs again)
    BATCH_PREEMPTED = "batch_preempted"
    BATCH_EXPIRED = "batch_expired"                 # a batch line stopped as its batch's window ended
    # limits
    RATE_LIMIT_MODEL_RPS = "rate_limit_model_rps"
    RATE_LIMIT_RPM = "rate_limit_rpm"
    RATE_LIMIT_TPM = "rate_limit_tpm"
    RATE_LIMIT_CONCURRENCY = "rate_limit_concurrency"
    ADMISSION_QUEUE_FULL = "admission_queue_full"
    ADMISSION_DISPLACED = "admission_displaced"
    ADMISSION_SHED = "admission_shed"
    ADMISSION_QUEUE_TIMEOUT = "admission_queue_timeout"
    ADMISSION_FAIR_SHARE = "admission_fair_share"
    ADMISSION_DEADLINE = "admission_deadline"
    # capacity and state
    NO_ENDPOINT = "no_endpoint"
    NO_ROUTE = "no_route"
    DRAINING = "draining"
    LORA_LOAD = "lora_load"
    STATE_UNAVAILABLE = "state_unavailable"
    RESPONSE_OWNER_UNAVAILABLE = "response_owner_unavailable"
    # a leg before its answer's head (``UpstreamFailure.kind``), or its answer's status
    UPSTREAM_CONNECT = "upstream_connect"
    UPSTREAM_RESET = "upstream_reset"
    UPSTREAM_TIMEOUT = "upstream_timeout"           # also: the whole exchange took too long
    UPSTREAM_PROTOCOL = "upstream_protocol"
    UPSTREAM_STATUS = "upstream_status"
    UPSTREAM_AUTH = "upstream_auth"                 # the engine refused the gateway's key for it (401, 403)
    DECODE_CONNECT = "decode_connect"
    DECODE_RESET = "decode_reset"
    DECODE_TIMEOUT = "decode_timeout"
    DECODE_PROTOCOL = "decode_protocol"
    PD_PREFILL_TIMEOUT = "pd_prefill_timeout"
    PD_PREFILL_TRANSPORT = "pd_prefill_transport"
    PD_PREFILL_HTTP_STATUS = "pd_prefill_http_status"
    PD_PREFILL_BAD_RESPONSE = "pd_prefill_bad_response"
    # an answer under way
    UPSTREAM_BROKEN = "upstream_broken"
    UPSTREAM_TOO_LARGE = "upstream_too_large"       # a whole answer over upstream.max_response_bytes
    UPSTREAM_EOF = "upstream_eof"
    UPSTREAM_STREAM_ERROR = "upstream_stream_error"
    # an in-stream error event with code 501: the engine does not implement what the request asks
    UPSTREAM_STREAM_UNSUPPORTED = "upstream_stream_unsupported"
    WATCHDOG_FIRST_CHUNK = "watchdog_first_chunk"
    WATCHDOG_IDLE = "watchdog_idle"
    WATCHDOG_RESPONSE = "watchdog_response"
    # the gateway
    INTERNAL = "internal"
    # no socket to an engine could be made in this process (its file descriptors or the kernel's
    # socket buffers ran out): no engine was asked
    GATEWAY_RESOURCES = "gateway_resources"
    GATEWAY = "gateway"                             # any other 5xx

    @property
    def is_watchdog(self) -> bool:
        """The decode watchdog fired (first chunk, idle, whole answer)."""
        return self in _WATCHDOG

    @property
    def is_timeout(self) -> bool:
        """Something took too long: a watchdog, or no answer (or no end of it) in time."""
        return self in _WATCHDOG or self is ErrorClass.UPSTREAM_TIMEOUT

    @classmethod
    def watchdog(cls, phase: str) -> ErrorClass:
        """The watchdog phase that fired: ``first_chunk``, ``idle`` or ``response``."""
        return _BY_WATCHDOG_PHASE[phase]

    @classmethod
    def upstream(cls, kind: str) -> ErrorClass:
        """A leg that failed before its answer's head: ``connect``, ``reset``, ``timeout``, ``protocol``."""
        return _BY_UPSTREAM_KIND[kind]

    @classmethod
    def decode(cls, kind: str) -> ErrorClass:
        """A P/D decode leg that failed before its answer's head (the kinds of ``upstream``)."""
        return _BY_DECODE_KIND[kind]

    @classmethod
    def pd_prefill(cls, failure: str) -> ErrorClass:
        """A failed prefill leg: ``timeout``, ``transport``, ``http_status``, ``bad_response``."""
        return _BY_PREFILL_FAILURE[failure]

    @classmethod
    def rate_limit(cls, reason: str) -> ErrorClass:
        """A tenancy limit: ``model_rps``, ``rpm``, ``tpm``, ``concurrency``."""
        return _BY_RATE_LIMIT[reason]

    @classmethod
    def admission(cls, reason: str) -> ErrorClass:
        """Admission control shed it: ``queue_full``, ``displaced``, ``shed``, ``queue_timeout``."""
        return _BY_ADMISSION[reason]


_WATCHDOG = frozenset({ErrorClass.WATCHDOG_FIRST_CHUNK, ErrorClass.WATCHDOG_IDLE, ErrorClass.WATCHDOG_RESPONSE})


E = ErrorClass
_BY_WATCHDOG_PHASE = {"first_chunk": E.WATCHDOG_FIRST_CHUNK, "idle": E.WATCHDOG_IDLE, "response": E.WATCHDOG_RESPONSE}
_BY_UPSTREAM_KIND = {"connect": E.UPSTREAM_CONNECT, "reset": E.UPSTREAM_RESET, "timeout": E.UPSTREAM_TIMEOUT,
                     "protocol": E.UPSTREAM_PROTOCOL}
_BY_DECODE_KIND = {"connect": E.DECODE_CONNECT, "reset": E.DECODE_RESET, "timeout": E.DECODE_TIMEOUT,
                   "protocol": E.DECODE_PROTOCOL}
_BY_PREFILL_FAILURE = {"timeout": E.PD_PREFILL_TIMEOUT, "transport": E.PD_PREFILL_TRANSPORT,
                       "http_status": E.PD_PREFILL_HTTP_STATUS, "bad_response": E.PD_PREFILL_BAD_RESPONSE}
_BY_RATE_LIMIT = {"model_rps": E.RATE_LIMIT_MODEL_RPS, "rpm": E.RATE_LIMIT_RPM, "tpm": E.RATE_LIMIT_TPM,
                  "concurrency": E.RATE_LIMIT_CONCURRENCY}
_BY_ADMISSION = {"queue_full": E.ADMISSION_QUEUE_FULL, "displaced": E.ADMISSION_DISPLACED, "shed": E.ADMISSION_SHED,
                 "queue_timeout": E.ADMISSION_QUEUE_TIMEOUT, "fair_share": E.ADMISSION_FAIR_SHARE,
                 "deadline": E.ADMISSION_DEADLINE}
del E


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a client's bytes that are not UTF-8 reach us as lone
    surrogates (aiohttp decodes headers with ``surrogateescape``), which no JSON encoder writes, so
    an error message quoting them would fail to be written; they become ``\\xNN`` escapes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


# the line an HTTP parser's message quotes (``b'...'`` or ``'...'``), a caret under its byte after it
_QUOTED_LINE = re.compile(r"""\n\s*\n\s*b?(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?:\s*\n\s*\^?)?""", re.S)
_BYTES_LITERAL = re.compile(r"""(?<!\w)b?(?:'(?:[^'\\]|\\.){16,}'|"(?:[^"\\]|\\.){16,}")""", re.S)
# a header field's name at the start of that line, as far as the colon after it
_FIELD = re.compile(r"""\n\s*\n\s*b?['"]([!#$%&*+.^_`|~0-9A-Za-z-]{1,64})[ \t]*:""")


def parser_message(text: str) -> str:
    """An HTTP parser's message about a head or a body it refused, without the bytes it quotes.
    aiohttp's parser quotes the line it stopped on (``Invalid header value char:\\n\\n  b'Authorization:
    Bearer sk-...'\\n  ^``): a header field's value (an API key, a cookie), a request target's query
    (a token) or a chunked body's data, which neither the answer nor the request log line may
    carry. What is left is what went wrong, and, on a header field's line, the field's name."""
    field = _FIELD.search(text)
    what, quoted = _QUOTED_LINE.split(text, maxsplit=1)[0], _QUOTED_LINE.search(text) is not None
    what = " ".join(_BYTES_LITERAL.sub("(...)", what).split()).rstrip(":")
    if field is not None:
        return f"{what} (header field '{field.group(1)}')"
    return what if what or not quoted else "unreadable bytes"


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ if type_ is not None else error_type(status), "param": param, "code": code}}


# reason phrases of the statuses the gateway answers that no standard names (Anthropic's overload)
EXTRA_REASONS = {529: "Overloaded"}


def error_response(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> web.Response:
    """The JSON answer of an error: ``body`` is the error in the request's API shape (``GatewayError.body_bytes``,
    an API's ``error_body``, a normalized engine error). Every error answer the gateway builds is this one."""
    return web.Response(status=status, reason=EXTRA_REASONS.get(status), body=body, headers=headers,
                        content_type="application/json")


class GatewayError(Exception):
    """An error answer the client should receive. ``header`` is a marker header (name, value).
    ``model``: the model the request's body named, when the error came after it was read (its
    log line names it)."""

    model: str | None = None
    # an engine's busy answer the gateway answers with a status of its own (a P/D prefill's 503,
    # 529 or 429, the pair's 502): the status an API that tells busy apart answers it with
    # (Anthropic's 529 of overload, its 429 of a rate limit) and the wait to name (the engine's
    # Retry-After, else the gateway's)
    busy: tuple[int, str] | None = None

    def __init__(self, status: int, message: str, *, param: str | None = None, code: Any = None,
                 type_: str | None = None, header: tuple[str, str] | None = None,
                 headers: dict[str, str] | None = None, error_class: ErrorClass | str | None = None) -> None:
        if not message.isascii():
            message = printable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or error_type(status)
        self.headers: dict[str, str] = dict(headers or {})
        if header:
            self.headers[header[0]] = header[1]
        # a short label for metrics and logs (e.g. "validation", "upstream_timeout")
        self.error_class = ErrorClass(error_class) if error_class else (
            ErrorClass.CLIENT if status < 500 else ErrorClass.GATEWAY)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, type_=self.type, param=self.param, code=self.code)

    def with_status(self, status: int) -> GatewayError:
        """This error answered with ``status`` (an API's own status for it), all else kept: a new
        error, as one may be raised to several requests (a shared LoRA load's waiters)."""
        out = GatewayError(status, self.message, param=self.param, code=self.code, type_=self.type,
                           headers=self.headers, error_class=self.error_class)
        out.model = self.model
        return out

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())


def engine_code(code: Any) -> str | None:
    """An engine's error ``code`` as OpenAI's error object has it, a string or null: vLLM and SGLang
    write the status there, a number (``400``), which becomes its string (``"400"``, what the
    openai SDK's ``e.code`` already read); a name stays; anything else (a bool, a float, an object)
    is no code."""
    if isinstance(code, str):
        return code
    if isinstance(code, int) and not isinstance(code, bool):
        return str(code)
    return None


def engine_param(param: Any) -> str | None:
    """An engine's error ``param`` as OpenAI's error object has it, a string or null: a name stays;
    another type (a validation error's location as a list, an index) becomes its JSON text, which
    still names the field for whoever reads it, where null would drop what the engine said."""
    if param is None or isinstance(param, str):
        return param
    try:
        return orjson.dumps(param).decode()
    except TypeError:           # not JSON (cannot come from a parsed body): no param
        return None


def normalize_upstream_error(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """Turn an engine's error answer into the nested OpenAI shape, keeping its status.

    vLLM sends ``{"error": {...}}``; SGLang's OpenAI routes send the flat
    ``{"object": "error", "message", "type", "param", "code"}``; auth failures send
    ``{"error": "Unauthorized"}``; anything else (HTML, plain text) is wrapped. A numeric
    ``code`` (the status, as both engines write it) becomes its string (``engine_code``), a ``param``
    of another type than a string its JSON text (``engine_param``).
    """
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            msg, type_ = err.get("message"), err.get("type")
            return status, error_body(status, msg if isinstance(msg, str) else str(msg or f"upstream error {status}"),
                                      type_=type_ if isinstance(type_, str) else None, param=engine_param(err.get("param")),
                                      code=engine_code(err.get("code")))
        if isinstance(err, str):
            return status, error_body(status, err)
        if data.get("object") == "error" or "message" in data:
            msg, type_ = data.get("message"), data.get("type")
            return status, error_body(status, msg if isinstance(msg, str) else f"upstream error {status}",
                                      type_=type_ if isinstance(type_, str) else None, param=engine_param(data.get("param")),
                                      code=engine_code(data.get("code")))
        if isinstance(data.get("detail"), str):
            return status, error_body(status, data["detail"])
    text = body[:512].decode("utf-8", "replace").strip() if body else ""
    return status, error_body(status, f"upstream returned status {status}" + (f": {text}" if text else ""))
