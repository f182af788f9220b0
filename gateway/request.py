"""Parse a client request once into an ``InferenceRequest``.

The body is decoded with orjson exactly once. Everything later stages need (model, stream flag,
the prompt text for prefix hashing, a token estimate) is extracted here, and every malformed
input is rejected here with an OpenAI-shaped 400 before any endpoint is touched. Fields we do not
know pass through to the engine untouched: the original bytes are forwarded unless a stage must
change the body.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

import orjson

from gateway.errors import GatewayError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ROUTED_PATHS = (CHAT, COMPLETIONS, EMBEDDINGS)
# where vLLM answers encoding_format "bytes" and "bytes_only" with the vectors' bytes
# (application/octet-stream, a ``metadata`` header), which the relay passes on as they came
BINARY_PATHS = (EMBEDDINGS, "/pooling")
BINARY_FORMATS = ("bytes", "bytes_only")

# A client-supplied request id is kept when it is short and made of safe characters, so that it
# can travel in headers, logs and engine request ids without escaping.
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

# Rough characters-per-token ratio for estimates when no tokenizer is at hand.
CHARS_PER_TOKEN = 4

# The most sequences one request may ask an engine to generate: ``n`` of chat and completions, from 1
# to this, as OpenAI's API takes it. The engines set no upper bound of their own, and a request's
# cost grows with it. ``best_of`` is not read: neither engine generates its sequences now (vLLM V1
# has no such field and ignores it, SGLang's completions type it and never use it).
MAX_CHOICES = 128


def given_request_id(headers: Any) -> str | None:
    """The client's ``x-request-id``. Lines giving different ids (a client's own and one a proxy
    added, say) name no one id: they are read joined, as RFC 9110 joins a field's lines ("a, b"),
    which ``request_id_from`` does not keep, so the request gets a fresh id rather than whichever
    line a reader takes first; the same id repeated is that id."""
    value = headers.get("x-request-id")
    if value is None:
        return None
    getall = getattr(headers, "getall", None)       # None for a plain mapping: one value a name
    if getall is not None and len(lines := getall("x-request-id")) > 1 and any(line != value for line in lines):
        return ", ".join(lines)
    return value


def request_id_from(header_value: str | None) -> str:
    if header_value and _SANE_REQUEST_ID.match(header_value):
        return header_value
    return f"{_random_bits(128):032x}"


# Request ids need to be unique, not secret: a PRNG seeded from the OS once per process is enough
# and costs no system call per request (os.urandom does). Seeded again in every forked process: the
# workers of one gateway (``server.workers``) would otherwise draw the same ids, each the parent's
# copy of one generator.
def _seed() -> None:
    global _random_bits
    _random_bits = random.Random(os.urandom(16)).getrandbits


_seed()
os.register_at_fork(after_in_child=_seed)


def header_text(value: str | None) -> str | None:
    """A header's value as text every part can encode (UTF-8 in msgpack, Redis, hashes, the log):
    bytes that are not UTF-8, which the HTTP parsers hold as surrogate escapes, become ``\\xNN``,
    so the value stays the client's, distinct and the same from request to request."""
    if value is None or value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


MAX_USER_CHARS = 128         # a claimed user name longer than this is kept as its digest (as the admin API's names)


def claimed_user(name: str | None) -> str | None:
    """The user a request names itself (without auth: the ``user`` header, else the body's
    ``user``, or ``metadata.user_id`` on Messages) as the gateway keeps it: as it is up to 128
    characters, else ``sha256:`` and the 64 hex digits of its SHA-256. Whatever holds the name (the
    tenancy windows, in memory and in Redis, vtc-basic's counts, admission's fair-share lines, the
    status page, logs, a 429's message) then holds 71 characters however long a name the client
    sends, and the same name is the same user from request to request."""
    if name is None or len(name) <= MAX_USER_CHARS:
        return name
    return "sha256:" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


_CALLER_HEADERS = ("user", "x-session-id", "x-session-key", "x-aibrix-session-key")


