"""Watching a Responses API event stream while its bytes pass through unchanged.

Engines frame each event as ``event: <type>`` plus ``data: <json>`` (vLLM, SGLang and OpenAI
alike). The scanner reads the type off the ``event:`` line (off the JSON only when a server omits
that line) and decodes the few events it needs:

* the first ``*.delta`` event (``response.output_text.delta``, reasoning, tool-call arguments) or
  the first output item, whichever comes first, is the first token (TTFT); the gaps between
  the reads that carry ``*.delta`` events are the inter-token latencies (as chat's: deltas that
  came in one read add no gap);
* ``response.created`` gives the response id (and a snapshot used if the gateway must fail the
  stream); ``response.completed`` / ``response.incomplete`` / ``response.failed`` give the usage,
  the final status and the output, and end the stream; an ``error`` event is an in-stream error
  (the stream's error, also when a ``response.failed`` follows it);
* ``response.output_item.added`` / ``.done``, ``response.content_part.added`` / ``.done`` (and
  vLLM's ``response.reasoning_part.added`` / ``.done``) and the text, reasoning and argument deltas
  build the output as the client was sent it, which a response the
  gateway fails carries (``output``).

The terminal event is *held back* until the upstream ends, so that the gateway can record what the
response created (its owner, or its history) before a client that saw ``response.completed`` can
send a follow-up to another replica. Every byte still reaches the client, in order, an event once it
is whole: the start of one that never ended (its engine's connection broke) is not passed on, so
the gateway's failure events are not glued to it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from gateway.pipeline.sse import ITL_KEEP, MAX_EVENT_BYTES, as_lf, cr_mode, has_fields, lf_scan

_BOUNDARY = re.compile(rb"\n\r?\n")
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_OUTPUT_ITEM = frozenset({"response.output_item.added", "response.output_item.done"})
_DECODED = TERMINAL | {"response.created", "error"}
# the events that build the output a failed response carries, as the client was sent it
# (vLLM opens and closes a reasoning item's reasoning_text part with events of their own)
_PART = frozenset({"response.content_part.added", "response.content_part.done",
                   "response.reasoning_part.added", "response.reasoning_part.done"})
_FOLDED = frozenset({"response.output_text.delta", "response.reasoning_text.delta",
                     "response.function_call_arguments.delta"})


def _fields(ev: bytes) -> tuple[str | None, bytes | None]:
    """The ``event:`` name and the ``data:`` payload of one event."""
    name = None
    parts = []
    for line in ev.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.startswith(b"data:"):
            v = line[5:]
            parts.append(v[1:] if v.startswith(b" ") else v)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    if not parts:
        return name, None
    return name, parts[0] if len(parts) == 1 else b"\n".join(parts)


class ResponsesScanner:
    """One upstream Responses stream. ``feed``/``finish`` return the bytes to forward."""

    model: str | None = None    # the model the engine's response names (created, terminal): the trace's

    def __init__(self, on_created: Callable[[str], None] | None = None) -> None:
        self.on_created = on_created           # called once with the id ``response.created`` gives
        self.first_token_at: float | None = None
        self.last_delta_at: float | None = None
        self.token_events = 0                  # ``*.delta`` events
        self.itl: list[float] = []
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.error: dict | None = None
        self.done = False                      # a terminal event was seen
        self.events = 0                        # events with data: the next sequence number
        self.moved = False                     # the last read held more than comments (``has_fields``)
        self.response_id: str | None = None
        self.snapshot: dict | None = None      # response.created's response object
        self.final: dict | None = None         # the terminal event's response object
        self._buf = bytearray()                # the incomplete event, forwarded once it is whole
        self._sent = 0                         # bytes at its head already forwarded (an outsized event's)
        self._held = bytearray()               # the terminal event and whatever follows it
        self._skip = False
        self._cr = False                       # lines end with bare CRs: read as LFs (``as_lf``)
        self._lf: bytearray | None = None      # with _cr: _buf as LFs, converted as its reads came
        self._items: dict[int, dict] = {}      # output index -> the item as last sent
        self._open: dict[tuple[int, int], list[str]] = {}  # (output, content) index -> text deltas since
        self._lps: dict[tuple[int, int], list] = {}         # (output, content) index -> the deltas' logprobs since
        self._args: dict[int, list[str]] = {}  # output index -> a call's argument deltas since

    def feed(self, chunk: bytes, now: float) -> bytes:
        if self.done:
            self.moved = has_fields(chunk)
            self._held += chunk
            return b""
        sent = self._sent
        old = len(self._buf)
        self._buf += chunk
        data = self._buf
        self.moved = self._skip or has_fields(data)    # the held bytes begin an event
        if not self._cr:
            self._cr = cr_mode(data, max(0, old - 3))
        scan: bytes | bytearray = data
        if self._cr:
            scan = lf_scan(self._lf, data, old)
        start = 0
        for m in _BOUNDARY.finditer(scan, max(0, old - 2)):
            if self._skip:
                self._skip = False
            elif self._event(bytes(scan[start:m.start()]), now):
                # the terminal event and whatever follows it are held; the events before it go
                # (a boundary found here ends past ``old``, so past what was sent of an outsized event)
                out = bytes(data[sent:start])
                self._held += data[start:]
                self._buf = bytearray()
                self._lf = None
                self._sent = 0
                return out
            start = m.end()
        if start == len(data) and not old:     # the usual read: whole events, nothing before it
            data.clear()
            self._lf = None
            return chunk
        out = bytes(data[sent:start]) if start else b""
        del data[:start]
        if self._cr:                           # the held bytes as LFs, kept with them
            if not data:
                self._lf = None
            elif scan is self._lf:
                del scan[:start]
            else:
                self._lf = bytearray(scan[start:])
        if start:
            sent = 0
        if len(data) > MAX_EVENT_BYTES:        # not scanned, still forwarded
            self._skip = True
        if self._skip:                         # forwarded as it comes, its last bytes kept (a blank line split across reads)
            out += data[sent:]
            del data[:-2]
            if self._lf is not None:
                del self._lf[:-2]
            sent = len(data)
        self._sent = sent
        return out

    def finish(self) -> bytes:
        """What is left to forward: the held terminal event and what followed it, or a last event
        that came without its blank line when it ends the stream or is an error. The start of an
        event that never ended is dropped: the stream ends in the gateway's failure events."""
        tail = b""
        if not self.done and self._buf and not self._skip:
            ev = (as_lf(self._buf) if self._cr else bytes(self._buf)).strip(b"\r\n")
            events = self.events
            if ev and (self._event(ev, 0.0) or self.error is not None):
                tail = bytes(self._buf[self._sent:])
            else:
                self.events = events           # not sent: the failure's sequence numbers go on from the last sent
        self._buf = bytearray()
        self._lf = None
        self._sent = 0
        held, self._held = bytes(self._held), bytearray()
        return tail + held

    def output(self) -> list[dict]:
        """The output items the client was sent, as they stood: a finished one as its
        ``output_item.done`` gave it, one in progress as its ``output_item.added`` gave it with the
        parts and the deltas sent since (text, a call's arguments) folded in, once each."""
        out = []
        for i in sorted(self._items):
            item = self._items[i]
            args = self._args.get(i)
            if args:
                item = {**item, "arguments": (item.get("arguments") or "") + "".join(args)}
            content = item.get("content")
            if isinstance(content, list) and any(k[0] == i for k in self._open):
                content = list(content)
                for ci, part in enumerate(content):
                    deltas = self._open.get((i, ci))
                    if deltas and isinstance(part, dict):
                        content[ci] = {**part, "text": (part.get("text") or "") + "".join(deltas)}
                        lps = self._lps.get((i, ci))
                        if lps:
                            had = part.get("logprobs")
                            content[ci]["logprobs"] = (had if isinstance(had, list) else []) + _with_bytes(lps)
                item = {**item, "content": content}
            out.append(item)
        return out

    def _decoded(self, obj: Any, payload: bytes) -> dict | None:
        if obj is None:
            try:
                obj = orjson.loads(payload)
            except ValueError:
                return None
        return obj if isinstance(obj, dict) else None

    def _item(self, obj: Any, payload: bytes) -> None:
        ev = self._decoded(obj, payload)
        if ev is None:
            return
        i, item = ev.get("output_index"), ev.get("item")
        if i.__class__ is not int or not isinstance(item, dict):
            return
        self._items[i] = item
        self._args.pop(i, None)
        for k in [k for k in self._open if k[0] == i]:
            del self._open[k]
            self._lps.pop(k, None)

    def _part(self, obj: Any, payload: bytes) -> None:
        ev = self._decoded(obj, payload)
        if ev is None:
            return
        i, ci, part = ev.get("output_index"), ev.get("content_index"), ev.get("part")
        item = self._items.get(i) if i.__class__ is int else None
        if item is None or ci.__class__ is not int or ci < 0 or not isinstance(part, dict):
            return
        content = list(item.get("content") or ()) if isinstance(item.get("content"), list) else []
        if ci < len(content):
            content[ci] = part
        elif ci == len(content):
            content.append(part)
        else:
            return
        self._items[i] = {**item, "content": content}
        self._open.pop((i, ci), None)
        self._lps.pop((i, ci), None)

    def _fold(self, name: str, obj: Any, payload: bytes) -> None:
        ev = self._decoded(obj, payload)
        if ev is None:
            return
        i, delta = ev.get("output_index"), ev.get("delta")
        if i.__class__ is not int or i not in self._items or not isinstance(delta, str):
            return
        if name == "response.function_call_arguments.delta":
            self._args.setdefault(i, []).append(delta)
            return
        ci = ev.get("content_index")
        if ci.__class__ is int:
            self._open.setdefault((i, ci), []).append(delta)
            lps = ev.get("logprobs")
            if lps and isinstance(lps, list):       # asked for with include: the client has them
                self._lps.setdefault((i, ci), []).extend(lps)

    @property
    def last_token_at(self) -> float | None:
        return self.last_delta_at

    def drain_itl(self) -> list[float]:
        gaps, self.itl = self.itl, []
        return gaps

    def _event(self, ev: bytes, now: float) -> bool:
        """Scan one complete event; True when it ends the stream."""
        name, payload = _fields(ev)
        if payload is None:
            return False
        self.events += 1
        if payload.strip() == b"[DONE]":
            self.done = True
            return True
        obj: Any = None
        if name is None:
            try:
                obj = orjson.loads(payload)
            except ValueError:
                return False
            name = obj.get("type") if isinstance(obj, dict) else None
            if not isinstance(name, str):
                return False
        if name.endswith(".delta"):
            self.token_events += 1
            if self.first_token_at is None:
                self.first_token_at = now
            # the gaps between reads (each has its own time), as chat's are: deltas in one read add none
            if self.last_delta_at is not None and now != self.last_delta_at and len(self.itl) < ITL_KEEP:
                self.itl.append(now - self.last_delta_at)
            self.last_delta_at = now
            if name in _FOLDED and self._items:
                self._fold(name, obj, payload)
            return False
        if name in _OUTPUT_ITEM:
            if self.first_token_at is None:
                self.first_token_at = now
            self._item(obj, payload)
            return False
        if name in _PART and self._items:
            self._part(obj, payload)
            return False
        if name not in _DECODED:
            return False
        if obj is None:
            try:
                obj = orjson.loads(payload)
            except ValueError:
                return False
        if not isinstance(obj, dict):
            return False
        if name == "error":
            self.error = {k: obj.get(k) for k in ("message", "code", "param", "type")}
            return False
        resp = obj.get("response")
        if not isinstance(resp, dict):
            return False
        if isinstance(resp.get("id"), str):
            self.response_id = resp["id"]
        model = resp.get("model")
        if model.__class__ is str:      # an event decoded already: no cost of its own
            self.model = model
        if name == "response.created":
            self.snapshot = resp
            if self.on_created is not None and self.response_id is not None:
                created, self.on_created = self.on_created, None
                created(self.response_id)
            return False
        self.final = resp
        usage = resp.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        status = resp.get("status")
        details = resp.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        self.finish_reason = reason if isinstance(reason, str) else status if isinstance(status, str) else None
        if name == "response.failed" and self.error is None:
            # after an ``error`` event, that event's error is kept: it is the one that names the
            # status (its ``code``, 501 for what the engine does not implement), where the failed
            # response's error names a kind (``server_error``)
            err = resp.get("error")
            self.error = err if isinstance(err, dict) else {"message": "the response failed"}
        self.done = True
        return True


