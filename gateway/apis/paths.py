"""The client-facing paths beyond chat, completions and embeddings (``gateway.request``).

Plain constants, so that ``handlers/`` can say which of them each engine serves without importing
anything else of the gateway.
"""

from __future__ import annotations

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
ANTHROPIC_PATHS = (MESSAGES, COUNT_TOKENS)

# JSON bodies routed by their "model" and relayed untouched
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")
SCORE_PATHS = ("/v1/score", "/score")
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
JSON_PASSTHROUGH_PATHS = (*RERANK_PATHS, *SCORE_PATHS, TOKENIZE, DETOKENIZE)

# multipart/form-data bodies (an audio file and form fields, "model" among them)
TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
AUDIO_PATHS = (TRANSCRIPTIONS, TRANSLATIONS)

PASSTHROUGH_PATHS = (*JSON_PASSTHROUGH_PATHS, *AUDIO_PATHS)
