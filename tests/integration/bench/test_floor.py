"""bench/floor.py: each step of the pipeline, added back to the forwarding floor, serves real requests."""

from __future__ import annotations

import re

from bench import floor


def test_every_step_answers_and_is_measured(capsys):
    assert floor.main(["--steps", "floor,record,log,admit,upstream,forward,full", "--rounds", "1", "--duration", "0.25"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "µs (" in line]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == ["floor", "record", "log", "admit", "upstream", "forward", "full"]
    for r in rows:
        cpu, rate = re.search(r"\| ([\d.]+) µs \(.*\| ([\d,]+) \|$", r).groups()
        assert float(cpu) > 0 and int(rate.replace(",", "")) > 0


def test_an_unknown_step_is_refused(capsys):
    try:
        floor.main(["--steps", "floor,X"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("an unknown step was accepted")
    assert "unknown steps ['X']" in capsys.readouterr().err
