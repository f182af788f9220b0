"""Simulated tool calls (``--tool-call-parser``), as an engine's tool parser turns a model's output
into calls: chat completions, the Messages API both engines build on their chat, and the
Responses API's function tools.

With a tool-call parser set, a request that offers function tools is answered with calls instead
of text when its ``tool_choice`` asks for one (``required`` or a named tool; ``any`` or ``tool`` in
the Messages API) or leaves it to the model (``auto``, the default when tools are given) and the
conversation ends with the user's message: a turn that answers a call (a ``tool`` message, a
``tool_result`` block, a ``function_call_output`` item) gets text, as a model that read the
result would write, and so does an assistant message left open to be continued
(``continue_final_message``). ``none`` gets text always. Without a parser the answer is text,
as before. Either way the tools are rendered into the prompt (``rendered_tools``), as the engines'
chat templates render them, and count in its tokens.

Which tools: a named one, else the first; with parallel calls allowed (chat's and Responses'
``parallel_tool_calls``, default true; the Messages API's ``tool_choice.disable_parallel_tool_use``,
default false) and two tools or more, the first two. Every call's ``arguments`` are the JSON object
``{"<key>": "<the generated text>"}``, ``<key>`` the first property of the tool's parameters schema
(``input`` when it has none): the generated tokens still pace the answer and count as its output,
and a stream sends the first call's arguments a generated piece at a time (the opening
``{"<key>":"`` with the first piece, the closing ``"}`` at the end), the other calls' whole after
it. The finish reason is ``tool_calls`` (the Messages API's ``tool_use``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson


def _chat_tool(tool: Any) -> tuple[str, Any] | None:
    """(name, parameters) of a chat ``tools`` entry (``{"type": "function", "function": {...}}``)."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return None
    return fn["name"], fn.get("parameters")


def _flat_tool(tool: Any, schema_key: str) -> tuple[str, Any] | None:
    """(name, schema) of a Messages tool (``input_schema``) or a Responses function tool (``parameters``)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        return None
    if tool.get("type") not in (None, "custom", "function"):
        return None
    return tool["name"], tool.get(schema_key)


def rendered_tools(tools: Any, schema_key: str | None = None) -> list[dict[str, Any]] | None:
    """The tools a request offers as the engine renders them into its prompt: the chat request's
    ``tools`` (``{"type": "function", "function": {...}}``), which the chat template is given. A
    chat's are its own (``schema_key`` None); a Messages request's (``input_schema``) and a
    Responses request's function tools (``parameters``) are made chat tools, as both engines build
    the chat request they run from them. None when it offers none."""
    if not isinstance(tools, list) or not tools:
        return None
    if schema_key is None:
        return [t for t in tools if isinstance(t, dict)] or None
    out = []
    for tool in tools:
        got = _flat_tool(tool, schema_key)
        if got is None:
            continue
        fn: dict[str, Any] = {"name": got[0]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = got[1]
        out.append({"type": "function", "function": fn})
    return out or None


def _key(schema: Any) -> str:
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict) and props:
        return next(iter(props))
    return "input"


@dataclass
class ToolCalls:
    """The calls of one answer: their ids and names, and each one's argument key."""

    names: list[str]
    keys: list[str]
    ids: list[str]
    named: bool = False                     # a named tool_choice (vLLM then finishes with "stop")
    text: str = ""                          # the generated text streamed so far
    _opened: bool = field(default=False, repr=False)

    def arguments(self, i: int, text: str) -> str:
        """Call ``i``'s whole arguments for the generated ``text``."""
        return orjson.dumps({self.keys[i]: text}).decode()

    def piece(self, text: str) -> str:
        """The next piece of the first call's arguments (its opening with the first)."""
        self.text += text
        body = orjson.dumps(text).decode()[1:-1]
        if self._opened:
            return body
        self._opened = True
        return '{' + orjson.dumps(self.keys[0]).decode() + ':"' + body

    def close(self) -> str:
        """The end of the first call's arguments (the opening too, when no piece came)."""
        return ('' if self._opened else self.piece("")) + '"}'


