"""Raw data (YAML's or JSON's dicts and lists) into msgspec Structs, strictly, with errors that
name the key path the way a user writes it: ``models[0].pd.sglang.abort_timeout_s``.

msgspec reports ``Expected `int` >= 0 - at `$.models[0].pd.x```; this module turns that into the
path ``models[0].pd.x`` and a short message. A mapping's key is not in msgspec's path
(``$.limits.users[...]``): the entry that fails on its own is named. A check in a Struct's
``__post_init__`` raises ``ValueError("key: message")`` (``key`` relative to the Struct, e.g.
``api_keys[1].key``) and the path continues with it.
"""

from __future__ import annotations

import difflib
import math
import re
import types
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec

T = TypeVar("T")

_AT = re.compile(r"(.*) - at (?:`key` in )?`\$(.*)`", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
# a mapping's key in the path is a name, which may hold dashes, slashes and dots (org/lora-1.5)
_OWN = re.compile(r"(\w+(?:\[\d+\])?(?:\.[^\s:\[\]]+(?:\[\d+\])?)*): (.*)", re.S)


class StrictError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


def convert(data: Any, cls: type[T], path: str = "") -> T:
    """``data`` as a ``cls``; ``path`` is where ``data`` sits in a larger document."""
    try:
        return msgspec.convert(data, cls, strict=True)
    except msgspec.ValidationError as e:
        at = _AT.fullmatch(str(e))
        message, where = at.groups() if at else (str(e), "")
        node, tp = data, cls
        for name, index in _STEP.findall(where):
            tp = _inner(tp, name)
            if index == "...":
                items = node.items() if isinstance(node, dict) else ()
                name = next((k for k, v in items if not _valid(v, tp)), "...")
            elif index:
                path, node = f"{path}[{index}]", node[int(index)] if isinstance(node, list) else None
                continue
            path, node = _join(path, name), node.get(name) if isinstance(node, dict) else None
        if m := re.fullmatch(r"Object contains unknown field `(.*)`", message):
            known = _names(tp)
            path, message = _join(path, m[1]), f"unknown key{did_you_mean(m[1], known)} (known: {', '.join(known)})"
        elif m := re.fullmatch(r"Object missing required field `(.*)`", message):
            path, message = _join(path, m[1]), "is required"
        elif m := re.fullmatch(r"Invalid enum value (.*)", message):
            words, others = _choices(tp)
            message = f"must be {' or '.join([*others, f'one of {words}'] if words else others)}, got {m[1]}"
        elif m := _OWN.fullmatch(message):
            path, message = _join(path, m[1]), m[2]
        elif message.endswith(", got `str`") and isinstance(node, str) and (why := _read_as_string(node)):
            message = f"{message} {node!r} ({why})"
        elif "`key` in" in str(e) and isinstance(node, dict) and (key := _not_a_name(node)) is not None:
            message = key
        raise StrictError(path or "<root>", message) from None


def _not_a_name(mapping: dict) -> str | None:
    """What is wrong with the first key of ``mapping`` YAML read as no string, or None."""
    for key in mapping:
        if isinstance(key, bool):
            return (f"the key {str(key).lower()} is a boolean to YAML (as yes, no, on and off are), where a name "
                    "goes: write it in quotes")
        if isinstance(key, int | float):
            return f"the key {key} is a number to YAML, where a name goes: write it in quotes"
    return None


_EXPONENT = re.compile(r"([-+]?[0-9]+(?:\.[0-9]*)?)[eE]([-+]?[0-9]+)")


def _read_as_string(text: str) -> str | None:
    """Why YAML read ``text``, which looks like a number or a boolean, as a string; None when it
    looks like neither."""
    if m := _EXPONENT.fullmatch(text):
        mantissa, exponent = m[1], m[2]
        written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent if exponent[0] in '+-' else '+' + exponent}"
        why = f"YAML reads a number with an exponent as one only with a dot and a sign, {written}"
        value = float(text)
        return f"{why}: write {int(value)}" if value.is_integer() and abs(value) < 1e16 else why
    if text.strip().lower() in ("true", "false"):
        return "true or false in quotes is a string: write it without them"
    try:
        if not math.isfinite(float(text)):
            return None
    except ValueError:
        return None
    return "a number in quotes is a string: write it without them"


