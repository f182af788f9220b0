"""``python -m gateway --check-config FILE``: validates a file as a start would, starts nothing,
names the key of an error (with a did-you-mean for a typo) and prints old names' warnings."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import structlog

from gateway.__main__ import main
from gateway.config import deprecated
from gateway.config.deprecated import REMOVED_IN
from gateway.config.schema import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[4]

GOOD = """
models:
  - name: llama
    endpoints: [http://127.0.0.1:8001]
  - name: qwen
    engine: sglang
    strategy: prefix-cache
    endpoints: [http://127.0.0.1:9001]
"""


def check(tmp_path, text, capsys) -> tuple[int, str, str]:
    f = tmp_path / "gw.yaml"
    f.write_text(text)
    rc = main(["--check-config", str(f)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_valid_file_is_ok_with_its_model_count(tmp_path, capsys):
    rc, out, err = check(tmp_path, GOOD, capsys)
    assert rc == 0 and err == ""
    assert out.strip() == f"{tmp_path / 'gw.yaml'}: OK (2 models)"


@pytest.mark.parametrize("text,expected", [
    ("listen: {prot: 8000}", "listen.prot: unknown key (did you mean 'port'?) (known: host, port)"),
    ("routing: {strategy: least-requests}",
     "routing.strategy: incorrect routing strategy least-requests: unknown strategy 'least-requests' "
     "(did you mean 'least-request'?)"),
    ("models: [{name: a, endpoints: [http://x:1], lock_strategy: 'prefix-cach:2,random:1'}]",
     "models[0].lock_strategy: incorrect routing strategy prefix-cach:2,random:1: unknown strategy "
     "'prefix-cach' (did you mean 'prefix-cache'?)"),
    ("models: [{name: a, endpionts: [http://x:1]}]", "models[0].endpionts: unknown key (did you mean 'endpoints'?)"),
    ("models: [{name: a, endpoints: [http://x:1], pd: {sglang: {abort_timeout: 1}}}]",
     "models[0].pd.sglang.abort_timeout: unknown key (did you mean 'abort_timeout_s'?)"),
    ("server: {max_body_bytes: -1}", "server.max_body_bytes: Expected `int` >= 0"),
    ("server: {workers: 0}", "server.workers: Expected `int` >= 1"),   # a start would refuse it
    ("models: [{name: a}]", "models[0]: model 'a' needs 'endpoints' or 'rolesets'"),
    # a model with only prefill/decode endpoints and a strategy that routes whole requests: every
    # request would be refused 503
    ("models: [{name: a, strategy: least-request, rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2']}]}]",
     "models[0].strategy: 'least-request' routes whole requests, and model 'a' has only prefill/decode "
     "endpoints (every request would be refused 503): use pd, or leave the key out"),
    ("models: [{name: a, lock_strategy: 'random', rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2']}]}]",
     "models[0].lock_strategy: 'random' routes whole requests, and model 'a' has only prefill/decode "
     "endpoints (every request would be refused 503): use pd, or leave the key out"),
    # URLs a start would refuse (gateway.endpoints.Endpoint parses them)
    ("models: [{name: a, endpoints: ['http://x:port']}]",
     "models[0].endpoints[0].url: Port could not be cast to integer value as 'port', in 'http://x:port'"),
    ("models: [{name: a, endpoints: ['http://x:99999']}]",
     "models[0].endpoints[0].url: Port out of range 0-65535, in 'http://x:99999'"),
    ("models: [{name: a, rolesets: [{decode: ['http://:8000']}]}]",
     "models[0].rolesets[0].decode[0].url: has no host, in 'http://:8000'"),
    # URLs a start would take and then fail every request on, or show a password for
    ("models: [{name: a, endpoints: ['http://x:8000/v1']}]",
     "models[0].endpoints[0].url: give the engine's root, without /v1 (the gateway adds the API path)"),
    ("models: [{name: a, endpoints: ['http://user:secret@x:8000']}]",
     "models[0].endpoints[0].url: must not carry a user name or password (they are not sent to the engine),"
     " in http://…@x"),
    # a typo that fell back to info; an interval that made the probes run back to back
    ("server: {log_level: eror}", "server.log_level: must be one of debug, info, warning or error, got 'eror'"),
    ("health: {interval_s: 0}", "health.interval_s: Expected `float` > 0.0"),
    ("scrape: {interval_s: 0}", "scrape.interval_s: Expected `float` > 0.0"),
    # a key that takes a number or a word: both are named
    ("server: {workers: four}", "server.workers: must be an integer or one of auto, got 'four'"),
])
def test_an_error_names_the_file_and_the_key(tmp_path, capsys, text, expected):
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 2 and out == ""
    # the file's line and column of the key or value at fault, then its key path (one line of YAML: line 1)
    assert re.match(rf"switchyard: config error: {re.escape(str(tmp_path / 'gw.yaml'))}:1:\d+: {re.escape(expected)}",
                    err), err


def test_a_missing_file_or_bad_yaml_is_an_error(tmp_path, capsys):
    assert main(["--check-config", str(tmp_path / "nope.yaml")]) == 2
    assert "<file>: cannot read" in capsys.readouterr().err
    rc, _, err = check(tmp_path, "models: [", capsys)
    assert rc == 2 and "<yaml>: invalid YAML" in err


OLD = """
upstream: {retry_on_connect_error: true}
pd: {abort_timeout_s: 5}
models:
  - name: a
    endpoints: [http://x:1]
    pd: {rewrite_remote_host: false, default_bootstrap_port: 9000, abort_retry_delay_s: 1}
"""
OLD_WARNINGS = [
    f"upstream.retry_on_connect_error is deprecated and will be removed in {REMOVED_IN}; write retry.enabled instead",
    f"pd.abort_timeout_s is deprecated and will be removed in {REMOVED_IN}; write pd.sglang.abort_timeout_s instead",
    f"models[0].pd.rewrite_remote_host is deprecated and will be removed in {REMOVED_IN}; "
    "write models[0].pd.vllm.rewrite_remote_host instead",
    f"models[0].pd.default_bootstrap_port is deprecated and will be removed in {REMOVED_IN}; "
    "write models[0].pd.sglang.default_bootstrap_port instead",
    f"models[0].pd.abort_retry_delay_s is deprecated and will be removed in {REMOVED_IN}; "
    "write models[0].pd.sglang.abort_retry_delay_s instead",
]


def test_old_names_still_load_and_are_printed_as_warnings(tmp_path, capsys):
    rc, out, err = check(tmp_path, OLD, capsys)
    assert rc == 0 and "OK (1 model)" in out
    assert err.splitlines() == [f"switchyard: warning: {w}" for w in OLD_WARNINGS]


def test_old_names_are_logged_once_per_load(monkeypatch):
    # a logger not yet bound: one cached under another test's configuration would bypass the capture
    monkeypatch.setattr(deprecated, "log", structlog.get_logger("switchyard.config"))
    with structlog.testing.capture_logs() as logs:
        c = parse_config(OLD, "gw.yaml")
    assert c.pd_for("a").sglang.default_bootstrap_port == 9000
    assert [(e["log_level"], e["key"], e["removed_in"]) for e in logs] == [
        ("warning", w.split(" ")[0], REMOVED_IN) for w in OLD_WARNINGS]
    assert all(REMOVED_IN in e["event"] for e in logs)
    with structlog.testing.capture_logs() as logs:
        parse_config(GOOD)
    assert logs == []


def test_a_deprecation_is_reported_with_the_error_it_comes_with(tmp_path, capsys):
    rc, _, err = check(tmp_path, "pd: {abort_timeout_s: 1, sglang: {abort_timeout_s: 2}}", capsys)
    assert rc == 2 and "pd.abort_timeout_s: also given as pd.sglang.abort_timeout_s" in err
    with pytest.raises(ConfigError):
        parse_config("upstream: {retry_on_connect_error: 3}")


def test_check_config_starts_nothing(tmp_path):
    """In a process of its own, with sockets and threads forbidden: nothing listens, connects,
    spawns a thread or imports the clients of Redis, Kubernetes or ZMQ."""
    f = tmp_path / "gw.yaml"
    f.write_text(GOOD + "state: {redis_url: 'redis://127.0.0.1:1/0'}\nkubernetes: {enabled: false}\n")
    probe = textwrap.dedent(f"""
        import socket, sys, threading
        def refuse(*a, **k):
            raise AssertionError("a socket was opened")
        socket.socket.__init__ = refuse
        threading.Thread.start = refuse
        from gateway.__main__ import main
        rc = main(["--check-config", {str(f)!r}])
        loaded = sorted(m for m in ("redis", "kubernetes_asyncio", "zmq", "tokenizers", "gateway.server.run")
                        if m in sys.modules)
        print("loaded:", loaded)
        sys.exit(rc)
    """)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "OK (2 models)" in done.stdout and "loaded: []" in done.stdout


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_port_outside_0_to_65535_is_refused_on_the_command_line(tmp_path, capsys, port):
    """As ``listen.port`` in the file is: not wrapped around to another port, no traceback."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(GOOD)
    with pytest.raises(SystemExit) as ei:
        main(["--config", str(cfg), "--port", port])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and "Traceback" not in err


@pytest.mark.parametrize("workers", ["2", "auto"])
def test_workers_with_the_demo_is_refused_not_ignored(capsys, workers):
    """The demo runs its engines in its own process, so it is one process: --workers is refused
    with why, before anything starts, not ignored (a reader who asked for two workers got one)."""
    with pytest.raises(SystemExit) as ei:
        main(["--demo", "--workers", workers])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--workers" in err and "--demo" in err and "Traceback" not in err


@pytest.mark.parametrize("text,key", [
    ("server: {shutdown_grace_s: 1}\nserver: {log_level: info}\n", "'server'"),
    ("routing: {strategy: random}\nrouting: {strategy: least-request}\n", "'routing'"),
])
def test_a_key_written_twice_is_an_error_not_the_last_one_silently(tmp_path, capsys, text, key):
    """YAML keeps the last of two equal keys: the first ``server:`` block would be dropped unseen."""
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 2 and out == ""
    assert f"found the key {key} a second time" in err, err


ANCHORED = """\
models:
  - &llama
    name: llama
    engine: sglang
    endpoints: &eps [http://10.0.0.5:8000, http://10.0.0.6:8000]
    watchdog: {first_chunk_timeout_s: 20}
  - <<: *llama
    name: llama-long
    endpoints: *eps
"""


def test_yaml_anchors_aliases_and_merge_keys_are_taken(tmp_path, capsys):
    """As configuration.md says: an anchor set where a node is first written, repeated by an alias,
    and laid under a mapping's own keys by a merge key (the keys written beside it win, and are not
    a key written twice); each copy is its own (a model's endpoints take that model's engine)."""
    from gateway.config.schema import load_config

    assert check(tmp_path, ANCHORED, capsys)[0] == 0
    a, b = load_config(tmp_path / "gw.yaml").models
    assert (a.name, b.name, a.engine, b.engine) == ("llama", "llama-long", "sglang", "sglang")
    assert [e.url for e in b.endpoints] == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    assert b.watchdog == a.watchdog and b.watchdog.first_chunk_timeout_s == 20
    rc, out, err = check(tmp_path, ANCHORED.replace("    endpoints: *eps\n", "    name: again\n"), capsys)
    assert rc == 2 and "found the key 'name' a second time" in err, err


def test_a_log_level_in_any_case_is_taken(tmp_path, capsys):
    assert check(tmp_path, "server: {log_level: WARNING}" + GOOD, capsys)[0] == 0


def _started_with_two_workers(cfg) -> subprocess.CompletedProcess:
    """``python -m gateway --config cfg --workers 2``, stopped before any worker starts: what the
    parent logged at start."""
    probe = textwrap.dedent(f"""
        import sys
        import gateway.server.workers as w
        w.run_workers = lambda *a, **k: 0          # stop before any worker starts
        from gateway.__main__ import main
        sys.exit(main(["--config", {str(cfg)!r}, "--workers", "2", "--log-format", "json"]))
    """)
    return subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_several_workers_by_number_with_state_per_process_say_so_at_start(tmp_path, capsys):
    """``--workers 2`` with the admin API and no Redis: run as asked, but the log says each worker
    keeps its own keys (a key created through one is unknown to the other)."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(GOOD + "auth: {admin_token: t0ken}\nlisten: {port: 1}\n")
    done = _started_with_two_workers(cfg)
    assert done.returncode == 0, done.stderr
    assert "each keeps its own state without state.redis_url" in done.stderr
    assert "the admin API's users and keys" in done.stderr


@pytest.mark.parametrize("view, warned", [("view: {share_monitoring: false}\n", True),
                                         ("view: {workers: false}\n", True), ("", False)])
def test_several_workers_by_number_with_adapters_not_shared_say_so_at_start(tmp_path, view, warned):
    """``--workers 2`` with adapters to load on demand and the workers not telling each other of
    them: run as asked, but the log says a worker may unload an adapter another is using."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("models: [{name: m, engine: vllm, endpoints: ['http://127.0.0.1:9'], "
                   "adapters: {sql: /a/sql}}]\nlisten: {port: 1}\n" + view)
    done = _started_with_two_workers(cfg)
    assert done.returncode == 0, done.stderr
    assert ("LoRA adapters are not shared between them" in done.stderr) is warned, done.stderr


@pytest.mark.parametrize("text", [
    # whole-request endpoints beside the pairs: the strategy routes to those
    "models: [{name: a, strategy: least-request, endpoints: ['http://x:3'], "
    "rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2']}]}]",
    "models: [{name: a, strategy: least-request, "
    "rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2'], combined: ['http://x:3']}]}]",
    # pods Kubernetes finds may serve whole requests
    "kubernetes: {enabled: true}\nmodels: [{name: a, strategy: least-request, "
    "rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2']}]}]",
    # the lock wins, so the strategy under it is never used
    "models: [{name: a, lock_strategy: pd, strategy: random, "
    "rolesets: [{prefill: ['http://x:1'], decode: ['http://x:2']}]}]",
])
def test_a_whole_request_strategy_on_a_model_with_somewhere_to_route_it_is_taken(tmp_path, capsys, text):
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 0, err


@pytest.mark.parametrize("text", ["", "# every model is elsewhere\n", "listen: {port: 8000}\n", "models: []\n",
                                  "models:\n"])
def test_a_file_that_declares_no_model_is_an_error(tmp_path, capsys, text):
    """A file with no model (an empty ConfigMap key, a ``models:`` block lost in an edit) would
    start a gateway that answers every request 404, or empty a running one's pool at a reload:
    refused, as a start and a reload refuse it. With Kubernetes discovery the models come from
    the pods."""
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 2 and out == ""
    at = ":1:1" if text.startswith("models") else ""       # the models: key written, else the file
    assert err.startswith(f"switchyard: config error: {tmp_path / 'gw.yaml'}{at}: models: no model is declared"), err
    rc, out, err = check(tmp_path, text + "kubernetes: {enabled: true}\n", capsys)
    assert rc == 0 and "OK (0 models, models discovered through Kubernetes)" in out, err


def test_a_model_limit_that_names_no_model_is_a_warning_at_check_and_at_start(tmp_path, capsys):
    """``limits.models`` is looked up by the model a request is routed to (an alias's or an
    adapter's request by its model's name): an entry naming no model limits nothing, which a typo
    makes easy to miss. The gateway runs with it, so it is a warning, by --check-config and in the
    start's log; with Kubernetes discovery the model may come from the pods."""
    aliased = GOOD + ("aliases: [{name: chat, targets: [{model: llama}]}]\n"
                      "limits: {models: {lama: {rps: 5}, chat: {rps: 5}, qwen: {rps: 5}}}\n")
    rc, out, err = check(tmp_path, aliased, capsys)
    assert rc == 0 and "OK (2 models)" in out
    assert err.splitlines() == [
        "switchyard: warning: limits.models.lama: names no model: this limit applies to no request",
        "switchyard: warning: limits.models.chat: names no model (an alias, whose requests are limited by "
        "their models' names): this limit applies to no request",
    ], err
    rc, out, err = check(tmp_path, aliased + "kubernetes: {enabled: true}\n", capsys)
    assert rc == 0 and err == ""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(aliased + "listen: {port: 1}\n")
    done = _started_with_two_workers(cfg)
    assert done.returncode == 0, done.stderr
    assert "limits.models.lama: names no model" in done.stderr, done.stderr


def test_a_users_entry_longer_than_a_claimed_name_is_no_warning(tmp_path, capsys):
    """A ``limits.users`` entry longer than 128 characters is kept as its digest, as a client's
    claimed name is: without auth it limits the client claiming it, so nothing to warn about."""
    long = "u" * 129
    text = GOOD + f"limits: {{users: {{{long}: {{rpm: 5}}, {'v' * 128}: {{rpm: 5}}}}}}\n"
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 0 and err == "", err
    keyed = text + f"auth: {{api_keys: [{{key: sk-0123456789abcdef, user: {long}}}]}}\n"
    rc, out, err = check(tmp_path, keyed, capsys)
    assert rc == 0 and err == "", err


def test_a_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path, capsys):
    """A config file whose bytes are not UTF-8 (saved in Latin-1, or a binary put in its place) is
    refused naming the file and where its bytes go wrong, as a file that cannot be read is."""
    f = tmp_path / "gw.yaml"
    f.write_bytes(GOOD.encode() + b"# caf\xe9\n")
    assert main(["--check-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}: <file>: not UTF-8 text" in err and f"byte {len(GOOD.encode()) + 5}" in err, err


def test_a_file_larger_than_a_config_is_refused_unread(tmp_path, capsys):
    """A config file of more than 4 MiB (a log or a dump written in its place, a generated file
    run away) is refused without being parsed, as a file that cannot be read is: YAML parsing takes
    seconds a megabyte, which at a reload would hold the --workers parent and stall every worker
    past worker_stall_timeout_s. A file just under the bound loads."""
    f = tmp_path / "gw.yaml"
    pad = "#" * 1023 + "\n"
    f.write_text(GOOD + pad * (4 * 1024 - 1))
    assert main(["--check-config", str(f)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    f.write_text(GOOD + pad * 4 * 1024)
    assert main(["--check-config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"switchyard: config error: {f}: <file>: larger than 4 MiB, not read " \
                          "(a config is kilobytes)", err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_check_config_of_a_fifo_no_one_writes_ends_at_a_stop(tmp_path, sig):
    """--check-config starts nothing, so a stop (Ctrl-C at a terminal) ends it, also while it waits
    for the text of a FIFO (or of /dev/stdin). Before, the stops a start holds back were held back
    here too, and only SIGKILL ended it."""
    f = tmp_path / "gw.yaml"
    os.mkfifo(f)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--check-config", str(f)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer = -1
    try:
        deadline = time.monotonic() + 30
        while writer < 0 and time.monotonic() < deadline:   # opens once the check has the file open to read
            try:
                writer = os.open(f, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.02)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=20)
    finally:
        if writer >= 0:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (-signal.SIGTERM, 130), (proc.returncode, err)
    assert "Traceback" not in err, err


@pytest.mark.parametrize("env,expected", [
    ({"OTEL_TRACES_SAMPLER": "bogus"}, "environment variable OTEL_TRACES_SAMPLER: 'bogus' is not supported"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
     "environment variable OTEL_TRACES_SAMPLER_ARG: must be within [0, 1], got '2'"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "environment variable OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json' is not supported"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector"}, "environment variable OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent.pem"},
     "environment variable OTEL_EXPORTER_OTLP_CERTIFICATE: cannot read '/nonexistent.pem'"),
    # the exporter dropped an entry that is no name=value pair with a warning, and sent the spans
    # without it (an authorization header lost: every export refused by the collector)
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_HEADERS": "x-team=a,Bearer s3cret"},
     "environment variable OTEL_EXPORTER_OTLP_HEADERS: entry 2 of 2 is not name=value"),
])
def test_otel_variables_a_start_refuses_are_refused_naming_the_variable(tmp_path, capsys, monkeypatch, env,
                                                                         expected):
    """The tracing variables a start reads are checked as the start checks them: a bad one failed
    the start (or, for a header, lost it silently) after ``--check-config`` said OK."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    rc, out, err = check(tmp_path, GOOD, capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"switchyard: config error: {expected}"), err
    assert "s3cret" not in err


def test_otel_variables_of_tracing_left_off_are_not_read_for_the_exporter(tmp_path, capsys, monkeypatch):
    """A CA file or headers are read only by the exporter, which a start without tracing builds not."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "garbage")
    rc, out, err = check(tmp_path, GOOD, capsys)
    assert rc == 0 and err == "" and "OK (2 models)" in out


def test_grpc_without_its_extra_is_refused_naming_the_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    rc, _, err = check(tmp_path, GOOD, capsys)
    assert rc == 2
    assert err == ("switchyard: config error: OTEL_EXPORTER_OTLP_PROTOCOL: grpc needs the OTLP gRPC exporter: "
                   "pip install 'switchyard[grpc]'\n")


def test_a_users_model_list_naming_no_model_is_a_warning_at_check(tmp_path, capsys):
    """``limits.users.<name>.models`` (and ``default_user``'s) is checked against the name a
    request asks for: a model, an alias or a LoRA adapter; a name that is none of them allows
    nothing, which a typo makes easy to miss. A warning, as for ``limits.models``."""
    text = GOOD + ("aliases: [{name: chat, targets: [{model: llama}]}]\n"
                   "limits: {users: {alice: {models: [llama, chat, lama]}}, default_user: {models: [qwen, qwn]}}\n")
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 0 and "OK (2 models)" in out
    assert err.splitlines() == [
        "switchyard: warning: limits.users.alice.models: 'lama' names no model, alias or LoRA adapter: it allows no request",
        "switchyard: warning: limits.default_user.models: 'qwn' names no model, alias or LoRA adapter: it allows no request",
    ], err
    rc, out, err = check(tmp_path, text + "kubernetes: {enabled: true}\n", capsys)
    assert rc == 0 and err == ""


@pytest.mark.parametrize(("text", "key", "shown", "why"), [
    # a user's entry that no request's user could match
    ("limits: {users: {'alice ': {rpm: 5}}}", "limits.users", "'alice '", "whitespace at its ends"),
    ("limits: {users: {ok: {rpm: 1}, \"\\tbob\": {rpm: 5}}}", "limits.users", "'\\tbob'", "whitespace at its ends"),
    ("auth: {api_keys: [{key: sk-0123456789abcdef, user: 'carol '}]}", "auth.api_keys[0].user", "'carol '",
     "whitespace at its ends"),
    # a control character inside a name: it would split a log line, a metric label or a header
    ("limits: {users: {\"al\\x01ice\": {rpm: 5}}}", "limits.users", "'al\\x01ice'", "control character"),
    ("auth: {api_keys: [{key: sk-0123456789abcdef, user: \"ca\\x1brol\"}]}", "auth.api_keys[0].user",
     "'ca\\x1brol'", "control character"),
    ("models: [{name: \"lla\\tma\", endpoints: ['http://127.0.0.1:1']}]", "models[0].name", "'lla\\tma'",
     "control character"),
    ("models: [{name: llama, endpoints: ['http://127.0.0.1:1'], adapters: {\"lo\\x7fra\": /a}}]",
     "models[0].adapters", "'lo\\x7fra'", "control character"),
    ("models: [{name: llama, endpoints: ['http://127.0.0.1:1']}]\naliases: [{name: \"ch\\nat\", "
     "targets: [{model: llama}]}]", "aliases[0].name", "'ch\\nat'", "control character"),
    ("models: [{name: llama, endpoints: ['http://127.0.0.1:1']}]\n"
     "limits: {users: {alice: {models: [\"lla\\x00ma\"]}}}", "limits.users.alice.models[0]", "'lla\\x00ma'",
     "control character"),
])
def test_a_user_or_model_name_no_request_can_match_is_refused_on_one_line_naming_its_key(
        tmp_path, capsys, text, key, shown, why):
    """A ``limits.users`` entry whose name has whitespace at its ends loaded and matched no
    request's user (a header's value is read without it); a control character inside a model's,
    an alias's, an adapter's or a user's name loaded and then split the log lines, metric labels
    and headers it went into. Each is refused on one line naming the key, as a model name with
    whitespace at its ends is."""
    text = (text if text.startswith("models") else GOOD + text) + "\n"
    rc, out, err = check(tmp_path, text, capsys)
    assert rc == 2 and out == "", err
    assert err.count("\n") == 1 and f" {key}: " in err and shown in err and why in err, err


LINED = """\
listen:
  host: 127.0.0.1
models:
  - name: llama
    endpoints:
      - http://127.0.0.1:8001
      - url: http://127.0.0.1:8002
        engine: vllm
limits:
  users:
    org.team:
      models: [llama, qwen]
"""


@pytest.mark.parametrize(("old", "new", "where", "key"), [
    ("engine: vllm", "engine: vlm", "8:9", "models[0].endpoints[1].engine"),
    ("engine: vllm", "enigne: vllm", "8:9", "models[0].endpoints[1].enigne"),     # an unknown key: the key's place
    ("[llama, qwen]", "[llama, ' qwen']", "12:23", "limits.users.org.team.models[1]"),   # a user's name with a dot
    ("engine: vllm\n", "engine: vllm\n    strategy: fastest\n", "9:5", "models[0].strategy"),
    ("http://127.0.0.1:8001", "ftp://127.0.0.1:8001", "6:9", "models[0].endpoints[0].url"),   # a URL string
    ("  - name: llama\n", "  - nme: llama\n", "4:5", "models[0].nme"),
    # a user's entry named so no request matches it: the entry's key, not the users: key above it
    ("    org.team:\n", "    org.team:\n      rpm: 1\n    'bob ':\n", "13:5", "limits.users"),
    ("    org.team:\n", "    org.team:\n      rpm: 1\n    \"b\\tob\":\n", "13:5", "limits.users"),
])
def test_an_error_past_the_yaml_names_its_line_and_column_and_its_key(tmp_path, capsys, old, new, where, key):
    """An error in what the YAML says (past its syntax) names the file's line and column of the key
    or the value at fault, as a compiler's does, and then the key path."""
    rc, out, err = check(tmp_path, LINED.replace(old, new, 1), capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"switchyard: config error: {tmp_path / 'gw.yaml'}:{where}: {key}: "), err


def test_an_error_of_a_key_the_file_does_not_write_names_the_nearest_one_written(tmp_path, capsys):
    """A missing key is named at the mapping that misses it; one of the file as a whole at no line."""
    rc, _, err = check(tmp_path, "models:\n  - engine: vllm\n    endpoints: ['http://127.0.0.1:1']\n", capsys)
    assert rc == 2 and err.startswith(f"switchyard: config error: {tmp_path / 'gw.yaml'}:2:5: models[0].name: "), err
    rc, _, err = check(tmp_path, "listen: {port: 8000}\n", capsys)
    assert rc == 2 and err.startswith(f"switchyard: config error: {tmp_path / 'gw.yaml'}: models: "), err
