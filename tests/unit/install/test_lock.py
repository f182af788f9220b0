"""The lock files agree with pyproject.toml: a dependency added to a range without `make lock` fails here,
before CI's `pip install --require-hashes` or the image build does."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pins(name: str) -> dict[str, str]:
    """{canonical name: version} of a lock file; every pin carries at least one hash."""
    text = (ROOT / name).read_text()
    out = {}
    for entry in re.split(r"\n(?=\S)", text):
        m = PIN.match(entry)
        if m:
            assert "--hash=sha256:" in entry, f"{name}: {m.group(1)} has no hash"
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def direct(*extras: str) -> list[Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return reqs


@pytest.mark.parametrize(("lock", "extras"), [("requirements.lock", ()), ("requirements-dev.lock", ("dev",))])
def test_every_direct_dependency_is_pinned_inside_its_range(lock, extras):
    pinned = pins(lock)
    for req in direct(*extras):
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is in pyproject.toml but not in {lock}: run `make lock`"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"{lock} pins {req.name}=={pinned[name]}, outside {req.specifier}: run `make lock`"
        for extra in req.extras:                # redis[hiredis]: here each extra is named after its package
            assert canonicalize_name(extra) in pinned, f"{req}: the extra {extra} is not in {lock}"


def test_the_dev_lock_holds_the_runtime_lock():
    runtime, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    differ = {n: (v, dev.get(n)) for n, v in runtime.items() if dev.get(n) != v}
    assert not differ, f"the two locks disagree (run `make lock`): {differ}"
