"""``python -m gateway --config FILE`` or ``python -m gateway --demo``; ``--check-config FILE``,
``--print-config-schema`` and ``--version`` answer and exit without starting anything."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from collections.abc import Callable

from gateway.server import hup

STOPS = {signal.SIGTERM, signal.SIGINT}

if __name__ == "__main__":
    hup.hold()      # before the imports: a SIGHUP while the gateway starts is a reload once it runs
    # and a stop is held back from here on: until the config is read, it ends the gateway with a
    # line in the config's log format (stopped_while_starting), then it is held until the event
    # loop handles it (gateway/server/run.py), or until the parent of --workers N does
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)

import uvloop  # noqa: E402

from gateway.config.deprecated import Deprecation, log_deprecations  # noqa: E402
from gateway.config.schema import (  # noqa: E402
    Config,
    ConfigError,
    ReadStopped,
    ServerConfig,
    config_from_file,
    load_config,
    log_no_effect,
    no_effect,
    not_a_listen_host,
    read_config_file,
    read_settled,
    read_within,
    settle_window_s,
)
from gateway.observability.logs import configure_logging  # noqa: E402
from gateway.version import version  # noqa: E402


def _workers_arg(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {v!r}") from None


def _port_arg(v: str) -> int:
    try:
        port = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {v!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0: any free port), got {port}")
    return port


def _host_arg(v: str) -> str:
    if why := not_a_listen_host(v):
        raise argparse.ArgumentTypeError(why)
    return v


def say(line: str) -> None:
    """One line to stderr in one write. With --workers the parent and its workers share stderr (a
    pipe, for a container runtime); ``print`` writes a line's text and its newline apart, so another
    process's log line could land between them and be read as one garbled line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway", description="Switchyard LLM inference gateway")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="YAML config file")
    src.add_argument("--demo", action="store_true",
                     help="run with in-process simulated engines (no GPU needed)")
    src.add_argument("--check-config", metavar="FILE",
                     help="validate the config file FILE and exit (0: valid); starts nothing")
    src.add_argument("--print-config-schema", action="store_true",
                     help="print the config file's JSON Schema and exit")
    p.add_argument("--version", action="version", version=f"switchyard {version()}")
    p.add_argument("--host", type=_host_arg, help="listen host (overrides listen.host)")
    p.add_argument("--port", type=_port_arg, help="listen port (overrides listen.port)")
    p.add_argument("--log-format", choices=("auto", "json", "console"), help="overrides server.log_format")
    p.add_argument("--workers", type=_workers_arg,
                   help="processes sharing the port via SO_REUSEPORT, or 'auto' for the CPUs of the cgroup's "
                        "quota (overrides server.workers)")
    args = p.parse_args(argv)
    if args.demo and args.workers is not None:
        # its engines run in its own event loop: forked workers would each start them again
        p.error("--workers applies to --config; --demo runs one process, its simulated engines in it")

    if args.print_config_schema:
        import orjson

        from gateway.config.json_schema import config_schema
        sys.stdout.write(orjson.dumps(config_schema(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    if args.check_config:
        # it starts nothing: a stop (Ctrl-C) ends it, also while it waits for a FIFO's or a terminal's text
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        try:
            return check_config(args.check_config)
        except KeyboardInterrupt:
            return 130

    if args.demo:
        from gateway.demo import run_demo
        configure_logging(args.log_format or "auto")
        if stopped_while_starting():
            return 0
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)       # Ctrl-C stops the demo's engines too
        raise_nofile()      # the demo's config keeps server.raise_nofile_limit's default, true
        from gateway.server.run import ListenError
        try:
            uvloop.run(run_demo(host=args.host, port=args.port, log_format=args.log_format or "auto"))
        except ListenError as e:  # its port or an engine's taken: one line, as a start with a config file says it
            hint = "" if "simulated engine" in str(e) else " (--port picks another: python -m gateway --demo --port 8080)"
            say(f"switchyard: {e}{hint}")
            return 1
        except KeyboardInterrupt:
            pass
        return 0

    listen: list = [args.host, args.port]
    # the worker count, once known, and the file's ``server.workers`` it was resolved from: a reload
    # of a file that still says it (``auto``, say) keeps the count; one that says another count is
    # a change of ``server``, refused as needing a restart (``--workers`` overrides the file's always)
    resolved: list[int] = []
    written: list[int | str] = []

    def parse(text: str, deprecations: list[Deprecation] | None = None) -> Config:
        """The config file's ``text`` with the command line's overrides."""
        cfg = config_from_file(text, args.config, deprecations).with_listen(*listen)
        if resolved and (args.workers is not None or cfg.server.workers in written):
            cfg = cfg.with_workers(resolved[0])
        return cfg.with_log_format(args.log_format) if args.log_format else cfg

    def load(deprecations: list[Deprecation] | None = None) -> Config:
        """The config file with the command line's overrides, at each reload of one process: in a
        thread (gateway/server/reload.py), one reload at a time, so a file that keeps it waiting for
        its text (a FIFO no one writes, a hung mount) is refused after ``server.reload_read_timeout_s``,
        not waited for while the reloads after it queue."""
        wait_s = config.server.reload_read_timeout_s or None    # ``server`` is read at start only
        text = read_within(lambda given_up: read_config_file(args.config, given_up, wait_s),
                           read_limit_s(config.server), args.config)
        return parse(text, deprecations)

    deprecated: list[Deprecation] = []      # logged once logging follows the config's format
    from gateway.server.workers import hold_for_tests
    hold_for_tests(HOLD_BEFORE_CONFIG_ENV)
    try:
        # a config path that waits for its text (a FIFO, a terminal) ends its wait at a stop
        config = parse(read_config_file(args.config, stopped=lambda: bool(signal.sigpending() & STOPS)), deprecated)
    except ReadStopped:
        configure_logging()     # the config's format is not known: the default one
        return 0 if stopped_while_starting() else 2
    except (ConfigError, ValueError) as e:
        say(f"switchyard: config error: {e}")
        return 2
    configure_logging(config.server.log_format, config.server.log_level)
    log_deprecations(deprecated, args.config)
    log_no_effect(config, args.config)      # keys that load and do nothing: said, not refused
    if stopped_while_starting():
        return 0
    from gateway.server.run import ListenError, free_port, serve
    if config.server.raise_nofile_limit:     # before the fork: every worker inherits it
        raise_nofile()
    from gateway.server.workers import WorkerInfo, auto_count, auto_workers
    workers, single = auto_workers(args.workers if args.workers is not None else config.server.workers, config)
    if workers < 1:
        say("switchyard: --workers must be >= 1")
        return 2
    if single is not None:
        import structlog
        structlog.get_logger("switchyard").warning(
            "workers: auto runs fewer workers than CPUs", workers=workers, reason=single, cpus=auto_count())
    else:
        workers_warnings(config, workers)
    resolved.append(workers)
    written.append(config.server.workers)
    config = config.with_workers(workers)
    if stopped_while_starting():
        return 0

    def serve_one(worker: WorkerInfo | None = None) -> int:
        try:
            uvloop.run(serve(config, reuse_port=worker is not None, loader=load, worker=worker, source=args.config))
        except ValueError as e:  # strategy names etc. validated at app build
            say(f"switchyard: {e}")
            return 2
        except ListenError as e:  # the port taken, the host unknown: one line, as a config error
            say(f"switchyard: {e}")
            return 1
        except KeyboardInterrupt:  # Ctrl-C before the loop handles it: stopped, without a traceback
            return 130
        return 0

    if workers == 1:
        return serve_one()
    if config.listen.port == 0:   # every worker must bind the same port
        listen[1] = free_port(config.listen.host)
        config = config.with_listen(*listen)
    from gateway.server.handoff import ConfigHandoff
    from gateway.server.rundir import RunDirectory, reclaim_stale
    from gateway.server.workers import parent_log, run_workers
    started = config
    generation = 1                # as the workers count it: +1 per reload applied

    def reread(trigger: str, later: Callable[[Callable[[], None]], None]) -> Callable[[], None]:
        """SIGHUP in the parent (``trigger``: ``signal``, or ``admin`` for a worker's POST
        /admin/reload): the file is read here once, in a thread of the parent's (gateway/server/workers.py)
        while it goes on watching the workers, and checked; what this returns, run in the parent's
        loop, applies it: what was read is handed to every worker for the reload the parent tells
        them of next (gateway/server/handoff.py), and a worker started from then on (a restart)
        gets the new config. ``later`` runs a step in the loop: this thread logs through it."""
        from gateway.server.reload import RestartRequired, check_offline
        deprecations: list[Deprecation] = []
        stops = beats.stops()       # a stop while the file's text is waited for ends the wait
        seq = beats.next_told()
        running = config            # only the loop changes it, and not while this reads
        settle_s = running.server.reload_settle_s

        def deferred() -> None:
            def say_deferred() -> None:
                beats.counted("deferred")
                parent_log("config reload deferred", trigger=trigger, file=args.config, settle_s=settle_s,
                           reason="the file changed within reload_settle_s: it is read once left unchanged")
            later(say_deferred)

        wait_s = running.server.reload_read_timeout_s or None

        def settled(given_up: Callable[[], bool]) -> str:
            """The file's text once whole: a file written in place was read half written
            (gateway/config/schema.py). A stop, or the read given up on, ends its waits."""
            def stopped() -> bool:
                return beats.stops() != stops or given_up()
            return read_settled(args.config, settle_s, lambda: read_config_file(args.config, stopped, wait_s),
                                stopped, deferred)

        text: str | None = None
        try:
            # bounded: a FIFO no one writes, a hung mount, refuse the reload after
            # server.reload_read_timeout_s, where the parent waited for them until a stop
            text = read_within(settled, read_limit_s(running.server), args.config)
            new = parse(text, deprecations)
            check_offline(started, running, new)
        except Exception as e:
            failed = e

            def refuse() -> None:
                # what was read goes to the workers before it is checked: they check the same text
                if text is not None:
                    handoff.put(seq, text=text)
                else:
                    handoff.put(seq, error=failed)
                result = "restart_required" if isinstance(failed, RestartRequired) else "invalid"
                beats.counted(result)
                error = str(failed) if isinstance(failed, ConfigError | ValueError) else f"{type(failed).__name__}: {failed}"
                # the fields of a worker's refusal line (gateway/server/reload.py), and of one process's
                parent_log("config reload refused, restarted workers keep the running config", "error",
                           trigger=trigger, result=result, key_path=getattr(failed, "key_path", None), error=error,
                           generation=generation)
            return refuse

        def apply() -> None:
            nonlocal config, generation
            handoff.put(seq, text=text)
            config = new
            generation += 1
            beats.reloaded(generation)      # before the workers are told: each takes this number
            beats.counted("ok")             # and counts it as the parent does
            # what a start warns of, once for every worker: old key names, keys that do nothing, and
            # what the workers keep apart
            log_deprecations(deprecations, args.config)
            log_no_effect(config, args.config)
            workers_warnings(config, workers)
        return apply

    started_at = time.time()      # the gateway's start, which every worker gives, a restarted one too
    # a stop from here until run_workers handles it is held back, then handled as any stop: its
    # default action would end the parent without removing the directory it makes now
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        if stale := reclaim_stale():    # those of gateways killed outright, whose processes are all gone
            parent_log("run directories of gateways no longer running removed", count=len(stale), paths=stale)
        run_dir = RunDirectory()      # the workers' sockets for each other (gateway/server/siblings.py)
        try:
            from gateway.server.heartbeat import Heartbeats
            beats = Heartbeats(workers)   # each worker's loop ticks, the parent watches (gateway/server/heartbeat.py)
            handoff = ConfigHandoff(run_dir.path)   # the text each reload of the parent's read
            # a worker parses it as the parent did; the parent logs its warnings, once
            handed = functools.partial(handoff.get, parse=lambda text: parse(text, []))
            parent_pid = os.getpid()
            return run_workers(workers, lambda index: serve_one(WorkerInfo(index, workers, run_dir.path, beats,
                                                                           generation, started_at, handed,
                                                                           parent_pid)),
                               parent_log, on_reload=reread, heartbeats=beats,
                               stall_timeout=lambda: config.server.worker_stall_timeout_s,
                               orphaned=run_dir.close_if_last,
                               stop_grace=lambda: config.server.shutdown_grace_s)
        finally:
            run_dir.close()
            # the parent exits without collecting what it holds: a config of tens of thousands of
            # keys (two, and the objects of a parse a stop cut short in the reload's thread) took
            # the interpreter's last collection seconds on a busy machine after every worker had stopped
            import gc
            gc.freeze()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)    # as it was (run_workers has let them through)


def workers_warnings(config: Config, workers: int) -> None:
    """What ``workers`` processes running ``config`` keep apart, as warnings: logged at start (when
    the count was asked for; ``auto`` runs one worker instead) and at each reload the parent applies."""
    import structlog

    from gateway.server.workers import adapters_apart, per_process_state
    if workers > 1 and (apart := per_process_state(config)) is not None:
        # asked for by number: run as asked, but say what each worker keeps apart
        structlog.get_logger("switchyard").warning(
            "workers: each keeps its own state without state.redis_url", workers=workers,
            kept_apart=apart, effect="a user gets up to workers x each limit, and an admin-API key or "
                                     "user created through one worker is unknown to the others")
    if workers > 1 and adapters_apart(config):
        structlog.get_logger("switchyard").warning(
            "workers: LoRA adapters are not shared between them", workers=workers,
            effect="with view.workers or view.share_monitoring off, a worker may load an adapter another "
                   "loaded, and unload one another has requests in flight for")


# For tests only: a directory where the gateway, about to read its config file, makes a FIFO named
# by its pid and waits until the test opens it (tests/integration/server/test_stop_starting.py).
# Unset in any deployment.
HOLD_BEFORE_CONFIG_ENV = "SWITCHYARD_TEST_HOLD_BEFORE_CONFIG"


def read_limit_s(server: ServerConfig) -> float:
    """How long a reload's read of the file may take at most (0: no limit): twice
    ``server.reload_read_timeout_s`` (a FIFO's wait for text, bounded by it once, says so first)
    after the longest wait for the file to be left unchanged (``server.reload_settle_s``)."""
    timeout = server.reload_read_timeout_s
    return 2 * timeout + settle_window_s(server.reload_settle_s) if timeout > 0 else 0.0


def stopped_while_starting() -> bool:
    """Whether a stop (SIGTERM, SIGINT) came while the gateway started and nothing listens yet: held
    back since the entry point began, it is taken here and logged (``stopped while starting, before
    listening``, with ``signal``), and the gateway exits 0. Called once logging follows the config,
    and before the gateway starts serving (or its workers). Before, SIGTERM's default action ended
    the process without a word, and SIGINT was a KeyboardInterrupt (exit 130)."""
    pending = signal.sigpending() & STOPS
    if not pending:
        return False
    first = signal.sigwait(pending)         # pending: returns at once
    while signal.sigpending() & STOPS:      # both came: taken too
        signal.sigwait(STOPS)
    import structlog
    name = signal.Signals(first).name
    structlog.get_logger("switchyard").info("stopped while starting, before listening", signal=name)
    return True


def raise_nofile() -> None:
    """The start's step for ``server.raise_nofile_limit`` (gateway/server/run.py), logged once
    logging is configured: before the app is built and any worker forked."""
    from gateway.server.run import raise_nofile_limit
    raised = raise_nofile_limit()
    if raised is None:
        return
    import structlog
    nofile_log = structlog.get_logger("switchyard")
    if raised.error is None:
        nofile_log.info("file descriptor limit raised", nofile_before=raised.before, nofile=raised.after,
                        nofile_hard=raised.hard)
    else:
        nofile_log.warning("file descriptor limit could not be raised", nofile=raised.before,
                           nofile_hard=raised.hard, error=raised.error)


def check_config(path: str) -> int:
    """``--check-config``: load and validate ``path`` as a start would, and stop there. Errors
    name the file and the key, or the ``OTEL_*`` variable; old names still accepted are printed as
    warnings."""
    deprecated: list[Deprecation] = []
    try:
        config = load_config(path, deprecated)
        # the OTEL_* variables a start reads (gateway/observability/tracing.py), checked as it does
        from gateway.observability.tracing import check_exporter, resolve
        check_exporter(resolve(config.tracing))
    except (ConfigError, ValueError) as e:
        for note in deprecated:
            say(f"switchyard: warning: {note}")
        say(f"switchyard: config error: {e}")
        return 2
    for note in deprecated:
        say(f"switchyard: warning: {note}")
    for note in no_effect(config):
        say(f"switchyard: warning: {note}")
    n = len(config.models)
    found = ", models discovered through Kubernetes" if config.kubernetes.enabled else ""
    print(f"{path}: OK ({n} model{'' if n == 1 else 's'}{found})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:       # Ctrl-C before a signal handler of ours: stopped, no traceback
        sys.exit(130)
