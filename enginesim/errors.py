"""Error answers in each engine's own envelope.

The gateway has to parse all of them, so the simulator must produce each one exactly:

- vLLM (current):   ``{"error": {"message", "type", "param", "code"}}``
- SGLang OpenAI:    ``{"object": "error", "message", "type", "param", "code"}`` (the old flat shape)
- SGLang /generate: ``{"error": {"message"}}``
"""

from __future__ import annotations

import enum
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web


class ErrorStyle(enum.Enum):
    VLLM = "vllm"
    SGLANG_OPENAI = "sglang_openai"
    SGLANG_NATIVE = "sglang_native"


# vLLM's exception-class names by status.
_VLLM_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def vllm_type(status: int) -> str:
    if status in _VLLM_TYPES:
        return _VLLM_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class ApiError(Exception):
    """An error answer. ``type_`` defaults to what the engine would use for the status."""

    def __init__(self, status: int, message: str, *, type_: str | None = None,
                 param: str | None = None, code_text: bool = False) -> None:
        super().__init__(message)
        self.status = status
        # the body's ``code`` is the status written as a string ("501"), not the number
        self.code: int | str = str(status) if code_text else status
        self.message = message
        self.type_ = type_
        self.param = param

    def payload(self, style: ErrorStyle) -> dict[str, Any]:
        if style is ErrorStyle.VLLM:
            return {"error": {"message": self.message, "type": self.type_ or vllm_type(self.status),
                              "param": self.param, "code": self.code}}
        if style is ErrorStyle.SGLANG_OPENAI:
            return {"object": "error", "message": self.message,
                    "type": self.type_ or str(self.status), "param": self.param, "code": self.code}
        return {"error": {"message": self.message}}

    def stream_payload(self, style: ErrorStyle) -> dict[str, Any]:
        """The body of an in-stream ``data: {"error": ...}`` event."""
        if style is ErrorStyle.SGLANG_OPENAI:
            return {"error": self.payload(style)}
        if style is ErrorStyle.SGLANG_NATIVE:
            return {"error": {"message": self.message, "type": self.type_ or str(self.status),
                              "code": self.code, "retryable": False}}
        return self.payload(style)

    def response(self, style: ErrorStyle, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.payload(style)),
                            content_type="application/json", headers=headers)


def internal_error(message: str = "Internal server error") -> ApiError:
    return ApiError(500, message, type_="InternalServerError")


def failed_error(code: int | None, message: str | None, code_text: bool = False) -> ApiError:
    """vLLM's answer to a request that failed: a 500, or, with the ``error_code`` fault's ``code``,
    an error of that status (its type by the status: ``NotImplementedError`` for 501); ``code_text``:
    the body's ``code`` is that status as a string."""
    if code is None or (code == 500 and not code_text):
        return internal_error()
    return ApiError(code, message or "Simulated engine failure", code_text=code_text)


class RequestFailed(Exception):
    """Raised by a role hook to end a request with the internal finish reason ``error``.

    Example: a vLLM decode engine whose KV pull failed under ``kv_load_failure_policy=fail``. The
    HTTP layer turns it into a 500 (or an in-stream error once the stream has started).

    With ``abort_status`` the request is instead *aborted with an HTTP status*, SGLang's
    ``prepare_abort(req, message, status_code=...)``: counted as an abort, but answered as an error
    with that status (e.g. a P/D bootstrap or transfer timeout, 500).
    """

    def __init__(self, message: str, *, abort_status: int | None = None) -> None:
        super().__init__(message)
        self.abort_status = abort_status
