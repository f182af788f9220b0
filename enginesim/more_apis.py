"""The engines' surface beyond chat, completions and embeddings, by engine.

vLLM: the Anthropic Messages API (``messages_api``), rerank, score, classify, pooling and Cohere
embed (``pooling_api``; its tokenize and detokenize live in ``vllm_api``), speech to text
(``audio_api``). SGLang: its own dialect of the Messages API (``messages_api``), rerank, score,
classify (``/v1/classify``), tokenize and detokenize.
"""

from __future__ import annotations

from aiohttp import web

from enginesim import messages_api
from enginesim.audio_api import AudioApi
from enginesim.engine import Engine
from enginesim.messages_api import MessagesApi
from enginesim.pooling_api import PoolingApi


def more_routes(engine: Engine) -> list[web.RouteDef]:
    if engine.cfg.engine == "vllm":
        return [*MessagesApi(engine).routes(), *PoolingApi(engine).vllm_routes(), *AudioApi(engine).routes()]
    return [*messages_api.sglang_routes(engine), *PoolingApi(engine).sglang_routes()]