def _choose(tools: list[tuple[str, Any]], choice: Any, parallel: bool, wants_call: bool,
            ids: Any) -> ToolCalls | None:
    """The calls for ``tools`` ((name, schema) each) under ``choice`` (chat's spelling: ``none``,
    ``auto``, ``required`` or a named tool); ``wants_call``: the conversation does not end with a
    tool's result."""
    if not tools:
        return None
    named: str | None = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if not isinstance(named, str):
            return None
    elif choice == "none" or (choice in (None, "auto") and not wants_call):
        return None
    elif choice not in (None, "auto", "required"):
        return None
    if named is not None:
        picked = [t for t in tools if t[0] == named][:1]
        if not picked:
            return None
    else:
        picked = tools[:2] if parallel else tools[:1]
    return ToolCalls(names=[n for n, _ in picked], keys=[_key(s) for _, s in picked],
                     ids=[ids() for _ in picked], named=named is not None)


def vllm_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def sglang_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_tool_calls(body: dict[str, Any], ids: Any) -> ToolCalls | None:
    """The calls a chat completion request gets (``None``: a text answer)."""
    tools = [t for t in map(_chat_tool, body.get("tools") or ()) if t is not None] \
        if isinstance(body.get("tools"), list) else []
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    return _choose(tools, body.get("tool_choice"), body.get("parallel_tool_calls") is not False,
                   last.get("role") == "user", ids)


def messages_tool_calls(body: dict[str, Any], ids: Any) -> ToolCalls | None:
    """The calls a Messages request gets, its ``tool_choice`` read as the engines convert it
    (``any`` is chat's ``required``, ``tool`` a named one)."""
    tools = [t for t in (_flat_tool(x, "input_schema") for x in body.get("tools") or ()) if t is not None] \
        if isinstance(body.get("tools"), list) else []
    tc = body.get("tool_choice")
    parallel = True
    choice: Any = None
    if isinstance(tc, dict):
        parallel = not tc.get("disable_parallel_tool_use")
        kind = tc.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if kind != "tool" \
            else {"name": tc.get("name")}
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}
    content = last.get("content")
    answered = isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result"
                                                 for b in content)
    return _choose(tools, choice, parallel, last.get("role") == "user" and not answered, ids)


def responses_tool_calls(body: dict[str, Any], ids: Any) -> ToolCalls | None:
    """The calls a Responses request gets: function tools only."""
    tools = [t for t in (_flat_tool(x, "parameters") for x in body.get("tools") or ())
             if t is not None] if isinstance(body.get("tools"), list) else []
    inp = body.get("input")
    last = inp[-1] if isinstance(inp, list) and inp and isinstance(inp[-1], dict) else {"role": "user"}
    return _choose(tools, body.get("tool_choice"), body.get("parallel_tool_calls") is not False,
                   last.get("role", "user") == "user" and last.get("type") in (None, "message"), ids)


def tool_deltas(calls: ToolCalls, text: str, finishing: bool) -> list[dict[str, Any]]:
    """The ``tool_calls`` delta entries of a chat stream for one output: the first call's id and
    name with its first piece, its arguments a piece at a time, their end and the other calls
    whole when the answer finishes."""
    started = calls._opened
    deltas: list[dict[str, Any]] = []
    if text or (finishing and not started):
        piece = calls.piece(text)
        if not started:
            deltas.append({"index": 0, "id": calls.ids[0], "type": "function",
                           "function": {"name": calls.names[0], "arguments": ""}})
        deltas.append({"index": 0, "function": {"arguments": piece}})
    if finishing:
        deltas.append({"index": 0, "function": {"arguments": calls.close()}})
        for i in range(1, len(calls.names)):
            deltas.append({"index": i, "id": calls.ids[i], "type": "function",
                           "function": {"name": calls.names[i], "arguments": calls.arguments(i, calls.text)}})
    return deltas
