"""The pass-through endpoints: rerank, score, tokenize, detokenize, classify, pooling, Cohere
embed (JSON) and audio (multipart).

They are routed by their ``model`` like chat and go through the same pipeline (auth, limits,
strategy, leases, watchdog, one log line, the request metrics), with OpenAI-shaped errors. The
body reaches the engine byte for byte; the gateway only reads what routing and accounting need:

- **JSON bodies.** ``model`` (required: it is what routes the request), and the texts the engine
  will encode, for the prefix key and the token estimate: a rerank's ``query`` and
  ``documents``, a score's ``text_1``/``text_2`` (vLLM), ``queries``/``documents`` or
  ``query``/``items`` (SGLang), a tokenize ``prompt`` or ``messages``, a classify's or a pooling's
  ``input`` (or ``messages``), a Cohere embed's ``texts`` and ``inputs``; a detokenize's token count.
  Usage in the answer (vLLM's rerank, score, classify and pooling report ``prompt_tokens``, its
  Cohere embed ``meta.tokens.input_tokens``; SGLang's classify ``prompt_tokens``, its rerank, a
  list, each item's in its ``meta_info``) is counted like chat's.
- **Audio (multipart/form-data).** The body is read once into one buffer, chunk by chunk against
  ``server.max_body_bytes`` (413 above it), and the form is not parsed into parts: the ``model``
  and ``stream`` fields are found by scanning that buffer for the part boundaries, and the same
  buffer is what the engine receives, with the client's ``Content-Type`` (its boundary) kept. The
  file is therefore copied once, from the connection into the buffer. A form that gives ``model``
  or ``stream`` twice is refused: the gateway would route by one value and the engine read another.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.apis.base import StreamScanner
from gateway.apis.paths import (
    AUDIO_PATHS,
    CLASSIFY_PATHS,
    COHERE_EMBED,
    DETOKENIZE_PATHS,
    JSON_PASSTHROUGH_PATHS,
    POOLING,
    RERANK_PATHS,
    SCORE_PATHS,
    TOKENIZE_PATHS,
)
from gateway.apis.serving import EngineSpecificApi
from gateway.errors import ErrorClass, GatewayError, error_body, parser_message
from gateway.pipeline.sse import SSEScanner
from gateway.request import (
    CHARS_PER_TOKEN,
    InferenceRequest,
    caller_headers,
    claimed_user,
    lax_bool,
    load_object,
    slo_objectives,
)

# keys whose strings the engine encodes, by path
_TEXT_KEYS: dict[str, tuple[str, ...]] = {
    **{p: ("query", "documents", "instruction") for p in RERANK_PATHS},
    **{p: ("text_1", "text_2", "queries", "documents", "query", "items", "data_1", "data_2") for p in SCORE_PATHS},
    **{p: ("prompt", "messages") for p in TOKENIZE_PATHS},
    **{p: ("input",) for p in CLASSIFY_PATHS},
    POOLING: ("input", "messages"),
    COHERE_EMBED: ("texts", "inputs"),
}
_MAX_DEPTH = 4


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, header=("x-error-request-body-processing", "true"),
                        error_class=ErrorClass.VALIDATION)


def _no_model(message: str) -> GatewayError:
    return GatewayError(400, message, param="model", code="model_not_found",
                        header=("x-error-no-model-backends", ""), error_class=ErrorClass.VALIDATION)


def _texts(v: Any, depth: int = 0) -> Iterator[str]:
    """Every string in ``v`` (lists, and the ``text``/``content`` of objects), a few levels deep."""
    if isinstance(v, str):
        yield v
    elif depth < _MAX_DEPTH:
        if isinstance(v, list):
            for x in v:
                yield from _texts(x, depth + 1)
        elif isinstance(v, dict):
            for k in ("text", "content"):
                if k in v:
                    yield from _texts(v[k], depth + 1)


def _token_count(v: Any) -> int | None:
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return len(v)
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        counts = [_token_count(x) for x in v]
        return None if None in counts else sum(counts)      # type: ignore[arg-type]
    return None


def _request(path: str, body: bytes, data: dict[str, Any], model: str, stream: bool, prompt_text: str,
             est: int, headers: Mapping[str, str], request_id: str, content_type: str) -> InferenceRequest:
    user, session_id, session_key = caller_headers(headers)
    if user is None and isinstance(data.get("user"), str):
        user = data["user"]
    user = claimed_user(user)
    slo_ttft, slo_tpot = slo_objectives(headers)
    return InferenceRequest(
        path=path, body=body, data=data, model=model, stream=stream, include_usage=True,
        prompt_text=prompt_text, prompt_tokens_est=max(1, est), request_id=request_id, user=user,
        session_id=session_id, session_key=session_key,
        headers=headers, content_type=content_type,        # type: ignore[arg-type]
        slo_ttft_ms=slo_ttft, slo_tpot_ms=slo_tpot,
    )


class PassthroughApi(EngineSpecificApi):
    """JSON pass-through: rerank, score, tokenize, detokenize, classify, pooling, Cohere embed. Errors are OpenAI's (the default
    ``error_body``); an answer that streams (a transcription with ``stream=true``) is watched like
    chat's."""

    name = "passthrough"
    paths = JSON_PASSTHROUGH_PATHS
    answer_members = ("usage", "meta")      # what ``body_usage`` reads; the answer goes out as it came

    def scanner(self, ctx: Any) -> StreamScanner:
        return SSEScanner()

    def stream_error(self, ctx: Any, status: int, message: str, code: str | None) -> bytes:
        return b"data: " + orjson.dumps(error_body(status, message, code=code)) + b"\n\n"

    def body_usage(self, ctx: Any, data: dict[str, Any]) -> dict | None:
        """The answer's usage; a ``total_tokens`` alone (vLLM's rerank before ``prompt_tokens`` was
        added to it) is what the engine encoded: its prompt tokens. A Cohere embed answer has no
        ``usage``: its ``meta.tokens.input_tokens`` are the prompt tokens."""
        usage = data.get("usage")
        if not isinstance(usage, dict):
            meta = data.get("meta")
            tokens = meta.get("tokens") if isinstance(meta, dict) else None
            n = tokens.get("input_tokens") if isinstance(tokens, dict) else None
            return {"prompt_tokens": n} if isinstance(n, int) and not isinstance(n, bool) else None
        total = usage.get("total_tokens")
        if ("prompt_tokens" not in usage and "completion_tokens" not in usage
                and isinstance(total, int) and not isinstance(total, bool)):
            return {"prompt_tokens": total}
        return usage

    def list_usage(self, ctx: Any, data: list[Any]) -> dict | None:
        """SGLang's rerank answers a list, one item per document, each with the ``meta_info`` of
        the query-document pair it encoded: the items' ``prompt_tokens`` added up are the request's
        prompt tokens. None when an item lacks them (the estimate stands)."""
        total = 0
        for item in data:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            n = meta.get("prompt_tokens") if isinstance(meta, dict) else None
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                return None
            total += n
        return {"prompt_tokens": total} if data else None

    def parse(self, path: str, body: bytes, headers: Mapping[str, str], request_id: str) -> InferenceRequest:
        data = load_object(body)
        model = data.get("model")
        if model is None or model == "":
            raise _no_model(f"'model' is required: it decides where {path} is routed")
        if not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        try:
            return self._parse_named(path, body, headers, request_id, data, model)
        except GatewayError as e:     # the request's log line names the model the body named
            e.model = model
            raise

    def _parse_named(self, path: str, body: bytes, headers: Mapping[str, str], request_id: str,
                     data: dict[str, Any], model: str) -> InferenceRequest:
        texts = [t for key in _TEXT_KEYS.get(path, ()) if key in data for t in _texts(data[key])]
        prompt_text = "\n".join(texts)
        est = len(prompt_text) // CHARS_PER_TOKEN
        if path in DETOKENIZE_PATHS:
            est = _token_count(data.get("tokens")) or 0
        # never a stream: no engine streams these (vLLM's and SGLang's request models for them have
        # no ``stream``, and ignore a field they do not have), so a client's ``"stream": true`` is
        # answered with the JSON body, as embeddings' is
        return _request(path, body, data, model, False, prompt_text, est, headers, request_id,
                        "application/json")


