"""Log probabilities of generated tokens, shaped as vLLM's OpenAI server writes them.

The values are made up but stable: a token's logprob depends on the engine's seed, the token and
its position only, so the same answer carries the same logprobs, streamed or not. The sampled token
ranks first among its ``top_logprobs`` (a greedy pick), the other candidates are output words with
lower logprobs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from enginesim.errors import ApiError
from enginesim.protocol import bool_field, lax_int

MAX_LOGPROBS = 20      # vLLM's --max-logprobs default


def _logprob(seed: int, token_id: int, position: int, rank: int) -> float:
    digest = hashlib.blake2b(f"{seed}\0{token_id}\0{position}".encode(), digest_size=8).digest()
    base = -(int.from_bytes(digest, "little") % 100_000) / 100_000.0      # (-1, 0]
    return round(base - 1.5 * rank, 6)


def _candidates(tokenizer: Any, seed: int, token_id: int, position: int, k: int) -> list[tuple[int, float]]:
    """``k`` (at least 1) candidates for a position: the sampled token first, then others."""
    out = [(token_id, _logprob(seed, token_id, position, 0))]
    vocab = tokenizer.output_ids
    start = (token_id * 31 + position * 7) % len(vocab)
    i = 0
    while len(out) < k and i < len(vocab):
        other = vocab[(start + i) % len(vocab)]
        i += 1
        if other != token_id:
            out.append((other, _logprob(seed, token_id, position, len(out))))
    return out


def chat_requested(body: dict[str, Any]) -> int | None:
    """The top logprobs a vLLM chat asks for (0: the sampled token's only), None when it asks for
    none; the refusals of vLLM's chat request model."""
    top = body.get("top_logprobs")
    if top is not None:
        try:
            top = lax_int(top)
        except ValueError as e:
            raise ApiError(400, f"1 validation error:\n  top_logprobs: {e}", type_="Bad Request",
                           param="top_logprobs") from None
        if top < 0 and top != -1:
            raise ApiError(400, "`top_logprobs` must be a positive value or -1.", type_="BadRequestError",
                           param="top_logprobs")
    wanted = bool_field(body, "logprobs", False)
    if top is not None and top != 0 and not wanted:
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                       type_="BadRequestError", param="top_logprobs")
    if not wanted:
        return None
    return _within_max(top or 0)


def completion_requested(body: dict[str, Any]) -> int | None:
    """The logprobs count a vLLM completion asks for (0: the sampled token's only), None for none."""
    n = body.get("logprobs")
    if n is None:
        return None
    try:
        n = lax_int(n)
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  logprobs: {e}", type_="Bad Request",
                       param="logprobs") from None
    if n < 0:
        raise ApiError(400, "`logprobs` must be a positive value.", type_="BadRequestError", param="logprobs")
    return _within_max(n)


def prompt_requested(body: dict[str, Any], kind: str) -> int | None:
    """The top logprobs of each prompt token a vLLM request asks for (its ``prompt_logprobs``; a
    completion's ``echo`` with ``logprobs`` asks for that many), None for none; the refusals of
    vLLM's request models' ``check_logprobs``."""
    n = body.get("prompt_logprobs")
    if n is None:
        if kind == "completions" and bool_field(body, "echo", False):
            return completion_requested(body)
        return None
    if isinstance(n, bool) or not isinstance(n, int | float):
        raise ApiError(400, "`prompt_logprobs` must be an integer.", type_="BadRequestError", param="prompt_logprobs")
    if body.get("stream") and (n > 0 or n == -1):
        raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.", type_="BadRequestError",
                       param="prompt_logprobs")
    if n < 0 and n != -1:
        raise ApiError(400, "`prompt_logprobs` must be a positive value or -1.", type_="BadRequestError",
                       param="prompt_logprobs")
    if n == -1 or n > MAX_LOGPROBS:
        raise ApiError(400, f"Requested prompt logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}",
                       type_="BadRequestError", param="prompt_logprobs")
    return int(n)


