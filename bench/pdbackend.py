"""Prefill/decode mock engines for overhead benchmarks: the timing of a P/D pair, on the wire.

One process serves a prefill port and a decode port of one engine style, on the fast backend's
HTTP server (``bench/fastbackend.py``: pre-encoded answers, a raw asyncio ``Protocol``), so a
benchmark through a gateway measures the gateway's orchestration, not the mock. All times are
taken when a request's body is complete, on the mock's event loop (millisecond timers: every
target sees the same granularity).

``--style vllm`` (context-first, NIXL-like):

- prefill: a body whose ``kv_transfer_params.do_remote_decode`` is true is answered, after
  ``--prefill-ms``, with a non-streaming ``chat.completion`` of one token carrying
  ``kv_transfer_params`` (``do_remote_prefill: true``, an engine id, block ids, host, port);
- decode: a body carrying those ``kv_transfer_params`` (``do_remote_prefill`` true, block ids and
  an engine id) streams its first token ``--transfer-ms`` after it arrived, then one token every
  ``--token-ms``. A body without them is served as a plain request: the decode recomputes the
  prompt, first token after ``--prefill-ms`` (as vLLM does), so a proxy that drops the KV hand-over
  shows in its TTFT, and in the counters.

``--style sglang`` (bootstrap):

- both legs must carry ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` (else 400);
  the two legs of one request meet by room, in either order;
- decode: headers with its first token (SGLang's OpenAI server sends none before it), at
  max(its own arrival, prefill arrival + ``--prefill-ms``) + ``--transfer-ms``, then one every
  ``--token-ms``. A decode whose prefill never comes ends
  with an error event after ``--wait-s``;
- prefill: answered (one token, JSON or a one-chunk stream, as the body asks) at max(prefill
  arrival + ``--prefill-ms``, decode arrival) + ``--transfer-ms``, i.e. once the decode took the
  KV; 500 after ``--wait-s`` without a decode. ``POST /abort_request`` answers 200.

The number of tokens is the body's ``max_tokens`` / ``max_completion_tokens`` (``--chunks`` when
absent); ``"stream": false`` on a decode answers the whole completion once its last token is due.

``GET /bench/stats`` adds a ``pd`` object of counters (prefills, decodes, decodes that got the
KV hand-over or the bootstrap triple, rooms matched, waits that timed out, aborts, bad bodies);
``GET /bench/last`` shows the last prefill and decode bodies received (what a router sends).

    python bench/pdbackend.py --style vllm --prefill-port 9100 --decode-port 9101 \\
        [--prefill-ms 20] [--transfer-ms 2] [--token-ms 5] [--model m]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import orjson
from fastbackend import HTTPProtocol, Responses, Stream, json_response, raise_nofile

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

KV_ANSWER = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "bench-prefill-engine",
             "remote_block_ids": [0, 1, 2, 3], "remote_host": "localhost", "remote_port": 5600, "tp_size": 1}


class Room:
    """The two legs of one SGLang request, met by bootstrap room."""

    __slots__ = ("prefill_at", "decode_at", "prefill", "decode", "timer")

    def __init__(self) -> None:
        self.prefill_at: float | None = None
        self.decode_at: float | None = None
        self.prefill: Delayed | None = None     # a prefill answer waiting for its decode
        self.decode: Stream | Delayed | None = None   # a decode waiting for its prefill
        self.timer: asyncio.TimerHandle | None = None


class PDResponses(Responses):
    def __init__(self, style: str, model: str, chunks: int, prefill_s: float, transfer_s: float,
                 token_s: float, wait_s: float) -> None:
        super().__init__(model, words=1, default_chunks=chunks, max_chunks=100000, pace_ms=0.0)
        self.style = style
        self.head_with_first = style == "sglang"    # SGLang's streams: the head comes with the first token
        self.prefill_s = prefill_s
        self.transfer_s = transfer_s
        self.token_s = token_s
        self.wait_s = wait_s
        self.rooms: dict[int, Room] = {}
        self.pd: dict[str, int] = dict.fromkeys(
            ("prefill", "decode", "prefill_kv", "prefill_plain", "decode_kv", "decode_recompute",
             "decode_bootstrap", "rooms_matched", "prefill_wait_timeouts", "decode_wait_timeouts",
             "aborts", "bad"), 0)
        self.bodies: dict[str, Any] = {}      # the last body of each role
        one = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": model,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "token"},
                            "logprobs": None, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}
        self.prefill_json = json_response(orjson.dumps(one))
        self.prefill_kv_json = json_response(orjson.dumps({**one, "kv_transfer_params": KV_ANSWER}))
        self.prefill_stream = self.stream_head + self.last + self.done

    def get(self, path: bytes) -> bytes:
        path = path.split(b"?", 1)[0]
        if path == b"/bench/stats":
            return json_response(orjson.dumps({"connections": self.connections, "streams": self.streams,
                                               "held": len(self.held), "rooms_open": len(self.rooms),
                                               "pd": self.pd}))
        if path == b"/bench/last":
            return json_response(orjson.dumps(self.bodies))
        return super().get(path)


class Delayed:
    """A whole answer written after a delay; in ``proto.stream`` meanwhile, so pipelined requests wait."""

    __slots__ = ("proto", "data", "handle", "ended", "tail")

    def __init__(self, proto: PDProtocol, data: bytes, tail: float = 0.0) -> None:
        self.proto = proto
        self.data = data
        self.tail = tail          # first token → whole answer (the other tokens' time)
        self.handle: asyncio.TimerHandle | None = None
        self.ended = False

    def first_in(self, delay: float) -> None:
        """The first token is ``delay`` seconds away; the answer goes out ``tail`` after it."""
        if not self.ended:
            self.handle = self.proto.loop.call_later(max(delay + self.tail, 0.0), self.fire)

    def fire(self, data: bytes | None = None) -> None:
        self.handle = None
        if self.ended:
            return
        self.ended = True
        p = self.proto
        if p.transport is None or p.transport.is_closing():
            return
        p.transport.write(self.data if data is None else data)
        p.stream = None
        if p.close_after:
            p.transport.close()
        else:
            p.process()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        self.ended = True


def _tokens(data: dict[str, Any], default: int) -> int:
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
        v = data.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return default


class PDProtocol(HTTPProtocol):
    role = "decode"
    r: PDResponses

    def post(self, path: bytes, body: bytes, close: bool) -> bool:
        r = self.r
        self.close_after = close
        if path.startswith(b"/abort_request"):
            r.pd["aborts"] += 1
            self.transport.write(json_response(b"{}"))
            return False
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            return self._bad("body is not a JSON object")
        r.pd[self.role] += 1
        r.bodies[self.role] = data
        if r.style == "vllm":
            return self._vllm_prefill(data) if self.role == "prefill" else self._vllm_decode(data)
        return self._sglang(data)

    def _bad(self, msg: str) -> bool:
        self.r.pd["bad"] += 1
        err = orjson.dumps({"error": {"message": msg, "type": "BadRequestError", "param": None, "code": 400}})
        self.transport.write(json_response(err, b"400 Bad Request"))
        return False

    def _answer(self, data: dict[str, Any], first: float) -> bool:
        """Generate: a stream whose first token is ``first`` seconds away, or the whole answer then."""
        r = self.r
        n = _tokens(data, r.default_chunks)
        if data.get("stream") is True:
            usage = isinstance(data.get("stream_options"), dict) and data["stream_options"].get("include_usage") is True
            self.stream = Stream(self, n, r.token_s, usage, False, first=first)
            self.stream.start()
        else:
            self.stream = Delayed(self, r.nonstream, tail=(n - 1) * r.token_s)
            if first >= 0:
                self.stream.first_in(first)
        return True

    # -- vLLM: context-first ------------------------------------------------------------------

    def _vllm_prefill(self, data: dict[str, Any]) -> bool:
        r = self.r
        kv = data.get("kv_transfer_params")
        if not (isinstance(kv, dict) and kv.get("do_remote_decode") is True):
            r.pd["prefill_plain"] += 1       # an ordinary request on the prefill engine
            return self._answer(data, r.prefill_s)
        r.pd["prefill_kv"] += 1
        if data.get("stream") is True:       # vLLM gives kv_transfer_params only without streaming
            self.stream = Delayed(self, r.prefill_stream)
        else:
            self.stream = Delayed(self, r.prefill_kv_json)
        self.stream.first_in(r.prefill_s)
        return True

    def _vllm_decode(self, data: dict[str, Any]) -> bool:
        r = self.r
        kv = data.get("kv_transfer_params")
        if (isinstance(kv, dict) and kv.get("do_remote_prefill") is True and kv.get("remote_engine_id")
                and kv.get("remote_block_ids") is not None and kv.get("remote_host")):
            r.pd["decode_kv"] += 1
            return self._answer(data, r.transfer_s)
        r.pd["decode_recompute"] += 1
        return self._answer(data, r.prefill_s)

    # -- SGLang: bootstrap --------------------------------------------------------------------

    def _sglang(self, data: dict[str, Any]) -> bool:
        r = self.r
        room_id = data.get("bootstrap_room")
        if not (isinstance(room_id, int) and data.get("bootstrap_host") and data.get("bootstrap_port") is not None):
            return self._bad(f"{self.role}: bootstrap_host, bootstrap_port and bootstrap_room are required")
        now = self.loop.time()
        room = r.rooms.get(room_id)
        if room is None:
            room = r.rooms[room_id] = Room()
            room.timer = self.loop.call_later(r.wait_s, self._expire, room_id)
        if self.role == "prefill":
            if room.prefill_at is not None:
                return self._bad("prefill: bootstrap_room already in use")
            room.prefill_at = now
            answer = r.prefill_stream if data.get("stream") is True else r.prefill_json
            self.stream = Delayed(self, answer)
            if room.decode_at is None:
                room.prefill = self.stream       # answered once its decode has come for the KV
            else:
                self.stream.first_in(max(now + r.prefill_s, room.decode_at) + r.transfer_s - now)
                if room.decode is not None:      # the decode was waiting for this prefill
                    room.decode.first_in(r.prefill_s + r.transfer_s)
                    room.decode = None
                self._matched(room_id, room)
            return True
        if room.decode_at is not None:
            return self._bad("decode: bootstrap_room already in use")
        room.decode_at = now
        r.pd["decode_bootstrap"] += 1
        if room.prefill_at is None:
            self._answer(data, -1.0)             # headers and first token once the prefill came
            room.decode = self.stream
            return True
        self._answer(data, max(now, room.prefill_at + r.prefill_s) + r.transfer_s - now)
        if room.prefill is not None:
            room.prefill.first_in(max(room.prefill_at + r.prefill_s, now) + r.transfer_s - now)
            room.prefill = None
        self._matched(room_id, room)
        return True

    def _matched(self, room_id: int, room: Room) -> None:
        self.r.pd["rooms_matched"] += 1
        if room.timer is not None:
            room.timer.cancel()
        self.r.rooms.pop(room_id, None)

    def _expire(self, room_id: int) -> None:
        r = self.r
        room = r.rooms.pop(room_id, None)
        if room is None:
            return
        if room.prefill is not None:
            r.pd["prefill_wait_timeouts"] += 1
            err = orjson.dumps({"error": {"message": "KV transfer: no decode came for this bootstrap room",
                                          "type": "InternalServerError", "param": None, "code": 500}})
            room.prefill.fire(json_response(err, b"500 Internal Server Error"))
        if room.decode is not None:
            r.pd["decode_wait_timeouts"] += 1
            st = room.decode
            if isinstance(st, Stream):
                p = st.proto
                if p.transport is not None and not p.transport.is_closing():
                    st.head()
                    ev = b'data: {"error": {"message": "KV transfer: no prefill came", "code": 500}}\n\n'
                    p.transport.write(b"%x\r\n" % len(ev) + ev + b"\r\n" + r.done)
                    st.end()
                    p.stream = None
                    p.transport.close()
            else:
                st.fire(json_response(b'{"error": {"message": "KV transfer: no prefill came"}}',
                                      b"500 Internal Server Error"))


class PrefillProtocol(PDProtocol):
    role = "prefill"


async def serve(host: str, prefill_port: int, decode_port: int, r: PDResponses, ready: str | None) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(lambda cls=cls: cls(r, loop), host, port, backlog=4096, reuse_address=True)
               for cls, port in ((PrefillProtocol, prefill_port), (PDProtocol, decode_port))]
    if ready:
        print(ready, flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--style", choices=("vllm", "sglang"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--decode-port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--chunks", type=int, default=32, help="tokens when the body names no max_tokens")
    p.add_argument("--prefill-ms", type=float, default=20.0)
    p.add_argument("--transfer-ms", type=float, default=2.0)
    p.add_argument("--token-ms", type=float, default=5.0)
    p.add_argument("--wait-s", type=float, default=10.0, help="SGLang: how long a leg waits for its other half")
    p.add_argument("--ready", default="pdbackend ready", help="line printed once listening ('' for none)")
    args = p.parse_args(argv)
    raise_nofile()
    r = PDResponses(args.style, args.model, args.chunks, args.prefill_ms / 1e3, args.transfer_ms / 1e3,
                    args.token_ms / 1e3, args.wait_s)
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        run(serve(args.host, args.prefill_port, args.decode_port, r, args.ready or None))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
