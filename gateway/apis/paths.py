"""The client-facing paths beyond chat, completions and embeddings (``gateway.request``).

Plain constants, so that ``handlers/`` can say which of them each engine serves without importing
anything else of the gateway.
"""

from __future__ import annotations

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
COUNT_TOKENS = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = (MESSAGES, COUNT_TOKENS)
# the characters that go on with a path's last name: after "/v1/messages" they make another path
# ("/v1/messagesx"); anything else after it (a "/", a control byte, a "%" left undecoded, a byte
# outside ASCII) leaves the request one to the Messages API, whose clients read Anthropic's errors
_NAME_GOES_ON = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def on_messages(path: str | None) -> bool:
    """Whether a request's path is the Messages API's: ``/v1/messages``, a path under it
    (``/v1/messages/batches``), or ``/v1/messages`` followed by a byte no path name has
    (``/v1/messages\\x00``, sent raw or as ``%00``)."""
    if path is None or not path.startswith(MESSAGES):
        return False
    return len(path) == len(MESSAGES) or path[len(MESSAGES)] not in _NAME_GOES_ON


# JSON bodies routed by their "model" and relayed untouched
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
# SGLang's own spellings of them (its /tokenize and /detokenize are aliases of these); vLLM has none
SGLANG_TOKENIZE = "/v1/tokenize"
SGLANG_DETOKENIZE = "/v1/detokenize"
TOKENIZE_PATHS = (TOKENIZE, SGLANG_TOKENIZE)
DETOKENIZE_PATHS = (DETOKENIZE, SGLANG_DETOKENIZE)
# classification: vLLM's at /classify, SGLang's (OpenAI-style, with ``model``) at /v1/classify
VLLM_CLASSIFY = "/classify"
SGLANG_CLASSIFY = "/v1/classify"
CLASSIFY_PATHS = (VLLM_CLASSIFY, SGLANG_CLASSIFY)
POOLING = "/pooling"                # vLLM's pooling API
COHERE_EMBED = "/v2/embed"          # vLLM's Cohere-style embed API
JSON_PASSTHROUGH_PATHS = (*RERANK_PATHS, *SCORE_PATHS, *TOKENIZE_PATHS, *DETOKENIZE_PATHS, *CLASSIFY_PATHS, POOLING,
                          COHERE_EMBED)

# multipart/form-data bodies (an audio file and form fields, "model" among them)
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO_PATHS = (TRANSCRIPTIONS, TRANSLATIONS)

PASSTHROUGH_PATHS = (*JSON_PASSTHROUGH_PATHS, *AUDIO_PATHS)
