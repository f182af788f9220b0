"""The ``models[].kv_events`` config block (read by ``gateway.kv.events`` and ``gateway.kv.index``),
and an endpoint's own ``kv_events`` (its publisher's ports, when engines share a host)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from gateway.config.block import Block

_Port = Annotated[int, Meta(ge=1, le=65535)]
_Seconds = Annotated[float, Meta(ge=0)]


class KVEventsConfig(Block):
    """Subscribe to the engines' KV-cache events (vLLM/SGLang ``--kv-events-config``)."""

    enabled: Annotated[bool, Meta(description="Subscribe to every endpoint's KV-cache events (vLLM/SGLang --kv-events-config); needs the model's tokenizer.")] = False
    port: Annotated[_Port, Meta(description="Port of the engine's event publisher (ZMQ PUB), on the endpoint's host.")] = 5557
    replay_port: Annotated[_Port | None, Meta(description="Port of the engine's replay socket (vLLM's replay_endpoint), asked for what the gateway has not heard each time it connects to the publisher (at start, so an idle engine's cache is known at once, and after a reconnect) and after a gap; null: no replay (a gap clears the endpoint's entries).")] = None
    topic: Annotated[str, Meta(description="Subscription topic prefix (empty: every topic).")] = ""
    stall_timeout_s: Annotated[_Seconds, Meta(description="When a request needed new blocks and no event came for this long, the endpoint falls back to the approximate prefix index, in seconds.")] = 10.0
    speculative_ttl_s: Annotated[_Seconds, Meta(description="A routed request's new blocks count as held by its endpoint for this long, or until events confirm them, in seconds.")] = 10.0
    replay_timeout_s: Annotated[float, Meta(gt=0, description="Longest wait for a replay answer, in seconds.")] = 2.0
    max_blocks_per_endpoint: Annotated[int, Meta(ge=1, description="Index entries kept per endpoint.")] = 262144
    max_request_blocks: Annotated[int, Meta(ge=1, description="Most blocks of one request hashed and looked up.")] = 16384
    # a data-parallel engine behind one endpoint publishes rank r on port + r (replay on replay_port + r)
    data_parallel_size: Annotated[int, Meta(ge=1, description="Data-parallel ranks behind one endpoint; rank r publishes on port + r (and replays on replay_port + r), so the two ranges of ports may not overlap.")] = 1
    # pin each request to the rank holding its prefix (``X-data-parallel-rank``) when
    # data_parallel_size > 1; None (the default) means true there; false leaves the rank to the engine
    route_ranks: Annotated[bool | None, Meta(description="Pin each request to the rank holding its prefix (X-data-parallel-rank header) when data_parallel_size > 1; null: true there.")] = None
    # forward a client's own X-data-parallel-rank header (stripped by default: clients do not pin ranks)
    client_rank: Annotated[bool, Meta(description="Pass on a client's own X-data-parallel-rank header, and SGLang's routed_dp_rank (or data_parallel_rank) and disagg_prefill_dp_rank body fields (by default they are removed, counted in switchyard_request_fields_dropped_total and logged in dropped_fields).")] = False
    # threads tokenizing requests off the event loop (one pool per gateway: the largest over the
    # models); 0 tokenizes on the loop. Segments shorter than tokenize_inline_chars stay on the loop:
    # a hop costs the request two handovers of the GIL, each up to the interpreter's switch interval
    # (5 ms) while the loop is busy, more than such a segment costs the loop.
    tokenize_threads: Annotated[int, Meta(ge=0, le=16, description="Threads tokenizing requests off the event loop, one pool per gateway sized by the largest value over the models (0: on the loop).")] = 1
    tokenize_inline_chars: Annotated[int, Meta(ge=0, description="Prompt segments shorter than this many characters are tokenized on the event loop.")] = 1024
    # tokenize every segment of a request, also those no engine's cache reaches (exact prompt token
    # counts for conditional P/D's thresholds, at the CPU cost of tokenizing every new prompt whole);
    # by default such a segment is only probed and its tokens estimated from its characters
    tokenize_unreached: Annotated[bool, Meta(description="Tokenize every segment of a request, also those no engine holds (exact prompt token counts for conditional P/D, at more CPU); by default their tokens are estimated from their characters.")] = False

    # a chat's answer, once relayed whole, is tokenized in the tokenizer threads as the next turn will
    # hold it (the chat template's form around an assistant message), so that turn finds it cached
    tokenize_answers: Annotated[bool, Meta(description="Tokenize a chat's relayed answer in the tokenizer threads once it ends, as the conversation's next turn will send it back, so that turn does not tokenize it on its way to the engine (needs tokenize_threads > 0).")] = True

    # the answers' tokenizing pauses while the next turns keep finding them held by no engine
    answers_unheld_limit: Annotated[int, Meta(ge=0, description="After this many next turns in a row found no engine holding the block with their answer's first generated tokens (an engine that does not cache what it generates, a template that rewrites earlier answers), answers are tokenized ahead only one in 16, until a next turn finds its answer held (0: every answer, always).")] = 64

    # a plain chat (messages of a role and a text each) is put together from the pieces its chat
    # template rendered once for that sequence of roles, instead of rendering the template each time
    chat_shapes: Annotated[bool, Meta(description="Put a plain chat's prompt (each message a role and a text, at most 128 messages) together from the pieces the chat template rendered once for its sequence of roles (learned at the sequence's second chat), instead of rendering the template for every request; the first chat put together of each sequence and one in 64 are also rendered and compared, and a difference turns this off for the model (false: render every chat).")] = True

    # byte-level BPE tokenizers (Llama 3, Qwen, GPT-style) encoded by tiktoken, about five times faster,
    # when it encodes as the tokenizers library does (checked at start and on a sample as it runs)
    fast_tokenizer: Annotated[bool, Meta(description="Encode the model's prompts with tiktoken (about five times faster than the tokenizers library) when its tokenizer is a byte-level BPE that tiktoken encodes the same way: checked at start on sample texts and the vocabulary, then on the first 32 segments and one in 256; the first difference turns it off for the model. Models sharing a tokenizer directory share the choice (false on any of them: off for all).")] = True

    def __post_init__(self) -> None:
        check_rank_ports(self.port, self.replay_port, self.data_parallel_size)

    @property
    def ranked(self) -> bool:
        """Whether the gateway picks the rank of a request to this engine (``route_ranks``)."""
        return self.data_parallel_size > 1 and self.route_ranks is not False

    def with_annotation(self, values: dict) -> KVEventsConfig:
        """This block with a pod annotation's ``port``, ``replay_port`` and ``topic`` laid over it."""
        out = msgspec.structs.replace(self, enabled=True, **values)
        check_rank_ports(out.port, out.replay_port, out.data_parallel_size)
        return out


