"""Tracing settings (the block, the OTEL_* variables, which wins), the disabled trace, the
exporter's failure count, excluded paths. The traces themselves: tests/integration/observability/test_tracing.py."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway.config.schema import ConfigError, config_from_dict
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import (
    MAX_ATTRIBUTE_LENGTH,
    NO_LEG,
    NO_TRACE,
    CountingExporter,
    SeldomLines,
    Tracing,
    TracingConfig,
    check_tls_files,
    resolve,
)


def test_off_by_default_and_defaults():
    s = resolve(TracingConfig(), env={})
    assert not s.enabled
    assert (s.endpoint, s.protocol, s.sample_ratio, s.parent_based, s.service_name) == (
        "http://localhost:4318/v1/traces", "http/protobuf", 1.0, True, "switchyard")
    assert s.exclude_paths == ("/health", "/ready", "/metrics", "/status", "/status.json")
    assert Tracing.from_config(TracingConfig(), GatewayMetrics(), env={}) is None


def test_an_endpoint_turns_it_on_unless_disabled():
    assert resolve(TracingConfig(endpoint="collector:4318"), env={}).enabled
    assert resolve(TracingConfig(), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).enabled
    assert not resolve(TracingConfig(), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                             "OTEL_SDK_DISABLED": "true"}).enabled
    assert not resolve(TracingConfig(), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                             "OTEL_TRACES_EXPORTER": "none"}).enabled
    # the file says so: it wins over the environment either way
    assert resolve(TracingConfig(enabled=True), env={"OTEL_SDK_DISABLED": "true"}).enabled
    assert not resolve(TracingConfig(enabled=False), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).enabled


@pytest.mark.parametrize("given, expected", [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("https://collector:4318/", "https://collector:4318/v1/traces"),
    ("http://collector:4318/otlp/v1/traces", "http://collector:4318/otlp/v1/traces"),
])
def test_http_endpoint_gets_the_traces_path(given, expected):
    assert resolve(TracingConfig(endpoint=given), env={}).endpoint == expected


def test_environment_fills_what_the_block_leaves_unset():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318/", "OTEL_SERVICE_NAME": "gw-eu",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    s = resolve(TracingConfig(), env=env)
    assert (s.endpoint, s.service_name, s.sample_ratio, s.parent_based) == (
        "http://base:4318/v1/traces", "gw-eu", 0.25, False)
    # the signal-specific variable is a full URL, used as is, and wins over the base one
    s = resolve(TracingConfig(), env={**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/custom"})
    assert s.endpoint == "http://t:1/custom"
    # a key in the block wins over its variable
    s = resolve(TracingConfig(endpoint="http://mine:4318", service_name="sy", sample_ratio=0.5,
                              parent_based=True), env=env)
    assert (s.endpoint, s.service_name, s.sample_ratio, s.parent_based) == (
        "http://mine:4318/v1/traces", "sy", 0.5, True)


def test_grpc_protocol_from_block_or_environment():
    s = resolve(TracingConfig(protocol="grpc"), env={})
    assert (s.protocol, s.endpoint) == ("grpc", "http://localhost:4317")
    s = resolve(TracingConfig(), env={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert (s.protocol, s.endpoint, s.enabled) == ("grpc", "http://c:4317", True)
    # the key's host:port is plain text, as over HTTP; https:// asks for TLS; the variable is the
    # OTLP spec's, passed as it is (the exporter reads OTEL_EXPORTER_OTLP_INSECURE for it)
    assert resolve(TracingConfig(protocol="grpc", endpoint="c:4317"), env={}).endpoint == "http://c:4317"
    assert resolve(TracingConfig(protocol="grpc", endpoint="https://c:4317"), env={}).endpoint == "https://c:4317"
    assert resolve(TracingConfig(), env={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                         "OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}).endpoint == "c:4317"


@pytest.mark.parametrize("env, message", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "not a url"}, "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT"),
    # the gRPC exporter raised float()'s own message for these, the HTTP one used its default
    ({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10s"}, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TIMEOUT": "ten"}, "OTEL_EXPORTER_OTLP_TIMEOUT"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": ""},
     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
])
def test_bad_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(TracingConfig(), env=env)


@pytest.mark.parametrize("block, path", [
    ({"protocol": "http/json"}, "tracing.protocol"),
    ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
    ({"sample_ratio": -0.1}, "tracing.sample_ratio"),
    ({"endpoint": "no-port"}, "tracing.endpoint"),
    ({"exclude_paths": ["health"]}, "tracing.exclude_paths[0]"),
    ({"export_timeout_s": 0}, "tracing.export_timeout_s"),
    ({"sampling": 1}, "tracing.sampling"),
])
def test_bad_block_names_the_key(block, path):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"tracing": block, "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}]})
    assert e.value.key_path == path


def test_block_in_config():
    c = config_from_dict({"tracing": {"enabled": True, "sample_ratio": 0.1, "exclude_paths": ["/health"]},
                          "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}]})
    assert c.tracing.enabled and c.tracing.sample_ratio == 0.1 and c.tracing.exclude_paths == ("/health",)


@pytest.mark.parametrize("block, env, named", [
    ({"protocol": "grpc"}, {}, "tracing.protocol"),
    ({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
])
def test_grpc_without_the_extra_is_a_clear_error_naming_what_asked_for_it(monkeypatch, block, env, named):
    # the extra not installed: its exporter cannot be imported
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ValueError) as e:
        Tracing.from_config(TracingConfig(enabled=True, **block), GatewayMetrics(), env=env)
    assert str(e.value) == f"{named}: grpc needs the OTLP gRPC exporter: pip install 'switchyard[grpc]'"


def test_tls_files_the_exporter_cannot_use_are_refused_naming_the_variable(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-")
    t, g = "OTEL_EXPORTER_OTLP_TRACES_", "OTEL_EXPORTER_OTLP_"
    for protocol in ("http/protobuf", "grpc"):
        check_tls_files(protocol, {})
        check_tls_files(protocol, {t + "CERTIFICATE": str(pem), t + "CLIENT_KEY": str(pem),
                                   t + "CLIENT_CERTIFICATE": str(pem)})
        with pytest.raises(ValueError, match=rf"^environment variable {g}CERTIFICATE: cannot read '/nonexistent.pem'"):
            check_tls_files(protocol, {g + "CERTIFICATE": "/nonexistent.pem"})
        with pytest.raises(ValueError, match=rf"^environment variable {t}CLIENT_KEY: cannot read"):
            check_tls_files(protocol, {t + "CERTIFICATE": str(pem), t + "CLIENT_KEY": str(tmp_path / "typo.key"),
                                       t + "CLIENT_CERTIFICATE": str(pem)})
    # over HTTP one file may hold the certificate and its key; gRPC needs both (its core aborts without)
    check_tls_files("http/protobuf", {t + "CLIENT_CERTIFICATE": str(pem)})
    with pytest.raises(ValueError, match=rf"^environment variable {g}CLIENT_KEY: a client key needs its "
                                         rf"certificate, in {g}CLIENT_CERTIFICATE$"):
        check_tls_files("grpc", {g + "CERTIFICATE": str(pem), g + "CLIENT_KEY": str(pem)})
    # the gRPC exporter reads the client files only beside a CA file, the traces ones beside the traces CA
    check_tls_files("grpc", {g + "CLIENT_KEY": str(pem)})
    check_tls_files("grpc", {t + "CERTIFICATE": str(pem), g + "CLIENT_KEY": str(pem)})


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"])
def test_a_compression_the_exporter_does_not_have_is_refused_naming_the_variable(protocol, var):
    with pytest.raises(ValueError, match=rf"^environment variable {var}: 'zstd' is not supported"):
        resolve(TracingConfig(protocol=protocol), env={var: "zstd"})
    assert resolve(TracingConfig(protocol=protocol), env={var: " GZip "}).compression == "gzip"
    assert resolve(TracingConfig(protocol=protocol), env={var: "none"}).compression == "none"
    assert resolve(TracingConfig(protocol=protocol), env={}).compression == "none"
    # the signal's variable wins over the general one
    assert resolve(TracingConfig(protocol=protocol), env={"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
                                                          "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "none"}
                   ).compression == "none"


def test_disabled_trace_does_nothing():
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    leg = NO_TRACE.leg("generate", object())  # type: ignore[arg-type]
    assert leg is NO_LEG and leg.inject(headers) is headers   # the client's traceparent passes through
    with NO_TRACE.leg("prefill", object()) as managed:  # type: ignore[arg-type]
        managed.responded(500)
    NO_TRACE.route_start()
    NO_TRACE.event("retry", {"a": 1})
    NO_TRACE.finish(object())  # type: ignore[arg-type]
    assert NO_TRACE.trace_id is None


def test_excluded_paths_exact_and_prefix():
    t = Tracing(resolve(TracingConfig(enabled=True, exclude_paths=("/health", "/admin/*")), env={}),
                GatewayMetrics(), exporter=_Fixed(SpanExportResult.SUCCESS))
    try:
        assert t.excluded("/health") and t.excluded("/admin/keys") and t.excluded("/admin/")
        assert not t.excluded("/healthz") and not t.excluded("/metrics") and not t.excluded("/v1/models")
    finally:
        t.provider.shutdown()


class _Fixed(SpanExporter):
    def __init__(self, result):
        self.result = result

    def export(self, spans):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def shutdown(self):
        pass


@pytest.mark.parametrize("inner, failed", [(_Fixed(SpanExportResult.SUCCESS), False),
                                           (_Fixed(SpanExportResult.FAILURE), True),
                                           (_Fixed(RuntimeError("boom")), True)])
def test_export_failures_are_counted(inner, failed):
    m = GatewayMetrics()
    result = CountingExporter(inner, m).export([object(), object(), object()])
    assert (result is SpanExportResult.FAILURE) == failed
    text = m.render().decode()
    assert f"switchyard_trace_export_failures_total {1.0 if failed else 0.0}" in text
    assert f'switchyard_trace_spans_total{{result="{"failed" if failed else "exported"}"}} 3.0' in text


def test_a_queue_smaller_than_the_sdk_batch_is_accepted():
    # the SDK refuses max_export_batch_size (512) > max_queue_size: the gateway failed to start
    t = Tracing(resolve(TracingConfig(enabled=True, max_queue_size=100), env={}),
                GatewayMetrics(), exporter=_Fixed(SpanExportResult.SUCCESS))
    try:
        assert t.processor._batch_processor._max_export_batch_size == 100
    finally:
        t.provider.shutdown()


class _Hanging(SpanExporter):
    """A collector that never answers: export blocks until the exporter is shut down."""

    def __init__(self):
        self.stop = threading.Event()
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        self.stop.wait(60)
        return SpanExportResult.FAILURE

    def shutdown(self):
        self.stop.set()


async def test_close_is_bounded_by_the_export_timeout_when_the_collector_hangs():
    hanging = _Hanging()
    t = Tracing(resolve(TracingConfig(enabled=True, export_timeout_s=0.5, batch_delay_s=0.01), env={}),
                GatewayMetrics(), exporter=hanging)
    for _ in range(3):
        t.tracer.start_span("x").end()
    while not hanging.calls:            # the export thread is stuck in the collector
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await t.close()
    assert time.monotonic() - t0 < 3.0      # was ~30 s: the SDK joins its export thread that long
    assert hanging.stop.is_set()            # the exporter was told to stop retrying


class _Keep(SpanExporter):
    def __init__(self):
        self.spans = []

    def export(self, spans):
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def test_a_client_value_cannot_make_a_span_too_large_to_export():
    # a 15 MB "user" made user.id 15 MB: five such requests and the batch (other requests' spans
    # with it) went over the exporter's 64 MB and was dropped whole
    keep = _Keep()
    t = Tracing(resolve(TracingConfig(enabled=True), env={}), GatewayMetrics(), exporter=keep)
    span = t.tracer.start_span("x")
    span.set_attribute("user.id", "u" * 1_000_000)
    span.add_event("retry", {"error.type": "e" * 1_000_000})
    span.end()
    t.provider.shutdown()
    (got,) = keep.spans
    assert len(got.attributes["user.id"]) == MAX_ATTRIBUTE_LENGTH
    assert len(got.events[0].attributes["error.type"]) == MAX_ATTRIBUTE_LENGTH


@pytest.mark.parametrize("env, named, where", [
    ({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret,Bearer s3cret"}, "OTEL_EXPORTER_OTLP_HEADERS", 2),
    ({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "authorization: Bearer s3cret", "OTEL_EXPORTER_OTLP_HEADERS": "a=b"},
     "OTEL_EXPORTER_OTLP_TRACES_HEADERS", 1),
])
def test_a_header_the_exporter_would_drop_fails_start_naming_the_variable(monkeypatch, env, named, where):
    """The exporter dropped an entry that is no name=value pair with a warning that names no
    variable, and sent every span without it (a collector's token lost): refused, its value not shown."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        Tracing.from_config(TracingConfig(enabled=True, endpoint="127.0.0.1:1"), GatewayMetrics())
    n = len(env[named].split(","))
    assert str(e.value).startswith(f"environment variable {named}: entry {where} of {n} is not name=value")
    assert "s3cret" not in str(e.value)


def test_headers_the_exporter_takes_start(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", " authorization = Bearer s3cret , x-team=a%20b,")
    t = Tracing.from_config(TracingConfig(enabled=True, endpoint="127.0.0.1:1"), GatewayMetrics())
    assert t is not None
    t.provider.shutdown()


def test_the_exporters_lines_are_logged_once_then_once_a_minute_with_the_count_not_logged():
    now = [0.0]
    seldom = SeldomLines(every_s=60.0, clock=lambda: now[0])

    def line(msg: str, *args: object, level: int = logging.ERROR) -> str | None:
        r = logging.LogRecord("opentelemetry.exporter", level, __file__, 1, msg, args, None)
        return r.getMessage() if seldom.filter(r) else None

    failed = "Failed to export %s batch code: %s, reason: %s"
    assert line(failed, "spans", 503, "Service Unavailable") == "Failed to export spans batch code: 503, reason: Service Unavailable"
    assert line("Transient error %s encountered", "x", level=logging.WARNING) == "Transient error x encountered"
    now[0] = 30.0
    assert [line(failed, "spans", 503, "Service Unavailable") for _ in range(5)] == [None] * 5
    assert line("debug %s", 1, level=logging.DEBUG) == "debug 1"
    now[0] = 61.0
    assert line(failed, "spans", 400, "Bad Request") == \
        "Failed to export spans batch code: 400, reason: Bad Request (5 more such line(s) not logged in the last 61 s)"
    assert line(failed, "spans", 400, "Bad Request") is None
    now[0] = 200.0
    assert line(failed, "spans", 400, "Bad Request") == "Failed to export spans batch code: 400, reason: Bad Request (1 more such line(s) not logged in the last 139 s)"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _seldom_logger(name: str, seldom: SeldomLines) -> tuple[logging.Logger, _Lines]:
    logger = logging.getLogger(name)
    logger.propagate = False
    lines = _Lines()
    logger.handlers[:] = [lines]
    logger.filters[:] = [seldom]
    return logger, lines


async def test_the_count_of_held_back_lines_is_logged_once_their_minute_is_over_with_no_next_line():
    """Failures that stopped: the lines held back were told only by the next line of their kind,
    so never. Now a timer on the loop tells them when the interval is over, in another thread's
    lines too (the exporter's)."""
    from tests.support.waiting import until

    seldom = SeldomLines(every_s=0.2)
    seldom.start(asyncio.get_running_loop())
    logger, lines = _seldom_logger("test.seldom.timer", seldom)
    failed = "Failed to export %s batch code: %s"

    def burst():
        for code in (503, 503, 502, 504):
            logger.error(failed, "spans", code)

    thread = threading.Thread(target=burst)
    thread.start()
    thread.join()
    assert lines.lines == ["Failed to export spans batch code: 503"]
    await until(lambda: len(lines.lines) == 2, timeout=5.0)
    assert lines.lines[1].startswith("Failed to export spans batch code: 504 (the last of 3 such line(s) not logged in the last ")
    seldom.stop()
    assert len(lines.lines) == 2 and not seldom._timers


async def test_the_held_back_count_is_logged_at_stop_and_its_timer_cancelled():
    seldom = SeldomLines(every_s=3600.0)
    seldom.start(asyncio.get_running_loop())
    logger, lines = _seldom_logger("test.seldom.stop", seldom)
    for _ in range(3):
        logger.warning("Transient error %s encountered", "x")
    await asyncio.sleep(0)            # the timer is set on the loop
    assert lines.lines == ["Transient error x encountered"] and len(seldom._timers) == 1
    seldom.stop()
    assert lines.lines[1].startswith("Transient error x encountered (the last of 2 such line(s) not logged in the last ")
    assert not seldom._timers
    seldom.stop()                     # told once
    assert len(lines.lines) == 2
