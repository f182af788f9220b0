"""vLLM prefill/decode roles: the NIXL connector in pull mode, with an HTTP side channel.

Both roles are one class, as in vLLM, where every instance with a ``NixlConnector`` can do both
halves and only the proxy decides who is P and who is D. The prefill role additionally runs the
side channel (the listener a decode pulls from), so it is the one that can serve
``do_remote_decode`` requests.

Prefill (``kv_transfer_params.do_remote_decode`` truthy): the request runs normally (a proxy sends
``max_tokens=1``, ``stream=false``). When it finishes *length-capped*, its prompt blocks stay
pinned under a lease and the answer carries the top-level ``kv_transfer_params`` a decode needs
(``do_remote_prefill: true``, ``remote_engine_id``, ``remote_block_ids`` as a list of lists,
``remote_request_id`` = the internal id, ``remote_host``/``remote_port`` of the side channel, ...).
A request that stopped for another reason gets ``kv_transfer_params: null`` and keeps nothing,
as vLLM's ``request_finished`` does. The lease (``kv_lease_s``) frees the blocks if nobody pulls.

Side channel: ``POST /kv/pull {remote_engine_id, remote_request_id, remote_block_ids}`` checks the
engine id and that the blocks are still pinned, releases them and answers 200; unknown or expired
ids are 404, a wrong engine id or block list is 409.

Decode (``kv_transfer_params.do_remote_prefill`` truthy with engine/host/port/request id): once
admitted, it pulls from ``remote_host:remote_port`` and spends ``ttft_base_ms`` plus
``kv_transfer_ms_per_token`` per transferred token instead of the prefill compute; transferred
tokens count as cached. A failed pull applies ``kv_load_failure_policy``: ``fail`` ends the request
with an engine error (HTTP 500 / in-stream error), ``recompute`` prefills locally at full cost.
Malformed params are logged and the prompt is recomputed; ``null`` or missing params are the
plain path. The decode samples its first token itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from enginesim.config import SimConfig
from enginesim.errors import ApiError, RequestFailed
from enginesim.pd_common import SideListener, client_session, close_session, read_body, url_host
from enginesim.roles import BaseRole, RoleHost
from enginesim.sequence import Sequence
from enginesim.wire import json_response

if TYPE_CHECKING:
    from enginesim.kvcache import Allocation

log = logging.getLogger("enginesim")

NIXL_CONNECTOR_VERSION = 15
# A pull that takes longer than this (connect + answer) counts as a failed KV load.
PULL_TIMEOUT_S = 10.0
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(eq=False)
class Pinned:
    """Prompt blocks of a finished prefill, kept for a decode to pull."""

    seq_id: str
    rid: str
    alloc: Allocation
    block_ids: list[int]
    num_tokens: int
    expires_at: float  # monotonic
    timer: asyncio.TimerHandle
    rank: int = 0      # the data-parallel rank whose pool holds them


@dataclass(eq=False)
class SharedPull:
    """The one pull a decode request's choices share, and how many of them have not finished."""

    pull: asyncio.Future[str | None] | None = None
    left: int = 0


@dataclass(frozen=True)
class RemotePrefill:
    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: Any