def check_rank_ports(port: int | None, replay_port: int | None, size: int | None) -> None:
    """Every rank's port (``port + rank``) must be a TCP port, and no rank's publisher port may be
    a rank's replay port: the engine binds both on its host, and a port bound twice stops it."""
    for name, p in (("port", port), ("replay_port", replay_port)):
        if p is not None and size is not None and p + size - 1 > 65535:
            raise ValueError(f"{name} {p} + data_parallel_size {size} - 1 is beyond 65535")
    if port is not None and replay_port is not None and size is not None and abs(port - replay_port) < size:
        def span(p: int) -> str:
            return f"{p}-{p + size - 1}" if size > 1 else str(p)
        raise ValueError(f"port {span(port)} and replay_port {span(replay_port)} overlap: rank r binds port + r "
                         f"and replay_port + r on the engine's host (data_parallel_size {size})")


class KVEventsEndpointConfig(Block):
    """An endpoint's ``kv_events``: this engine's publisher, laid over its model's block (as the pod
    annotation ``switchyard.io/kv-events`` is). Engines sharing a host publish on ports of their own."""

    port: Annotated[_Port | None, Meta(description="Port of this engine's event publisher; null: the model's kv_events.port.")] = None
    replay_port: Annotated[_Port | None, Meta(description="Port of this engine's replay socket; null: the model's.")] = None
    topic: Annotated[str | None, Meta(description="This engine's topic prefix; null: the model's.")] = None
    data_parallel_size: Annotated[Annotated[int, Meta(ge=1)] | None, Meta(description="Data-parallel ranks of this engine; null: the model's.")] = None

    def __post_init__(self) -> None:
        check_rank_ports(self.port, self.replay_port, self.data_parallel_size)

    def items(self) -> tuple[tuple[str, object], ...]:
        """The keys given, as the endpoint's ``extra["kv_events"]`` holds them (like the annotation)."""
        return tuple((k, getattr(self, k)) for k in ("port", "replay_port", "topic", "data_parallel_size")
                     if getattr(self, k) is not None)
