"""What a user installs: the wheel, in a fresh venv holding only requirements.lock, as the Dockerfile does.

An editable install reads everything from the checkout, so it cannot see a module or a data file that
the wheel leaves out (the tiny tokenizer of ``python -m gateway --demo`` once was). This test builds the
wheel from a copy of what the Dockerfile copies, installs the lock with ``--require-hashes`` and the
wheel with ``--no-deps``, and runs the installed commands from a directory where no checkout is on the
path. It needs the package index (or pip's cache): the first run downloads, later ones reuse the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("gateway", "routers", "handlers", "k8s", "enginesim")     # what the Dockerfile copies
DATA = ("gateway/static/status.html", "enginesim/tokenizer_data/tiny/tokenizer.json",
        "enginesim/tokenizer_data/tiny/tokenizer_config.json")

pytestmark = pytest.mark.timeout(900)


def run(*cmd: str | Path, cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def source_modules() -> set[str]:
    """Dotted names of every module and package of the checkout's distribution."""
    out = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.add(".".join(parts))
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the fresh venv's python, a directory outside the checkout to run it in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", dist, src, cwd=tmp)
    wheels = list(dist.glob("switchyard-*.whl"))
    assert len(wheels) == 1, wheels
    venv.create(tmp / "venv", with_pip=True)
    py = tmp / "venv" / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--no-compile", "--require-hashes", "-r", ROOT / "requirements.lock", cwd=tmp)
    run(py, "-m", "pip", "install", "-q", "--no-compile", "--no-deps", wheels[0], cwd=tmp)
    work = tmp / "elsewhere"
    work.mkdir()
    return py, work


def test_the_lock_satisfies_the_wheels_requirements(installed):
    py, work = installed
    run(py, "-m", "pip", "check", cwd=work)


def test_the_installed_commands_start(installed):
    py, work = installed
    usage = run(py, "-m", "gateway", "--help", cwd=work)
    assert "--config" in usage and "--demo" in usage
    if "--version" in usage:
        assert "0.1.0" in run(py, "-m", "gateway", "--version", cwd=work)
    assert "--engine" in run(py, "-m", "enginesim", "--help", cwd=work)


def test_the_wheel_holds_every_module_and_data_file(installed):
    py, work = installed
    script = textwrap.dedent(f"""
        import importlib, importlib.resources, pkgutil, sys
        found = set()
        for top in {PACKAGES!r}:
            pkg = importlib.import_module(top)
            assert "site-packages" in pkg.__file__, pkg.__file__    # not the checkout
            found.add(top)
            for m in pkgutil.walk_packages(pkg.__path__, top + "."):
                importlib.import_module(m.name)                     # imports with the locked deps only
                found.add(m.name)
        for rel in {DATA!r}:
            top, _, rest = rel.partition("/")
            assert importlib.resources.files(top).joinpath(rest).is_file(), rel
        from enginesim.tiny_tokenizer import TINY_DIR
        from tokenizers import Tokenizer
        assert Tokenizer.from_file(str(TINY_DIR / "tokenizer.json")).encode("hello world").ids
        print("\\n".join(sorted(found)))
    """)
    found = set(run(py, "-c", script, cwd=work).split())
    assert found == source_modules(), (source_modules() - found, found - source_modules())
