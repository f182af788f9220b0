"""Rerank, score, classify, (vLLM) pooling and Cohere embed, (SGLang) tokenize/detokenize: the
pooling-style endpoints of both engines.

Scores are deterministic and plausible, not learned: the overlap of the two texts' lower-cased
words (cosine over word sets), so a document that shares words with the query ranks above one
that shares none. Shapes, from each engine's own source:

vLLM (its ``RerankResponse`` and ``ScoreResponse`` protocol models), at ``/rerank``, ``/v1/rerank``, ``/v2/rerank``:
  request ``{model, query, documents, top_n}`` (``top_n`` 0 = all); answer ``{"id": "rerank-…",
  "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "document": {"text"},
  "relevance_score"}]}``, best first. At ``/score``, ``/v1/score``: ``{model, text_1, text_2}``
  (one to one, one to many, or many to many of equal length); answer ``{"id": "score-…",
  "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}],
  "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}``.
  An unknown model is vLLM's 404. At ``/classify`` and ``/pooling``: ``{model, input}`` (a
  string, strings, token ids); answers ``{"id": "classify-…"|"pool-…", "object": "list",
  "created", "model", "data": [{"index", "label", "probs", "num_classes"}] | [{"index",
  "object": "pooling", "data": [floats]}], "usage"}`` (score's usage). At ``/v2/embed`` (Cohere's
  embed API): ``{model, texts, input_type, embedding_types}``; answer ``{"id": "embd-…",
  "embeddings": {"float": [...], "base64": [...]}, "texts", "meta": {"api_version": {"version":
  "2"}, "tokens": {"input_tokens"}}}``, no ``usage``.

SGLang (``python/sglang/srt/entrypoints/openai/serving_rerank.py``, ``serving_score.py``,
``serving_tokenize.py``), which never checks ``model``:
  ``/v1/rerank`` ``{query, documents}`` → a JSON *list* ``[{"score", "document", "index",
  "meta_info"}]``, best first. ``/v1/score`` ``{query, items, label_token_ids, apply_softmax,
  model}`` → ``{"scores": [[p per label token] per item], "model", "usage": null, "object":
  "scoring"}``. ``/v1/classify`` ``{model, input}`` → vLLM's classify answer, ``usage`` the
  items' prompt tokens added up. ``/v1/tokenize`` and ``/tokenize`` ``{prompt: str | [str]}`` → ``{"tokens",
  "count", "max_model_len"}``; ``/v1/detokenize`` and ``/detokenize`` ``{tokens}`` → ``{"text"}``.
  Errors in SGLang's flat envelope.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import time
import uuid
from array import array
from typing import Any

from aiohttp import web

from enginesim.engine import Engine
from enginesim.errors import ApiError, ErrorStyle
from enginesim.protocol import token_id_list
from enginesim.vllm_api import BYTES_FORMATS, binary_options, bytes_response, embed, embedding_inputs
from enginesim.wire import json_response, read_json

_WORD = re.compile(r"\w+")
_BAD = "Bad Request"
_LABELS = ("negative", "positive")      # a sequence classifier's id2label


def relevance(a: str, b: str) -> float:
    """Cosine similarity of the two texts' word sets, nudged by a stable hash so ties break the
    same way every time; in [0, 1]."""
    wa, wb = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
    overlap = len(wa & wb) / math.sqrt(len(wa) * len(wb)) if wa and wb else 0.0
    jitter = int.from_bytes(hashlib.blake2b(f"{a}\0{b}".encode(), digest_size=2).digest(), "little") / 65535
    return round(min(1.0, 0.95 * overlap + 0.05 * jitter), 6)


def _doc_text(d: Any, param: str) -> str:
    if isinstance(d, str):
        return d
    if isinstance(d, dict) and isinstance(d.get("text"), str):
        return d["text"]
    raise ApiError(400, f"1 validation error:\n  {param}: Input should be a valid string", type_=_BAD, param=param)


def _str_list(v: Any, param: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        return [_doc_text(x, param) for x in v]
    raise ApiError(400, f"1 validation error:\n  {param}: Input should be a valid string or list", type_=_BAD,
                   param=param)


class PoolingApi:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    def _ntok(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text))

    # -- vLLM -----------------------------------------------------------------------------------

    def vllm_routes(self) -> list[web.RouteDef]:
        return [*(web.post(p, self.vllm_rerank) for p in ("/rerank", "/v1/rerank", "/v2/rerank")),
                *(web.post(p, self.vllm_score) for p in ("/score", "/v1/score")),
                web.post("/classify", self.vllm_classify), web.post("/pooling", self.vllm_pooling),
                web.post("/v2/embed", self.vllm_cohere_embed)]

    def _ids(self, item: str | list[int]) -> list[int]:
        return item if isinstance(item, list) else self.engine.tokenizer.encode(item)

    def _classify_answer(self, inputs: list[str | list[int]]) -> web.Response:
        """A classify answer (vLLM's and SGLang's share it): each input's class probabilities, and
        the usage of what it encoded."""
        data, total = [], 0
        for i, item in enumerate(inputs):
            ids = self._ids(item)
            total += len(ids)
            logits = embed(ids, len(_LABELS), self.cfg.seed)
            exp = [math.exp(x) for x in logits]
            probs = [e / sum(exp) for e in exp]
            data.append({"index": i, "label": _LABELS[probs.index(max(probs))], "probs": probs,
                         "num_classes": len(probs)})
        return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.cfg.served_name, "data": data, "usage": self._usage(total)})

    def _usage(self, tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}

    async def _vllm_inputs(self, request: web.Request, body: dict[str, Any] | None = None) -> list:
        """The inputs of a vLLM request of ``model`` and ``input`` (``/classify``, ``/pooling``)."""
        if body is None:
            body = await read_json(request, require_json=True)
        self._vllm_model(body)
        return embedding_inputs(body.get("input"))

    async def vllm_classify(self, request: web.Request) -> web.Response:
        """vLLM's ``/classify`` (``ClassificationRequest``: ``model``, ``input``): a label and the
        class probabilities per input, and the usage of what it encoded."""
        try:
            inputs = await self._vllm_inputs(request)
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        return self._classify_answer(inputs)

    async def vllm_pooling(self, request: web.Request) -> web.Response:
        """vLLM's ``/pooling`` (``PoolingRequest``: ``model``, ``input``): the pooled output per
        input (here the embedding vector), and the usage; with ``encoding_format`` "bytes" or
        "bytes_only", the vectors' bytes (``bytes_response``)."""
        try:
            body = await read_json(request, require_json=True)
            inputs = await self._vllm_inputs(request, body)
            fmt = body.get("encoding_format") or "float"
            dtype, endianness = binary_options(body)
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        if fmt in BYTES_FORMATS:
            ids = [self._ids(item) for item in inputs]
            return await bytes_response(request, f"pool-{uuid.uuid4().hex}", self.cfg.served_name,
                                        [embed(i, self.cfg.embedding_dim, self.cfg.seed) for i in ids],
                                        sum(map(len, ids)), fmt, dtype, endianness)
        data, tokens = [], 0
        for i, item in enumerate(inputs):
            ids = self._ids(item)
            tokens += len(ids)
            data.append({"index": i, "object": "pooling", "data": embed(ids, self.cfg.embedding_dim, self.cfg.seed)})
        return json_response({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.cfg.served_name, "data": data, "usage": self._usage(tokens)})

    async def vllm_cohere_embed(self, request: web.Request) -> web.Response:
        """vLLM's ``/v2/embed`` (Cohere's embed API: ``model``, ``texts``, ``input_type``,
        ``embedding_types``): the vectors by type, and the tokens it encoded in
        ``meta.tokens.input_tokens`` (no ``usage``)."""
        try:
            body = await read_json(request, require_json=True)
            if not isinstance(body.get("model"), str):
                raise ApiError(400, "1 validation error:\n  model: Field required", type_=_BAD, param="model")
            self._vllm_model(body)
            texts = body.get("texts")
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, "1 validation error:\n  texts: Input should be a valid list of strings",
                               type_=_BAD, param="texts")
            types = body.get("embedding_types") or ["float"]
            if not isinstance(types, list) or any(t not in ("float", "base64") for t in types):
                raise ApiError(400, "1 validation error:\n  embedding_types: Input should be 'float', 'binary', "
                               "'ubinary' or 'base64'", type_=_BAD, param="embedding_types")
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        vectors = [embed(self._ids(t), self.cfg.embedding_dim, self.cfg.seed) for t in texts]
        tokens = sum(len(self._ids(t)) for t in texts)
        embeddings: dict[str, Any] = {}
        for t in types:
            embeddings[t] = (vectors if t == "float"
                             else [base64.b64encode(array("f", v).tobytes()).decode() for v in vectors])
        return json_response({"id": f"embd-{uuid.uuid4().hex}", "embeddings": embeddings, "texts": texts,
                              "meta": {"api_version": {"version": "2"}, "tokens": {"input_tokens": tokens}}})

    def _vllm_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.cfg.served_model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    async def vllm_rerank(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=True)
            self._vllm_model(body)
            query = _doc_text(body.get("query"), "query")
            docs = _str_list(body.get("documents"), "documents")
            top_n = body.get("top_n") or 0
            if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
                raise ApiError(400, "1 validation error:\n  top_n: Input should be a valid integer", type_=_BAD,
                               param="top_n")
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        results = sorted(({"index": i, "document": {"text": d}, "relevance_score": relevance(query, d)}
                          for i, d in enumerate(docs)), key=lambda r: -r["relevance_score"])
        if top_n:
            results = results[:top_n]
        tokens = sum(self._ntok(query) + self._ntok(d) for d in docs)
        return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": self.cfg.served_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})

    async def vllm_score(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=True)
            self._vllm_model(body)
            left = _str_list(body.get("text_1", body.get("queries")), "text_1")
            right = _str_list(body.get("text_2", body.get("documents")), "text_2")
            if len(left) == 1:
                left = left * len(right)
            if len(left) != len(right):
                raise ApiError(400, "At least one of text_1 or text_2 must be a single text, or both lists "
                               "must have the same length.", type_="BadRequestError")
        except ApiError as exc:
            return exc.response(ErrorStyle.VLLM)
        data = [{"index": i, "object": "score", "score": relevance(a, b)} for i, (a, b) in enumerate(zip(left, right, strict=True))]
        tokens = sum(self._ntok(a) + self._ntok(b) for a, b in zip(left, right, strict=True))
        return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.cfg.served_name, "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                        "prompt_tokens_details": None}})

    # -- SGLang ---------------------------------------------------------------------------------

    def sglang_routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/rerank", self.sglang_rerank), web.put("/v1/rerank", self.sglang_rerank),
                web.post("/v1/score", self.sglang_score), web.post("/v1/classify", self.sglang_classify),
                web.post("/v1/tokenize", self.sglang_tokenize), web.post("/tokenize", self.sglang_tokenize),
                web.post("/v1/detokenize", self.sglang_detokenize), web.post("/detokenize", self.sglang_detokenize)]

    async def sglang_rerank(self, request: web.Request) -> web.Response:
        style = ErrorStyle.SGLANG_OPENAI
        try:
            body = await read_json(request, require_json=True)
            query = body.get("query")
            docs = body.get("documents")
            if not isinstance(query, str) or not query.strip():
                raise ApiError(400, "Query cannot be empty or whitespace only", type_="BadRequest")
            if not isinstance(docs, list) or not docs:
                raise ApiError(400, "Documents cannot be empty", type_="BadRequest")
            if not all(isinstance(d, str) and d.strip() for d in docs):
                raise ApiError(400, "Each document cannot be empty or whitespace only", type_="BadRequest")
        except ApiError as exc:
            return exc.response(style)
        rid = uuid.uuid4().hex
        out = [{"score": relevance(query, d), "document": d, "index": i,
                "meta_info": {"id": f"{rid}-{i}", "prompt_tokens": self._ntok(query) + self._ntok(d)}}
               for i, d in enumerate(docs)]
        out.sort(key=lambda r: -r["score"])
        return json_response(out)

    async def sglang_classify(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/classify`` (``ClassifyRequest``: ``model``, ``input``): vLLM's answer
        shape, the prompt tokens its items' ``meta_info`` report added up in ``usage``."""
        try:
            body = await read_json(request, require_json=True)
            value = body.get("input")
            if not value or (isinstance(value, str) and not value.strip()):
                raise ApiError(400, "Input cannot be empty", type_="BadRequest")
            try:
                inputs = embedding_inputs(value)
            except ApiError:
                raise ApiError(400, "All items in input list must be strings", type_="BadRequest") from None
        except ApiError as exc:
            return exc.response(ErrorStyle.SGLANG_OPENAI)
        return self._classify_answer(inputs)

    async def sglang_score(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request, require_json=True)
            query, items = body.get("query"), body.get("items")
            labels = body.get("label_token_ids")
            if not isinstance(query, str) or items is None:
                raise ApiError(400, "query and items are required", type_="BadRequest")
            items = [items] if isinstance(items, str) else items
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ApiError(400, "items must be a string or a list of strings", type_="BadRequest")
            if not isinstance(labels, list) or not labels or not all(isinstance(t, int) for t in labels):
                raise ApiError(400, "label_token_ids must be a non-empty list of token ids", type_="BadRequest")
        except ApiError as exc:
            return exc.response(ErrorStyle.SGLANG_OPENAI)
        scores = []
        for item in items:
            raw = [relevance(query, item) + relevance(str(t), item) for t in labels]
            if body.get("apply_softmax"):
                exp = [math.exp(x) for x in raw]
                raw = [round(e / sum(exp), 6) for e in exp]
            scores.append(raw)
        return json_response({"scores": scores, "model": body.get("model"), "usage": None, "object": "scoring"})

    async def sglang_tokenize(self, request: web.Request) -> web.Response:
        tok = self.engine.tokenizer
        try:
            body = await read_json(request, require_json=True)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids: Any = tok.encode(prompt)
                count: Any = len(ids)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                ids = [tok.encode(p) for p in prompt]
                count = [len(x) for x in ids]
            else:
                raise ApiError(400, f"Invalid prompt type: {type(prompt)}. Expected str or List[str].",
                               type_="BadRequest")
        except ApiError as exc:
            return exc.response(ErrorStyle.SGLANG_OPENAI)
        return json_response({"tokens": ids, "count": count, "max_model_len": self.cfg.max_model_len})

    async def sglang_detokenize(self, request: web.Request) -> web.Response:
        tok = self.engine.tokenizer
        try:
            body = await read_json(request, require_json=True)
            tokens = body.get("tokens")
            if tokens == []:
                return json_response({"text": ""})
            if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
                lists = [token_id_list(t, "tokens") for t in tokens]
                if any(x is None for x in lists):
                    raise ApiError(400, "Invalid input: Sublist in 'tokens' must contain only integers.",
                                   type_="BadRequest")
                return json_response({"text": [tok.decode(x or []) for x in lists]})
            ids = token_id_list(tokens, "tokens")
            if ids is None:
                raise ApiError(400, f"Invalid tokens type: {type(tokens)}. Expected List[int] or List[List[int]].",
                               type_="BadRequest")
        except ApiError as exc:
            return exc.response(ErrorStyle.SGLANG_OPENAI)
        return json_response({"text": tok.decode(ids)})