def did_you_mean(word: str, known: list[str]) -> str:
    """`` (did you mean 'port'?)`` when ``word`` is close to one of ``known``, else ``""``."""
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _core(tp: Any) -> Any:
    """``tp`` without ``Annotated`` constraints and ``| None``."""
    while get_origin(tp) in (Annotated, Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    return tp


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _choices(tp: Any) -> tuple[str, list[str]]:
    """The words a ``Literal`` (in ``tp``, a union maybe) allows, and what else the union takes:
    ``("auto", ["an integer"])`` for ``int | Literal["auto"]``."""
    words: list[str] = []
    others: list[str] = []
    todo = [tp]
    while todo:
        t = todo.pop(0)
        if get_origin(t) is Annotated:
            todo.insert(0, get_args(t)[0])
        elif get_origin(t) in (Union, types.UnionType):
            todo[:0] = [a for a in get_args(t) if a is not type(None)]
        elif get_origin(t) is Literal:
            words += map(str, get_args(t))
        else:
            others.append(_KINDS.get(t, getattr(t, "__name__", str(t))))
    return ", ".join(words), others


def _names(tp: Any) -> list[str]:
    tp = _core(tp)
    is_struct = isinstance(tp, type) and issubclass(tp, msgspec.Struct)
    return [f.encode_name for f in msgspec.structs.fields(tp)] if is_struct else []


def _inner(tp: Any, name: str) -> Any:
    """The type of field ``name`` of a Struct, or of an item (``name`` empty) of a tuple or dict."""
    tp = _core(tp)
    if not name:
        return (get_args(tp) or (None,))[-1 if get_origin(tp) is dict else 0]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return next((f.type for f in msgspec.structs.fields(tp) if f.encode_name == name), None)
    return None


def _valid(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp, strict=True)
    except (msgspec.ValidationError, TypeError):
        return False
    return True


def self_reference(root: Any) -> str | None:
    """The key path of the first mapping or list that contains itself (a YAML anchor used inside
    its own node, ``a: &x [*x]``, loads as a structure without end, which every walk of it would
    follow for ever), or None. Each node is walked once, however often anchors repeat it."""
    def children(node: Any, path: str):
        if isinstance(node, dict):
            return ((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        return ((v, f"{path}[{i}]") for i, v in enumerate(node))

    if not isinstance(root, dict | list):
        return None
    open_, done = {id(root)}, set()         # on the path from the root; walked whole
    stack = [(root, children(root, ""))]
    while stack:
        node, rest = stack[-1]
        for child, path in rest:
            if isinstance(child, dict | list):
                if id(child) in open_:
                    return path
                if id(child) not in done:
                    open_.add(id(child))
                    stack.append((child, children(child, path)))
                    break
        else:
            stack.pop()
            open_.discard(id(node))
            done.add(id(node))
    return None


def alias_expansion(root: Any, limit: int) -> tuple[str, int] | None:
    """Where YAML aliases make ``root`` (acyclic: see ``self_reference``) more than ``limit``
    values larger than the text it was read from, and how large it is there, or None.

    An alias shares what its anchor built, so loading is quick, but every walk of the config
    (dropping nulls, converting it) copies a shared node once for each place that names it: a few
    lines of anchors each listing the one before ten times are billions of values. Sizes are
    counted once per node, so this check is as quick as the text is long. The path is the
    top-level key holding the most values."""
    if not isinstance(root, dict | list):
        return None
    size: dict[int, int] = {}        # id -> values once expanded (the node and all below it)
    own = 0                          # values written in the text: each node counted once
    stack = [root]
    while stack:
        node = stack[-1]
        if id(node) in size:
            stack.pop()
            continue
        items = list(node.values() if isinstance(node, dict) else node)
        pending = [c for c in items if isinstance(c, dict | list) and id(c) not in size]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        size[id(node)] = 1 + sum(size[id(c)] if isinstance(c, dict | list) else 1 for c in items)
        own += 1 + len(items)
    if size[id(root)] - own <= limit:
        return None
    pairs = root.items() if isinstance(root, dict) else enumerate(root)
    sizes = [(size[id(v)] if isinstance(v, dict | list) else 1, k) for k, v in pairs]
    key = max(sizes, key=lambda sk: sk[0])[1] if sizes else None
    return (str(key) if isinstance(root, dict) else f"[{key}]") if key is not None else "<root>", size[id(root)]


def nested_beyond(root: Any, limit: int) -> str | None:
    """The key path of the first node nested more than ``limit`` deep in ``root`` (acyclic: see
    ``self_reference``), or None. The walks of a config (dropping nulls, converting it) recurse
    once a level, and YAML's parser takes a thousand levels, past Python's recursion limit. Each
    node is measured once, however often aliases repeat it."""
    if not isinstance(root, dict | list):
        return None
    height: dict[int, int] = {}      # id -> levels of containers from the node down, itself included
    stack = [root]
    while stack:
        node = stack[-1]
        if id(node) in height:
            stack.pop()
            continue
        kids = [c for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, dict | list)]
        pending = [c for c in kids if id(c) not in height]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        height[id(node)] = 1 + max((height[id(c)] for c in kids), default=0)
    if height[id(root)] <= limit:
        return None
    path, node = "", root
    for _ in range(limit):
        pairs = ((f"{path}.{k}" if path else str(k), v) for k, v in node.items()) if isinstance(node, dict) \
            else ((f"{path}[{i}]", v) for i, v in enumerate(node))
        path, node = max(((p, v) for p, v in pairs if isinstance(v, dict | list)), key=lambda pv: height[id(pv[1])])
    return path


def non_finite(root: Any) -> tuple[str, float] | None:
    """The key path and value of the first number in ``root`` that is infinite or not a number
    (YAML's ``.inf`` and ``.nan``, or a number past a double's range such as ``1.0e+400``), or
    None. No key takes one: a timer or a timeout given infinity fails when it is armed, and 0 is
    what turns a limit off. Acyclic ``root`` (see ``self_reference``); each node walked once."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return path or "<root>", node
            continue
        if not isinstance(node, dict | list) or id(node) in seen:
            continue
        seen.add(id(node))
        pairs = [(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()] if isinstance(node, dict) \
            else [(v, f"{path}[{i}]") for i, v in enumerate(node)]
        stack.extend(reversed(pairs))
    return None


def without_nulls(v: Any) -> Any:
    """``v`` with every null mapping value dropped: null means the default."""
    if isinstance(v, dict):
        return {k: without_nulls(x) for k, x in v.items() if x is not None}
    return [without_nulls(x) for x in v] if isinstance(v, list) else v


def laid_over(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``: only the keys ``over`` names change, nested mappings key by key."""
    return {**base, **{k: laid_over(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}