def _within_max(n: int) -> int:
    if n == -1 or n > MAX_LOGPROBS:
        raise ApiError(400, f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}",
                       type_="BadRequestError", param="logprobs")
    return n


def chat_logprobs(tokenizer: Any, seed: int, ids: list[int] | tuple[int, ...], start: int,
                  top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs`` for ``ids``, the answer's tokens from position ``start`` on."""
    content = []
    for pos, tid in enumerate(ids, start):
        cands = _candidates(tokenizer, seed, tid, pos, max(top, 1))
        token = tokenizer.piece(tid)
        content.append({"token": token, "logprob": cands[0][1], "bytes": list(token.encode()),
                        "top_logprobs": [{"token": (t := tokenizer.piece(c)), "logprob": lp,
                                          "bytes": list(t.encode())} for c, lp in cands[:top]]})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, seed: int, ids: list[int] | tuple[int, ...], start: int,
                        top: int, offset: int) -> dict[str, Any]:
    """A completion choice's ``logprobs`` for ``ids`` (from position ``start``), their text
    beginning at character ``offset`` of the choice's text. Each position's ``top_logprobs`` holds
    the sampled token and the ``top`` best (the sampled one ranking first: ``top`` entries, one
    with 0)."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for pos, tid in enumerate(ids, start):
        cands = _candidates(tokenizer, seed, tid, pos, max(top, 1))
        token = tokenizer.piece(tid)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(cands[0][1])
        out["tokens"].append(token)
        out["top_logprobs"].append({tokenizer.piece(c): lp for c, lp in cands})
        offset += len(token)
    return out


def _prompt_candidates(tokenizer: Any, seed: int, prompt_ids: list[int], pos: int, k: int) -> list[tuple[int, float]]:
    """The candidates at prompt position ``pos`` (at least 1), the prompt's token first (its values
    apart from the generated tokens': a position of its own)."""
    return _candidates(tokenizer, seed, prompt_ids[pos], -1 - pos, max(k, 1))


def prompt_logprobs(tokenizer: Any, seed: int, prompt_ids: list[int], top: int) -> list[dict[str, Any] | None]:
    """A vLLM choice's ``prompt_logprobs``: None for the first prompt token (nothing precedes it),
    then per token its ``{token id: {logprob, rank, decoded_token}}`` of the prompt's token and the
    ``top`` best (vLLM's ``Logprob`` objects, keyed by id)."""
    out: list[dict[str, Any] | None] = [None]
    for pos in range(1, len(prompt_ids)):
        cands = _prompt_candidates(tokenizer, seed, prompt_ids, pos, top)
        out.append({str(c): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.piece(c)}
                    for rank, (c, lp) in enumerate(cands, 1)})
    return out


