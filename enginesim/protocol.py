"""Parsing of OpenAI-style request bodies, shared by the vLLM and SGLang front ends.

Both engines accept the same fields for what the simulator models (prompt, token limits, stop
strings, streaming options); where they differ (defaults, ids, model validation) the engine's own
front end decides. Unknown fields are accepted and ignored, as both engines do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from enginesim.errors import ApiError
from enginesim.tokenizer import FakeTokenizer
from enginesim.tools import rendered_tools

_BAD = "Bad Request"


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "chat" | "completions"
    model: str | None
    prompt_ids: list[int]
    stream: bool
    has_stream_options: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    cache_salt: str | None
    return_token_ids: bool = False
    max_tokens_null: bool = False  # a completion's max_tokens given as an explicit null
    n: int = 1                     # choices asked for (more than one: a simulated aggregated engine only)
    echo: str | None = None        # ``echo``: the prompt's text a completion's answer begins with, the
                                   # last message's a vLLM chat's
    # a completion's batch of prompts (a list of several): each prompt's ids and its echo
    # (``prompt_ids`` and ``echo`` are the first's); empty for one prompt
    batch: tuple[tuple[list[int], str | None], ...] = ()
    logprobs: int | None = None    # vLLM: the top logprobs each generated token carries (0: its own only)
    echo_only: bool = False        # a vLLM completion's max_tokens 0 with echo: one token generated, the
                                   # prompt alone answered
    prompt_logprobs: int | None = None  # vLLM: the top logprobs each prompt token's answered with


# vLLM's and SGLang's request models are pydantic v2 models in lax mode: an ``int`` field takes a
# whole float, a numeric string and a bool; a ``bool`` field takes 0/1 and these words, any case.
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_STRING = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")


def lax_int(v: Any) -> int:
    """``v`` as pydantic's lax mode reads an ``int``; ``ValueError`` with pydantic's message."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError("Input should be a finite number")
        if not v.is_integer():
            raise ValueError("Input should be a valid integer, got a number with a fractional part")
        if not -(1 << 63) <= v < 1 << 63:
            raise ValueError("Unable to parse input string as an integer, exceeded maximum size")
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        if _INT_STRING.fullmatch(s):
            try:
                return int(s.partition(".")[0])
            except ValueError:
                pass
        raise ValueError("Input should be a valid integer, unable to parse string as an integer")
    raise ValueError("Input should be a valid integer")


def lax_bool(v: Any) -> bool:
    """``v`` as pydantic's lax mode reads a ``bool``; ``ValueError`` with pydantic's message."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and (v == 0 or v == 1):
        return v == 1
    if isinstance(v, str) and v.lower() in _TRUE_WORDS | _FALSE_WORDS:
        return v.lower() in _TRUE_WORDS
    if isinstance(v, str | int) or (isinstance(v, float) and v.is_integer()):
        raise ValueError("Input should be a valid boolean, unable to interpret input")
    raise ValueError("Input should be a valid boolean")


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    try:
        return lax_bool(value)
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  {name}: {e}", type_=_BAD, param=name) from None


def _int_field(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    """``body[name]`` read as an ``Optional[int]`` field is; ``minimum`` None: any integer."""
    value = body.get(name)
    if value is None:
        return None
    try:
        value = lax_int(value)
    except ValueError as e:
        raise ApiError(400, f"1 validation error:\n  {name}: {e}", type_=_BAD, param=name) from None
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}.", type_="BadRequestError",
                       param=name)
    return value


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise ApiError(400, "1 validation error:\n  stop: Input should be a valid string or list of strings",
                   type_=_BAD, param="stop")


def token_id_list(value: Any, param: str) -> list[int] | None:
    """``value`` as a list of token ids, ``None`` if it is not one; bad ids are a 400. Items read
    as the engines' ``list[int]`` reads them (``[1.0, "2"]`` is ``[1, 2]``; a list of strings is
    not token ids)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(t, int) for t in value):
        if all(isinstance(t, str) for t in value):
            return None
        try:
            value = [lax_int(t) for t in value]
        except ValueError:
            return None
    if any(isinstance(t, bool) or t < 0 for t in value):
        raise ApiError(400, f"{param}: token ids must be non-negative integers", type_=_BAD, param=param)
    return list(value)


def completion_prompts(prompt: Any, tokenizer: FakeTokenizer) -> list[list[int]] | None:
    """A completions ``prompt`` that is a batch (vLLM's ``list[str]`` or ``list[list[int]]`` of more
    than one), each prompt's ids; None for anything else."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        batch = [token_id_list(p, "prompt") for p in prompt]
        if all(ids is not None for ids in batch):
            return batch     # type: ignore[return-value]
    return None


def completion_prompt_ids(prompt: Any, tokenizer: FakeTokenizer) -> list[int]:
    """A completions ``prompt``: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids = token_id_list(prompt, "prompt")
    if ids is not None:
        return ids
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(501, "enginesim serves one prompt per request; batched prompts are not simulated",
                       param="prompt")
    raise ApiError(400, "1 validation error:\n  prompt: Input should be a string, a list of strings "
                   "or a list of token ids", type_=_BAD, param="prompt")


def chat_prompt_ids(messages: Any, tokenizer: FakeTokenizer, add_generation_prompt: bool = True,
                    continue_final: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The ids of a chat's prompt: its messages and the ``tools`` it offers, rendered."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ApiError(400, "1 validation error:\n  messages: Input should be a valid list of messages",
                       type_=_BAD, param="messages")
    if not messages:
        raise ApiError(400, "Messages cannot be empty.", type_="BadRequestError", param="messages")
    # continue_final_message: the last message stays open, the model continues it
    return tokenizer.encode_open_chat(messages, tools) if continue_final else tokenizer.encode_chat(messages, tools)