def caller_headers(headers: Any) -> tuple[str | None, str | None, str | None]:
    """The caller's names in the request's headers, as ``header_text``: ``user``, ``x-session-id``,
    and the session key (``x-session-key``, else AIBrix's ``x-aibrix-session-key``)."""
    user, sid, key, aibrix = map(headers.get, _CALLER_HEADERS)     # looked up in C
    if user is None and sid is None and key is None and aibrix is None:     # the usual request: no call more
        return None, None, None
    getall = getattr(headers, "getall", None)       # None for a plain mapping (a batch line's): one value a name
    if getall is not None:
        for name, value in zip(_CALLER_HEADERS, (user, sid, key, aibrix), strict=True):
            if value is not None and len(lines := getall(name)) > 1:
                one_value(lines, name)
    return header_text(user), header_text(sid), header_text(key or aibrix)


def one_value(lines: list[str], name: str) -> None:
    """A 400 when a header that names one thing comes on lines naming different values (a
    client's own and one a proxy added, say): which one counts is not left to whichever line a
    reader takes first. The same value repeated names one."""
    if any(line != lines[0] for line in lines):
        raise GatewayError(400, f"the {name} header is given more than once with different values; give it once",
                           param=name, code="ambiguous_header", error_class="validation")


class WholeBody:
    """A request body as aiohttp's ``StreamReader`` shows one that arrived whole with its head (the
    pipeline takes such a body with ``read_nowait``, gateway/pipeline/pipeline.py ``_parse``): for
    requests made without aiohttp's parser (the edge's fast lane, the batch runner's lines)."""

    __slots__ = ("_body",)

    def __init__(self, body: bytes) -> None:
        self._body = body

    def is_eof(self) -> bool:
        return True

    def read_nowait(self, n: int = -1) -> bytes:
        return self._body

    def exception(self) -> None:
        return None

    def feed_eof(self) -> None:
        return None


@dataclass(slots=True)
class InferenceRequest:
    path: str
    body: bytes
    data: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool          # what the client asked for
    prompt_text: str             # the text the engine will prefill, for prefix hashing
    prompt_tokens_est: int
    request_id: str
    user: str | None = None
    # with auth on, the user the request's API key names (``user`` as the tenancy's admit decides it):
    # the sessions it names are that user's (routers/session_map.py)
    tenant: str | None = None
    session_id: str | None = None
    session_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"     # what the engine is told the body is (multipart keeps its boundary)
    # the LoRA adapter the client named in ``model`` (``model`` is then its base model; gateway/lora/adapters.py)
    lora: str | None = None
    # content parts other than text (images, audio, video, files): the engine folds their feature
    # hashes into its KV block hashes, which the gateway cannot compute (gateway/kv/index.py)
    multimodal: bool = False
    # Responses with the gateway holding the state: the ``previous_response_id`` it expanded into the
    # input (and took out of the body); routing still follows the conversation by it
    previous_response_id: str | None = None
    # latency objectives in milliseconds: the x-slo-ttft-ms / x-slo-tpot-ms headers, else the model's
    # ``slo:`` defaults (laid in by the pipeline's admit stage); admission's deadlines and SLO-aware
    # routing read them
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # how many choices the answer carries: ``n`` (1 unless asked), times the prompts of a completion's
    # batch; the relay reads a stream of several its own way (gateway/pipeline/sse.py ``ChoicesScanner``)
    choices: int = 1
    # how many sequences the engine generates for each prompt (``n``: ``best_of`` is ignored by the
    # engines), and for the whole request (times a completion's batch of prompts); admission's
    # output estimate counts each
    fan: int = 1
    sequences: int = 1
    # told the answer's text (``None``, and why not, when there is none) once a chat's answer is relayed
    # whole (set by the KV-events router, which tokenizes it ahead of the next turn: gateway/kv/events.py)
    answered: Callable[..., None] | None = None
    # ``prompt_tokens_est`` is the prompt's exact count (a prompt of token ids), not an estimate
    prompt_tokens_exact: bool = False
    # a mid-stream continuation's leg (gateway/pipeline/migration.py): what the client already has,
    # its first token included, came from the legs before (a leg that starts over, nothing generated
    # nor sent, is not one)
    continues: bool = False
    # the client's X-Vllm-Priority header goes to the engine (``upstream.client_priority``; the
    # gateway's own ``admission.engine_priority`` takes it back): kept from the legs otherwise
    priority_header: bool = False
    # its request's ``RequestRecord.serial``: a request id is the client's to give, and two requests
    # in flight may give the same one
    serial: int = 0

    @property
    def is_embeddings(self) -> bool:
        return self.path == EMBEDDINGS


