"""SGLang prefill/decode roles: the bootstrap server and the rendezvous on ``bootstrap_room``.

A router sends the *same* body (plus ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``) to a
prefill and a decode engine at once; the two meet on the room, the prefill sends its KV and its
first sampled token, the decode continues from there. Either side may arrive first.

Prefill (``--role prefill``): runs the bootstrap server on ``bootstrap_port`` (``GET /health`` ->
``OK``, ``GET /route`` for the decode's handshake, ``POST /rendezvous/{room}`` where a decode
waits for its KV). A request is parked in the *bootstrap queue* until its decode shows up (at most
``bootstrap_timeout_s``: then it is aborted with status 500, "Request <room> timed out after Xs in
KVPoll.Bootstrapping"), then queued and prefilled like any request, samples its one token, sends
the KV (``kv_transfer_ms_per_token`` per prompt token, the *inflight queue*) and answers only once
the decode's rendezvous call took the KV. It generates exactly one token and reports
``finish_reason`` length (``/generate``: ``{"type": "length", "length": 0}``).

Decode (``--role decode``): a request is parked while it handshakes with the bootstrap server
(*prealloc queue*; an unreachable or wrong bootstrap address is aborted with status 500 at once)
and while it waits for the KV (*transfer queue*, at most ``waiting_timeout_s``: then aborted with
status 500, "... fail to receive KV Cache transfer done signal ..."). Then it is queued, skips the
prefill and emits the prefill's token first. It has no radix cache of its own and reports the
prefill's ``cached_tokens``.

Aborts (``/abort_request`` by rid prefix, client disconnect) end a parked request at once. A
prefill that goes away does not tell its decode, which waits for its own timeout, as in SGLang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from enginesim.config import SimConfig
from enginesim.errors import ApiError, RequestFailed
from enginesim.pd_common import SideListener, client_session, close_session, read_body, url_host
from enginesim.roles import BaseRole, RoleHost
from enginesim.sequence import Sequence
from enginesim.tokenizer import OutputSource
from enginesim.wire import json_response

log = logging.getLogger("enginesim")

NO_ROOM = "Invalid request: Disaggregated request received without bootstrap room id."
NO_HOST = "Invalid request: Disaggregated request received without bootstrap host."
ROOM_LIMIT = 2**63
# The decode's handshake with the bootstrap server (GET /route) must answer within this.
HANDSHAKE_TIMEOUT_S = 10.0

PD_GAUGES = ("num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs",
             "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs",
             "kv_transfer_latency_ms")


def _item(body: dict[str, Any], key: str, prompt: int, prompts: int) -> tuple[Any, bool]:
    """``body[key]`` for prompt ``prompt`` of ``prompts``: a list's element of that index (a list
    must name one value a prompt; a one-element list stands for one prompt's value), else the
    value itself, and whether it was a list."""
    value = body.get(key)
    if not isinstance(value, list):
        return value, False
    if len(value) != prompts:
        if prompts == 1:
            return value, True      # refused by the caller's type check
        raise ApiError(400, f"Invalid request: {key} has {len(value)} values for a batch of {prompts} prompts.",
                       type_="BadRequest")
    return value[prompt], True


@dataclass(frozen=True)
class Bootstrap:
    host: str | None
    port: int | None
    room: int


def parse_bootstrap(body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> Bootstrap:
    """Prompt ``prompt``'s bootstrap triple. Like SGLang's GenerateReqInput normalization, a batch
    gives its prompt i the room ``bootstrap_room[i]`` of a list, or ``bootstrap_room + i`` of one
    room, on both legs, so each prompt meets its own counterpart."""
    room, listed = _item(body, "bootstrap_room", prompt, prompts)
    if room is None:
        raise ApiError(400, NO_ROOM, type_="BadRequest")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < ROOM_LIMIT:
        raise ApiError(400, f"Invalid request: bootstrap_room must be an integer in [0, 2^63), got {room!r}.",
                       type_="BadRequest")
    if not listed:
        room += prompt
    host, _ = _item(body, "bootstrap_host", prompt, prompts)
    if host is not None and not isinstance(host, str):
        raise ApiError(400, f"Invalid request: bootstrap_host must be a string, got {host!r}.", type_="BadRequest")
    port, _ = _item(body, "bootstrap_port", prompt, prompts)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ApiError(400, f"Invalid request: bootstrap_port must be a port number, got {port!r}.",
                       type_="BadRequest")
    return Bootstrap(host=host or None, port=port, room=room)


@dataclass(eq=False)
class Room:
    """Prefill-side meeting point of one prefill request and one decode request."""

    room: int
    prefill: Sequence | None = None
    decode_rid: str | None = None
    decode_fail: bool = False  # the decode asked for a failed transfer (kv_pull_fail)
    decode_gone: bool = False  # the decode's rendezvous call went away before taking the KV
    result: dict[str, Any] | None = None
    failed: str | None = None
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # result or failed is set
    released: asyncio.Event = field(default_factory=asyncio.Event)  # the decode's call is over
    created: float = field(default_factory=time.monotonic)


class _SglangPD(BaseRole):
    def __init__(self, cfg: SimConfig, engine: RoleHost) -> None:
        super().__init__(cfg, engine)
        self.phases: dict[Sequence, str] = {}  # parked/transferring requests and where they are
        self.transfers = 0
        self.kv_failures = 0
        self.bootstrap_failures = 0
        self.last_transfer_ms = 0.0

    def wants_stage(self, seq: Sequence) -> bool:
        return True

    def on_finish(self, seq: Sequence) -> None:
        self.phases.pop(seq, None)

    def _count_phase(self, phase: str) -> int:
        return sum(1 for p in self.phases.values() if p == phase)

    def gauges(self) -> dict[str, float]:
        return {"num_prefill_bootstrap_queue_reqs": self._count_phase("bootstrapping"),
                "num_prefill_inflight_queue_reqs": self._count_phase("inflight"),
                "num_decode_prealloc_queue_reqs": self._count_phase("prealloc"),
                "num_decode_transfer_queue_reqs": self._count_phase("transfer"),
                "kv_transfer_latency_ms": self.last_transfer_ms}

    def _failure(self, kind: str) -> None:
        if kind == "bootstrap":
            self.bootstrap_failures += 1
        self.kv_failures += 1
        self.engine.metrics.on_pd_event(f"{kind}_failed")

    def _transferred(self, ms: float) -> None:
        self.transfers += 1
        self.last_transfer_ms = ms
        self.engine.metrics.on_pd_event("transfer_done")

    def _base_state(self) -> dict[str, Any]:
        return {"pinned": [], "transfers": self.transfers, "kv_failures": self.kv_failures,
                "bootstrap_failures": self.bootstrap_failures}


class SglangPrefillRole(_SglangPD):
    name = "prefill"
    disaggregation_mode = "prefill"

    def __init__(self, cfg: SimConfig, engine: RoleHost) -> None:
        super().__init__(cfg, engine)
        self.rooms: dict[int, Room] = {}
        self._listener: SideListener | None = None

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/health", self._health), web.get("/route", self._route),
                        web.post("/rendezvous/{room}", self._rendezvous)])
        listener = SideListener(app, self.cfg.host, self.cfg.bootstrap_port)
        self.bootstrap_port = await listener.start()
        self._listener = listener

    async def close(self) -> None:
        for room in self.rooms.values():  # wake waiting decodes: this prefill is going away
            if not room.done.is_set():
                room.failed = "prefill server is shutting down"
                room.done.set()
        if self._listener is not None:
            await self._listener.close()

    # -- request hooks --------------------------------------------------------------------------

    def accept(self, seq: Sequence, body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> None:
        seq.role_data["bootstrap"] = parse_bootstrap(body, prompt, prompts)
        # The prefill samples one token and is done once its KV has been sent.
        seq.params = dataclasses.replace(seq.params, max_tokens=1)
        seq.role_data["finish_length"] = 0

    async def stage(self, seq: Sequence) -> None:
        """The bootstrap queue: wait until the decode for this room has shown up."""
        room_id = seq.role_data["bootstrap"].room
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room(room_id)
        elif room.prefill is not None:
            raise RequestFailed(f"bootstrap_room {room_id} is already used by request {room.prefill.rid}",
                                abort_status=400)
        room.prefill = seq
        seq.role_data["room"] = room
        self.phases[seq] = "bootstrapping"
        timeout = self.cfg.bootstrap_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await room.decode_arrived.wait()
        except TimeoutError:
            self._failure("bootstrap")
            raise RequestFailed(f"Request {room_id} timed out after {timeout:g}s in KVPoll.Bootstrapping",
                                abort_status=500) from None
        self.phases.pop(seq, None)

    async def prefill(self, seq: Sequence, compute_s: float) -> None:
        room: Room = seq.role_data["room"]
        await asyncio.sleep(compute_s)
        cfg = self.cfg
        source = OutputSource(self.engine.tokenizer, cfg.seed, seq.output_key, seq.prompt_ids)
        allow_eos = not seq.params.ignore_eos and seq.params.min_tokens <= 0
        seq.first_token = source.next_token(allow_eos, cfg.eos_probability)
        self.phases[seq] = "inflight"
        if room.decode_fail or seq.fault.kv_pull_fail:
            room.failed = f"KVTransferError(bootstrap_room={room.room}): Failed to send kv chunk of " \
                          f"{room.room} to the decode (simulated)"
            room.done.set()
            self._failure("transfer")
            raise RequestFailed(room.failed, abort_status=500)
        transfer_ms = cfg.kv_transfer_ms_per_token * seq.prompt_tokens
        await asyncio.sleep(transfer_ms / 1000.0)
        room.result = {"first_token": seq.first_token, "prompt_tokens": seq.prompt_tokens,
                       "cached_tokens": seq.cached_tokens, "transfer_ms": transfer_ms, "rid": seq.rid}
        room.done.set()
        # Answer only once the decode took the KV (or went away, so nobody is left to take it).
        await room.released.wait()
        self._transferred(transfer_ms)

    def on_finish(self, seq: Sequence) -> None:
        super().on_finish(seq)
        room: Room | None = seq.role_data.get("room")
        if room is not None and room.prefill is seq:
            room.prefill = None
            self._maybe_drop(room)

    def _maybe_drop(self, room: Room) -> None:
        if room.prefill is None and (room.decode_rid is None or room.released.is_set()):
            if self.rooms.get(room.room) is room:
                del self.rooms[room.room]

    # -- bootstrap server -----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        return json_response({"engine": "enginesim", "disaggregation_mode": "prefill", "dp_size": 1,
                              "tp_size": 1, "pp_size": 1, "page_size": self.cfg.block_size,
                              "model": self.cfg.served_name})

    async def _rendezvous(self, request: web.Request) -> web.StreamResponse:
        try:
            room_id = int(request.match_info["room"])
            body = await request.json()
        except ValueError:
            return json_response({"error": "expected an integer room and a JSON body"}, status=400)
        if not isinstance(body, dict):
            body = {}
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room(room_id)
        elif room.decode_rid is not None:
            return json_response({"error": f"bootstrap_room {room_id} already has a decode "
                                           f"({room.decode_rid})"}, status=409)
        room.decode_rid = str(body.get("rid") or "?")
        room.decode_fail = bool(body.get("fail"))
        room.decode_arrived.set()
        try:
            await room.done.wait()
            if room.failed is not None:
                return json_response({"error": room.failed}, status=500)
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(orjson.dumps(room.result))
            await resp.write_eof()
            return resp
        except BaseException:
            room.decode_gone = True
            raise
        finally:
            room.released.set()
            self._maybe_drop(room)

    # -- introspection --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        rooms = []
        for room in self.rooms.values():
            if room.prefill is not None:
                phase = self.phases.get(room.prefill, "prefilling")
                rooms.append({"room": room.room, "side": "prefill", "rid": room.prefill.rid,
                              "state": phase, "decode_arrived": room.decode_arrived.is_set(),
                              "age_s": round(now - room.created, 3)})
            if room.decode_rid is not None and not room.released.is_set():
                rooms.append({"room": room.room, "side": "decode", "rid": room.decode_rid,
                              "state": "waiting_for_kv", "prefill_arrived": room.prefill is not None,
                              "age_s": round(now - room.created, 3)})
        return {**self._base_state(), "bootstrap_port": self.bootstrap_port, "rooms_waiting": rooms}


class SglangDecodeRole(_SglangPD):
    name = "decode"
    disaggregation_mode = "decode"

    def __init__(self, cfg: SimConfig, engine: RoleHost) -> None:
        super().__init__(cfg, engine)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = client_session()

    async def close(self) -> None:
        await close_session(self._session)
        self._session = None

    def accept(self, seq: Sequence, body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> None:
        boot = parse_bootstrap(body, prompt, prompts)
        if boot.host is None:
            raise ApiError(400, NO_HOST, type_="BadRequest")
        seq.role_data["bootstrap"] = boot
        seq.hashes = []  # no decode-side radix cache (--disaggregation-decode-enable-radix-cache off)

    async def stage(self, seq: Sequence) -> None:
        """The prealloc queue (handshake with the bootstrap server), then the transfer queue."""
        assert self._session is not None
        boot: Bootstrap = seq.role_data["bootstrap"]
        port = boot.port or self.cfg.bootstrap_port
        addr = f"{boot.host}:{port}"
        base = f"http://{url_host(boot.host or '')}:{port}"
        who = f"rid={seq.rid!r} bootstrap_room={boot.room}"
        self.phases[seq] = "prealloc"
        try:
            async with asyncio.timeout(min(HANDSHAKE_TIMEOUT_S, self.cfg.waiting_timeout_s)):
                async with self._session.get(base + "/route") as resp:
                    await resp.read()
                    ok = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            ok = False
        if not ok:
            self._failure("bootstrap")
            raise RequestFailed(f"Decode handshake failed for request {who}: Could not fetch prefill "
                                f"parallel info from bootstrap_addr: {addr}", abort_status=500)
        self.phases[seq] = "transfer"
        timeout = self.cfg.waiting_timeout_s
        started = time.monotonic()
        payload = {"rid": seq.rid, "prompt_tokens": seq.prompt_tokens, "fail": seq.fault.kv_pull_fail}
        try:
            async with asyncio.timeout(timeout):
                async with self._session.post(f"{base}/rendezvous/{boot.room}", json=payload) as resp:
                    answer = await read_body(resp)
                    status = resp.status
        except TimeoutError:
            self._failure("transfer")
            raise RequestFailed(
                f"Decode transfer failed for request {who}: Request {boot.room} timed out after {timeout:g}s "
                "in KVPoll.WaitingForInput. Some requests fail to receive KV Cache transfer done signal "
                "after bootstrapping. If a greater mean TTFT is acceptable, you can 'export "
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600' (10 minutes) to relax the timeout condition.",
                abort_status=500) from None
        except (aiohttp.ClientError, OSError) as exc:
            self._failure("transfer")
            raise RequestFailed(f"Decode transfer failed for request {who}: lost the prefill at {addr}: "
                                f"{exc}", abort_status=500) from None
        if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("first_token"), int):
            detail = answer.get("error") if isinstance(answer, dict) else answer
            self._failure("transfer")
            raise RequestFailed(f"Decode transfer failed for request {who}: {detail}", abort_status=500)
        seq.first_token = answer["first_token"]
        seq.role_data["remote_cached"] = int(answer.get("cached_tokens") or 0)
        self._transferred(float(answer.get("transfer_ms") or (time.monotonic() - started) * 1000.0))
        self.phases.pop(seq, None)

    async def prefill(self, seq: Sequence, compute_s: float) -> None:
        # The KV arrived with the prefill's first token: nothing to compute before emitting it.
        seq.cached_tokens = seq.role_data.get("remote_cached", 0)
        await asyncio.sleep(0)

    def state(self) -> dict[str, Any]:
        rooms = [{"room": s.role_data["bootstrap"].room, "side": "decode", "rid": s.rid, "state": phase}
                 for s, phase in self.phases.items()]
        return {**self._base_state(), "rooms_waiting": rooms}
