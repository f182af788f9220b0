"""The relay's SSE scanner: watch an engine's event stream while its bytes pass through untouched.

The relay forwards every upstream chunk to the client as soon as it arrives. It hands each chunk
to ``SSEScanner.feed`` too, which finds the event boundaries (events may be split anywhere across
chunks) and notes what the gateway must know: when the first generated token went out, the gaps
between token-carrying chunks, the usage object, the finish reason, an in-stream error, ``[DONE]``.

Why it is shaped like this:

* Bytes only, no re-encoding. A chunk of whole events is returned itself (same object, zero
  copies). The bytes of an incomplete event (a read may end anywhere in one) are held until its
  blank line comes: a client's SSE parser can do nothing with half an event, and a stream the
  gateway must end early (the drain's cut, an engine that breaks off) then ends with an error event
  on its own lines, where one glued onto the half event the client had was an undecodable line.
* Most events are never JSON-decoded. Whether an event carries generated content is decided by
  one regex search over its bytes for the handful of keys that hold it (``"content"``, ``"text"``, ``"tool_calls"``,
  ``"reasoning_content"``, ``"reasoning"``) followed by a non-empty value. A JSON string can hold
  a quote only escaped, so ``"key"`` followed by ``:`` in the raw bytes is always a real key, never
  text inside a value. Only events that mention ``"usage"`` or ``"error"``, or have a non-null
  ``finish_reason``, are decoded with orjson, and a decoding failure is skipped, never raised.
* ``strip_usage``: the gateway injected ``stream_options.include_usage`` for its own accounting,
  and the client, who did not ask for it, must not see the usage-only chunk (``choices: []`` plus
  ``usage``). Every other byte reaches the client unchanged; the usage chunk, an incomplete
  event until its blank line comes (held as any is), is dropped then. Stray blank lines between events
  are never held either: they are kept even before a usage chunk that is dropped. ``finish()``
  returns what is still held when the upstream ends.

Framing accepted: events end at a blank line (``\\n\\n``, ``\\r\\n\\r\\n`` and mixtures of LF and
CRLF line ends), the first one after a UTF-8 byte order mark or not (``BOM``). ``data:`` with or without a space; several ``data:`` lines are joined with
``\\n``; comment frames (``: keep-alive``), ``event:``, ``id:`` and ``retry:`` lines are ignored.
A trailing event without its blank line is still scanned by ``finish()``. Bare-CR line ends (legal
in SSE, never sent by vLLM or SGLang): once a CR not followed by LF is seen (``cr_mode``), the
scanner reads a copy of the bytes in which each bare CR is an LF (``as_lf``, the same length, so
every offset is the original's) and passes on the original bytes; the copy of an incomplete event is
kept with it and only each read's bytes are converted (an event of MBs in many reads is converted
once); the usual chunk's path (one event ending in ``\n\n``) never meets one and is unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import engine_param

# An event larger than this is not scanned (its bytes still pass through). It bounds the memory a
# malformed upstream that never sends a blank line can pin. SGLang's native cumulative stream makes
# large events on long generations, hence the generous size. Of such an event only its head (the
# first _BIG_HEAD bytes: its choice's index and whether it carries generated content) and its end
# (the last _BIG_TAIL bytes, kept: its finish) are read: a vLLM completion's echo with logprobs
# sends a long prompt's logprobs, tens of MB, in its first event, with its first token (and, with
# max_tokens 0, its finish).
MAX_EVENT_BYTES = 8 << 20
_BIG_HEAD = 4096
_BIG_TAIL = 4096

# How many inter-token gaps ``itl`` keeps between drains; count, sum and max are always kept.
ITL_KEEP = 4096

# a UTF-8 byte order mark, which may open an event stream: an SSE client skips it, and the scanner
# reads the event after it as the stream's first (the bytes pass on as they came)
BOM = b"\xef\xbb\xbf"

_BOUNDARY = re.compile(rb"\n\r?\n")
# a ``data: [DONE]`` event, whole, on its own line (as ``_event`` reads one: blanks around it)
_DONE_EVENT = re.compile(rb"(?:\A|\n)(?:\xef\xbb\xbf)?data:[ \t]*\[DONE\][ \t]*\r?\n\r?\n")
# a CR that no LF follows: a line ended by a bare CR, or, at the end of a read, a CR whose LF may
# come with the next one (either way a line ends there)
_CR_ALONE = re.compile(rb"\r(?!\n)")


def cr_mode(data: bytes | bytearray, pos: int = 0) -> bool:
    """Whether ``data`` from ``pos`` holds a CR that no LF follows: from then on the stream is read
    with its bare CRs as LFs (a CRLF stream whose read ended between CR and LF is read so too,
    which changes nothing of what is found in it)."""
    return data.find(b"\r", pos) >= 0 and _CR_ALONE.search(data, pos) is not None


def as_lf(data: bytes | bytearray) -> bytes:
    """``data`` with each bare CR made an LF (CRLF kept): the same length, so offsets carry over.
    A CR that ends ``data`` counts as bare (in a stream of CR line ends it is; the LF of a CRLF
    split there comes with the next read, which is scanned with it again)."""
    return _CR_ALONE.sub(b"\n", data)


def lf_scan(lf: bytearray | None, data: bytes | bytearray, old: int) -> bytes | bytearray:
    """What a scanner of a bare-CR stream reads of ``data`` (its held bytes, the first ``old`` of
    them held before this read, then the read's): ``lf``, the held bytes as LFs converted as their
    reads came, extended in place from the last held byte on (a CR whose LF came with this read is
    the only one that can read otherwise now), rather than all of ``data`` converted again at
    every read, which made an event of MBs in many reads quadratic work. Without such a copy of
    the held bytes, ``data`` is converted whole."""
    if old and lf is not None and len(lf) == old:
        del lf[old - 1:]
        lf += as_lf(data[old - 1:])
        return lf
    return as_lf(data)


# The per-event tests, one regex search each (``_event`` runs once per relayed event): generated
# content is a content key (``"content"``, ``"text"``, ``"reasoning_content"``, ``"reasoning"``)
# followed by a non-empty string, or ``"tool_calls"`` by a non-empty list; a finish is a
# ``"finish_reason"`` whose value is not null. JSON whitespace may sit around the colon.
_CONTENT_RE = re.compile(rb'"(?:content|text|reasoning_content|reasoning)"[ \t\r\n]*:[ \t\r\n]*"[^"]'
                         rb'|"tool_calls"[ \t\r\n]*:[ \t\r\n]*\[[ \t\r\n]*[^\] \t\r\n]')
_FINISH_RE = re.compile(rb'"finish_reason"[ \t\r\n]*:[ \t\r\n]*[^n \t\r\n]')
# a finish reason's value, read from the end of an event too large to decode
_FINISH_VALUE_RE = re.compile(rb'"finish_reason"[ \t\r\n]*:[ \t\r\n]*"([^"\\]+)"')



def _has_content(p: bytes | bytearray) -> bool:
    """Whether an event's data carries generated content (see ``_CONTENT_RE``)."""
    i = p.find(b'"content":"')     # engines write compact JSON: the usual token event, found cheaply
    if i >= 0 and p[i + 11:i + 12] not in (b'"', b""):
        return True
    return _CONTENT_RE.search(p) is not None


# feed flags returned by _event
_CONTENT = 1
_USAGE_ONLY = 2


def _after_blank_lines(data: bytes | bytearray, i: int, stop: int) -> int:
    """Index of the first byte at or after ``i`` (before ``stop``) that is not CR or LF."""
    while i < stop and (data[i] == 0x0A or data[i] == 0x0D):
        i += 1
    return i


def has_fields(data: bytes | bytearray, start: int = 0, end: int | None = None) -> bool:
    """Whether ``data[start:end]`` (an event, the start of one, or several) holds a line other
    than blank lines and comment lines (``: keep-alive``): bytes of the engine's progress, where
    comments are only what an engine (or a proxy in front of it) sends to keep a silent connection
    open. The usual event answers at its first byte."""
    if end is None:
        end = len(data)
    i = start
    while i < end:
        c = data[i]
        if c == 0x0A or c == 0x0D:
            i += 1
        elif c == 0x3A:             # a comment line: its end
            n = data.find(b"\n", i, end)
            r = data.find(b"\r", i, n if n >= 0 else end)
            i = r if r >= 0 else n
            if i < 0:
                return False
        else:
            return True
    return False


def _data_of(ev: bytes | bytearray) -> bytes | None:
    """The data payload of a multi-line event (``None`` when it has no ``data:`` line)."""
    parts = []
    for line in ev.split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            if v.endswith(b"\r"):
                v = v[:-1]
            if v.startswith(b" "):
                v = v[1:]
            parts.append(bytes(v))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b"\n".join(parts)


# a content string as the engine wrote it, escapes kept (the unrolled form: one class run at a time)
_DELTA_TEXT = re.compile(rb'"content"[ \t]*:[ \t]*"([^"\\]*(?:\\.[^"\\]*)*)"')


def _content_parts(data: bytes) -> list[bytes] | None:
    """The ``content`` strings of the events in ``data`` as the engine wrote them (escapes kept);
    ``None`` for a tool call. A JSON string holds no bare quote, so ``"content":"`` in the bytes is
    always that key opening its value (``"reasoning_content"`` is another key), and the value ends
    at the first quote after it that no backslash escapes. (One regex pass: about 1 µs for a token's
    event; a loop over ``split`` pieces costs as much.)"""
    if b'"tool_calls"' in data:
        return None
    return _DELTA_TEXT.findall(data)


def _joined_text(parts: list[bytes]) -> str | None:
    """The strings joined, their escapes decoded once (a character escaped as a surrogate pair
    split over two deltas comes out whole); ``None`` when empty or not a JSON string's content."""
    if not parts:
        return None
    try:
        text = orjson.loads(b'"' + b"".join(parts) + b'"')
    except orjson.JSONDecodeError:
        return None
    return text if isinstance(text, str) and text else None


class AnswerText:
    """A chat completion stream's answer, collected as the stream passes (``add`` each read): the
    ``content`` strings of its complete events are taken out every ``RAW_BYTES`` of stream, so what
    it holds is the answer's text and at most about that much of the stream. ``gone`` says why there
    will be no text: ``not_text`` (a tool call), ``too_long`` (past ``MAX_BYTES`` of text)."""

    RAW_BYTES = 16 * 1024
    MAX_BYTES = 256 * 1024

    __slots__ = ("_raw", "_size", "_parts", "_held", "gone")

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._size = 0
        self._parts: list[bytes] = []
        self._held = 0
        self.gone: str | None = None

    def add(self, chunk: bytes) -> None:
        if self.gone is None:
            self._raw.append(chunk)
            self._size += len(chunk)
            if self._size > self.RAW_BYTES:
                self._take(False)

    def _take(self, end: bool) -> None:
        raw = b"".join(self._raw)
        if end:
            cut = len(raw)
        else:                           # through the last complete event; the rest waits for more
            lf, crlf = raw.rfind(b"\n\n"), raw.rfind(b"\n\r\n")
            cut = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
        rest = raw[cut:]
        parts = _content_parts(raw[:cut]) if cut else []
        if parts is None:
            self._drop("not_text")
            return
        self._parts += parts
        self._held += sum(map(len, parts))
        self._raw, self._size = ([rest] if rest else []), len(rest)
        if self._held + self._size > self.MAX_BYTES:
            self._drop("too_long")

    def _drop(self, why: str) -> None:
        self.gone = why
        self._raw, self._parts, self._size, self._held = [], [], 0, 0

    def text(self) -> str | None:
        """The answer's text once the stream ended (``None``: see ``gone``, or no content)."""
        if self.gone is None:
            self._take(True)
        if self.gone is not None:
            return None
        text = _joined_text(self._parts)
        if text is None:
            self.gone = "not_text"
        return text


def message_text(data: Any) -> str | None:
    """The assistant message of a whole chat completion (``choices[0].message.content``); ``None``
    when it is not one plain text (several choices, a tool call, no content)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    msg = choices[0].get("message")
    if not isinstance(msg, dict) or msg.get("tool_calls"):
        return None
    c = msg.get("content")
    return c if isinstance(c, str) and c else None


def engine_error(obj: dict) -> dict | None:
    """The error an event carries: ``{"error": {...}}`` (a bare string is its message), or the
    flat ``{"object": "error", "message": ...}`` older vLLM builds stream (its fields, without
    ``object``); None: the event is not an error."""
    err = obj.get("error")
    if err:
        return err if isinstance(err, dict) else {"message": str(err)}
    if obj.get("object") == "error" and "message" in obj:
        return {k: v for k, v in obj.items() if k != "object"}
    return None


def string_code(data: bytes) -> bytes:
    """``data`` (whole events, the last one perhaps without its blank line) with the ``code`` of
    its error event a string where the engine wrote a number (vLLM's and SGLang's ``400``), as
    OpenAI's error object has it and as an error answered before the stream's head has it (and a
    ``param`` of another type than a string its JSON text, as there); ``data``
    itself when no event needs it. Run once a stream, on the read whose error event ended it."""
    out: list[bytes] = []
    start = 0
    for m in _BOUNDARY.finditer(data):
        out.append(_coded_event(data, start, m.start()))
        out.append(data[m.start():m.end()])
        start = m.end()
    if start < len(data):
        out.append(_coded_event(data, start, len(data)))
    joined = b"".join(out)
    return data if joined == data else joined


def _coded_event(data: bytes, start: int, end: int) -> bytes:
    """The event ``data[start:end]``, a one-line ``data:`` error event's numeric code made its string
    and its ``param`` of another type than a string its JSON text (``engine_param``)."""
    ev = data[start:end]
    if (b'"code"' not in ev and b'"param"' not in ev) or b'"error"' not in ev or not ev.startswith(b"data:") or b"\n" in ev:
        return ev
    try:
        obj = orjson.loads(ev[5:])
    except ValueError:
        return ev
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        if not (isinstance(obj, dict) and obj.get("object") == "error"):
            return ev
        err = obj                   # older vLLM's flat error event
    code, param = err.get("code"), err.get("param")
    coded = isinstance(code, int) and not isinstance(code, bool)
    if not coded and (param is None or isinstance(param, str)):
        return ev
    if coded:
        err["code"] = str(code)
    if param is not None and not isinstance(param, str):
        err["param"] = engine_param(param)
    return b"data: " + orjson.dumps(obj) + (b"\r" if ev.endswith(b"\r") else b"")


def _nonneg_int(v: Any) -> int:
    if type(v) is int:          # the usual case (not a bool: its type is bool)
        return v if v > 0 else 0
    if v is None:               # absent (cached tokens, mostly)
        return 0
    if isinstance(v, bool):
        return 0
    if isinstance(v, int):
        return v if v > 0 else 0
    if isinstance(v, float) and v.is_integer() and v > 0:
        return int(v)
    return 0


# a usage object's counts as chat and completions spell them, then as the Responses API does
_USAGE_KEYS = ("prompt_tokens", "completion_tokens", "prompt_tokens_details",
               "input_tokens", "output_tokens", "input_tokens_details")


def usage_tokens(usage: dict | None) -> tuple[int, int, int]:
    """``(prompt, completion, cached)`` token counts of an OpenAI usage object; 0 where absent.

    Accepts the Responses-API spellings (``input_tokens``/``output_tokens``) as well.
    """
    if not isinstance(usage, dict):
        return 0, 0, 0
    # every spelling looked up in one pass in C; the Responses API's taken where chat's is absent
    prompt, completion, details, r_prompt, r_completion, r_details = map(usage.get, _USAGE_KEYS)
    if prompt is None:
        prompt = r_prompt
    if completion is None:
        completion = r_completion
    if not isinstance(details, dict):
        details = r_details
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    # the usual counts (ints above 0; no cached tokens) are taken as they are, without a call each
    return (prompt if type(prompt) is int and prompt > 0 else _nonneg_int(prompt),
            completion if type(completion) is int and completion > 0 else _nonneg_int(completion),
            0 if cached is None else _nonneg_int(cached))


class SSEScanner:
    """Scan one upstream SSE stream. One instance per response; not thread-safe (one event loop).

    ``feed(chunk, now)`` returns the bytes to forward for that chunk (its whole events, with what
    was held of the first of them); ``finish()`` returns any bytes still held back when the
    upstream ends. Concatenating every ``feed`` result and ``finish()``
    gives the input exactly (``strip_usage=False``) or the input minus its usage-only events.
    """

    __slots__ = (
        "strip_usage", "first_token_at", "last_token_at", "token_events", "itl", "usage", "finish_reason",
        "model", "error", "done", "events", "moved", "ends_at_done", "trailing",
        "_buf", "_sent", "_skip", "_now", "_cr", "_lf", "_lf_owed", "_big_index",
    )

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        self.first_token_at: float | None = None   # `now` of the first chunk with generated content
        self.last_token_at: float | None = None
        self.token_events = 0                      # events that carried generated content
        self.itl: list[float] = []                 # gaps between content chunks, up to ITL_KEEP
        self.usage: dict | None = None             # the last usage object seen
        self.finish_reason: str | None = None
        self.model: str | None = None              # the ``model`` of the decoded events (a finish's, a usage's)
        self.error: dict | None = None             # in-stream `data: {"error": ...}`
        self.done = False                          # saw `data: [DONE]`
        self.events = 0                            # events with a data payload (incl. [DONE])
        self.moved = False                         # the last read held more than comments (``has_fields``)
        # the plain relay's: nothing after [DONE] is passed on (``_past_done``, ``_cut_at_done``), and
        # ``trailing`` says the engine wrote more than blank space after it
        self.ends_at_done = False
        self.trailing = False
        self._buf = bytearray()    # the current incomplete event (or its last _BIG_TAIL bytes if skipped)
        self._sent = 0             # how many leading bytes of _buf went out already (an event past MAX_EVENT_BYTES)
        self._skip = False         # the current event outgrew MAX_EVENT_BYTES: do not scan it
        self._now = 0.0
        self._cr = False           # the stream ends lines with bare CRs: scanned as LFs (``as_lf``)
        self._lf: bytearray | None = None   # with _cr: _buf as LFs (``as_lf``), converted as its reads came
        self._lf_owed = False      # strip mode: a dropped usage chunk ended with the CR of a read, whose LF may come next
        self._big_index = 0        # the choice the skipped event is of, read from its head

    # -- public -------------------------------------------------------------------------------

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Scan ``chunk`` (received at ``now``) and return the bytes to forward for it."""
        if self.done and self.ends_at_done:     # the answer ended at [DONE]: nothing after it passes
            return self._past_done(chunk)
        self._now = now
        buf = self._buf
        end = len(chunk) - 2
        if not buf and chunk.endswith(b"\n\n") and chunk.find(b"\n") == end \
                and not (self.strip_usage and chunk.find(b'"usage"', 0, end) >= 0):
            # the usual chunk: exactly one whole event, nothing held from before (and, when usage
            # is stripped, no usage in it: it is not the usage-only event, so it passes as is)
            if chunk.startswith(b"data:") and chunk.find(b"[DONE]", 5, end) < 0 and not self.done:
                # ``_event`` on its payload ``chunk[5:end]``, without copying it out (one token's
                # event: the relay's most frequent call)
                self.moved = True
                self.events += 1
                i = chunk.find(b'"content":"', 5, end)
                if (i >= 0 and i + 11 < end and chunk[i + 11] != 0x22) or _CONTENT_RE.search(chunk, 5, end):
                    self.token_events += 1
                    self._mark(now)
                if chunk.find(b'"usage"', 5, end) >= 0 or chunk.find(b'"error"', 5, end) >= 0 \
                        or _FINISH_RE.search(chunk, 5, end) is not None:
                    self._decode(chunk[5:end])
                return chunk
            self.moved = has_fields(chunk, 0, end)
            if self._lf_owed:
                # b"\n\n" after a dropped usage chunk whose read ended in its CRLF's CR: that LF is
                # the chunk's, dropped with it (``_feed_held``); ``[DONE]``, a comment, a blank line
                # come here, a token's event never does
                return self._feed_held(chunk, now)
            if self._event(chunk, 0, end) & _CONTENT:
                self._mark(now)
            return chunk
        return self._feed_held(chunk, now)

    def passes(self, chunk: bytes) -> bool:
        """Whether ``feed`` will return ``chunk`` itself, so the relay may write it before the scan:
        for whole events with nothing held from before (and, when usage is stripped, no usage in
        them: a usage-only event is the one thing stripping drops), no error event (whose
        numeric code the relay writes as its string: ``string_code``) and no ``[DONE]`` (what
        follows it is dropped), nor any read after it."""
        return not self._buf and chunk.endswith(b"\n\n") and not self._lf_owed and not self.done \
            and not (self.strip_usage and chunk.find(b'"usage"') >= 0) and chunk.find(b'"error"') < 0 \
            and chunk.find(b"[DONE]") < 0

    def finish(self) -> bytes:
        """End of upstream: scan a trailing event that lacked its blank line, and return whatever
        bytes are still held back (that event's, but for a usage-only one ``strip_usage`` drops)."""
        buf = self._buf
        if not buf:
            return b""
        self._buf = bytearray()
        self._lf = None
        sent, self._sent = self._sent, 0
        flags = 0
        if self._skip:
            self._skip = False
            self._big_end(buf, 0, len(buf))
        else:
            ev = (as_lf(buf) if self._cr else bytes(buf)).rstrip(b"\r\n")
            if ev:
                flags = self._event(ev, 0, len(ev))
        if flags & _CONTENT:
            self._mark(self._now)
        if sent >= len(buf):
            return b""
        if self.strip_usage and flags & _USAGE_ONLY:
            # drop the usage event but keep any stray blank lines that preceded it
            lead = len(buf) - len(bytes(buf).lstrip(b"\r\n"))
            return bytes(buf[sent:lead])
        return bytes(buf[sent:])

    def drain_itl(self) -> list[float]:
        """Return the inter-token gaps collected since the last drain, and forget them."""
        gaps = self.itl
        self.itl = []
        return gaps

    @property
    def held_bytes(self) -> int:
        """How many bytes are currently held back (of an incomplete event)."""
        return len(self._buf) - self._sent

    # -- internals ----------------------------------------------------------------------------

    def _feed_held(self, chunk: bytes, now: float) -> bytes:
        if self._lf_owed and chunk:     # the LF of the CRLF that ended the usage chunk dropped: dropped with it
            self._lf_owed = False           # (an empty read between them leaves it owed)
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._buf
        if buf:
            old = len(buf)
            pos = old - 2 if old > 2 else 0
            cursor = self._sent                    # bytes of `data` before cursor are handled
            buf += chunk
            data: bytes | bytearray = buf
        elif chunk:
            data = chunk
            old = pos = cursor = 0
        else:
            self.moved = False
            return chunk
        # the held bytes begin an event (or a blank line): from there on, more than comments?
        self.moved = self._skip or has_fields(data)
        if not self._cr:
            self._cr = cr_mode(data, max(pos - 1, 0))
        scan: bytes | bytearray = data      # read for events; the bytes passed on are ``data``'s
        if self._cr:
            scan = lf_scan(self._lf, data, old)
        out: list[bytes | bytearray] | None = None
        start = 0
        flags = 0
        for m in _BOUNDARY.finditer(scan, pos):
            if self.done and self.ends_at_done:     # events after [DONE] are no answer's: not read
                break
            end = m.end()
            if self._skip:
                self._skip = False
                f = self._big_end(scan, start, m.start())
            else:
                f = self._event(scan, start, m.start())
                flags |= f
            if f & _USAGE_ONLY and self.strip_usage:
                cut = _after_blank_lines(data, start, m.start())   # keep stray blank lines before it
                if cursor <= cut:                  # nothing of the event itself went out: drop it
                    if out is None:
                        out = []
                    if cursor < cut:
                        out.append(data[cursor:cut])
                    cursor = end
                    if end == len(data) and data[end - 1] == 0x0D:
                        self._lf_owed = True       # its last CR may be a CRLF's, split by the read
            start = end
        n = len(data)
        # the incomplete event is held (none of it went out); blank lines before it are not
        lead = _after_blank_lines(data, start, n)
        held = lead < n and cursor <= lead
        stop = lead if held else n
        if data is chunk and cursor == 0 and stop == n and out is None:
            result: bytes = chunk
        else:
            if out is None:
                out = []
            if cursor < stop:
                out.append(data[cursor:stop])
            result = b"".join(out)
        if data is buf:
            del buf[:start]
        elif start < n:
            self._buf = bytearray(chunk[start:])
        if self._cr:            # the held bytes as LFs, kept with them
            if start >= n:
                self._lf = None
            elif scan is self._lf:
                del scan[:start]
            else:
                self._lf = bytearray(scan[start:])
        self._sent = max(cursor, stop) - start if start < n else 0
        if self.done and self.ends_at_done:     # this read brought [DONE]: what follows it is not passed on
            if flags & _CONTENT:
                self._mark(now)
            return self._cut_at_done(result)
        if len(self._buf) > MAX_EVENT_BYTES:
            if held:
                result += bytes(self._buf[self._sent:])
            flags |= self._overflow()
            self._sent = len(self._buf)
        elif self._skip and len(self._buf) > _BIG_TAIL:
            # an event past the bound goes on: its bytes went out, its last ones are all its end needs
            # (its finish, a blank line split across reads); kept to the bound again, a stream of
            # such events pinned 8 MiB (16 with its LF copy) for as long as it lasted
            cut = min(len(self._buf) - _BIG_TAIL, self._sent)
            del self._buf[:cut]
            if self._lf is not None:
                del self._lf[:cut]
            self._sent -= cut
        if flags & _CONTENT:
            self._mark(now)
        return result

    def _past_done(self, chunk: bytes) -> bytes:
        """A read after [DONE]: dropped; ``trailing`` when it holds more than blank space."""
        if not self.trailing and chunk.strip():
            self.trailing = True
        return b""

    def _cut_at_done(self, result: bytes) -> bytes:
        """``result`` up to the end of its [DONE] event; the rest, and anything held after it, dropped
        (``trailing`` when more than blank space). A [DONE] in a framing the cut does not find
        (bare-CR line ends, a multi-line event) leaves ``result`` whole."""
        m = _DONE_EVENT.search(result)      # the first: it ended the answer
        if m is None:
            return result
        rest = result[m.end():]
        if rest.strip() or bytes(self._buf[self._sent:]).strip():
            self.trailing = True
        self._buf = bytearray()
        self._lf = None
        self._sent = 0
        self._skip = False
        return result[:m.end()] if rest else result

    def _overflow(self) -> int:
        """Give up scanning this event (its head read on its first overflow: ``_CONTENT`` when it
        carries generated content); keep its last bytes, for its finish and a boundary split
        across chunks."""
        flags = 0
        if not self._skip:          # the buffer begins with the event
            flags = self._big_head(self._buf, min(len(self._buf), _BIG_HEAD))
        self._skip = True
        del self._buf[:-_BIG_TAIL]
        if self._lf is not None:
            del self._lf[:-_BIG_TAIL]
        return flags

    def _big_head(self, data: bytes | bytearray, end: int) -> int:
        """The head ``data[:end]`` of an event too large to scan: the choice it is of, and
        ``_CONTENT`` (counted as a token event) when it carries generated content."""
        m = _INDEX_RE.search(data, 0, end)
        self._big_index = int(m.group(1)) if m is not None else 0
        if self.done or not _has_content(data[:end]):
            return 0
        self.token_events += 1
        return _CONTENT

    def _big_end(self, data: bytes | bytearray, start: int, end: int) -> int:
        """The end ``data[start:end]`` of an event too large to scan (its last ``_BIG_TAIL`` bytes at
        least): its choice's finish, when it names one."""
        found = list(_FINISH_VALUE_RE.finditer(data, max(start, end - _BIG_TAIL), end))
        if found:
            last = found[-1]
            self._read({"choices": [{"index": self._big_index,
                                     "finish_reason": last.group(1).decode("utf-8", "replace")}]})
        return 0

    def _mark(self, now: float) -> None:
        """The read of ``now`` carried generated content: the gaps are those between such reads
        (each has its own time; a trailing event ``finish`` reads is of the last read's)."""
        last = self.last_token_at
        if last is None:
            self.first_token_at = now
        elif now != last and len(self.itl) < ITL_KEEP:
            self.itl.append(now - last)
        self.last_token_at = now

    def _event(self, data: bytes | bytearray, start: int, end: int) -> int:
        """Scan the complete event ``data[start:end]`` (boundary excluded); return flags."""
        if data.startswith(BOM, start):     # a stream's byte order mark, before its first event
            start += 3
        if data.startswith(b"data:", start) and data.find(b"\n", start, end) < 0:
            p = data[start + 5:end]
        else:
            p = _data_of(data[start:end])
            if p is None:
                return 0          # comment / keep-alive / event-only frame
        self.events += 1
        if b"[DONE]" in p and p.strip() == b"[DONE]":
            self.done = True
            return 0
        flags = 0
        i = p.find(b'"content":"')     # ``_has_content``, inline: this runs once per event
        # after [DONE] a token's event passes on as it came, but is no token of the answer's
        if not self.done and ((i >= 0 and p[i + 11:i + 12] not in (b'"', b"")) or _CONTENT_RE.search(p) is not None):
            flags = _CONTENT
            self.token_events += 1
        if b'"usage"' in p or b'"error"' in p or _FINISH_RE.search(p) is not None:
            flags |= self._decode(p)
        return flags

    def _decode(self, p: bytes | bytearray) -> int:
        try:
            obj = orjson.loads(p)
        except ValueError:       # orjson.JSONDecodeError is a ValueError
            return 0
        if not isinstance(obj, dict):
            return 0
        return self._read(obj)

    def _read(self, obj: dict) -> int:
        """What a decoded event says: its usage, error, finish and the model it names."""
        model = obj.get("model")
        if model.__class__ is str:
            self.model = model
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        else:
            usage = None
        err = engine_error(obj)
        if err is not None:
            self.error = err
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    fr = c.get("finish_reason")
                    if isinstance(fr, str) and fr:
                        self.finish_reason = fr
        if usage is not None and not choices and not err:
            return _USAGE_ONLY
        return 0


# the index of an event's choice where the engines write it, first in the choice's object
_INDEX_RE = re.compile(rb'"choices"[ \t\r\n]*:[ \t\r\n]*\[[ \t\r\n]*\{[ \t\r\n]*"index"[ \t\r\n]*:[ \t\r\n]*(\d+)')


def _of_choice_zero(data: bytes | bytearray, start: int, end: int) -> bool:
    """Whether the whole event ``data[start:end]`` carries choice 0 (an event without an index is
    choice 0's, as a choice's index is 0 by default)."""
    m = _INDEX_RE.search(data, start, end)
    if m is not None:
        return m.group(1) == b"0"
    p = _data_of(data[start:end])          # an index written elsewhere in the choice: read it
    try:
        obj = orjson.loads(p) if p is not None else None
    except ValueError:
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("index", 0) == 0 for c in choices)


