"""``GET /v1/models`` and ``GET /v1/models/{id}`` in Anthropic's Models API shape, for the requests
that carry ``anthropic-version`` (Anthropic's SDKs always send it, OpenAI's never do).

The models are the OpenAI listing's (``gateway/server/app.py`` builds it: served, declared, aliases,
adapters), in its order; each becomes a ModelInfo, ``{"type": "model", "id", "display_name",
"created_at"}``, the display name being the id (the gateway knows no other) and ``created_at`` the
OpenAI entry's ``created`` as an RFC 3339 UTC time. A list is one page of them:
``{"data", "first_id", "last_id", "has_more"}``, ``limit`` long (20 unless asked, 1 to 1000), from
the start, right after the model ``after_id`` names or right before the one ``before_id`` names;
``has_more`` says whether models follow in the page's direction (after it, or before it with
``before_id``), as Anthropic's SDK reads it to ask for the next page with the page's ``last_id``
(``first_id`` going backwards). A bad ``limit``, a cursor naming no listed model, both cursors at
once or a parameter given twice is a 400 ``invalid_request_error``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from multidict import MultiMapping

from gateway.errors import ErrorClass, GatewayError

ANTHROPIC_VERSION = "anthropic-version"
MODELS = "/v1/models"
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


def on_models(path: str) -> bool:
    """``/v1/models`` or a path under it, whose answers' shape follows ``anthropic-version``."""
    return path == MODELS or path.startswith(MODELS + "/")


def asks_anthropic(path: str, headers: Mapping[str, str]) -> bool:
    """Whether a request is Anthropic's SDK asking the models paths (its errors are Anthropic's too)."""
    return on_models(path) and ANTHROPIC_VERSION in headers


def model_info(entry: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI listing's entry as Anthropic's ModelInfo."""
    created = datetime.fromtimestamp(entry["created"], UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": entry["id"], "display_name": entry["id"], "created_at": created}


def _bad(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param=param, error_class=ErrorClass.VALIDATION)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "...")


def _one(query: MultiMapping[str], name: str) -> str | None:
    values = query.getall(name, [])
    if len(values) > 1:
        raise _bad(name, "given more than once")
    return values[0] if values else None


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    # ASCII digits only (int() would take "+5", " 5", "1_0" and other scripts' digits), four at most
    if not (text.isascii() and text.isdigit() and len(text) <= 4) or not 1 <= int(text) <= MAX_LIMIT:
        raise _bad("limit", f"Input should be an integer from 1 to {MAX_LIMIT}, got {_shown(text)}")
    return int(text)


def _position(ids: list[str], param: str, cursor: str) -> int:
    try:
        return ids.index(cursor)
    except ValueError:
        raise _bad(param, f"no model {_shown(cursor)} is listed") from None


def models_page(entries: list[dict[str, Any]], query: MultiMapping[str]) -> dict[str, Any]:
    """One page of the OpenAI listing's ``entries`` as ``query`` asks for it (see the module docstring)."""
    limit = _limit(_one(query, "limit"))
    after, before = _one(query, "after_id"), _one(query, "before_id")
    if after is not None and before is not None:
        raise _bad("before_id", "after_id and before_id cannot both be given")
    ids = [e["id"] for e in entries]
    if before is not None:
        end = _position(ids, "before_id", before)
        start = max(0, end - limit)
        more = start > 0
    else:
        start = 0 if after is None else _position(ids, "after_id", after) + 1
        end = min(len(ids), start + limit)
        more = end < len(ids)
    data = [model_info(e) for e in entries[start:end]]
    return {"data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