def _invalid_reason(kv: dict[str, Any]) -> str | None:
    """Why decode-side params cannot be used (vLLM logs and recomputes), or ``None``."""
    missing = [k for k in _REQUIRED if kv.get(k) in (None, "")]
    if missing:
        return f"missing {', '.join(missing)}"
    port = kv["remote_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return f"remote_port {port!r} is not a port"
    for k in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(kv[k], str):
            return f"{k} is not a string"
    blocks = kv.get("remote_block_ids")
    if blocks is not None and not isinstance(blocks, list):
        return "remote_block_ids is not a list"
    return None


def _flat_blocks(blocks: Any) -> list[Any] | None:
    """``[[1, 2], [3]]`` or the older flat ``[1, 2, 3]`` as one flat list."""
    if not isinstance(blocks, list):
        return None
    out: list[Any] = []
    for b in blocks:
        if isinstance(b, list):
            out.extend(b)
        else:
            out.append(b)
    return out


class NixlRole(BaseRole):
    def __init__(self, cfg: SimConfig, engine: RoleHost) -> None:
        super().__init__(cfg, engine)
        self.name = cfg.role
        self.disaggregation_mode = cfg.role
        self.engine_id = cfg.engine_id or str(uuid.uuid4())
        self.serves_pulls = cfg.role == "prefill"
        self.pinned: dict[str, Pinned] = {}
        self.transfers = 0  # prefill: pulls served; decode: successful pulls
        self.kv_failures = 0  # prefill: refused pulls; decode: failed pulls
        self.expired = 0
        self.recomputed = 0
        self._listener: SideListener | None = None
        self._session: aiohttp.ClientSession | None = None
        # decode, n > 1: the choices of one request carry the same kv_transfer_params and read the
        # same remote blocks; one pull serves them (its outcome, and how many of them are left)
        self._shared: dict[tuple[str, str, str], SharedPull] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = client_session()
        if not self.serves_pulls:
            return
        app = web.Application()
        app.add_routes([web.post("/kv/pull", self._serve_pull), web.get("/health", self._health)])
        listener = SideListener(app, self.cfg.host, self.cfg.side_channel_port)
        try:
            self.side_channel_port = await listener.start()
        except BaseException:
            await close_session(self._session)
            self._session = None
            raise
        self._listener = listener

    async def close(self) -> None:
        for pinned in list(self.pinned.values()):
            pinned.timer.cancel()
            self.engine.pools[pinned.rank].free(pinned.alloc)
        self.pinned.clear()
        if self._listener is not None:
            await self._listener.close()
        await close_session(self._session)
        self._session = None

    # -- request hooks --------------------------------------------------------------------------

    def accept(self, seq: Sequence, body: dict[str, Any], prompt: int = 0, prompts: int = 1) -> None:
        kv = body.get("kv_transfer_params")
        if kv is None:
            return
        if not isinstance(kv, dict):
            raise ApiError(400, "1 validation error:\n  kv_transfer_params: Input should be a valid "
                           "dictionary", type_="Bad Request", param="kv_transfer_params")
        ids = kv.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
            raise ApiError(400, "kv_transfer_params.prompt_token_ids must be a non-empty list of "
                           "non-negative integers", type_="BadRequestError", param="kv_transfer_params")
        if kv.get("do_remote_decode") and self.serves_pulls:
            seq.role_data["remote_decode"] = True
        if kv.get("do_remote_prefill"):
            reason = _invalid_reason(kv)
            if reason is not None:
                log.warning("Got invalid KVTransferParams: %s (%s). This request will not utilize "
                            "KVTransfer", kv, reason)
                seq.role_data["kv_invalid"] = reason
                return
            remote = RemotePrefill(
                engine_id=kv["remote_engine_id"], request_id=kv["remote_request_id"],
                host=kv["remote_host"], port=kv["remote_port"], block_ids=kv.get("remote_block_ids"))
            seq.role_data["remote_prefill"] = remote
            key = (seq.id, remote.engine_id, remote.request_id)
            self._shared.setdefault(key, SharedPull()).left += 1
            seq.role_data["pull_key"] = key

    async def prefill(self, seq: Sequence, compute_s: float) -> None:
        remote: RemotePrefill | None = seq.role_data.get("remote_prefill")
        if remote is None:
            await asyncio.sleep(compute_s)
            return
        to_pull = max(0, seq.prompt_tokens - seq.cached_tokens)  # local prefix hits stay local
        if seq.fault.kv_pull_fail:
            error: str | None = "simulated KV pull failure (x-sim-fault kv_pull_fail)"
        else:
            error = await self._shared_pull(seq, remote)
        if error is not None:
            self.kv_failures += 1
            if self.cfg.kv_load_failure_policy == "fail":
                log.warning("KV load failed for request %s: %s", seq.rid, error)
                raise RequestFailed(f"KV load failed for request {seq.rid}: {error}")
            log.warning("KV load failed for request %s: %s; recomputing the prompt locally", seq.rid, error)
            self.recomputed += 1
            seq.role_data["recomputed"] = True
            await asyncio.sleep(compute_s)
            return
        cfg = self.cfg
        await asyncio.sleep((cfg.ttft_base_ms + cfg.kv_transfer_ms_per_token * to_pull) / 1000.0)
        # vLLM counts every block it received as a prefix hit.
        seq.cached_tokens = seq.prompt_tokens
        seq.role_data["kv_transferred_tokens"] = to_pull

    async def _shared_pull(self, seq: Sequence, remote: RemotePrefill) -> str | None:
        """The pull of ``seq``'s blocks: the first of a request's choices pulls, the others (vLLM's
        child requests of ``n`` > 1, all with the request's kv_transfer_params) read the same
        blocks and share its outcome."""
        shared = self._shared[seq.role_data["pull_key"]]
        if shared.pull is not None:
            return await asyncio.shield(shared.pull)
        shared.pull = asyncio.ensure_future(self._pull(remote))
        error = await asyncio.shield(shared.pull)
        if error is None:
            self.transfers += 1
        return error

    def on_finish(self, seq: Sequence) -> None:
        key = seq.role_data.get("pull_key")
        shared = self._shared.get(key) if key is not None else None
        if shared is not None:
            shared.left -= 1
            if shared.left <= 0:
                del self._shared[key]

    async def _pull(self, remote: RemotePrefill) -> str | None:
        """Pull (and so release) the remote blocks; the failure reason, or ``None`` on success."""
        assert self._session is not None
        url = f"http://{url_host(remote.host)}:{remote.port}/kv/pull"
        payload = {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id,
                   "remote_block_ids": remote.block_ids}
        try:
            async with asyncio.timeout(PULL_TIMEOUT_S):
                async with self._session.post(url, json=payload) as resp:
                    answer = await read_body(resp)
                    if resp.status != 200:
                        detail = answer.get("error") if isinstance(answer, dict) else answer
                        return f"side channel {remote.host}:{remote.port} refused the pull " \
                               f"({resp.status}): {detail}"
        except TimeoutError:
            return f"side channel {remote.host}:{remote.port} did not answer within {PULL_TIMEOUT_S:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"cannot reach side channel {remote.host}:{remote.port}: {exc}"
        return None

    def retain_blocks(self, seq: Sequence) -> bool:
        if not seq.role_data.get("remote_decode") or seq.finish_reason != "length" or seq.alloc is None:
            return False
        pool = self.engine.pools[seq.rank]
        block_ids = list(seq.alloc.block_ids[:pool.blocks_for(seq.prompt_tokens)])
        lease = self.cfg.kv_lease_s
        timer = asyncio.get_running_loop().call_later(lease, self._expire, seq.rid)
        self.pinned[seq.rid] = Pinned(seq_id=seq.id, rid=seq.rid, alloc=seq.alloc, block_ids=block_ids,
                                      num_tokens=seq.prompt_tokens, expires_at=time.monotonic() + lease,
                                      timer=timer, rank=seq.rank)
        seq.role_data["kv_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": seq.rid,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.side_channel_port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": seq.prompt_tokens,
            "remote_blocks_expiry_time": None,  # only a decode-side answer fills this in
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }
        return True

    def response_extras(self, seq: Sequence) -> dict[str, Any]:
        if not seq.role_data.get("remote_decode"):
            return {}
        return {"kv_transfer_params": seq.role_data.get("kv_params")}

    def _release(self, rid: str) -> Pinned | None:
        pinned = self.pinned.pop(rid, None)
        if pinned is not None:
            pinned.timer.cancel()
            self.engine.pools[pinned.rank].free(pinned.alloc)
            self.engine.reschedule()  # freed blocks may let a waiting request in
        return pinned

    def _expire(self, rid: str) -> None:
        if self._release(rid) is not None:
            self.expired += 1
            log.info("KV lease of request %s expired after %gs; blocks freed", rid, self.cfg.kv_lease_s)

    # -- side channel ---------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _serve_pull(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return json_response({"error": "expected a JSON object"}, status=400)
        rid = body.get("remote_request_id")
        if body.get("remote_engine_id") != self.engine_id:
            self.kv_failures += 1
            return json_response({"error": f"engine id mismatch: this engine is {self.engine_id}, "
                                           f"asked for {body.get('remote_engine_id')!r}"}, status=409)
        pinned = self.pinned.get(rid) if isinstance(rid, str) else None
        if pinned is None:
            self.kv_failures += 1
            return json_response({"error": f"no pinned blocks for request {rid!r} (unknown, expired "
                                           "or already pulled)"}, status=404)
        asked = body.get("remote_block_ids")
        if asked is not None and _flat_blocks(asked) != pinned.block_ids:
            self.kv_failures += 1
            return json_response({"error": f"block ids do not match the blocks pinned for {rid}"},
                                 status=409)
        self._release(rid)
        self.transfers += 1
        return json_response({"remote_request_id": rid, "num_tokens": pinned.num_tokens,
                              "remote_block_ids": [pinned.block_ids]})

    # -- introspection --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "engine_id": self.engine_id,
            "side_channel_port": self.side_channel_port,
            "pinned": [{"id": p.seq_id, "remote_request_id": p.rid, "block_ids": [p.block_ids],
                        "num_tokens": p.num_tokens, "expires_in_s": round(max(0.0, p.expires_at - now), 3)}
                       for p in self.pinned.values()],
            "rooms_waiting": [],
            "transfers": self.transfers,
            "kv_failures": self.kv_failures,
            "expired": self.expired,
            "recomputed": self.recomputed,
        }
