"""A stored file's validators, and what a request's conditionals and ``Range`` make of them (RFC 9110).

A file under ``batch.dir`` never changes once published (a new one gets a new id), so its validators
are strong: the ETag is its modification time in nanoseconds and its size (the value aiohttp's
``FileResponse`` gave it), the Last-Modified its modification time in whole seconds, which is what
the header can say and so what dates are compared with.

Read in RFC 9110 §13.2.2's order: ``If-Match`` (else ``If-Unmodified-Since``) fails with a 412;
``If-None-Match`` (else ``If-Modified-Since``) makes a 304; then a ``Range`` is served when an
``If-Range`` (if any) names this file's bytes. One range is served; a ``Range`` that does not
parse, names another unit or lists several ranges is ignored (§14.2: a server may ignore it), and
the whole file is the answer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# more digits than this (leading zeros aside) is past any file's size; int() is not asked to convert
# them (it refuses past 4300 digits)
_MAX_DIGITS = 18
_PAST_ANY = 10 ** _MAX_DIGITS
_DIGITS = re.compile(r"[0-9]+")
_ETAG = re.compile(r'\s*(W/)?"([\x21\x23-\x7e\x80-\uffff]*)"\s*')


@dataclass(frozen=True, slots=True)
class Validators:
    etag: str               # quoted, strong
    last_modified: int      # POSIX seconds
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> Validators:
        return cls(f'"{st.st_mtime_ns:x}-{st.st_size:x}"', int(st.st_mtime), st.st_size)


UNSATISFIABLE = "unsatisfiable"


def _tags(value: str) -> list[tuple[bool, str]]:
    """An entity-tag list as (weak, quoted tag); an element that is no entity tag matches nothing."""
    out = []
    for part in value.split(","):
        m = _ETAG.fullmatch(part)
        if m is not None:
            out.append((m.group(1) is not None, f'"{m.group(2)}"'))
    return out


def if_match(value: str, v: Validators) -> bool:
    """§13.1.1: ``*``, or one of the tags equal to the ETag by strong comparison (a weak tag never is)."""
    if value.strip() == "*":
        return True
    return any(not weak and tag == v.etag for weak, tag in _tags(value))


def if_none_match(value: str, v: Validators) -> bool:
    """§13.1.2: true (the method is performed) when no tag equals the ETag by weak comparison."""
    if value.strip() == "*":
        return False
    return all(tag != v.etag for _, tag in _tags(value))


def if_range_etag(value: str) -> bool:
    """Whether an ``If-Range`` holds an entity tag (else it is read as a date)."""
    s = value.lstrip()
    return s.startswith('"') or s.startswith("W/")


def if_range_holds(value: str, date: float | None, v: Validators) -> bool:
    """§13.1.5: the range is served when the entity tag is the ETag (strong), or the date is the
    Last-Modified exactly; anything else (a weak tag, another date, no date) is another
    representation, and the whole file is sent."""
    if if_range_etag(value):
        tags = _tags(value)
        return len(tags) == 1 and not tags[0][0] and tags[0][1] == v.etag
    return date is not None and int(date) == v.last_modified


def _number(digits: str) -> int:
    digits = digits.lstrip("0")
    return _PAST_ANY if len(digits) > _MAX_DIGITS else int(digits or "0")


def byte_range(value: str, size: int) -> tuple[int, int] | str | None:
    """§14.1.1: (first, last), both inclusive, of a ``Range`` of one byte range; ``UNSATISFIABLE``
    when it starts at or past the end (or asks for a suffix of no bytes); None when it is to be
    ignored (it does not parse, its unit is not ``bytes``, it lists several ranges)."""
    unit, eq, ranges = value.partition("=")
    if not eq or unit.lower() != "bytes":
        return None
    specs = [s for s in (p.strip(" \t") for p in ranges.split(",")) if s]     # a list's empty elements
    if len(specs) != 1:
        return None
    first, dash, last = specs[0].partition("-")
    if not dash or (last and not _DIGITS.fullmatch(last)) or (first and not _DIGITS.fullmatch(first)):
        return None
    if not first:                           # a suffix: the last N bytes
        if not last:
            return None
        n = _number(last)
        if size == 0:
            return None                     # a suffix of nothing: the whole (empty) file
        return UNSATISFIABLE if n == 0 else (max(size - n, 0), size - 1)
    start = _number(first)
    end = _number(last) if last else None
    if end is not None and end < start:
        return None
    if start >= size:
        return UNSATISFIABLE
    return start, size - 1 if end is None else min(end, size - 1)
