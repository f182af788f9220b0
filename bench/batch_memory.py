"""A large batch's memory: ``python -m bench.batch_memory [--lines 100000]``.

Two simulated vLLM engines that answer at once (no TTFT, no inter-token time, 128 slots each)
behind a gateway with ``batch.enabled`` (``max_lines`` raised to ``--lines``, 128 lines in flight,
no reserved slots). Through the openai SDK: upload a ``--lines`` chat batch (one token each), run
it, download the output. Prints the gateway's RSS before the upload, after it, its peak while the
batch runs (sampled every 2 s) and after the download, the lines per second, and checks that the
output holds exactly one line per ``custom_id``. Results are kept in the job store as they come
and the output file is written by streaming them, so the RSS should stay flat whatever
``--lines`` is.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench.procs import start_group, stop, wait_port
from gateway.server.run import free_port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run(lines: int, d: Path, port: int, pid: int) -> dict:
    from openai import AsyncOpenAI

    body = b"".join(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "m", "max_tokens": 1,
                                           "messages": [{"role": "user", "content": f"hello {i}"}]}}) + b"\n"
                    for i in range(lines))
    c = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
    try:
        before = rss_mb(pid)
        f = await c.files.create(file=("in.jsonl", body), purpose="batch")
        uploaded = rss_mb(pid)
        del body
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t0, peak = time.monotonic(), uploaded
        while True:
            b = await c.batches.retrieve(b.id)
            peak = max(peak, rss_mb(pid))
            if b.status in ("completed", "failed", "cancelled", "expired"):
                break
            await asyncio.sleep(2)
        secs = time.monotonic() - t0
        out = (await c.files.content(b.output_file_id)).content if b.output_file_id else b""
        ids = [orjson.loads(x)["custom_id"] for x in out.splitlines()]
        return {"lines": lines, "status": b.status, "completed": b.request_counts.completed,
                "failed": b.request_counts.failed, "seconds": round(secs, 1), "lines_per_s": round(lines / secs),
                "rss_mb": {"before": round(before), "after_upload": round(uploaded), "peak_running": round(peak),
                           "after_download": round(rss_mb(pid))},
                "output_lines": len(ids), "distinct_custom_ids": len(set(ids))}
    finally:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ports = [free_port(), free_port()]
        sims = [start_group([sys.executable, "-m", "enginesim", "--engine", "vllm", "--port", str(p), "--model", "m",
                             "--ttft-base-ms", "0", "--prefill-ms-per-token", "0", "--itl-ms", "0",
                             "--itl-jitter-ms", "0", "--max-num-seqs", "128"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
        gport = free_port()
        cfg = d / "gw.yaml"
        cfg.write_text(f"models:\n  - name: m\n    engine: vllm\n    endpoints: "
                       f"[{', '.join(f'http://127.0.0.1:{p}' for p in ports)}]\n"
                       f"batch:\n  enabled: true\n  dir: {d / 'batch'}\n  max_lines: {a.lines}\n"
                       f"  max_concurrency: 128\n  endpoint_capacity: 64\n  reserve_slots: 0\n")
        gw = None
        try:
            for p, s in zip(ports, sims, strict=True):
                wait_port(p, s)
            with open(d / "gw.log", "wb") as log:
                gw = start_group([sys.executable, "-m", "gateway", "--config", str(cfg), "--port", str(gport), "--workers", "1"],
                                 stdout=log, stderr=log)
            wait_port(gport, gw)
            r = asyncio.run(run(a.lines, d, gport, gw.pid))
        finally:
            for p in ([gw] if gw is not None else []) + sims:
                stop(p)
    m = r["rss_mb"]
    print(f"{r['lines']:,} lines: {r['status']}, {r['completed']:,} completed, {r['failed']} failed, "
          f"{r['seconds']} s ({r['lines_per_s']:,} lines/s)")
    print(f"gateway RSS: {m['before']} MB before the upload, {m['after_upload']} MB after it, "
          f"{m['peak_running']} MB at most while it ran, {m['after_download']} MB after the download")
    print(f"output: {r['output_lines']:,} lines, {r['distinct_custom_ids']:,} distinct custom_ids")


if __name__ == "__main__":
    main()
