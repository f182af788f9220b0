"""Export to a real collector the ways a deployment sets it up: over TLS with a certificate authority
of its own (``OTEL_EXPORTER_OTLP_*_CERTIFICATE``, and mutual TLS with ``_CLIENT_KEY`` and
``_CLIENT_CERTIFICATE``), with an authorization header and gzip (``_HEADERS``, ``_COMPRESSION``),
over OTLP/HTTP and OTLP/gRPC (the grpc extra); a collector that is not trusted, down or silent; and
the start-up lines of what cannot work (gRPC without its extra, half a client certificate). The
receivers are real servers on loopback (tests/support/otlp_receiver.py), their certificates made by
the test (tests/support/tls.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys

import pytest

pytest.importorskip("cryptography", reason="the dev lock installs it (make test)")

from tests.support.gateway_process import gateway_process, get_new, post_new  # noqa: E402
from tests.support.http import post  # noqa: E402
from tests.support.metrics import metric  # noqa: E402
from tests.support.otlp_receiver import GrpcOTLPReceiver, OTLPReceiver  # noqa: E402
from tests.support.ports import listen_port  # noqa: E402
from tests.support.tls import CertificateAuthority  # noqa: E402
from tests.support.waiting import wait_for  # noqa: E402

MSG = [{"role": "user", "content": "Trace this request to a collector over TLS."}]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
OTEL_VARS = ("HEADERS", "COMPRESSION", "CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE", "INSECURE",
             "ENDPOINT", "PROTOCOL", "TIMEOUT")


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    """Only what a test sets: the exporters read these variables when the gateway starts, and
    requests, which the HTTP one sends with, reads a machine's CA bundle from the last two."""
    for var in OTEL_VARS:
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{var}", raising=False)
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_TRACES_{var}", raising=False)
    for var in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory) -> CertificateAuthority:
    """Another CA, which the gateway is not told to trust."""
    return CertificateAuthority(tmp_path_factory.mktemp("tls-other"), name="another CA")


def tracing(endpoint: str, **over) -> dict:
    return {"enabled": True, "endpoint": endpoint, "batch_delay_s": 0.05, "export_timeout_s": 2.0, **over}


def server_span(rx: OTLPReceiver, request_id: str):
    return next((s for s in rx.spans if s.kind == "SERVER" and s.service == "switchyard"
                 and s.attributes.get("gen_ai.request.id") == request_id), None)


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("bundle", [None, "REQUESTS_CA_BUNDLE"])
async def test_https_collector_with_its_own_ca_gets_spans_headers_and_gzip(sims, gateway, ca, stranger,
                                                                          monkeypatch, bundle):
    """The CA, an authorization header (percent-encoded, as the variable's format says) and gzip,
    all from the standard variables: the spans arrive whole, under the client's trace. The CA
    given for the collector is the one used even on a machine whose environment names a CA bundle
    of its own for every client (REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE: set in many images)."""
    rx = await OTLPReceiver(ssl=ca.issue().server_context()).start()
    try:
        if bundle:
            monkeypatch.setenv(bundle, str(stranger.cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(ca.cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret,x-scope-orgid=team-a")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}], tracing=tracing(rx.url))
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": True},
                                        {"traceparent": TRACEPARENT})
        assert status == 200
        rid = headers["request-id"]
        assert await rx.wait_for(lambda r: server_span(r, rid) is not None and len(r.trace(CLIENT_TRACE)) >= 3)
        root = server_span(rx, rid)
        assert (root.trace_id, root.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
        sent = rx.headers[0]
        assert sent["authorization"] == "Bearer s3cret" and sent["x-scope-orgid"] == "team-a"
        assert sent["content-encoding"] == "gzip" and sent["content-type"] == "application/x-protobuf"
        text = await gw.metrics_text()
        assert sample(text, "switchyard_trace_export_failures_total") == 0
        assert sample(text, 'switchyard_trace_spans_total{result="exported"}') >= 3
    finally:
        await rx.close()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_a_collector_whose_certificate_the_ca_does_not_sign_gets_nothing_and_the_log_says_why(
        sims, gateway, ca, stranger, monkeypatch, caplog, protocol):
    """A collector serving a certificate of another CA: no span is delivered (the handshake fails
    before any request), each failed batch is counted, the requests are served as ever, and the
    line that reports the failed export names the cause, a certificate not trusted (over HTTP it is
    no transient error, so the export does not wait and retry it)."""
    if protocol == "grpc":
        needs_grpc()
        theirs = stranger.issue()
        rx = await GrpcOTLPReceiver(tls=(theirs.key.read_bytes(), theirs.cert.read_bytes())).start()
    else:
        rx = await OTLPReceiver(ssl=stranger.issue().server_context()).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(ca.cert))
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(rx.url, protocol=protocol, export_timeout_s=0.5))
        caplog.set_level(logging.WARNING, logger="opentelemetry")
        for i in range(4):
            status, _, body = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": i % 2 == 0})
            assert status == 200 and body

        async def all_failed() -> bool:      # 3 spans a request, in batches each counted once
            text = await gw.metrics_text()
            return sample(text, 'switchyard_trace_spans_total{result="failed"}') == 12 \
                and sample(text, "switchyard_trace_export_failures_total") >= 1
        assert await wait_for(all_failed, timeout=15)
        assert rx.exports == 0
        assert 'switchyard_trace_spans_total{result="exported"}' not in await gw.metrics_text()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and all("certificate verify failed" in e.lower().replace("_", " ") for e in errors), errors
    finally:
        await rx.close()


@pytest.mark.parametrize("collector", ["closed", "plain"])
async def test_a_collector_out_of_reach_over_http_is_named_with_its_cause_in_one_line(sims, gateway, caplog,
                                                                                     collector):
    """Over HTTP, a collector's closed port (connection refused) or an https:// endpoint at a
    collector that speaks plain HTTP: each failed batch is counted, and the gateway says once, not
    at every batch, which endpoint failed and why; the SDK's own last line says only "timeout, max
    retries or shutdown"."""
    rx = None
    if collector == "closed":
        endpoint = f"http://127.0.0.1:{listen_port()}/v1/traces"
        cause = "connection refused"
    else:
        rx = await OTLPReceiver().start()
        endpoint = rx.url.replace("http://", "https://")
        cause = "tls handshake failed"
    try:
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(endpoint, export_timeout_s=0.3))
        caplog.set_level(logging.WARNING)
        for i in range(2):
            status, _, body = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
            assert status == 200 and body
            # each request's spans in a batch of their own, once the first failed

            async def failed(n: int = i + 1) -> bool:
                return sample(await gw.metrics_text(), "switchyard_trace_export_failures_total") >= n
            assert await wait_for(failed, timeout=10)
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("switchyard")]
        assert len(ours) == 1, ours
        assert endpoint in ours[0] and cause in ours[0].lower(), ours
    finally:
        if rx is not None:
            await rx.close()