class ChoicesScanner(SSEScanner):
    """The scanner of a stream of several choices (``n`` > 1, or a completion's batch of prompts),
    whose chunks each carry one choice, the choices interleaved. The first token is any choice's;
    the inter-token gaps are choice 0's alone (the gaps between all choices' chunks would be a
    fraction of any one's); ``finish_reason`` is choice 0's, and ``finish_reasons`` every choice's,
    by index, up to the last that finished (``None`` for an earlier one that did not): the list grows
    with the finishes that come, never to the count the request claims (a completion's batch times
    ``n`` may claim millions). A stream of one choice keeps the plain ``SSEScanner``: nothing here
    runs for it.

    Usage on every chunk (``continuous_usage_stats``) is, on vLLM and SGLang alike, the chunk's
    choice's alone: its completion tokens, and its prompt's. Until the final usage chunk (no
    choices) comes with the whole answer's, ``usage`` is every choice's last usage together: their
    completion tokens added up, and each prompt of a batch counted once (choice ``i`` is of prompt
    ``i // n``, as both engines number them), so a stream broken before its end is counted for all
    its choices, not for the one whose chunk came last."""

    __slots__ = ("finish_reasons", "_choices", "_zero_at", "_zero", "_chunk", "_n", "_whole", "_completions",
                 "_prompts", "_completion", "_prompt", "_cached")

    def __init__(self, choices: int, strip_usage: bool = False, n: int = 1) -> None:
        super().__init__(strip_usage)
        self.finish_reasons: list[str | None] = []
        self._choices = choices                 # the indexes a finish may name: 0 to this, excluded
        self._zero_at: float | None = None     # the last content of choice 0
        self._zero: bool | None = None         # this read carried content of choice 0 (None: not known yet)
        self._chunk = b""
        self._n = max(1, n)                    # choices of each prompt
        self._whole = False                    # the final usage came: the answer's, taken as it is
        self._completions: dict[int, int] = {}              # choice → its completion tokens so far
        self._prompts: dict[int, tuple[int, int]] = {}      # prompt → its prompt and cached tokens
        self._completion = self._prompt = self._cached = 0  # their sums

    def feed(self, chunk: bytes, now: float) -> bytes:
        self._chunk = chunk
        self._zero = None
        return SSEScanner.feed(self, chunk, now)

    def finish(self) -> bytes:
        self._chunk = b""
        self._zero = None
        return SSEScanner.finish(self)

    def _event(self, data: bytes | bytearray, start: int, end: int) -> int:
        flags = SSEScanner._event(self, data, start, end)
        if flags & _CONTENT and not self._zero:
            self._zero = _of_choice_zero(data, start, end)
        return flags

    def _big_head(self, data: bytes | bytearray, end: int) -> int:
        flags = SSEScanner._big_head(self, data, end)
        if flags & _CONTENT and not self._zero:
            self._zero = self._big_index == 0
        return flags

    def _mark(self, now: float) -> None:
        zero = self._zero
        if zero is None:        # ``feed``'s usual chunk: one whole event, which ``_event`` did not read
            chunk = self._chunk
            zero = _of_choice_zero(chunk, 0, len(chunk))
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        if zero:
            last = self._zero_at
            if last is not None and now != last and len(self.itl) < ITL_KEEP:
                self.itl.append(now - last)
            self._zero_at = now

    def _read(self, obj: dict) -> int:
        first, whole = self.finish_reason, self.usage if self._whole else None
        flags = SSEScanner._read(self, obj)    # usage, error, and a finish of some choice
        self.finish_reason = first
        if flags & _USAGE_ONLY:
            self._whole = True
        elif whole is not None:             # a choice's usage after the answer's: the answer's stands
            self.usage = whole
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return flags
        reasons = self.finish_reasons
        for c in choices:
            if isinstance(c, dict):
                fr, i = c.get("finish_reason"), c.get("index", 0)
                if not (isinstance(i, int) and 0 <= i < self._choices):
                    continue
                if isinstance(fr, str) and fr:
                    if i >= len(reasons):
                        reasons.extend([None] * (i + 1 - len(reasons)))     # in place: the log line holds it
                    reasons[i] = fr
                    if i == 0:
                        self.finish_reason = fr
                usage = obj.get("usage")
                if isinstance(usage, dict) and not self._whole:
                    self._choice_usage(i, usage)
        return flags

    def _choice_usage(self, i: int, usage: dict) -> None:
        """Choice ``i``'s usage so far, from a chunk of its own: ``usage`` becomes every choice's."""
        prompt, completion, cached = usage_tokens(usage)
        self._completion += completion - self._completions.get(i, 0)
        self._completions[i] = completion
        k = i // self._n
        was_prompt, was_cached = self._prompts.get(k, (0, 0))
        self._prompt += prompt - was_prompt
        self._cached += cached - was_cached
        self._prompts[k] = (prompt, cached)
        together: dict = {"prompt_tokens": self._prompt, "completion_tokens": self._completion,
                          "total_tokens": self._prompt + self._completion}
        if self._cached:
            together["prompt_tokens_details"] = {"cached_tokens": self._cached}
        self.usage = together