def bad_body(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    """A 400 for a request body the gateway refuses (every API's parser raises these)."""
    return GatewayError(400, message, param=param, code=code, header=("x-error-request-body-processing", "true"),
                        error_class="validation")


_bad = bad_body


def _not_parsed(body: bytes, e: orjson.JSONDecodeError) -> str:
    """What the parser found wrong with ``body``, and where: a client whose body is valid JSON by
    RFC 8259's grammar but past what the gateway reads (a number beyond a double's range, a lone
    surrogate escape, nesting past 1024 levels) sees which of them it was."""
    if e.msg.startswith("str is not valid UTF-8"):
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as u:
            return f"the body is not UTF-8 text (at byte {u.start})"
    return f"{e.msg} (line {e.lineno}, column {e.colno})"


def load_object(body: bytes, not_json: str = "request body is not valid JSON",
                not_object: str = "request body must be a JSON object") -> dict[str, Any]:
    """The body as a JSON object, or the 400 that says why it is not one."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_body(f"{not_json.rstrip('.')}: {_not_parsed(body, e)}") from None
    if not isinstance(data, dict):
        raise bad_body(not_object)
    return data


# What the engines accept where their request models declare an ``int`` or a ``bool``. vLLM's and
# SGLang's request models are pydantic v2 models in lax mode, validated from ``json.loads`` output:
# an ``int`` field takes a whole float (5.0), a numeric string ("5", " 5 ", "1_000", "5.0") and a
# bool; a ``bool`` field takes 0/1, 0.0/1.0 and the words below in any case. The parsers take the
# common case (an int, a bool) as it is and send only other types through these, so a request
# pays nothing for them; a coerced value is written back into the parsed body, so every later
# stage sees the int or the bool the engine will see.
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_STRING = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_I64 = 1 << 63
_U64 = 1 << 64        # orjson writes ints in [-2**63, 2**64)
_TOO_BIG = "Unable to parse input string as an integer, exceeded maximum size"
# the code of the 400 for an integer past 64 bits, whichever field it is in
OUT_OF_RANGE = "integer_out_of_range"


def int_error(key: str, e: ValueError) -> GatewayError:
    """The 400 for ``key``'s value that ``lax_int`` refused; one past 64 bits says so in its code."""
    return bad_body(f"{key}: {e}", key, OUT_OF_RANGE if str(e) == _TOO_BIG else None)


# orjson reads an integer literal outside [-2**63, 2**64) as the nearest double, so a body the
# gateway re-encodes would carry another number than the client's (123456789012345678901234567890
# as 1.2345678901234568e+29) where the body forwarded as it came carries the client's digits; and it
# reads 1024 levels of nesting but writes 254. ``body_bytes`` writes both as they came: such a
# double, 2**63 or more in size, is written with an exponent ("e+"), which a re-encoded body seldom
# holds otherwise; only then are the client's bytes looked at (19 digits in a row, then its number
# literals, in the order the parsed body holds them); a body nested deeper than orjson writes is
# written level by level.
_WIDE_DIGITS = re.compile(rb"[0-9]{19}")
# a JSON string (group 1; a key when a colon follows, group 2), a number or an object's brace: read
# from left to right over a body that parsed, every number outside strings
_TOKENS = re.compile(rb'("[^"\\]*(?:\\.[^"\\]*)*")([ \t\r\n]*:)?|-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|[{}]')


def may_hold_wide_ints(original: bytes) -> bool:
    """Whether ``original`` may hold an integer past 64 bits (it has 19 digits in a row)."""
    return _WIDE_DIGITS.search(original) is not None


def body_bytes(data: Any, original: bytes) -> bytes:
    """``data``, a body parsed from ``original`` and rewritten, as the JSON an engine is sent: the
    integers past 64 bits ``original`` holds are written with their digits, not as doubles, and
    nesting deeper than orjson writes is written all the same."""
    try:
        out = orjson.dumps(data)
    except TypeError:       # nesting past orjson's 254 levels (another type is a bug: raised again)
        return _encode(data, _wide_ints(original) if _WIDE_DIGITS.search(original) else {})
    if b"e+" not in out or not _WIDE_DIGITS.search(original):
        return out
    wide = _wide_ints(original)
    return _encode(data, wide) if wide else out


def _wide_ints(original: bytes) -> dict[float, list[orjson.Fragment | None]]:
    """The integer literals of ``original`` past 64 bits by the double orjson reads each as, each
    with its digits, in the order the parsed body holds them; a float literal equal to one of those
    doubles comes in its place in that order as ``None`` (it stays a float). A key given twice in an
    object keeps its last value at its first place, as orjson (and Python's json) read it: the
    literals of its earlier values are dropped, those of its last take the first one's place."""
    # the literals as the parsed body holds them: an object is a list of one list per key, in the
    # order of their first giving, holding what its last value holds (the literals, the objects);
    # an array adds nothing of its own. Each literal, key and object is met once: linear in the body
    root: list[Any] = []
    into = root                         # where the literals read now go
    objects: list[tuple[dict[str, list[Any]], list[Any], list[Any]]] = []   # open: its keys, its lists, its place
    for m in _TOKENS.finditer(original):
        lit = m.group()
        c = lit[0]
        if c == 0x22:           # a string: a key when a colon follows
            if m.group(2) is not None:
                keys, slots, _ = objects[-1]
                name = json.loads(m.group(1)) if b"\\" in lit else m.group(1)[1:-1].decode()
                into = keys.get(name)
                if into is None:
                    into = keys[name] = []
                    slots.append(into)
                else:           # given again: what its earlier value held is not in the parsed body
                    into.clear()
        elif c == 0x7B:         # {
            slots = []
            into.append(slots)
            objects.append(({}, slots, into))
            into = slots
        elif c == 0x7D:         # }
            _, slots, into = objects.pop()
            slots[:] = [slot for slot in slots if slot]     # the keys that hold none of them go
            if not slots:
                into.pop()      # the object, the last thing put where it is
        elif b"." in lit or b"e" in lit or b"E" in lit:
            v = float(lit)
            if abs(v) >= _I64 and v.is_integer():
                into.append((v, None))
        elif len(lit) >= 19:
            n = int(lit)
            if not -_I64 <= n < _U64:
                into.append((float(n), lit))
    seen: list[tuple[float, bytes | None]] = []
    nested = [iter(root)]
    while nested:
        for item in nested[-1]:
            if type(item) is list:
                nested.append(iter(item))
                break
            seen.append(item)
        else:
            nested.pop()
    wide = {v for v, lit in seen if lit is not None}
    out: dict[float, list[orjson.Fragment | None]] = {}
    for v, lit in seen:
        if v in wide:
            out.setdefault(v, []).append(None if lit is None else orjson.Fragment(lit))
    for values in out.values():
        values.reverse()        # taken from the end: the body's order
    return out


_END = object()


def _encode(root: Any, wide: dict[float, list[orjson.Fragment | None]]) -> bytes:
    """``root`` as orjson writes it, a container at a time (no recursion, so at any depth), each
    double of ``wide`` written as the next literal it stood for (the last one again when the
    rewritten body holds more of them than the client's)."""
    out: list[bytes] = []
    stack: list[list[Any]] = []         # [items, closing bracket, is an object, no item yet]

    def put(v: Any) -> None:
        t = type(v)
        if t is dict:
            out.append(b"{")
            stack.append([iter(v.items()), b"}", True, True])
        elif t is list:
            out.append(b"[")
            stack.append([iter(v), b"]", False, True])
        else:
            if t is float and wide:
                values = wide.get(v)
                if values is not None:
                    lit = values.pop() if len(values) > 1 else values[0]
                    if lit is not None:
                        v = lit
            out.append(orjson.dumps(v))

    put(root)
    while stack:
        top = stack[-1]
        item = next(top[0], _END)
        if item is _END:
            out.append(top[1])
            stack.pop()
            continue
        if top[3]:
            top[3] = False
        else:
            out.append(b",")
        if top[2]:
            key, item = item
            out.append(orjson.dumps(key))
            out.append(b":")
        put(item)
    return b"".join(out)


def lax_int(v: Any) -> int:
    """``v`` read as pydantic's lax mode reads an ``int``; ``ValueError`` with pydantic's message.

    One difference: a numeric string beyond 64 bits is refused (pydantic reads it as a big int),
    as pydantic refuses such a float: a body re-encoded with it could not be written (orjson).
    """
    if type(v) is int:
        return v
    if v is True or v is False:
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("Input should be a finite number")
        if not v.is_integer():
            raise ValueError("Input should be a valid integer, got a number with a fractional part")
        if not -_I64 <= v < _I64:
            raise ValueError(_TOO_BIG)
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        if _INT_STRING.fullmatch(s):
            try:
                out = int(s.partition(".")[0])
            except ValueError:       # more digits than int() converts
                raise ValueError(_TOO_BIG) from None
            if not -_I64 <= out < _U64:
                raise ValueError(_TOO_BIG)
            return out
        raise ValueError("Input should be a valid integer, unable to parse string as an integer")
    raise ValueError("Input should be a valid integer")


def lax_bool(v: Any) -> bool:
    """``v`` read as pydantic's lax mode reads a ``bool``; ``ValueError`` with pydantic's message."""
    if v is True or v is False:
        return v
    if isinstance(v, int | float) and (v == 0 or v == 1):
        return v == 1
    if isinstance(v, str):
        low = v.lower()
        if low in _TRUE_WORDS:
            return True
        if low in _FALSE_WORDS:
            return False
        raise ValueError("Input should be a valid boolean, unable to interpret input")
    if (type(v) is int or isinstance(v, float) and v.is_integer()) and -_I64 <= v < _I64:
        raise ValueError("Input should be a valid boolean, unable to interpret input")
    raise ValueError("Input should be a valid boolean")


def lax_float(v: Any) -> float:
    """``v`` read as pydantic's lax mode reads a ``float`` (an int, a bool, a numeric string);
    ``ValueError`` with pydantic's message. NaN and the infinities a string may spell come back as
    they are: a range check refuses them."""
    if type(v) is float or type(v) is int:
        return v
    if v is True or v is False:
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            raise ValueError("Input should be a valid number, unable to parse string as a number") from None
    raise ValueError("Input should be a valid number")


def lax_int_list(v: Any) -> list[int] | None:
    """A list whose items all read as ints (``[1.0, "2", true]`` is ``[1, 2, 1]`` to the engine's
    ``list[int]``), or None."""
    if not isinstance(v, list):
        return None
    try:
        return [lax_int(x) for x in v]
    except ValueError:
        return None


def _int_field(data: dict[str, Any], key: str, nullable: bool = True) -> int | None:
    """``data[key]`` as the engine reads an optional ``int`` field (written back when coerced)."""
    v = data.get(key)
    if type(v) is int:
        return v
    if v is None and (nullable or key not in data):
        return None
    try:
        out = data[key] = lax_int(v)
    except ValueError as e:
        raise int_error(key, e) from None
    return out


def _check_seed(v: Any) -> None:
    """A ``seed`` past 64 bits is refused: vLLM bounds its ``seed`` to a signed 64-bit integer
    (``ge``/``le`` of ``torch.long``'s range on its chat and completion requests); orjson reads an integer literal past 64 bits as a float, which
    a re-encoded body would send as another number (-2**63 - 1 as -2**63: a whole float of that size
    is refused, the literal -2**63 is an int). A fraction or a string is the engine's to read."""
    if type(v) is int and not -_I64 <= v < _I64 or isinstance(v, float) and v.is_integer() and abs(v) >= _I64:
        raise bad_body(f"seed: must be a signed 64-bit integer, from {-_I64} to {_I64 - 1}", "seed", OUT_OF_RANGE)


def _fan_out(v: int, key: str) -> int:
    """``v``, a count of sequences to generate (``n``), when it is from 1 to ``MAX_CHOICES``."""
    if v < 1:
        raise _bad(f"'{key}' must be at least 1, got {v}", key)
    if v > MAX_CHOICES:
        raise _bad(f"'{key}' must be at most {MAX_CHOICES}, got {v}", key)
    return v


# content part types that carry text only; any other part (image_url, input_audio, video_url, ...) is
# multimodal
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})