@pytest.mark.parametrize("answer", [503, 400])
async def test_a_collector_that_refuses_every_batch_gets_one_line_of_the_sdk_not_one_a_batch(
        sims, gateway, caplog, answer):
    """A collector answering every export with 503 (which the exporter retries until its timeout)
    or 400 (which it does not): each failed batch is counted, but the exporter's own lines, a
    "Failed to export" for each batch and a "Transient error" for each retry, are logged the first
    time and then at most once a minute, not once a batch."""
    rx = await OTLPReceiver(fail_with=answer).start()
    try:
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(rx.url, export_timeout_s=0.3))
        caplog.set_level(logging.WARNING)
        for i in range(4):
            status, _, body = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
            assert status == 200 and body

            async def failed(n: int = i + 1) -> bool:
                return sample(await gw.metrics_text(), "switchyard_trace_export_failures_total") >= n
            assert await wait_for(failed, timeout=10)
        sdk = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
        failed_lines = [m for m in sdk if m.startswith("Failed to export")]
        assert len(failed_lines) == 1, sdk
        assert sum(m.startswith("Transient error") for m in sdk) <= 1, sdk
    finally:
        await rx.close()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_mutual_tls_with_the_client_certificate_and_key_from_the_environment(sims, gateway, ca,
                                                                                  monkeypatch, protocol):
    """A collector that asks for a client certificate: the exporter presents the one of
    OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE and _CLIENT_KEY, over either protocol."""
    if protocol == "grpc":
        needs_grpc()
    server, client = ca.issue(), ca.issue(client=True)
    if protocol == "grpc":
        rx = GrpcOTLPReceiver(tls=(server.key.read_bytes(), server.cert.read_bytes()), client_ca=ca.cert.read_bytes())
    else:
        rx = OTLPReceiver(ssl=server.server_context(client_ca=ca.cert))
    await rx.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(ca.cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", str(client.cert))
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", str(client.key))
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(rx.url, protocol=protocol))
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
        assert status == 200
        assert await rx.wait_for(lambda r: server_span(r, headers["request-id"]) is not None)
    finally:
        await rx.close()

def needs_grpc() -> None:
    pytest.importorskip("grpc", reason="the dev lock installs the grpc extra's exporter (make test)")