def completion_prompt_logprobs(tokenizer: Any, seed: int, prompt_ids: list[int], top: int) -> dict[str, Any]:
    """The prompt's part of an echoing vLLM completion's ``logprobs`` (``echo`` with ``logprobs``):
    per prompt token its ``tokens``, ``token_logprobs`` and ``top_logprobs`` (None for the first:
    nothing precedes it), ``text_offset`` counted from 0; the generated tokens' follow."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for pos, tid in enumerate(prompt_ids):
        token = tokenizer.piece(tid)
        out["text_offset"].append(offset)
        out["tokens"].append(token)
        if pos == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            cands = _prompt_candidates(tokenizer, seed, prompt_ids, pos, top)
            out["token_logprobs"].append(cands[0][1])
            out["top_logprobs"].append({tokenizer.piece(c): lp for c, lp in cands})
        offset += len(token)
    return out


def sglang_requested(body: dict[str, Any], kind: str) -> int | None:
    """The top logprobs an SGLang request asks for (0: the sampled token's only), None for none:
    a chat's ``logprobs`` flag with its ``top_logprobs``, a completion's ``logprobs`` count."""
    if kind == "chat":
        if not bool_field(body, "logprobs", False):
            return None
        top = body.get("top_logprobs")
    else:
        top = body.get("logprobs")
        if top is None:
            return None
    try:
        return max(0, lax_int(top)) if top is not None else 0
    except ValueError as e:
        param = "top_logprobs" if kind == "chat" else "logprobs"
        raise ApiError(400, f"1 validation error:\n  {param}: {e}", type_="Bad Request", param=param) from None


def sglang_logprobs(tokenizer: Any, seed: int, ids: list[int] | tuple[int, ...], start: int, top: int,
                    kind: str) -> dict[str, Any]:
    """A choice's ``logprobs`` as SGLang's OpenAI server writes them: a chat's ``content`` (no
    ``refusal``), a completion's lists with ``text_offset`` -1 (SGLang does not compute it) and
    ``top_logprobs`` of ``top`` entries per token (an empty list when ``top`` is 0)."""
    if kind == "chat":
        content = []
        for pos, tid in enumerate(ids, start):
            cands = _candidates(tokenizer, seed, tid, pos, max(top, 1))
            token = tokenizer.piece(tid)
            content.append({"token": token, "bytes": list(token.encode()), "logprob": cands[0][1],
                            "top_logprobs": [{"token": (t := tokenizer.piece(c)), "bytes": list(t.encode()),
                                              "logprob": lp} for c, lp in cands[:top]]})
        return {"content": content}
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for pos, tid in enumerate(ids, start):
        cands = _candidates(tokenizer, seed, tid, pos, max(top, 1))
        out["text_offset"].append(-1)
        out["token_logprobs"].append(cands[0][1])
        out["tokens"].append(tokenizer.piece(tid))
        if top:
            out["top_logprobs"].append({tokenizer.piece(c): lp for c, lp in cands[:top]})
    return out


def sglang_echo_logprobs(tokenizer: Any, seed: int, prompt_ids: list[int], top: int,
                         generated: dict[str, Any] | None) -> dict[str, Any]:
    """An echoing SGLang completion's ``logprobs`` (``echo`` with a count above 0: its
    ``logprob_start_len`` 0): the prompt's tokens first, the first with null logprob and top
    logprobs, ``text_offset`` -1 for all (its ``to_openai_style_logprobs``), then ``generated``'s."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for pos, tid in enumerate(prompt_ids):
        out["text_offset"].append(-1)
        out["tokens"].append(tokenizer.piece(tid))
        if pos == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        cands = _prompt_candidates(tokenizer, seed, prompt_ids, pos, top)
        out["token_logprobs"].append(cands[0][1])
        out["top_logprobs"].append({tokenizer.piece(c): lp for c, lp in cands[:top]})
    for key, values in (generated or {}).items():
        out[key].extend(values)
    return out


def responses_requested(body: dict[str, Any]) -> int | None:
    """The top logprobs a vLLM Responses request asks for, None when it asks for none: only an
    ``include`` naming ``message.output_text.logprobs`` turns them on, ``top_logprobs`` (default 0)
    saying how many alternatives each token carries."""
    include = body.get("include")
    if not isinstance(include, list) or "message.output_text.logprobs" not in include:
        return None
    top = body.get("top_logprobs")
    try:
        top = lax_int(top) if top is not None else 0
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  top_logprobs: {e}", type_="Bad Request",
                       param="top_logprobs") from None
    return _within_max(max(top, 0))


def responses_logprobs(tokenizer: Any, seed: int, ids: list[int] | tuple[int, ...], start: int, top: int,
                       *, with_bytes: bool) -> list[dict[str, Any]]:
    """An output text's ``logprobs`` for ``ids`` (from position ``start``): in a whole answer's
    ``output_text`` part each entry carries ``bytes`` (as chat's do); a stream's
    ``response.output_text.delta`` carries them without (vLLM's delta event type has no ``bytes``)."""
    out = chat_logprobs(tokenizer, seed, ids, start, top)["content"]
    if not with_bytes:
        for entry in out:
            del entry["bytes"]
            for alt in entry["top_logprobs"]:
                del alt["bytes"]
    return out
