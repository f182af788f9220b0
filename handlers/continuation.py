"""Continuing a stream on another engine: what each leg's request body is (pure, no I/O).

Two ways to hand an engine what was already generated:

- ``token``: the first leg asks for ``return_token_ids`` (vLLM: the prompt's ids on the first
  chunk, each chunk's generated ids); the continuation is a ``/v1/completions`` request whose prompt
  is those ids followed by the generated ones. Token-exact: the engine resumes from the very state
  the dying one had, with no re-tokenization at the seam. A chat request is continued this way too
  (the chat template was applied once, on the first leg), so the gateway re-frames the
  continuation's completion chunks as chat chunks.
- ``text``: the partial answer goes back as text: a chat request gets it as a final assistant
  message with ``continue_final_message`` (and ``add_generation_prompt: false`` on vLLM, which
  refuses both at once), a completion gets it appended to its string prompt. Faithful up to
  re-tokenization at the seam. The text is exactly what the client received: the characters vLLM
  holds back while they might begin a stop string never reached it from a leg that broke, so they
  are not sent back, and the next engine generates them again (their tokens still count as
  generated, in the usage and off ``max_tokens``).

Which one an engine gets is its adapter's choice (``handlers.vllm``, ``handlers.sglang``).
Both legs ask for usage on every chunk (``continuous_usage_stats``), so the tokens generated before
a failure are known exactly and ``max_tokens``/``min_tokens`` of the next leg are reduced by them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gateway.request import CHAT, COMPLETIONS, lax_bool, lax_int

TOKEN = "token"
TEXT = "text"

USAGE_EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}

# what a chat request's sampling is, when it is continued as a completion of token ids
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
            "skip_special_tokens", "spaces_between_special_tokens", "seed", "user", "priority", "cache_salt",
            "bad_words", "allowed_token_ids", "logit_bias", "include_stop_str_in_output", "vllm_xargs",
            "presence_penalty", "frequency_penalty")
# keys of a completion request that do not carry over to its continuation
_NOT_CARRIED = ("prompt", "max_tokens", "min_tokens", "echo", "stream_options", "suffix", "return_token_ids",
                "truncate_prompt_tokens")


@dataclass(slots=True)
class Partial:
    """What the client has been sent of a stream so far."""

    path: str                              # the client's path
    data: dict[str, Any]                   # the client's request
    text: str = ""                         # generated text the client saw
    prompt_ids: list[int] | None = None    # the first leg's prompt as token ids (token mode)
    token_ids: list[int] = field(default_factory=list)   # generated ids (token mode)
    completion_tokens: int = 0             # tokens generated so far, all legs
    prompt_tokens: int | None = None       # the client's prompt as the engine that ran it counted it


def first_leg(data: dict[str, Any], mode: str) -> dict[str, Any]:
    """The first leg's body: usage on every chunk, and the token ids in token mode."""
    out = {**data, "stream_options": dict(USAGE_EVERY_CHUNK)}
    if mode == TOKEN:
        out["return_token_ids"] = True
    return out


def max_tokens_of(path: str, data: dict[str, Any]) -> int | None:
    if path == CHAT:
        v = data.get("max_completion_tokens")
        if v is None:
            v = data.get("max_tokens")
    else:
        v = data.get("max_tokens")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _length(data: dict[str, Any], p: Partial, default_max: int | None) -> int | None:
    """The answer's length bound in tokens, as the engine reads the request; None: the rest of the context."""
    given = max_tokens_of(p.path, data)
    if given is None and not (p.path == COMPLETIONS and "max_tokens" in data and data["max_tokens"] is None):
        given = default_max           # a completion's explicit null is the rest of the context (vLLM)
    return given


def at_length(p: Partial, default_max: int | None) -> bool:
    """Every token the answer may have was generated: the engine would have ended it there, with
    finish_reason "length" (a continuation would add to it: no engine takes a max_tokens of 0)."""
    given = _length(p.data, p, default_max)
    return given is not None and p.completion_tokens >= given


