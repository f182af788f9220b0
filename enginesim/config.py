"""Simulator configuration: one frozen dataclass shared by the CLI and in-process callers.

Every knob is a field with a ``help`` entry in its metadata, and the CLI is generated from the
fields, so the two can never drift apart. A value of ``0`` for ``block_size``, ``kv_blocks`` and
``default_max_tokens`` means "what this engine does by default"; ``__post_init__`` resolves it so
the rest of the package only ever sees concrete numbers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from enginesim.faults import parse_fault

ENGINES = ("vllm", "sglang")
IMPLEMENTED_ROLES = ("aggregated", "prefill", "decode")
PLANNED_ROLES: tuple[str, ...] = ()
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
SCHEDULING_POLICIES = ("fcfs", "priority")

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

# Token capacity of the default pool: 4096 blocks of 16 tokens. SGLang gets the same capacity at
# page size 1 so both engines cache the same amount of text by default.
_DEFAULT_KV_TOKENS = 4096 * 16


def _knob(default: Any, help_: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help_, **extra})


@dataclass(frozen=True)
class SimConfig:
    """All knobs of one simulated engine. Times are in milliseconds unless the name says ``_s``."""

    engine: str = _knob("vllm", "which engine to imitate on the wire", choices=ENGINES)
    role: str = _knob("aggregated", "serving role: aggregated, or prefill/decode for P/D disaggregation",
                      choices=IMPLEMENTED_ROLES)
    host: str = _knob("127.0.0.1", "address to bind")
    port: int = _knob(0, "port to bind; 0 picks a free port (CLI default: 8000 vLLM, 30000 SGLang)")
    model: str = _knob("sim-model", "model path/name (vLLM: the card's root)")
    served_model_names: tuple[str, ...] = _knob(
        (), "served model names/aliases; the first is the metric label and response model",
        cli="--served-model-name")
    seed: int = _knob(0, "seed for output tokens and jitter; same seed + prompt gives the same output")
    ttft_base_ms: float = _knob(20.0, "fixed part of the prefill time")
    prefill_ms_per_token: float = _knob(0.05, "prefill cost of each uncached prompt token")
    itl_ms: float = _knob(10.0, "base inter-token latency")
    itl_jitter_ms: float = _knob(0.0, "uniform jitter added to each inter-token gap (+/-)")
    itl_growth_per_running: float = _knob(
        0.0, "extra inter-token latency (ms) per other running request, so load slows decode")
    max_num_seqs: int = _knob(64, "max running requests; the rest wait in a queue (first come first served, "
                                  "or by priority with priority scheduling)")
    scheduling_policy: str = _knob(
        "fcfs", "vLLM --scheduling-policy: 'priority' admits the waiting request of the lowest priority first "
        "(the body's priority, or an X-Vllm-Priority header over it; 0 when neither), then the earliest; "
        "'fcfs': in arrival order, and a priority other than 0 is refused (400), as vLLM does",
        choices=SCHEDULING_POLICIES)
    enable_priority_scheduling: bool = _knob(
        False, "SGLang --enable-priority-scheduling: the waiting request of the highest body priority is "
        "admitted first, then the earliest; one that names none goes after every one that does")
    kv_blocks: int = _knob(0, "KV pool size in blocks (0: 65536 tokens' worth)")
    block_size: int = _knob(0, "tokens per KV block (0: 16 for vLLM, 1 for SGLang's page size)")
    enable_prefix_caching: bool = _knob(True, "automatic prefix caching (vLLM) / radix cache (SGLang)")
    cache_output_blocks: bool = _knob(
        False, "also cache a request's generated tokens, a block once it fills (as vLLM and SGLang do, "
        "and report it in KV events), so a conversation's next turn can hit its answer too; off: "
        "only the blocks a prefill computed are cached")
    report_cached_tokens: bool = _knob(
        True, "report prompt_tokens_details.cached_tokens (vLLM --enable-prompt-tokens-details, "
        "SGLang --enable-cache-report)")
    default_max_tokens: int = _knob(
        0, "max tokens when the request gives none (0: 16 for vLLM and SGLang completions, "
        "128 for SGLang chat and /generate)")
    max_model_len: int = _knob(8192, "context length; longer prompts are rejected with 400")
    rest_of_context: bool = _knob(
        False, "vLLM: a chat that names no max_tokens (or a completion whose max_tokens is an explicit "
        "null) generates up to max_model_len minus its prompt, as the real engine does; off: "
        "default_max_tokens instead, so simulated answers stay short")
    eos_probability: float = _knob(
        0.0, "chance per generated token (after min_tokens) of a natural EOS unless ignore_eos")
    startup_delay_s: float = _knob(
        0.0, "vLLM: refuse connections for this long; SGLang: /health and /health_generate 503")
    fault: str = _knob("", "default fault spec for every request, e.g. 'error_after=3;error_code=501' (an "
                           "in-stream error event with code 501 after 3 tokens; error_code=\"501\" sends the code as a "
                           "string; see enginesim/README.md)")
    sse_keepalive_s: float = _knob(0.0, "vLLM --sse-keep-alive-interval; 0 disables keep-alive frames")
    keepalive_timeout_s: float = _knob(
        5.0, "an idle kept-alive HTTP connection is closed after this many seconds (uvicorn's "
        "timeout_keep_alive, 5 s in vLLM (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and SGLang); 0: never")
    sglang_abort_delay_s: float = _knob(
        0.1, "SGLang: delay between client disconnect and abort (real: ~2 s stream, <=4 s non-stream)")
    enable_request_id_headers: bool = _knob(False, "vLLM --enable-request-id-headers: echo X-Request-Id")
    enable_metrics: bool = _knob(True, "SGLang --enable-metrics (vLLM always serves /metrics)")
    embedding_dim: int = _knob(16, "length of the vectors /v1/embeddings returns")
    enable_responses_store: bool = _knob(
        False, "vLLM VLLM_ENABLE_RESPONSES_API_STORE=1: keep /v1/responses answers (store: true) in process "
        "for previous_response_id, GET and cancel; SGLang always keeps them")
    tool_call_parser: str = _knob(
        "", "vLLM --enable-auto-tool-choice --tool-call-parser, SGLang --tool-call-parser: answer a request "
        "that offers function tools with simulated calls (chat, Messages, Responses; see enginesim/tools.py); "
        "empty: the answer is text (the tools still count in the prompt, as the engine renders them)")
    reasoning_parser: str = _knob(
        "", "vLLM --reasoning-parser: the first half of an answer's max tokens is reasoning (a chat's "
        "reasoning, in its message and deltas; a Messages thinking block; a Responses reasoning item, counted in reasoning_tokens), the rest "
        "its content; empty: no reasoning")
    # -- LoRA adapters --------------------------------------------------------------------------
    enable_lora: bool = _knob(False, "serve LoRA adapters (vLLM --enable-lora; SGLang --enable-lora)")
    max_loras: int = _knob(4, "GPU slots for adapters (vLLM --max-loras, SGLang --max-loras-per-batch)")
    lora_modules: tuple[str, ...] = _knob(
        (), "adapters registered at start, as name=path (vLLM --lora-modules, SGLang --lora-paths)")
    max_loaded_loras: int = _knob(
        0, "registered adapters allowed; a load beyond is refused with the engine's error (SGLang "
        "--max-loaded-loras; vLLM's plain manager at --max-cpu-loras); 0: no cap")
    lora_full_evicts: bool = _knob(
        False, "at max_loaded_loras a load succeeds and the least recently used adapter without running "
        "requests is unloaded instead (SGLang 0.5.23 and later; its answer's loaded_adapters then "
        "lacks the evicted one), rather than being refused")
    runtime_lora_updating: bool = _knob(
        True, "vLLM VLLM_ALLOW_RUNTIME_LORA_UPDATING=true: serve /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter; off, vLLM has no such routes (404, {\"detail\": \"Not Found\"})")
    lora_load_ms: float = _knob(
        50.0, "cold load: time an adapter takes to enter a free (or evicted, LRU) GPU slot")
    lora_load_call_ms: float = _knob(
        0.0, "runtime load call: time the engine takes before it answers one (registers the adapter, or "
        "refuses it), as reading a large adapter from disk or the hub does; 0: at once")
    # -- P/D disaggregation --------------------------------------------------------------------
    kv_transfer_ms_per_token: float = _knob(
        0.01, "P/D: KV transfer time per transferred prompt token (vLLM pull, SGLang send)")
    side_channel_host: str = _knob(
        "localhost", "vLLM prefill: host reported as kv_transfer_params.remote_host "
        "(VLLM_NIXL_SIDE_CHANNEL_HOST); the side channel itself binds --host")
    side_channel_port: int = _knob(
        0, "vLLM prefill: NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT); 0 picks a free port "
        "(CLI default: 5600)", cli_default=5600)
    engine_id: str = _knob("", "vLLM: remote_engine_id this engine reports (empty: a fresh uuid4)")
    kv_lease_s: float = _knob(
        30.0, "vLLM prefill: how long blocks stay pinned for a decode to pull (kv_lease_duration)")
    kv_load_failure_policy: str = _knob(
        "fail", "vLLM decode: on a failed KV pull, 'fail' the request (500) or 'recompute' locally",
        choices=KV_LOAD_FAILURE_POLICIES)
    bootstrap_port: int = _knob(
        0, "SGLang: --disaggregation-bootstrap-port (prefill listens; decode uses it when a request "
        "has no bootstrap_port); 0 picks a free port (CLI default: 8998)", cli_default=8998)
    bootstrap_timeout_s: float = _knob(
        300.0, "SGLang prefill: wait this long for the decode (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
    waiting_timeout_s: float = _knob(
        300.0, "SGLang decode: wait this long for the KV (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
    # -- tokenizer and KV-cache events ---------------------------------------------------------
    tokenizer: str = _knob(
        "", "Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json with chat_template); "
        "empty: the built-in fake tokenizer")
    kv_events_port: int = _knob(
        -1, "vLLM --kv-events-config endpoint: publish KV-cache events on a ZMQ PUB socket on this port "
        "(0: a free port; -1: off)")
    kv_events_replay_port: int = _knob(-1, "the replay ROUTER socket's port (0: a free port; -1: none)")
    kv_events_topic: str = _knob("", "topic frame of every KV-event message")
    kv_events_encoding: str = _knob("map", "events as maps tagged 'type' (vLLM today) or positional arrays "
                                    "(older vLLM)", choices=("map", "array"))
    data_parallel_size: int = _knob(
        1, "vLLM --data-parallel-size: N ranks behind one endpoint, each with its own KV cache pool and KV-event "
        "publisher (rank r on kv-events port + r, replay port + r); a request runs on the rank its "
        "X-data-parallel-rank header names, else on the least loaded (one scheduler queue still)")
    # -- authentication ------------------------------------------------------------------------
    api_key: str = _knob(
        "", "--api-key: requests without 'Authorization: Bearer KEY' get 401 {\"error\": \"Unauthorized\"} "
        "on the routes the engine protects (vLLM: /v1/*; SGLang: every route but /health* and /metrics); "
        "empty: none")
    # -- tracing -------------------------------------------------------------------------------
    otlp_traces_endpoint: str = _knob(
        "", "vLLM --otlp-traces-endpoint: emit an llm_request span per request, under the request's "
        "traceparent, to this OTLP/HTTP endpoint (URL; /v1/traces added to host:port); empty: off")

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.role not in IMPLEMENTED_ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of aggregated, prefill, decode")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', not {self.scheduling_policy!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be 'fail' or 'recompute', "
                             f"not {self.kv_load_failure_policy!r}")
        for name in ("ttft_base_ms", "prefill_ms_per_token", "itl_ms", "itl_jitter_ms",
                     "itl_growth_per_running", "startup_delay_s", "sse_keepalive_s", "keepalive_timeout_s",
                     "sglang_abort_delay_s", "kv_blocks", "block_size", "default_max_tokens", "port",
                     "kv_transfer_ms_per_token", "side_channel_port", "kv_lease_s", "bootstrap_port",
                     "bootstrap_timeout_s", "waiting_timeout_s", "lora_load_ms", "max_loaded_loras",
                     "lora_load_call_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for module in self.lora_modules:
            if "=" not in module or not module.split("=", 1)[0] or not module.split("=", 1)[1]:
                raise ValueError(f"lora_modules entries are name=path, got {module!r}")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for name in ("max_num_seqs", "max_model_len", "embedding_dim", "max_loras", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be within [0, 1], got {self.eos_probability!r}")
        for name in ("port", "side_channel_port", "bootstrap_port"):
            if getattr(self, name) > 65535:
                raise ValueError(f"{name} must be a TCP port, got {getattr(self, name)!r}")
        if self.kv_events_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_encoding must be map or array, not {self.kv_events_encoding!r}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            if not -1 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a TCP port, 0 or -1, got {getattr(self, name)!r}")
            if getattr(self, name) > 0 and getattr(self, name) + self.data_parallel_size - 1 > 65535:
                raise ValueError(f"{name} + data_parallel_size - 1 must be a TCP port")
        parse_fault(self.fault, self.role)  # fail at startup, not on the first request
        # Resolve "engine default" zeros into concrete values.
        if not self.served_model_names:
            object.__setattr__(self, "served_model_names", (self.model,))
        else:
            object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        if self.block_size == 0:
            object.__setattr__(self, "block_size", 16 if self.engine == "vllm" else 1)
        if self.kv_blocks == 0:
            object.__setattr__(self, "kv_blocks", max(1, _DEFAULT_KV_TOKENS // self.block_size))

    @property
    def priority_scheduling(self) -> bool:
        """The waiting queue orders by priority (vLLM's ``--scheduling-policy priority``, SGLang's
        ``--enable-priority-scheduling``; either turns it on, the engine sets the direction)."""
        return self.scheduling_policy == "priority" or self.enable_priority_scheduling

    @property
    def served_name(self) -> str:
        """The first served name: metric label and (vLLM) the model reported in responses."""
        return self.served_model_names[0]

    @property
    def engine_type(self) -> str:
        """SGLang's ``engine_type`` metric label for this role."""
        return "unified" if self.role == "aggregated" else self.role

    def max_tokens_default(self, route: str) -> int:
        """Max tokens when a request names none; ``route`` is ``chat``, ``completions`` or ``generate``."""
        if self.default_max_tokens:
            return self.default_max_tokens
        if self.engine == "sglang" and route != "completions":
            return 128
        return 16


def _cli_flag(name: str, meta: dict[str, Any]) -> str:
    return str(meta.get("cli", "--" + name.replace("_", "-")))


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser with one flag per ``SimConfig`` field."""
    parser = argparse.ArgumentParser(
        prog="python -m enginesim",
        description="Simulated vLLM / SGLang engine speaking the real wire protocols.")
    for f in fields(SimConfig):
        meta = dict(f.metadata)
        flag = _cli_flag(f.name, meta)
        default = f.default if f.default is not MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif isinstance(default, tuple):
            kwargs["nargs"] = "+"
            kwargs["default"] = default
        else:
            kwargs["type"] = type(default)
            kwargs["default"] = None if f.name == "port" else meta.get("cli_default", default)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        parser.add_argument(flag, **kwargs)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse CLI arguments into a ``SimConfig``; a bad knob exits with argparse's usage error."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    if ns["port"] is None:
        ns["port"] = 8000 if ns["engine"] == "vllm" else 30000
    ns["served_model_names"] = tuple(ns["served_model_names"] or ())
    try:
        return SimConfig(**ns)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
