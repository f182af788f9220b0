"""Client-facing APIs other than chat/completions/embeddings, each behind one small object.

``base.ApiShape`` is the seam: the pipeline and the relay ask the request's API how to parse its
body, how to shape an error before and after the response headers, how to watch its event stream
(first token, inter-token gaps, usage, completion) and, around routing, what it must do with state.
The OpenAI chat/completions/embeddings paths keep their own code (``ctx.api`` is ``None``).
"""