def _reduced(data: dict[str, Any], p: Partial, default_max: int | None) -> tuple[int | None, int | None]:
    """(max_tokens, min_tokens) of the next leg; None: leave unset."""
    given = _length(data, p, default_max)
    left = None if given is None else max(1, given - p.completion_tokens)
    mn = min_tokens_of(data)
    min_left = max(0, mn - p.completion_tokens) if mn else None
    return left, min_left


def min_tokens_of(data: dict[str, Any]) -> int | None:
    """``min_tokens`` as the engines read it (pydantic's lax mode: "12" is 12); None: none given."""
    v = data.get("min_tokens")
    if v is None:
        return None
    try:
        return lax_int(v)
    except ValueError:        # refused by the engine before anything streams
        return None


def continuation(p: Partial, mode: str, default_max: int | None) -> tuple[str, dict[str, Any]]:
    """(path, body) of the request that continues the stream."""
    data = p.data
    left, min_left = _reduced(data, p, default_max)
    if mode == TOKEN:
        assert p.prompt_ids is not None
        if p.path == CHAT:
            body = {k: data[k] for k in _CARRIED if k in data}
        else:
            body = {k: v for k, v in data.items() if k not in _NOT_CARRIED}
        body.update(model=data.get("model"), prompt=p.prompt_ids + p.token_ids, stream=True,
                    stream_options=dict(USAGE_EVERY_CHUNK), return_token_ids=True)
        # A chat that named no length runs to the rest of the context. A completion that names none
        # stops at the protocol's 16 tokens, but an explicit null means the rest of the context
        # (vLLM: CompletionRequest.max_tokens defaults to 16; get_max_tokens takes a None as
        # max_model_len minus the prompt), so the continuation ends where the unbroken answer would.
        body["max_tokens"] = left
        if min_left is not None:
            body["min_tokens"] = min_left
        return COMPLETIONS, body
    body = {**data, "stream_options": dict(USAGE_EVERY_CHUNK)}
    body.pop("return_token_ids", None)
    if p.path == CHAT:
        messages = list(data["messages"])
        last = messages[-1] if messages else None
        extended = _extended(last, p.text) if _flag(data, "continue_final_message", False) else None
        if extended is not None:
            messages[-1] = extended       # the client's own prefill, extended
        else:
            messages.append({"role": "assistant", "content": p.text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False     # vLLM refuses both at once; SGLang ignores the key
        body.pop("echo", None)        # vLLM would send the extended final message back: the client has it
        body.pop("max_tokens", None)
        body.pop("max_completion_tokens", None)
    else:
        body["prompt"] = text_prompt(data) + p.text
        body["echo"] = False
    if left is not None:
        body["max_tokens"] = left
    body.pop("min_tokens", None)      # the client's, read as a number, is what min_left was counted from
    if min_left is not None:
        body["min_tokens"] = min_left
    keep = _truncation(data, p)
    if keep is not None:
        body["truncate_prompt_tokens"] = keep
    return p.path, body


# an engine's 400 for a request past its context, naming the context's length and the prompt's
# tokens as it counted them, and how far short of the context a request must stay
_PAST_CONTEXT = (
    # vLLM: the prompt and max_tokens up to the context
    (re.compile(r"maximum context length is (\d+) tokens and your request has (\d+) input tokens"), 0),
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens \((\d+) in the"), 0),
    # SGLang: short of it
    (re.compile(r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: (\d+) tokens"), 1),
)


def fitted(body: dict[str, Any], refusal: str) -> dict[str, Any] | None:
    """A continuation's ``body`` with the ``max_tokens`` that fits the context beside its prompt,
    when ``refusal`` (the engine's 400) refused it for passing the context: a text continuation's
    prompt is the partial answer tokenized again, which can come out a token or more longer than
    the tokens generated. None: not such a refusal, or no smaller ``max_tokens`` fits."""
    asked = body.get("max_tokens")
    if not isinstance(asked, int) or isinstance(asked, bool):
        return None
    for pattern, short in _PAST_CONTEXT:
        m = pattern.search(refusal)
        if m is None:
            continue
        fits = int(m.group(1)) - int(m.group(2)) - short
        if not 1 <= fits < asked:
            return None
        out = {**body, "max_tokens": fits}
        mn = out.get("min_tokens")
        if isinstance(mn, int) and mn > fits:
            out["min_tokens"] = fits
        return out
    return None


def _extended(last: Any, text: str) -> dict[str, Any] | None:
    """The client's final assistant message (a prefill it continues) with ``text`` added to its
    end: to its content, or to its last part when the content is a list ending in a text part (so
    the engine joins the parts as it did for the first leg); None when it is not one."""
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return {**last, "content": content + text}
    if isinstance(content, list) and content and isinstance(content[-1], dict) \
            and content[-1].get("type") == "text" and isinstance(content[-1].get("text"), str):
        end = content[-1]
        return {**last, "content": [*content[:-1], {**end, "text": end["text"] + text}]}
    return None


def _truncation(data: dict[str, Any], p: Partial) -> int | None:
    """A text continuation's ``truncate_prompt_tokens`` (vLLM: keep the prompt's last k tokens):
    its prompt is the client's and the generated text, so k grows by the tokens generated; at most
    the first leg's prompt and those, which fit the context (vLLM refuses a k past it). None: the
    client's value stays (none, -1 for the context's length, or one the engine refuses)."""
    v = data.get("truncate_prompt_tokens")
    if v is None:
        return None
    try:
        k = lax_int(v)
    except ValueError:
        return None
    if k < 0:
        return None
    if p.prompt_tokens is not None:
        k = min(k, p.prompt_tokens)
    return k + p.completion_tokens


def text_prompt(data: dict[str, Any]) -> str:
    """A completion's prompt as one string ("" when it is not one: token ids, a batch)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def _flag(data: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field as the engines read it (a value they refuse: the default, nothing streams)."""
    try:
        return lax_bool(data.get(key, default))
    except ValueError:
        return default


def echo_length(path: str, data: dict[str, Any], chat_echo: bool) -> int:
    """How many characters the first leg's answer begins with that are the request's ``echo``, the
    client's own text and not generated: a completion's string prompt (vLLM and SGLang send it with
    the first output's text); a chat's last message where the engine echoes one (``chat_echo``:
    vLLM sends its content in a chunk of its own when its role is the answer's, an assistant
    message or any with ``add_generation_prompt: false``, text parts joined by newlines). 0: none,
    or none the gateway knows (a prompt of token ids, echoed as the engine decodes them)."""
    if not _flag(data, "echo", False):
        return 0
    if path == COMPLETIONS:
        return len(text_prompt(data))
    messages = data.get("messages")
    if path != CHAT or not chat_echo or not isinstance(messages, list) or not messages:
        return 0
    last = messages[-1]
    if not isinstance(last, dict) or (_flag(data, "add_generation_prompt", True) and last.get("role") != "assistant"):
        return 0
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content
                            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return len(content) if isinstance(content, str) else 0


def stop_strings(data: dict[str, Any]) -> bool:
    stop = data.get("stop")
    return bool(stop) and (isinstance(stop, str) or any(isinstance(s, str) and s for s in stop or ()))


def multimodal(data: dict[str, Any]) -> bool:
    """A chat with a part other than text in a message (an image, audio, a video): its prompt's
    ids hold the media's placeholder tokens, not the media."""
    messages = data.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") != "text" for part in m["content"])
        for m in messages)


def tools_on(data: dict[str, Any]) -> bool:
    return bool(data.get("tools")) and data.get("tool_choice") != "none"


def text_mode_refusal(path: str, data: dict[str, Any]) -> str | None:
    """Why a text continuation cannot be built for this request (None: it can)."""
    if path == COMPLETIONS and not text_prompt(data):
        return "prompt_form"      # token ids or a batch: no text to append to
    return None
