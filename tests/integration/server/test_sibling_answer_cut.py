"""``--workers 2``: a sibling killed while it wrote its answer to a scrape's question (an answer of
hundreds of KB, for a gateway of many endpoints, takes several writes) leaves the asker with the
first part of it and the end of the stream, as if it had said all. The asker must not take the part
for the whole: the sibling's counts would be missing from that answer (Prometheus reads the fall as a
reset), and the status page would fail on the half of a JSON document. Its last report stands for it,
as for a sibling that did not answer in time.

The cut is made by hand: the parent is stopped (so it does not restart the sibling), the sibling
killed, and a socket of the test's put in its place answers the first half of what the sibling
answered before."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from tests.integration.server.test_worker_restart_metrics import COMPLETION, Pages, config, connections
from tests.integration.server.test_workers import children_of, sibling_sockets
from tests.support.gateway_process import gateway_process, post_new
from tests.support.metrics import metric
from tests.support.ports import listen_port
from tests.support.waiting import sigstop, until


async def asked(path: str, kind: bytes) -> bytes:
    """Everything a worker's sibling socket sends for ``kind``, as it sends it."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(kind + b"\n")
    await writer.drain()
    out = await reader.read()
    writer.close()
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", ["within_a_line", "at_a_line_end"])
async def test_an_answer_cut_short_by_the_siblings_death_is_not_taken_for_the_whole(sims, tmp_path, cut):
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = config(tmp_path / "gw.yaml", port, [sim.url])
    pages = Pages()
    parent_stopped = False
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2) as proc, \
            contextlib.AsyncExitStack() as stack:
        survivor, victim = await connections(port, 2, stack)
        for _ in range(6):
            for w in (survivor, victim):
                async with w.session.post(w.base + "/v1/completions", json=COMPLETION) as r:
                    assert r.status == 200
        page = pages.saw(await survivor.get("/metrics"))
        assert metric(page, "switchyard_requests_total", status="200") == 12
        assert (await survivor.status())["totals"]["requests_since_start"] == 12
        path = sibling_sockets([victim.pid])[victim.pid]
        whole = {b"metrics": await asked(path, b"metrics"), b"status": await asked(path, b"status")}
        if cut == "within_a_line":
            part = {k: v[:len(v) // 2] for k, v in whole.items()}
        else:   # the exposition cut at the end of a line (what is left parses), the JSON after a comma
            part = {b"metrics": whole[b"metrics"][:whole[b"metrics"].rindex(b"\n", 0, len(whole[b"metrics"]) // 2) + 1],
                    b"status": whole[b"status"][:whole[b"status"].index(b",", len(whole[b"status"]) // 2) + 1]}

        async def answer_part(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            kind = (await reader.readline()).strip()
            writer.write(part.get(kind, b""))
            await writer.drain()
            writer.close()          # then the end of the stream, as the kernel gives it for a dead process

        try:
            await sigstop(proc.pid)         # no restart meanwhile
            parent_stopped = True
            os.kill(victim.pid, signal.SIGKILL)
            await until(lambda: gone(victim.pid), timeout=10)
            os.unlink(path)
            server = await asyncio.start_unix_server(answer_part, path=path)
            try:
                page = pages.saw(await survivor.get("/metrics"))
                assert metric(page, "switchyard_requests_total", status="200") == 12
                doc = await survivor.status()
                assert doc.get("totals", {}).get("requests_since_start") == 12, doc
            finally:
                server.close()
                await server.wait_closed()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            if parent_stopped:
                os.kill(proc.pid, signal.SIGCONT)

        async def restarted() -> bool:
            kids = children_of(proc.pid)
            return len(kids) == 2 and victim.pid not in kids and len(sibling_sockets(kids)) == 2

        await until(restarted, timeout=30)
        assert (await post_new(port, "/v1/completions", COMPLETION))[0] == 200
        page = pages.saw(await survivor.get("/metrics"))
        assert metric(page, "switchyard_requests_total", status="200") >= 13
