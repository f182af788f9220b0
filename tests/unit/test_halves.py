"""``make test`` runs the suite in two halves (tests/support/halves.py): every place of tests/ that
holds tests is in exactly one of them, so a new folder cannot go untested."""

from __future__ import annotations

from tests.support import halves


def test_every_folder_of_tests_is_in_exactly_one_half():
    assert halves.check() == []


def test_a_folder_in_neither_half_or_in_both_is_named():
    first, second = halves.HALVES
    assert halves.check((first[1:], second)) == [f"tests/{first[0]} is in no half of tests/support/halves.py"]
    assert halves.check((first, second + first[:1])) == [f"tests/{first[0]} is in both halves"]
    assert halves.check((first + ("integration/nowhere",), second)) == [
        "tests/integration/nowhere does not exist (or holds no tests)"]
