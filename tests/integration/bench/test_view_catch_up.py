"""bench/view_catch_up.py runs and reports its figures (small sizes: the test checks the script,
not the figures, which are measured on a quiet machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_catch_up_benchmark_runs_and_prints_its_medians():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "view_catch_up.py"), "--sessions", "3000",
                          "--blocks", "4096", "--rounds", "1"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "round 1:" in out and "3,000 sessions, 4,096 blocks, median of 1" in out, out
