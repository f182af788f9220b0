"""A minimal, fast OpenAI-style backend for overhead benchmarks: as little CPU per request as we can.

A raw asyncio ``Protocol`` HTTP/1.1 server on uvloop (keep-alive, TCP_NODELAY, pipelining-safe). It
does not pretend to be an engine beyond the wire shape: every response is pre-encoded at start-up,
so a request costs a header scan and one ``transport.write`` (non-streaming) or one write per SSE
chunk (streaming). That way a benchmark through a gateway measures the gateway, not the backend.

``POST /v1/chat/completions`` (and ``/v1/completions``):

- ``"stream": false`` → a fixed ``chat.completion`` JSON body with ``Content-Length``;
- ``"stream": true`` → vLLM framing over chunked transfer encoding: N ``data: {chunk}\\n\\n`` events
  (the last with ``finish_reason: "stop"``), a usage event when ``"include_usage": true`` is in the
  body, then ``data: [DONE]\\n\\n``.

Per-request knobs are read from the body bytes, so they survive any router that re-serialises the
JSON (sglang-router drops unknown fields and renames ``max_tokens``; it keeps message text):

- N = ``max_tokens`` / ``max_completion_tokens`` (default ``--chunks``), capped at ``--max-chunks``;
- ``bench-pace-ms=X`` anywhere in the body (e.g. in the prompt text) → the headers go out at once,
  then each chunk X ms after the previous one (the first one X ms after the headers, a stand-in for
  prefill time); default ``--pace-ms``. With 0 the chunks are written one per event-loop turn, so
  concurrent streams interleave and each chunk is its own write, as an engine emits tokens;
- ``bench-hold`` anywhere in the body → the headers and one chunk, then nothing until the client
  goes away (for idle-stream memory measurements).

A stream's headers go out at once, as vLLM's OpenAI server sends them; with ``--head-with-first``
they go out with its first chunk instead, as SGLang's does (it awaits the first chunk before it
answers, so that an early error is still an HTTP error).

``GET`` anything (``/health``, ``/v1/models``, ``/server_info``, ``/model_info``, ``/metrics``, ...)
answers 200 with a small JSON body, which is what the routers probe at start-up.

Benchmark control (not an engine API): ``GET /bench/stats`` → ``{"connections", "streams", "held",
"by_port"}`` (open connections, streams in progress, held streams, POSTs per listening port);
``POST /bench/release`` ends every held
stream (last chunk, ``[DONE]``), so a proxy that kept its upstream leg open after its client left
finds out on its next write, and the next measurement starts clean.

    python bench/fastbackend.py --port 9000 [--port 9001 ...] [--host 127.0.0.1] [--model m] [--chunks 100]

Several ``--port`` make one backend process serve as several endpoints (a router spreading
streams over N worker URLs), sharing one set of counters. ``bench/pdbackend.py`` builds the
prefill/decode mocks on this server (``HTTPProtocol.post`` and ``Stream.first_in``).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import resource
import signal
import socket
import sys
from collections.abc import Callable

import orjson

try:  # uvloop is a gateway dependency; fall back so the module stays importable anywhere
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

_LEN_RE = re.compile(rb"content-length:\s*(\d+)", re.I)
_TOKENS_RE = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_PACE_RE = re.compile(rb"bench-pace-ms=(\d+(?:\.\d+)?)")
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')


class Responses:
    """Every byte string the server sends, built once."""

    def __init__(self, model: str, words: int, default_chunks: int, max_chunks: int, pace_ms: float) -> None:
        self.default_chunks = default_chunks
        self.max_chunks = max_chunks
        self.pace_s = pace_ms / 1000.0
        self.head_with_first = False    # a stream's head waits for its first chunk (SGLang), or goes at once (vLLM)
        content = " ".join(["token"] * words)
        body = orjson.dumps({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": words, "total_tokens": 8 + words},
        })
        self.nonstream = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(body)) + body
        self.stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")

        def event(obj) -> bytes:
            payload = b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"
            return b"%x\r\n" % len(payload) + payload + b"\r\n"

        def chunk(delta: dict, finish) -> dict:
            return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000,
                    "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]}

        self.token = event(chunk({"content": "token "}, None))
        self.first = event(chunk({"role": "assistant", "content": "token "}, None))
        self.last = event(chunk({"content": "token "}, "stop"))
        self.usage_events: dict[int, bytes] = {}
        self._usage_chunk = lambda n: event({
            "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": model,
            "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}})
        self.done = event(b"[DONE]") + b"0\r\n\r\n"
        self.connections = 0
        self.streams = 0
        self.held: set[Stream] = set()
        self.by_port: dict[int, int] = {}     # POSTs per listening port (an endpoint each)
        models = orjson.dumps({"object": "list", "data": [
            {"id": model, "object": "model", "created": 1700000000, "owned_by": "bench", "max_model_len": 32768}]})
        self.models = models
        self.info = orjson.dumps({"model_path": model, "served_model_name": model, "is_generation": True,
                                  "max_total_num_tokens": 32768})

    def usage(self, n: int) -> bytes:
        ev = self.usage_events.get(n)
        if ev is None:
            ev = self.usage_events[n] = self._usage_chunk(n)
        return ev

    def get(self, path: bytes) -> bytes:
        path = path.split(b"?", 1)[0]
        if path == b"/bench/stats":
            body, ctype = orjson.dumps({"connections": self.connections, "streams": self.streams,
                                        "held": len(self.held), "by_port": self.by_port},
                                       option=orjson.OPT_NON_STR_KEYS), b"application/json"
        elif path in (b"/health", b"/ping"):
            body, ctype = b"", b"text/plain"
        elif path == b"/metrics":
            body, ctype = b"# fastbackend: no metrics\n", b"text/plain; version=0.0.4"
        elif path == b"/v1/models":
            body, ctype = self.models, b"application/json"
        else:
            body, ctype = self.info, b"application/json"
        return (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (ctype, len(body))) + body


class Stream:
    """One streaming response in progress: writes its chunks on a schedule, stops when the peer leaves."""

    __slots__ = ("proto", "left", "pace", "usage", "n", "handle", "hold", "ended", "first", "headed")

    def __init__(self, proto: HTTPProtocol, n: int, pace: float, usage: bool, hold: bool,
                 first: float | None = None) -> None:
        self.proto = proto
        self.n = n
        self.left = n
        self.pace = pace
        self.usage = usage
        self.hold = hold
        self.ended = False
        self.first = pace if first is None else first   # headers → first chunk (< 0: not yet known)
        self.handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self.headed = False

    def start(self) -> None:
        p = self.proto
        p.r.streams += 1
        if self.hold or not p.r.head_with_first:
            self.head()
        if self.hold:
            p.transport.write(p.r.first)   # one chunk, then nothing until the client goes away
            self.left = 1                  # or until /bench/release: then the last chunk and [DONE]
            p.r.held.add(self)
            return
        if self.first >= 0:
            self.first_in(self.first)

    def head(self) -> None:
        """Write the response head (at once, or with the first chunk: ``--head-with-first``)."""
        if not self.headed:
            self.headed = True
            self.proto.transport.write(self.proto.r.stream_head)

    def first_in(self, delay: float) -> None:
        """Schedule the first chunk ``delay`` seconds from now (the rest follow every ``pace``)."""
        if self.ended:
            return
        if delay > 0:
            self.handle = self.proto.loop.call_later(delay, self.step)
        else:
            self.step()

    def step(self) -> None:
        self.handle = None
        p = self.proto
        if p.transport is None or p.transport.is_closing():
            return
        if p.paused:
            p.resume_cb = self.step
            return
        r = p.r
        left = self.left
        if left == self.n and left > 1:
            data = r.first
        elif left > 1:
            data = r.token
        else:
            data = r.last
            if self.usage:
                data += r.usage(self.n)
            data += r.done
        self.left = left - 1
        if not self.headed:         # SGLang's way: the head goes out with the first chunk
            self.headed = True
            data = r.stream_head + data
        p.transport.write(data)
        if self.left <= 0:
            self.end()
            p.stream = None
            if p.close_after:
                p.transport.close()
            else:
                p.process()
        elif self.pace > 0:
            self.handle = p.loop.call_later(self.pace, self.step)
        else:
            self.handle = p.loop.call_soon(self.step)

    def cancel(self) -> None:
        """The connection went away."""
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        r = self.proto.r
        r.streams -= 1
        r.held.discard(self)

    def release(self) -> None:
        """A held stream: finish it now (the last chunk and [DONE])."""
        self.hold = False
        self.proto.r.held.discard(self)
        if not self.ended:
            self.step()


class HTTPProtocol(asyncio.Protocol):
    __slots__ = ("r", "loop", "transport", "buf", "stream", "paused", "resume_cb", "close_after", "lport")

    def __init__(self, responses: Responses, loop: asyncio.AbstractEventLoop) -> None:
        self.r = responses
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.stream: Stream | None = None
        self.paused = False
        self.resume_cb = None
        self.close_after = False
        self.lport = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.r.connections += 1
        name = transport.get_extra_info("sockname")
        self.lport = name[1] if name else 0
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc) -> None:
        self.r.connections -= 1
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        self.transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        cb, self.resume_cb = self.resume_cb, None
        if cb is not None:
            cb()

    def data_received(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data
        if self.stream is None:
            self.process()

    def post(self, path: bytes, body: bytes, close: bool) -> bool:
        """Answer a POST. True: an answer is in progress (``self.stream``, which calls ``process``
        again once it is over); False: it was written whole."""
        if _STREAM_RE.search(body):
            m = _TOKENS_RE.search(body)
            n = min(int(m.group(1)), self.r.max_chunks) if m else self.r.default_chunks
            n = max(n, 1)
            m = _PACE_RE.search(body)
            pace = float(m.group(1)) / 1000.0 if m else self.r.pace_s
            self.stream = Stream(self, n, pace, b'"include_usage":true' in body.replace(b" ", b""),
                                 b"bench-hold" in body)
            self.close_after = close
            self.stream.start()
            return True
        self.transport.write(self.r.nonstream)
        return False

    def process(self) -> None:
        """Answer every complete request in the buffer (one at a time while a stream is running)."""
        while self.stream is None and self.buf and self.transport is not None:
            buf = self.buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536 or buf.startswith(b"PRI "):   # HTTP/2 preface or garbage
                    self.transport.close()
                return
            head = buf[:end]
            if head.startswith(b"PRI "):
                self.transport.close()
                return
            m = _LEN_RE.search(head)
            clen = int(m.group(1)) if m else 0
            total = end + 4 + clen
            if len(buf) < total:
                return
            body = buf[end + 4:total]
            self.buf = buf[total:]
            line_end = head.find(b"\r\n")
            request_line = head[:line_end] if line_end >= 0 else head
            close = b"connection: close" in head.lower() if b"lose" in head else False
            parts = request_line.split(b" ")
            method = parts[0]
            path = parts[1] if len(parts) > 1 else b"/"
            t = self.transport
            if method == b"GET" or method == b"HEAD":
                t.write(self.r.get(path))
            elif method == b"POST":
                if path == b"/bench/release":
                    held = list(self.r.held)
                    for st in held:
                        st.release()
                    t.write(json_response(orjson.dumps({"released": len(held)})))
                else:
                    self.r.by_port[self.lport] = self.r.by_port.get(self.lport, 0) + 1
                    if self.post(path, body, close):
                        if self.stream is None and close:   # finished synchronously (n == 1)
                            t.close()
                        return
            else:
                t.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
            if close:
                t.close()
                return


def json_response(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (status, len(body))) + body


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve(host: str, ports: list[int], responses: Responses, ready: str | None,
                protocol: Callable[..., asyncio.Protocol] | None = None) -> None:
    """Listen on every port of ``ports`` (one server state for all) until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    make = protocol or HTTPProtocol
    servers = [await loop.create_server(lambda: make(responses, loop), host, port, backlog=4096,
                                        reuse_address=True) for port in ports]
    if ready:
        print(ready.format(port=servers[0].sockets[0].getsockname()[1]), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, action="append",
                   help="port to listen on; repeat for several (endpoints of one backend); default 9000")
    p.add_argument("--model", default="m")
    p.add_argument("--words", type=int, default=16, help="words in the non-streaming answer")
    p.add_argument("--chunks", type=int, default=100, help="stream chunks when the body has no max_tokens")
    p.add_argument("--max-chunks", type=int, default=100000)
    p.add_argument("--pace-ms", type=float, default=0.0, help="default pause between stream chunks")
    p.add_argument("--head-with-first", action="store_true",
                   help="a stream's head goes out with its first chunk, as SGLang's OpenAI server sends it "
                        "(default: at once, as vLLM's)")
    p.add_argument("--ready", default="fastbackend listening on port {port}",
                   help="line printed to stdout once listening ('' for none)")
    args = p.parse_args(argv)
    raise_nofile()
    responses = Responses(args.model, args.words, args.chunks, args.max_chunks, args.pace_ms)
    responses.head_with_first = args.head_with_first
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(serve(args.host, args.port or [9000], responses, args.ready or None))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
