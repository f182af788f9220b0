"""``Block``: the base of every config block the gateway itself defines.

A block is frozen (a config is shared by every request of its generation and never changes under
them), forbids unknown keys (a typo must be an error, not a silent default) and takes keywords
only. ``_secret`` names fields whose values never appear in a ``repr`` (logs, tracebacks).

The strategies', engines' and discovery's settings (``routers``, ``handlers``, ``k8s``) declare
the same flags themselves: those packages import nothing of the gateway but its domain modules.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class Block(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    _secret: ClassVar[tuple[str, ...]] = ()      # fields never shown in a repr (logs, tracebacks)

    def __repr__(self) -> str:
        shown = (f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f not in self._secret)
        return f"{type(self).__name__}({', '.join(shown)})"