@pytest.mark.parametrize("form", ["url", "host:port"])
async def test_grpc_export_with_headers_and_gzip(sims, gateway, monkeypatch, form):
    """protocol: grpc, to the OTLP/gRPC trace service without TLS: the spans arrive under the
    client's trace, gzip-compressed (the service inflates them), the headers as gRPC metadata. The
    endpoint given as host:port means plain text, as it does over HTTP and as the default
    (http://localhost:4317) does."""
    needs_grpc()
    rx = await GrpcOTLPReceiver().start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20s3cret")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
        sim = await sims("vllm", "m")
        endpoint = rx.url if form == "url" else rx.url.removeprefix("http://")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(endpoint, protocol="grpc"))
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2},
                                        {"traceparent": TRACEPARENT})
        assert status == 200
        rid = headers["request-id"]
        assert await rx.wait_for(lambda r: server_span(r, rid) is not None and len(r.trace(CLIENT_TRACE)) >= 3)
        root = server_span(rx, rid)
        assert (root.trace_id, root.parent_id, root.name) == (CLIENT_TRACE, CLIENT_SPAN, "POST /v1/chat/completions")
        assert {s.name for s in rx.children(root)} == {"route", "generate"}
        assert rx.headers[0]["authorization"] == "Bearer s3cret"
        assert sample(await gw.metrics_text(), 'switchyard_trace_spans_total{result="exported"}') >= 3
    finally:
        await rx.close()


async def test_grpc_export_with_compression_none_as_the_specification_spells_it(sims, gateway, monkeypatch):
    """OTEL_EXPORTER_OTLP_COMPRESSION=none, a value the OTLP specification lists (and manifests
    often spell out), over gRPC."""
    needs_grpc()
    rx = await GrpcOTLPReceiver().start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "none")
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(rx.url, protocol="grpc"))
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
        assert status == 200
        assert await rx.wait_for(lambda r: server_span(r, headers["request-id"]) is not None)
    finally:
        await rx.close()

async def test_grpc_export_over_tls_with_its_own_ca(sims, gateway, ca, monkeypatch):
    needs_grpc()
    issued = ca.issue()
    rx = await GrpcOTLPReceiver(tls=(issued.key.read_bytes(), issued.cert.read_bytes())).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(ca.cert))
        sim = await sims("vllm", "m")
        gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                           tracing=tracing(rx.url, protocol="grpc"))
        status, headers, _ = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2})
        assert status == 200 and rx.url.startswith("https://")
        assert await rx.wait_for(lambda r: server_span(r, headers["request-id"]) is not None)
    finally:
        await rx.close()


@pytest.mark.parametrize("collector", ["down", "silent"])
async def test_a_grpc_collector_down_or_silent_costs_requests_nothing(sims, gateway, collector):
    """Over gRPC as over HTTP: with the collector's port closed, every request is served while the
    exports fail, each failed batch counted; with a collector that takes the connection and never
    answers, the requests are served while the export is held, and the spans beyond the queue's
    bound are dropped and counted."""
    needs_grpc()
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    if collector == "down":
        server.close()
        await server.wait_closed()
    sim = await sims("vllm", "m")
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url]}],
                       tracing=tracing(f"http://127.0.0.1:{port}", protocol="grpc", max_queue_size=4,
                                       export_timeout_s=0.5 if collector == "down" else 2.0))

    async def served(n: int) -> None:
        for i in range(n):
            status, _, body = await post(gw, {"model": "m", "messages": MSG, "max_tokens": 2, "stream": i % 2 == 0})
            assert status == 200 and body

    try:
        if collector == "down":
            await served(4)

            async def counted() -> bool:
                text = await gw.metrics_text()
                return sample(text, "switchyard_trace_export_failures_total") >= 1 \
                    and sample(text, 'switchyard_trace_spans_total{result="failed"}') >= 1
            assert await wait_for(counted, timeout=15)
        else:
            await served(1)
            assert await wait_for(lambda: bool(held), timeout=10)     # its spans' export is held
            await served(10)            # 3 spans each: 30 spans for a queue of 4
            assert sample(await gw.metrics_text(), 'switchyard_trace_spans_total{result="dropped"}') >= 30 - 2 * 4
        assert 'switchyard_trace_spans_total{result="exported"}' not in await gw.metrics_text()
    finally:
        for w in held:
            w.close()
        server.close()


# ``python -m gateway`` where the grpc extra is not installed: its exporter cannot be imported
WITHOUT_GRPC_EXTRA = ("import runpy, sys; sys.modules['opentelemetry.exporter.otlp.proto.grpc'] = None; "
                      "sys.argv[0] = 'gateway'; runpy.run_module('gateway', run_name='__main__', alter_sys=True)")


