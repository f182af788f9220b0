"""Client-facing APIs other than chat/completions/embeddings, each behind one small object.

``base.ApiShape`` is the seam: the pipeline and the relay ask the request's API how to read and
parse its body, how to shape an error before and after the response headers (and an engine's
error answer), how to watch its event stream (first token, inter-token gaps, usage, completion)
and, around routing, what it must do with state or which endpoints may serve it. The OpenAI
chat/completions/embeddings paths keep their own code (``ctx.api`` is ``None``).

The APIs: the Responses API (``responses``), the Anthropic Messages API (``anthropic``), the
pass-through endpoints (``passthrough``: rerank, score, tokenize, detokenize, classify, pooling,
Cohere embed, audio); the paths
only some engines serve go through ``serving.EngineSpecificApi``.
"""
