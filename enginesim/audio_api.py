"""vLLM's speech-to-text endpoints: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``.

A multipart/form-data body: the audio ``file`` and form fields (``model``, ``language``,
``prompt``, ``response_format``, ``temperature``, ``stream``). The "transcript" is a deterministic
string of pseudo-words drawn from a hash of the file's bytes, its length proportional to the
audio's duration, which is estimated from the file size as 16 kHz mono 16-bit PCM (32,000 bytes a
second). Shapes, from vLLM's ``TranscriptionResponse`` / ``TranslationResponse``:

- ``response_format`` ``json`` (default): transcription ``{"text", "usage": {"type": "duration",
  "seconds"}}``, translation ``{"text"}``; ``text``: the text alone, ``text/plain``;
  ``verbose_json``: ``{"duration", "language", "text", "segments": [], "words": null}``.
- ``stream`` read as vLLM's form model reads its ``Optional[bool]`` (pydantic's lax words: ``1``,
  ``on``, ``yes``, ``true``, ... in any case; an empty field is the default, false; another word a
  400): the words of the text as ``transcription.chunk`` / ``translation.chunk`` events, one word's
  ``delta.content`` each, the last with ``finish_reason: "stop"``, then a usage event when
  ``stream_include_usage`` says so, then ``[DONE]``, as vLLM's speech-to-text stream.
- An unknown model is vLLM's 404; a missing file is a 400. ``srt``/``vtt`` are not simulated (a
  400 that says so).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from email import policy
from email.parser import BytesParser
from typing import Any

from aiohttp import web

from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle
from enginesim.protocol import lax_bool
from enginesim.tokenizer import OUTPUT_WORDS
from enginesim.wire import SseWriter, json_response

BYTES_PER_SECOND = 32_000
WORDS_PER_SECOND = 2.5


def parse_form(content_type: str, body: bytes) -> dict[str, Any]:
    """The fields of a multipart/form-data body: text for plain fields, bytes for files."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, "Expected a multipart/form-data body", type_="Bad Request")
    msg = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    out: dict[str, Any] = {}
    charset = str(msg.get_param("charset") or "utf-8")
    for part in msg.iter_parts() if msg.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        payload = part.get_payload(decode=True) or b""
        out[str(name)] = payload if part.get_filename() is not None else _field_text(payload, charset)
    return out


def _field_text(value: bytes, charset: str) -> str:
    """A plain field's value as Starlette's form reader (vLLM's) gives it: as it came, in the
    charset of the request's Content-Type (UTF-8 by default), or in Latin-1 when it does not
    decode in it or the charset is unknown."""
    try:
        return value.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return value.decode("latin-1")


def form_bool(form: dict[str, Any], name: str) -> bool:
    """A form field read as vLLM's form model reads an ``Optional[bool] = False``: missing or empty
    (FastAPI takes an empty form value as not sent) is false; otherwise pydantic's lax words."""
    value = form.get(name)
    if value is None or value == "":
        return False
    try:
        return lax_bool(value)
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  {name}: {e}", type_="Bad Request", param=name) from None


def transcript(audio: bytes, seconds: int) -> str:
    rng = random.Random(int.from_bytes(hashlib.blake2b(audio, digest_size=8).digest(), "little"))
    n = max(1, round(seconds * WORDS_PER_SECOND))
    return "".join(rng.choice(OUTPUT_WORDS) for _ in range(n)).strip()


class AudioApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/audio/transcriptions", self.transcriptions),
                web.post("/v1/audio/translations", self.translations)]

    async def transcriptions(self, request: web.Request) -> web.Response:
        return await self._speech(request, translate=False)

    async def translations(self, request: web.Request) -> web.Response:
        return await self._speech(request, translate=True)

    async def _speech(self, request: web.Request, translate: bool) -> web.StreamResponse:
        try:
            form = parse_form(request.headers.get("Content-Type", ""), await request.read())
            model = form.get("model")
            if model is not None and model not in self.cfg.served_model_names:
                raise ApiError(404, f"The model `{model}` does not exist.", param="model")
            audio = form.get("file")
            if not isinstance(audio, bytes):
                raise ApiError(400, "1 validation error:\n  file: Field required", type_="Bad Request", param="file")
            fmt = form.get("response_format") or "json"
            if fmt not in ("json", "text", "verbose_json"):
                raise ApiError(400, f"enginesim does not simulate response_format {fmt!r}", param="response_format")
            stream = form_bool(form, "stream")
            usage = form_bool(form, "stream_include_usage")
            if usage and not stream:
                raise ApiError(400, "1 validation error:\n  Value error, Stream options can only be defined when "
                               "`stream=True`.", type_="Bad Request")
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        seconds = max(1, math.ceil(len(audio) / BYTES_PER_SECOND))
        text = transcript(audio, seconds)
        if stream:
            return await self._stream(request, text, seconds, str(model or self.cfg.served_model_names[0]),
                                      translate, usage)
        if fmt == "text":
            return web.Response(text=text, content_type="text/plain")
        if fmt == "verbose_json":
            return json_response({"duration": str(seconds), "language": form.get("language") or "en",
                                  "text": text, "segments": [], "words": None})
        if translate:
            return json_response({"text": text})
        return json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})

    async def _stream(self, request: web.Request, text: str, seconds: int, model: str, translate: bool,
                      usage: bool) -> web.StreamResponse:
        kind = "translation" if translate else "transcription"
        rid = f"{'trsl' if translate else 'trsc'}-{random.getrandbits(128):032x}"
        created = int(time.time())
        out = SseWriter(request, charset="utf-8")
        words = [w for w in text.split(" ") if w]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            choice: dict[str, Any] = {"delta": {"content": word if i == 0 else " " + word}}
            if last:
                choice |= {"finish_reason": "stop", "stop_reason": None}
            await out.send({"id": rid, "object": f"{kind}.chunk", "created": created, "model": model,
                            "choices": [choice]})
        if usage:
            await out.send({"id": rid, "object": f"{kind}.chunk", "created": created, "model": model, "choices": [],
                            "usage": {"prompt_tokens": seconds, "completion_tokens": len(words),
                                      "total_tokens": seconds + len(words)}})
        return await out.done()
