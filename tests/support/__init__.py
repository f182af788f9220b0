"""What the tests share, so that no helper is written twice. Fixtures stay in ``tests/conftest.py``.

- ``http``: a client's request and its answer (``post``, ``post_json``, ``chat_body``, ``bearer``), SSE
  readers, ``/_sim/state``, the OpenAI and Anthropic SDKs pointed at a gateway.
- ``metrics``: the metric reader (a Prometheus page as samples; ``metric`` sums one series).
- ``waiting``: ``wait_for`` a condition, or fail the test ``until`` it holds.
- ``factories``: config blocks (models, P/D rolesets, one-model configs), pods for the Kubernetes
  emulator, requests, endpoints and router contexts for pure code, KV events, a settable clock.
- ``loops``: run a test once on asyncio's loop and once on uvloop.
- ``ports``: ``listen_port`` for a server a test starts in a process of its own or restarts on its
  port (below the kernel's ephemeral range, so no outgoing connection takes it meanwhile, and never
  given twice in a run, so two processes that have not bound yet never share one).
- ``enginesim``, ``edge``: helpers of the engine simulator's tests and of the edge's raw-HTTP tests;
  ``tenancy``, ``lora``, ``routing``, ``status``: what several test files of one feature share (keys,
  prompts, a request), so that no test module imports another.
- The fakes: ``kube_emulator`` (a Kubernetes API server), ``otlp_receiver`` (an OpenTelemetry
  collector), ``redis_server`` (a real redis-server on a ``listen_port``), ``cdp`` (a headless Chromium
  driven over DevTools), ``promql_check`` (dashboards' queries against exported metrics), ``helm``
  (the chart rendered by ``helm_render/``, a small Go program, since CI has no helm).
- ``status_screenshot``: ``make status-screenshot``'s picture of the status page.
"""
