"""OpenAI-shaped errors.

Every error the gateway returns has the body ``{"error": {"message", "type", "param", "code"}}``
and a status that says what happened. ``type`` follows what OpenAI clients expect for the status.
"""

from __future__ import annotations

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


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error")


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}


def error_response(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> web.Response:
    """The JSON answer of an error: ``body`` is the error in the request's API shape (``GatewayError.body_bytes``,
    an API's ``error_body``, a normalized engine error). Every error answer the gateway builds is this one."""
    return web.Response(status=status, body=body, headers=headers, content_type="application/json")


class GatewayError(Exception):
    """An error answer the client should receive. ``header`` is a marker header (name, value)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: Any = None,
                 type_: str | None = None, header: tuple[str, str] | None = None,
                 headers: dict[str, str] | None = None, error_class: str | None = None) -> None:
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
        self.error_class = error_class or ("client" if status < 500 else "gateway")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())


def normalize_upstream_error(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """Turn an engine's error answer into the nested OpenAI shape, keeping its status.

    vLLM sends ``{"error": {...}}``; SGLang's OpenAI routes send the flat
    ``{"object": "error", "message", "type", "param", "code"}``; auth failures send
    ``{"error": "Unauthorized"}``; anything else (HTML, plain text) is wrapped.
    """
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            msg = err.get("message")
            return status, {"error": {
                "message": msg if isinstance(msg, str) else str(msg or f"upstream error {status}"),
                "type": err.get("type") if isinstance(err.get("type"), str) else error_type(status),
                "param": err.get("param"),
                "code": err.get("code"),
            }}
        if isinstance(err, str):
            return status, error_body(status, err)
        if data.get("object") == "error" or "message" in data:
            msg = data.get("message")
            return status, {"error": {
                "message": msg if isinstance(msg, str) else f"upstream error {status}",
                "type": data.get("type") if isinstance(data.get("type"), str) else error_type(status),
                "param": data.get("param"),
                "code": data.get("code"),
            }}
        if isinstance(data.get("detail"), str):
            return status, error_body(status, data["detail"])
    text = body[:512].decode("utf-8", "replace").strip() if body else ""
    return status, error_body(status, f"upstream returned status {status}" + (f": {text}" if text else ""))
