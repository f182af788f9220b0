"""``make test``: the suite in two pytest runs side by side, one per half of its folders.

Most of an integration test's time is spent waiting (for a process to start, an engine's tokens, a
timeout to pass), not computing, so two runs on two cores take little more than the longer half,
where one run took both. Each half has its own slice of the listening ports
(``SWITCHYARD_TEST_PORT_SLICE``, tests/support/ports.py) and its own base temporary directory, so
the two never pick one port or one path. Every folder of tests/ belongs to exactly one half: a new
folder that is in neither stops the run before it starts, rather than go untested.

    python -m tests.support.halves [PYTEST ARGS ...]    # e.g. -x, -k something

Each half's output is written to a file while it runs and printed whole once both are done; the
exit code is the first half's that failed (0 when both passed). ``make test-unit`` and ``make
test-integration`` run pytest as before, in one process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# balanced by the time each folder took in a run of the whole suite (about 600 s each on a loaded
# machine); a folder's tests stay together, with the fixtures they share
HALVES: tuple[tuple[str, ...], tuple[str, ...]] = (
    ("integration/server", "integration/view", "integration/k8s", "integration/lora", "integration/resilience",
     "integration/install", "integration/routing", "integration/docs", "integration/demo"),
    ("unit", "integration/batch", "integration/tenancy", "integration/bench", "integration/observability",
     "integration/admission", "integration/api", "integration/pd", "integration/state", "integration/upstream",
     "integration/kv", "integration/enginesim", "integration/pipeline"),
)


def folders() -> set[str]:
    """The places of tests/ that hold tests: tests/unit, each folder of tests/integration, and any
    test file directly in tests/ or tests/integration (named as such: a half must name it)."""
    out = {"unit"}
    out |= {f"integration/{d.name}" for d in (TESTS / "integration").iterdir()
            if d.is_dir() and any(d.rglob("test_*.py"))}
    out |= {str(f.relative_to(TESTS)) for where in (TESTS, TESTS / "integration") for f in where.glob("test_*.py")}
    return out


def check(halves: tuple[tuple[str, ...], ...] = HALVES) -> list[str]:
    """What is wrong with ``halves``: a folder in neither, in both, or one that does not exist."""
    have = folders()
    named = [f for half in halves for f in half]
    problems = [f"tests/{f} is in no half of tests/support/halves.py" for f in sorted(have - set(named))]
    problems += [f"tests/{f} is in both halves" for f in sorted({f for f in named if named.count(f) > 1})]
    problems += [f"tests/{f} does not exist (or holds no tests)" for f in sorted(set(named) - have)]
    return problems


def main(argv: list[str]) -> int:
    problems = check()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="switchyard-tests-"))
    runs = []
    start = time.monotonic()
    for i, half in enumerate(HALVES):
        log = open(work / f"half{i}.log", "wb")      # closed below, once its run is done
        env = {**os.environ, "SWITCHYARD_TEST_PORT_SLICE": f"{i}/{len(HALVES)}"}
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(work / f"tmp{i}"),
               *argv, *(f"tests/{f}" for f in half)]
        runs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for i, (proc, log) in enumerate(runs):
        code = proc.wait()
        log.close()
        codes.append(code)
        print(f"===== half {i + 1} of {len(runs)}: {' '.join(HALVES[i])} (exit {code}) =====", flush=True)
        sys.stdout.write((work / f"half{i}.log").read_text(errors="replace"))
        sys.stdout.flush()
    print(f"===== both halves done in {time.monotonic() - start:.0f} s; exit codes {codes} =====", flush=True)
    failed = [c for c in codes if c != 0]
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"the halves' logs and temporary files are in {work}", file=sys.stderr)
    return failed[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
