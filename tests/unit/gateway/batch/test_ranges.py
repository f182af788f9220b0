"""A content request's Range and conditionals (gateway/batch/ranges.py): whatever a client writes, the
answer is a range inside the file, unsatisfiable, or ignored, and nothing raises."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from gateway.batch import ranges

V = ranges.Validators('"abc-10"', 1_700_000_000, 16)

RANGE_TEXT = st.one_of(
    st.text(max_size=40),
    st.builds(lambda u, a, b: f"{u}={a}-{b}", st.sampled_from(["bytes", "BYTES", "items", ""]),
              st.text(alphabet="0123456789 ,-", max_size=8), st.text(alphabet="0123456789 ,-x", max_size=8)),
)


@given(RANGE_TEXT, st.integers(0, 64))
def test_a_range_is_inside_the_file_unsatisfiable_or_ignored(value, size):
    got = ranges.byte_range(value, size)
    if isinstance(got, tuple):
        first, last = got
        assert 0 <= first <= last < size, (value, size, got)
    else:
        assert got in (None, ranges.UNSATISFIABLE)


def test_ranges():
    assert ranges.byte_range("bytes=0-3", 16) == (0, 3)
    assert ranges.byte_range("bytes=-4", 16) == (12, 15)
    assert ranges.byte_range("bytes=-40", 16) == (0, 15)
    assert ranges.byte_range("bytes= 1-2 ,", 16) == (1, 2)        # a list: spaces around an element, an empty one
    assert ranges.byte_range("bytes=4-400", 16) == (4, 15)
    assert ranges.byte_range("bytes=" + "0" * 5000 + "4-", 16) == (4, 15)       # zeros in front of a small one
    assert ranges.byte_range("bytes=" + "9" * 5000 + "-", 16) == ranges.UNSATISFIABLE
    assert ranges.byte_range("bytes=16-", 16) == ranges.UNSATISFIABLE
    assert ranges.byte_range("bytes=-0", 16) == ranges.UNSATISFIABLE
    assert ranges.byte_range("bytes=0-", 0) == ranges.UNSATISFIABLE
    assert ranges.byte_range("bytes=-5", 0) is None
    for ignored in ("bytes=0-1,3-4", "bytes=3-1", "bytes=\u0661-", "bytes=1 -2", "bytes =1-2", "nope"):
        assert ranges.byte_range(ignored, 16) is None, ignored


@given(st.text(max_size=60), st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False,
                                                          min_value=-1e12, max_value=1e12)))
def test_conditionals_never_raise(value, date):
    assert isinstance(ranges.if_match(value, V), bool)
    assert isinstance(ranges.if_none_match(value, V), bool)
    assert isinstance(ranges.if_range_holds(value, date, V), bool)


def test_entity_tags():
    assert ranges.if_match('"abc-10"', V) and ranges.if_match('"x", "abc-10"', V) and ranges.if_match(" * ", V)
    assert not ranges.if_match('W/"abc-10"', V) and not ranges.if_match("abc-10", V)
    assert not ranges.if_none_match('W/"abc-10"', V) and not ranges.if_none_match("*", V)
    assert ranges.if_none_match('"x"', V) and ranges.if_none_match("garbage", V)
    assert ranges.if_range_holds('"abc-10"', None, V) and not ranges.if_range_holds('W/"abc-10"', None, V)
    assert ranges.if_range_holds("Tue, 14 Nov 2023 22:13:20 GMT", 1_700_000_000.0, V)
    assert not ranges.if_range_holds("Tue, 14 Nov 2023 22:13:21 GMT", 1_700_000_001.0, V)
    assert not ranges.if_range_holds("garbage", None, V)


def test_validators_of_a_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    v = ranges.Validators.of(os.stat(p))
    assert v.size == 10 and v.etag.startswith('"') and v.etag.endswith('-a"')