# a parameter of a Content-Type or a part's Content-Disposition (RFC 2045 section 5.1, RFC 2183:
# its value a token or a quoted string): the form readers in front of the engines (Starlette's
# python-multipart, Python's ``email``) take the name in any case, spaces around the "=", and
# either kind of value
_PARAM = re.compile(rb';\s*([^\s=;"]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')
_QUOTED_PAIR = re.compile(rb"\\(.)")
_WANTED = (b"model", b"stream")
_MAX_FIELD = 1024            # a wanted field's value longer than this is not a model name


def _disposition(value: bytes) -> tuple[list[bytes], bool]:
    """The ``name`` parameters of a part's Content-Disposition value, in order, and whether it
    has a ``filename`` (a file part)."""
    names: list[bytes] = []
    is_file = False
    for m in _PARAM.finditer(value):
        key = m.group(1).lower()
        if key == b"name":
            v = m.group(2)
            names.append(_QUOTED_PAIR.sub(rb"\1", v[1:-1]) if v.startswith(b'"') else v.rstrip())
        elif key in (b"filename", b"filename*"):
            is_file = True
    return names, is_file


def _field_spans(body: bytes, boundary: bytes, wanted: tuple[bytes, ...],
                 twice: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Where the values of the ``wanted`` plain fields are in ``body``: name → (start, end), the
    first of each. With ``twice``, the whole form is read, and the wanted names it has more than
    one plain field of are appended to it."""
    out: dict[str, tuple[int, int]] = {}
    seen: set[bytes] = set()
    delim = b"--" + boundary
    i = body.find(delim)
    while i >= 0 and (twice is not None or len(out) < len(wanted)):
        j = i + len(delim)
        if body.startswith(b"--", j):           # the closing delimiter
            break
        head_end = body.find(b"\r\n\r\n", j)
        if head_end < 0:
            break
        nxt = body.find(b"\r\n" + delim, head_end + 4)
        if nxt < 0:
            break
        dispositions = [_disposition(line[20:]) for line in body[j:head_end].split(b"\r\n")
                        if line[:20].lower().startswith(b"content-disposition:")]
        if len(dispositions) == 1:
            names, is_file = dispositions[0]
            mine = [n for n in names if n in wanted] if not is_file else []
        else:
            names, mine = [], [n for ns, _ in dispositions for n in ns if n in wanted]
        if len(names) > 1 or len(dispositions) > 1:
            # a part named twice (two name parameters, or two Content-Disposition lines) is read
            # by one form reader after the first, by another after the last (Starlette's, in front
            # of vLLM, keeps the last header and the last name), a file by one maybe a field by
            # the other: a wanted name in any of them is that field given twice
            seen.update(mine)
        for name in mine:
            if name in seen:
                if twice is not None and name.decode() not in twice:
                    twice.append(name.decode())
            elif nxt - head_end - 4 <= _MAX_FIELD:
                out[name.decode()] = (head_end + 4, nxt)
            seen.add(name)
        i = nxt + 2
    return out


def form_fields(body: bytes, boundary: bytes, wanted: tuple[bytes, ...] = _WANTED,
                twice: list[str] | None = None, charset: str = "utf-8") -> dict[str, str]:
    """The values of the ``wanted`` plain (non-file) fields of a multipart/form-data body.

    Works on ``body`` in place: it looks for the part delimiters and reads only the small part
    headers and the wanted values; a file part's bytes are skipped over by ``bytes.find``, never
    copied. Stops when every wanted field was found, or at the closing delimiter; with ``twice``,
    at the closing delimiter, having appended to it the wanted names given more than once.
    """
    return {name: _field_text(body[a:b], charset)
            for name, (a, b) in _field_spans(body, boundary, wanted, twice).items()}


def _field_text(value: bytes, charset: str) -> str:
    """A field's value as the form reader in front of vLLM (Starlette's) gives it: as it came,
    spaces kept, decoded in the request's charset, or in Latin-1 when it does not decode in it or
    the charset is unknown."""
    try:
        return value.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return value.decode("latin-1")


def _ctype_params(ctype: str) -> tuple[bytes | None, str]:
    """The multipart Content-Type's boundary, or None (none, or not 1 to 70 ASCII characters: RFC
    2046 allows letters, digits and a few marks only), and its charset (UTF-8 when it names none),
    in which the form reader in front of vLLM decodes the fields. Either given twice is a 400: that
    reader takes the last (python-multipart fills a dict in order), another reader the first, and
    the form read with each could name another model."""
    found: dict[bytes, bytes] = {}
    for m in _PARAM.finditer(ctype.encode("utf-8", "surrogateescape")):
        key = m.group(1).lower()
        if key in (b"boundary", b"charset"):
            if key in found:
                raise _bad(f"the multipart Content-Type gives '{key.decode()}' more than once", "Content-Type")
            v = m.group(2)
            found[key] = _QUOTED_PAIR.sub(rb"\1", v[1:-1]) if v.startswith(b'"') else v.rstrip()
    b = found.get(b"boundary")
    charset = found.get(b"charset")
    return (b if b is not None and 0 < len(b) <= 70 and b.isascii() else None,
            charset.decode("latin-1") if charset is not None else "utf-8")


def _boundary(ctype: str) -> bytes | None:
    """The multipart Content-Type's boundary (``_ctype_params``)."""
    return _ctype_params(ctype)[0]