async def test_grpc_without_the_extra_fails_start_up_with_one_line_saying_what_to_install(tmp_path):
    """The one start-up message, naming the key that asked for gRPC and the extra to install; the
    process exits 2, as for a config error."""
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("listen: {host: 127.0.0.1, port: 0}\ntracing: {enabled: true, protocol: grpc}\n"
                   "models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WITHOUT_GRPC_EXTRA, "--config", str(cfg),
                                                env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 2, (out, err)
    # (each worker that got as far says it, before the first one's exit stops the others)
    lines = {line for line in (out + err).decode().splitlines() if "grpc" in line}
    assert lines == {"switchyard: tracing.protocol: grpc needs the OTLP gRPC exporter: pip install 'switchyard[grpc]'"}


async def test_a_grpc_client_certificate_without_its_key_fails_start_up_with_a_line_naming_them(tmp_path, ca):
    """Mutual TLS over gRPC half configured (the key's variable unset): the start fails with the
    config error's exit code and one line naming the variables, with --workers too."""
    needs_grpc()
    client = ca.issue(client=True)
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("listen: {host: 127.0.0.1, port: 0}\n"
                   "tracing: {enabled: true, protocol: grpc, endpoint: 'https://127.0.0.1:9'}\n"
                   "models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9']}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE=str(ca.cert),
               OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE=str(client.cert))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                "--workers", "2", env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(f"the gateway did not stop; its output ends: {err[-1500:]!r}") from None
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    said = {line for line in (out + err).decode().splitlines() if "CLIENT" in line}
    assert said == {"switchyard: environment variable OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE: a client "
                    "certificate needs its key, in OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"}


async def test_grpc_export_failures_are_logged_as_json_lines_only(sims, tmp_path):
    """A gateway logging JSON (what a log pipeline parses), its gRPC exports failing at the TLS
    handshake (a collector speaking plain text to an https:// endpoint): the exporter's failures
    are JSON lines of the gateway's format, and grpc's own core prints none of its own format."""
    needs_grpc()
    rx = await GrpcOTLPReceiver().start()
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, log_format: json, log_level: warning}\n"
                   f"tracing: {{enabled: true, protocol: grpc, endpoint: '{rx.url.replace('http:', 'https:')}', "
                   "batch_delay_s: 0.05, export_timeout_s: 0.5}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "GRPC_"))}
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway", "--config", str(cfg),
                                                    "--workers", "1", env=env, stderr=f)
    try:
        async def up() -> bool:
            try:
                return (await get_new(port, "/ready"))[0] == 200
            except OSError:
                return False
        assert await wait_for(up, timeout=40)
        assert (await post_new(port, "/v1/chat/completions", {"model": "m", "messages": MSG, "max_tokens": 1}))[0] == 200

        async def failed() -> bool:
            return metric((await get_new(port, "/metrics"))[1], "switchyard_trace_export_failures_total") >= 1
        assert await wait_for(failed, timeout=20)
    finally:
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(20):
            await proc.wait()
        await rx.close()
    lines = err.read_text().splitlines()
    records = [json.loads(line) for line in lines]      # every line: JSON
    assert any(r.get("logger", "").startswith("opentelemetry.exporter.otlp.proto.grpc") and r["level"] == "error"
               and "Failed to export traces" in r["event"] for r in records), lines


async def test_two_workers_each_export_over_grpc(sims, tmp_path):
    """gRPC and fork do not mix: each worker of --workers 2 builds its own channel after the fork
    (the parent never loads grpc), and every request's spans arrive, from two instances."""
    needs_grpc()
    rx = await GrpcOTLPReceiver().start()
    sim = await sims("vllm", "m")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, log_level: warning}\n"
                   f"tracing: {{enabled: true, protocol: grpc, endpoint: '{rx.url}', batch_delay_s: 0.05, "
                   "export_timeout_s: 1}\n"
                   f"models: [{{name: m, engine: vllm, endpoints: ['{sim.url}']}}]\n")
    try:
        async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
            body = {"model": "m", "messages": MSG, "max_tokens": 1}
            served = {(await post_new(port, "/v1/chat/completions", body))[1]["request-id"] for _ in range(20)}
            assert await rx.wait_for(lambda r: served <= {s.attributes.get("gen_ai.request.id") for s in r.spans})
        assert len({s.instance for s in rx.spans if s.service == "switchyard"}) == 2
    finally:
        await rx.close()