def _with_bytes(lps: list) -> list:
    """A stream's delta logprobs as a finished ``output_text`` part carries them: a delta's entries
    (vLLM's) have no ``bytes``, a part's do, the token's UTF-8 (as the engines write them), at
    each entry and at each of its ``top_logprobs``."""
    out = []
    for lp in lps:
        if isinstance(lp, dict) and "bytes" not in lp and isinstance(lp.get("token"), str):
            lp = {**lp, "bytes": list(lp["token"].encode())}
            top = lp.get("top_logprobs")
            if isinstance(top, list):
                lp["top_logprobs"] = [{**t, "bytes": list(t["token"].encode())}
                                      if isinstance(t, dict) and "bytes" not in t and isinstance(t.get("token"), str)
                                      else t for t in top]
        out.append(lp)
    return out


def failed_after_error(scanner: ResponsesScanner) -> tuple[bytes, dict] | None:
    """What ends a stream its engine ended with an ``error`` event of its own and no terminal event
    (vLLM on a generation error): ``response.failed``, after that error (whose sequence number it
    follows), carrying the response as created, now failed with the engine's message. Its error's
    ``code`` is the engine's when it is a name, else OpenAI's ``server_error``. None when the engine
    announced no response (no ``response.created``): there is no id to fail."""
    if scanner.snapshot is None or scanner.error is None:
        return None
    code, message = scanner.error.get("code"), scanner.error.get("message")
    if not isinstance(code, str) or not code or code.isdigit():
        code = "server_error"
    snap = {**scanner.snapshot, **as_it_stood(scanner), "status": "failed",
            "error": {"code": code, "message": message if isinstance(message, str) else "the response failed"}}
    failed = {"type": "response.failed", "sequence_number": scanner.events, "response": snap}
    return b"event: response.failed\ndata: " + orjson.dumps(failed) + b"\n\n", snap