def chat_template_flags(body: dict[str, Any], vllm: bool) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)``. vLLM has both (the first defaults to
    true) and refuses them together; SGLang has only ``continue_final_message``, which then replaces
    the generation prompt."""
    cont = bool_field(body, "continue_final_message", False)
    if not vllm:
        return not cont, cont
    agp = bool_field(body, "add_generation_prompt", True)
    if agp and cont:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       type_="BadRequestError")
    return agp, cont


def parse_openai(body: dict[str, Any], kind: str, tokenizer: FakeTokenizer, vllm: bool = True,
                 several: bool = False) -> OpenAIRequest:
    """``several``: the engine simulates ``n`` > 1 and a completion's batch of prompts (else it
    answers 501 to either)."""
    echo: str | None = None
    batch: tuple[tuple[list[int], str | None], ...] = ()
    echo_only = False
    if kind == "chat":
        agp, cont = chat_template_flags(body, vllm)
        prompt_ids = chat_prompt_ids(body.get("messages"), tokenizer, agp, cont, rendered_tools(body.get("tools")))
        if vllm and bool_field(body, "echo", False):
            echo = _last_message_text(body["messages"], agp)
        if vllm:
            max_tokens = _int_field(body, "max_completion_tokens", 1)
            if max_tokens is None:
                max_tokens = _int_field(body, "max_tokens", 1)
        else:
            # SGLang: ``max_completion_tokens or max_tokens``, so a max_completion_tokens of 0 is no
            # bound at all and a max_tokens of 0 a prefill-only request (no token, finish "length")
            max_tokens = _int_field(body, "max_completion_tokens", 0) or _int_field(body, "max_tokens", 0)
    else:
        if vllm and body.get("prompt_embeds") not in (None, []):
            # vLLM takes prompt_embeds in the place of (or beside) prompt, and serves them only when
            # started with --enable-prompt-embeds, which the simulated vLLM is not
            raise ApiError(400, "You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
                           type_="BadRequestError", param="prompt_embeds")
        if "prompt" not in body:
            raise ApiError(400, "1 validation error:\n  prompt: Field required", type_=_BAD, param="prompt")
        echoing = bool_field(body, "echo", False)
        prompts = completion_prompts(body["prompt"], tokenizer) if several else None
        if prompts is not None:
            batch = tuple((ids, _prompt_text(p, ids, tokenizer) if echoing else None)
                          for p, ids in zip(body["prompt"], prompts, strict=True))
            prompt_ids, echo = batch[0]
        else:
            prompt_ids = completion_prompt_ids(body["prompt"], tokenizer)
            if echoing:
                echo = _prompt_text(body["prompt"], prompt_ids, tokenizer)
        # vLLM: max_tokens 0 with echo generates one token (its sampling params' least) and answers
        # the prompt alone
        if not vllm and (asked := _int_field(body, "max_tokens", -(1 << 63))) is not None and asked <= 0:
            # SGLang's completion request model: a validator refuses a max_tokens below 1
            raise ApiError(400, "1 validation error:\n  max_tokens: Value error, max_tokens must be positive",
                           type_=_BAD)
        max_tokens = _int_field(body, "max_tokens", 0 if vllm and echoing else 1)
        if not vllm:
            # SGLang's completion request has ``best_of: Optional[int]``, never used but typed: a
            # value that is no integer is refused (vLLM's requests have no such field and ignore it)
            _int_field(body, "best_of", None)
        echo_only = max_tokens == 0
        if echo_only:
            max_tokens = 1
    n = _int_field(body, "n", 1)
    if n is not None and n > 1 and not several:
        raise ApiError(501, "enginesim does not simulate n > 1", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "1 validation error:\n  model: Input should be a valid string", type_=_BAD,
                       param="model")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "1 validation error:\n  stream_options: Input should be an object",
                       type_=_BAD, param="stream_options")
    opts = stream_options or {}
    include_usage = bool_field(opts, "include_usage", False)
    continuous_usage = bool_field(opts, "continuous_usage_stats", False)
    salt = body.get("cache_salt")
    return OpenAIRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        stream=bool_field(body, "stream", False),
        has_stream_options=stream_options is not None,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        max_tokens=max_tokens,
        min_tokens=_int_field(body, "min_tokens", 0) or 0,
        stop=parse_stop(body.get("stop")),
        ignore_eos=bool_field(body, "ignore_eos", False),
        cache_salt=salt if isinstance(salt, str) and salt else None,
        return_token_ids=bool_field(body, "return_token_ids", False),
        max_tokens_null=kind != "chat" and "max_tokens" in body and body["max_tokens"] is None,
        n=n if n is not None and n > 1 else 1,
        echo=echo,
        batch=batch,
        echo_only=echo_only,
    )


def _last_message_text(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
    """What a vLLM chat's ``echo`` sends back: the last message's content when its role is the
    answer's (``assistant`` with the generation prompt, else the last message's own), text parts
    joined by newlines; None when there is none."""
    last = messages[-1]
    if add_generation_prompt and last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) and content else None


def _prompt_text(prompt: Any, prompt_ids: list[int], tokenizer: FakeTokenizer) -> str:
    """The text an ``echo`` sends back: a string prompt as given, token ids decoded."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