def _text_of_content(content: Any, i: int, media: list[bool]) -> str:
    """Message ``i``'s content is a string, null, or a list of parts; text parts contribute their
    text. A part of another type sets ``media[0]``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    where = f"messages[{i}].content"        # named only past the usual string
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise _bad(f"'{where}[{i}]' must be an object", f"{where}[{i}]")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(f"'{where}[{i}].text' must be a string", f"{where}[{i}].text")
                out.append(text)
            elif kind is None:
                media[0] = True          # no type: the engine infers it from the part's keys
            elif not isinstance(kind, str):
                raise _bad(f"'{where}[{i}].type' must be a string", f"{where}[{i}].type")
            elif kind not in TEXT_PARTS:
                media[0] = True
        return " ".join(out)
    raise _bad(f"'{where}' must be a string, an array of content parts or null", where)


_ROLE_CONTENT = itemgetter("role", "content")


def _calls_chars(messages: list[Any]) -> int:
    """The characters of the arguments of the assistant turns' ``tool_calls``, which the engine
    renders with the calls (their content, null or empty, holds none of it)."""
    n = 0
    for msg in messages:
        calls = msg.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    n += len(fn["arguments"])
    return n


def tools_tokens(tools: Any) -> int:
    """The token estimate of a request's ``tools``: the engine renders them into the prompt it
    prefills (a chat template's ``tools``, as JSON), so they count as their JSON's characters do.
    Called only for a request that offers tools; a value the encoder cannot write (nested past
    its depth) counts nothing, the engine's to refuse."""
    try:
        return len(orjson.dumps(tools)) // CHARS_PER_TOKEN
    except orjson.JSONEncodeError:
        return 0


def text_and_tools_tokens(text: str, tools: Any) -> int:
    """The prompt's token estimate from its text and the ``tools`` it offers (``tools_tokens``): the
    Messages and Responses parsers' (a chat's, in ``parse``, also counts earlier calls)."""
    return max(1, len(text) // CHARS_PER_TOKEN) + (tools_tokens(tools) if tools else 0)


def _chat_prompt(data: dict[str, Any], media: list[bool]) -> str:
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise _bad("'messages' is a required property and must be an array", "messages")
    if not messages:
        raise _bad("'messages' must not be empty", "messages")
    try:        # the usual messages, objects with a string role and string content: joined in C
        return "\n".join(chain.from_iterable(map(_ROLE_CONTENT, messages)))
    except (TypeError, KeyError):       # another shape: read message by message, as it is checked
        pass
    parts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise _bad(f"'messages[{i}].role' is a required string", f"messages[{i}].role")
        parts.append(role)
        content = msg.get("content")        # the usual string taken as it is, without a call
        parts.append(content if isinstance(content, str) else _text_of_content(content, i, media))
    return "\n".join(parts)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _lax_tokens(v: list[Any]) -> list[Any] | None:
    """``v`` (not token ids as they are) as the engines' ``list[int] | list[list[int]]`` reads it
    (``[1.0, "2"]`` is ``[1, 2]``), or None."""
    ids = lax_int_list(v)
    if ids is not None:
        return ids
    if all(isinstance(p, list) for p in v):
        out = [lax_int_list(p) for p in v]
        if None not in out:
            return out
    return None


def prompt_embeds(data: dict[str, Any]) -> Any:
    """A completion's ``prompt_embeds`` (vLLM's: base64 tensors, one or a list), or None when it
    gives none (missing, null, an empty list, as vLLM reads it)."""
    pe = data.get("prompt_embeds")
    return None if pe is None or pe == [] else pe


def _completion_prompt(data: dict[str, Any]) -> tuple[str, int | None]:
    """Returns the prompt text and, for token-id prompts, the exact token count."""
    prompt = data.get("prompt")
    if prompt is None and prompt_embeds(data) is not None:
        # vLLM's prompt_embeds in the place of a prompt: the engine's to read (with
        # --enable-prompt-embeds); no text to estimate or hash
        return "", None
    if "prompt" not in data:
        raise _bad("'prompt' is a required property", "prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
        if _is_int_list(prompt):
            return " ".join(map(str, prompt)), len(prompt)
        if all(_is_int_list(p) for p in prompt):
            return "\n".join(" ".join(map(str, p)) for p in prompt), sum(len(p) for p in prompt)
        lax = _lax_tokens(prompt)
        if lax is not None:
            data["prompt"] = lax
            return _completion_prompt(data)
    raise _bad("'prompt' must be a string, an array of strings, or token ids", "prompt")


def _embedding_input(data: dict[str, Any], media: list[bool]) -> tuple[str, int | None]:
    if data.get("input") is None and "messages" in data:
        # vLLM's chat embeddings request (``EmbeddingChatRequest``): a chat's messages, rendered by
        # the chat template into the one prompt embedded (an input, missing or null, does not make
        # it OpenAI's request); checked and estimated as a chat's
        return _chat_prompt(data, media), None
    if "input" not in data:
        raise _bad("'input' is a required property (or, for vLLM's chat embeddings, 'messages')", "input")
    inp = data["input"]
    if isinstance(inp, str):
        return inp, None
    if isinstance(inp, list) and inp:
        if all(isinstance(p, str) for p in inp):
            return "\n".join(inp), None
        if _is_int_list(inp):
            return "", len(inp)
        if all(_is_int_list(p) for p in inp):
            return "", sum(len(p) for p in inp)
        lax = _lax_tokens(inp)
        if lax is not None:
            data["input"] = lax
            return _embedding_input(data, media)
        # multimodal parts: pass through, estimate from any text
        if all(isinstance(p, dict) for p in inp):
            return " ".join(p["text"] for p in inp if isinstance(p.get("text"), str)), None
    raise _bad("'input' must be a string, an array of strings, or token ids", "input")


def _stream_flags(data: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) of a chat or completions body, read as the engines read them."""
    raw = data.get("stream")
    stream = raw
    if stream is not True and stream is not False:
        if stream is None:
            stream = False
        else:
            try:
                stream = data["stream"] = lax_bool(raw)
            except ValueError as e:
                raise _bad(f"stream: {e}", "stream") from None
    so = data.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    iu = so.get("include_usage")
    if iu is not None and iu is not True and iu is not False:
        try:
            iu = so["include_usage"] = lax_bool(iu)
        except ValueError as e:
            raise _bad(f"stream_options.include_usage: {e}", "stream_options.include_usage") from None
    # vLLM's check, on the values as sent: options that say something need a truthy stream
    if so and not raw:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not stream:
        # "stream": "false" passed that check: the options are moot, and a re-encoded body
        # (with stream false) would not pass it
        data.pop("stream_options", None)
        return False, False
    return True, bool(iu)


SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"


def _slo_header(headers: Any, name: str) -> float | None:
    # read whole, as RFC 9110 joins a field's lines: two lines make a value that is no number (a
    # 400), whichever comes first
    raw = headers.get(name)
    if raw is None:                     # the common case: no objective, one lookup
        return None
    getall = getattr(headers, "getall", None)       # None for a plain mapping (a test's)
    if getall is not None:
        lines = getall(name, ())
        if len(lines) > 1:
            raw = ", ".join(lines)
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise GatewayError(400, f"{name} must be a positive number of milliseconds, got {raw[:40]!r}", param=name,
                           code="invalid_slo", error_class="validation")
    return v


def slo_objectives(headers: Any) -> tuple[float | None, float | None]:
    """A request's latency objectives from its ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers
    (positive milliseconds); a bad value is a 400 naming the header. Every API's parser calls it."""
    if SLO_TTFT_HEADER not in headers and SLO_TPOT_HEADER not in headers:
        return None, None
    return _slo_header(headers, SLO_TTFT_HEADER), _slo_header(headers, SLO_TPOT_HEADER)


def no_model(model: str | None) -> GatewayError:
    """The 400 of a body that names no model: none given (absent or null) misses a required
    parameter; an empty string is a value, empty. Neither names a model that does not exist
    (``model_not_found``, a 404, is for a name the gateway does not serve)."""
    if model == "":
        return GatewayError(400, "Invalid 'model': empty string. Expected a string with minimum length 1, but got "
                            "an empty string instead.", param="model", code="empty_string",
                            header=("x-error-no-model-backends", ""), error_class="validation")
    return GatewayError(400, "Missing required parameter: 'model'.", param="model", code="missing_required_parameter",
                        header=("x-error-no-model-backends", ""), error_class="validation")


def parse(path: str, body: bytes, headers: dict[str, str], request_id: str) -> InferenceRequest:
    """Validate and extract. ``headers`` are the client's, lower-cased names."""
    data = load_object(body)

    model = data.get("model")
    if model is None or model == "":
        raise no_model(model)
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")

    try:
        return _parse_named(path, body, headers, request_id, data, model)
    except GatewayError as e:         # the request's log line names the model the body named
        e.model = model
        raise


def _parse_named(path: str, body: bytes, headers: dict[str, str], request_id: str, data: dict[str, Any],
                 model: str) -> InferenceRequest:
    choices = fan = prompts = 1
    if path == EMBEDDINGS:
        # not fields of an embeddings request: the engines ignore them, and nothing streams
        stream = include_usage = False
    else:
        stream, include_usage = _stream_flags(data)
        # both engines refuse a negative limit; 0 is left to them (SGLang serves a chat max_tokens
        # of 0, vLLM a completions one with echo). n: 1 to MAX_CHOICES
        limits = ("max_tokens", "max_completion_tokens") if path == CHAT else ("max_tokens",)
        for key in limits:
            if key in data:
                v = _int_field(data, key)
                if v is not None and v < 0:
                    raise _bad(f"'{key}' must be a non-negative integer, got {v}", key)
        # ``n: int`` in both engines' CompletionRequest; chat's is Optional in vLLM's
        if "n" in data:
            n = _int_field(data, "n", nullable=path == CHAT)
            if n is not None:
                choices = fan = _fan_out(n, "n")
        seed = data.get("seed")
        if seed is not None and not (type(seed) is int and -_I64 <= seed < _I64):
            _check_seed(seed)
        # OpenAI's name for the conversation's cache, a string (routers/session_map.py): another value
        # was read as no session, the client never told
        key = data.get("prompt_cache_key")
        if key is not None and key.__class__ is not str:
            raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")

    exact_tokens: int | None = None
    media = [False]
    tools_est = 0
    if path == CHAT:
        prompt_text = _chat_prompt(data, media)
        tools = data.get("tools")
        if tools:       # a conversation with tool calls offers tools: their calls are counted with them
            tools_est = tools_tokens(tools) + _calls_chars(data["messages"]) // CHARS_PER_TOKEN
    elif path == COMPLETIONS:
        prompt_text, exact_tokens = _completion_prompt(data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompts = len(prompt)       # a batch of prompts: n choices each
        elif prompt is None and isinstance(data.get("prompt_embeds"), list):
            prompts = len(data["prompt_embeds"])      # a batch of prompt embeddings, likewise
        choices *= prompts
    else:
        prompt_text, exact_tokens = _embedding_input(data, media)

    user, session_id, session_key = caller_headers(headers)
    if user is None and isinstance(data.get("user"), str):
        user = data["user"]
    user = claimed_user(user)

    est = exact_tokens if exact_tokens is not None else max(1, len(prompt_text) // CHARS_PER_TOKEN) + tools_est
    slo_ttft, slo_tpot = slo_objectives(headers)
    return InferenceRequest(
        path=path,
        body=body,
        data=data,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_text=prompt_text,
        prompt_tokens_est=est,
        request_id=request_id,
        user=user,
        session_id=session_id,
        session_key=session_key,
        headers=headers,
        multimodal=media[0],
        slo_ttft_ms=slo_ttft,
        slo_tpot_ms=slo_tpot,
        choices=choices,
        fan=fan,
        sequences=fan * prompts,
        prompt_tokens_exact=exact_tokens is not None,
    )


def usage_stream_options(ireq: InferenceRequest, continuous_alone: bool = False) -> dict[str, Any] | None:
    """``{"stream_options": ...}`` to send upstream when the client streams without asking for
    usage, so every stream is accounted (the relay then hides the usage chunk); else ``None``.

    On vLLM ``continuous_usage_stats`` only takes effect with ``include_usage``, so it is dropped,
    or usage would ride on every chunk the client sees. An engine that reads it apart
    (``continuous_alone``: SGLang) puts the usage on every chunk for it alone, which the client
    sees as it would without the gateway, so it is kept.
    """
    if not ireq.stream or ireq.include_usage:
        return None
    so = ireq.data.get("stream_options")
    if not isinstance(so, dict):
        kept = {}
    elif continuous_alone:
        kept = so
    else:
        kept = {k: v for k, v in so.items() if k != "continuous_usage_stats"}
    return {"stream_options": {**kept, "include_usage": True}}
