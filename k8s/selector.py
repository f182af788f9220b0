"""Kubernetes label selectors: parse the string form and match a pod's labels against it.

The gateway hands the selector string to the API server, which does the filtering; it parses it
itself only to reject a malformed ``kubernetes.label_selector`` at config load instead of failing
every list call at run time. The parser accepts the grammar of ``k8s.io/apimachinery`` labels:
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (a,b)``,
``key notin (a,b)``, ``key>N``, ``key<N``, joined by commas (a logical AND).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*"
_KEY = rf"(?:{_PREFIX}/)?{_NAME}"
_VALUE = rf"(?:{_NAME})?"

_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")
_EQUALITY = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s*\(([^()]*)\)$")
_NUMERIC = re.compile(rf"^({_KEY})\s*(>|<)\s*(-?\d+)$")
_VALUE_RE = re.compile(rf"^{_VALUE}$")


class SelectorError(ValueError):
    pass


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str                       # exists | !exists | = | != | in | notin | > | <
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        v = labels.get(self.key)
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op in ("=", "in"):
            return has and v in self.values
        if self.op in ("!=", "notin"):
            return not has or v not in self.values
        if not has:
            return False
        try:
            n = int(v)  # type: ignore[arg-type]
        except ValueError:
            return False
        bound = int(self.values[0])
        return n > bound if self.op == ">" else n < bound


def _split(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SelectorError(f"unbalanced '(' in {text!r}")
    parts.append("".join(cur))
    return parts


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """Parse a selector string; the empty string selects everything. Raises ``SelectorError``."""
    text = text.strip()
    if not text:
        return ()
    reqs = []
    for raw in _split(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"empty requirement in {text!r}")
        if m := _SET.match(part):
            values = tuple(v.strip() for v in m.group(3).split(","))
            if not values or any(not _VALUE_RE.match(v) for v in values) or values == ("",):
                raise SelectorError(f"invalid value list in {part!r}")
            reqs.append(Requirement(m.group(1), m.group(2), values))
        elif m := _EQUALITY.match(part):
            op = "=" if m.group(2) in ("=", "==") else "!="
            reqs.append(Requirement(m.group(1), op, (m.group(3),)))
        elif m := _NUMERIC.match(part):
            reqs.append(Requirement(m.group(1), m.group(2), (m.group(3),)))
        elif m := _EXISTS.match(part):
            reqs.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
        else:
            raise SelectorError(f"cannot parse requirement {part!r}")
    return tuple(reqs)


def matches(requirements: tuple[Requirement, ...], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    return all(r.matches(labels) for r in requirements)