def _form_stream(value: str | None) -> bool:
    """A form's ``stream`` as vLLM reads it (its transcription and translation models take an
    ``Optional[bool] = False`` from the form): missing or empty (FastAPI takes an empty form value as
    not sent) is false, else the words of pydantic's lax bool (``1``, ``on``, ``yes``, ``true``, ...
    in any case); another word is the 400 the engine would answer."""
    if not value:
        return False
    try:
        return lax_bool(value)
    except ValueError as e:
        raise _bad(f"stream: {e}", "stream") from None


class AudioApi(PassthroughApi):
    """Multipart pass-through: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``."""

    name = "audio"
    paths = AUDIO_PATHS

    async def read_body(self, request: web.Request, max_bytes: int) -> bytes:
        """The body in one buffer, the file copied into it once (``request.read()`` copies twice:
        into a growing bytearray, then into bytes)."""
        length = request.content_length
        if max_bytes and length is not None and length > max_bytes:
            raise GatewayError(413, f"request body exceeds {max_bytes} bytes (server.max_body_bytes)",
                               code="body_too_large", error_class=ErrorClass.VALIDATION)
        if not request.body_exists:
            # aiohttp's one shared empty payload answers "end of an HTTP chunk" for ever once read
            return b""
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk, end_of_http_chunk = await request.content.readchunk()    # as received: no copy
                if not chunk:
                    if end_of_http_chunk:
                        continue
                    break
                size += len(chunk)
                if max_bytes and size > max_bytes:
                    raise GatewayError(413, f"request body exceeds {max_bytes} bytes (server.max_body_bytes)",
                                       code="body_too_large", error_class=ErrorClass.VALIDATION)
                chunks.append(chunk)
        except web.RequestPayloadError as e:
            raise GatewayError(400, f"the request body could not be read: {parser_message(str(e))}", code="bad_body",
                               error_class=ErrorClass.VALIDATION) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def parse(self, path: str, body: bytes, headers: Mapping[str, str], request_id: str) -> InferenceRequest:
        ctype = headers.get("content-type") or ""
        if not ctype.lower().startswith("multipart/form-data"):
            raise GatewayError(415, f"{path} takes a multipart/form-data body (the audio file and its fields)",
                               header=("x-error-request-body-processing", "true"), error_class=ErrorClass.VALIDATION)
        boundary, charset = _ctype_params(ctype)
        if boundary is None:
            raise _bad("the multipart Content-Type has no boundary (or one that is not ASCII)")
        twice: list[str] = []
        fields = form_fields(body, boundary, twice=twice, charset=charset)
        if twice:
            # the engine's form reader keeps one value of a repeated field (Starlette's, in front of
            # vLLM, the last), the gateway routes by the first: which one the client meant is not known
            raise _bad(f"the form gives '{twice[0]}' more than once; give it once", twice[0])
        model = fields.get("model")
        if not model:
            raise _no_model(f"'model' is required: it decides where {path} is routed")
        try:
            stream = _form_stream((fields.get("stream") or "").strip())
            return _request(path, body, {"model": model}, model, stream, "", 1, headers, request_id, ctype)
        except GatewayError as e:     # the request's log line names the model the form named
            e.model = model
            raise

    def with_model(self, ireq: InferenceRequest, model: str) -> None:
        """The ``model`` field's value replaced inside the form (the body is copied once more,
        only when an alias rewrites it)."""
        boundary = _boundary(ireq.content_type)
        span = _field_spans(ireq.body, boundary, (b"model",)).get("model") if boundary else None
        if span is not None:
            a, b = span
            view = memoryview(ireq.body)     # slices of a view are not copies: the join is the one copy
            ireq.body = b"".join((view[:a], model.encode(), view[b:]))
        ireq.data["model"] = ireq.model = model

