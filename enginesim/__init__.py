"""enginesim: a simulated vLLM / SGLang engine that speaks the real wire protocols.

It exists so the gateway can be developed and tested without GPUs, against something that behaves
like the real engines where a gateway can tell the difference: SSE framing, header timing, error
envelopes, request ids, usage and cached-token reporting, Prometheus metric names, queueing under
``max_num_seqs``, a bounded KV pool with prefix caching, client-disconnect aborts, and faults on
demand. See ``enginesim/README.md`` for the knobs, the fault spec and the ``/_sim`` endpoints.

In-process use (tests, the gateway's demo mode)::

    server = await start_sim(SimConfig(engine="vllm", model="demo", ttft_base_ms=1, itl_ms=1))
    ...  # server.url
    await server.close()

Command line: ``python -m enginesim --engine vllm --port 8001 --model demo``.
"""

from enginesim.config import SimConfig
from enginesim.faults import FaultSpec, FaultSpecError, parse_fault
from enginesim.server import SimServer, build_app, start_sim

__all__ = ["FaultSpec", "FaultSpecError", "SimConfig", "SimServer", "build_app", "parse_fault", "start_sim"]