def as_it_stood(scanner: ResponsesScanner) -> dict:
    """What a failed response carries of what its stream sent: its output items (``output``), and
    the usage when the engine gave one (no engine sends usage before its terminal event)."""
    got: dict[str, Any] = {}
    output = scanner.output()
    if output:
        got["output"] = output
    if scanner.usage is not None:
        got["usage"] = scanner.usage
    return got


def error_event(sequence_number: int, message: str, code: str | None) -> bytes:
    """OpenAI's ``error`` event of a Responses stream."""
    error = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": sequence_number}
    return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"


def failure_events(scanner: ResponsesScanner | None, model: str, status: int, message: str,
                   code: str | None) -> bytes:
    """The events of ``failure`` alone."""
    return failure(scanner, model, status, message, code)[0]


def failure(scanner: ResponsesScanner | None, model: str, status: int, message: str,
            code: str | None) -> tuple[bytes, dict]:
    """What ends a Responses stream the gateway cannot complete: an ``error`` event, then
    ``response.failed`` carrying the response as created, now failed (sequence numbers go on from
    the engine's). A stream that failed before ``response.created`` names none: its response gets
    an id of the gateway's, as a client's ``Response`` needs one, and a ``response.created`` of it
    goes first, since a Responses stream opens with one (the openai SDK's ``responses.stream()``
    refuses any other first event). That id is ``resp_`` and a fresh UUID's hex digits, as the
    engines make theirs, not the request id, which a client chooses with ``x-request-id``: the
    failed response is kept under its id, and one named after another response would replace it.
    With the events, the failed response, which the gateway keeps as the response's last state."""
    seq = scanner.events if scanner is not None else 0
    rid = scanner.response_id if scanner is not None else None
    created = b""
    if scanner is not None and scanner.snapshot:
        snap = {**scanner.snapshot, **as_it_stood(scanner)}
    else:
        snap = {"id": rid or f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "model": model, "status": "in_progress", "output": []}
        opened = {"type": "response.created", "sequence_number": seq, "response": snap}
        created = b"event: response.created\ndata: " + orjson.dumps(opened) + b"\n\n"
        seq += 1
        snap = dict(snap)
    snap.update(status="failed", error={"code": code or "server_error", "message": message})
    failed = {"type": "response.failed", "sequence_number": seq + 1, "response": snap}
    return (created + error_event(seq, message, code) + b"event: response.failed\ndata: "
            + orjson.dumps(failed) + b"\n\n"), snap
