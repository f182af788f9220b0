"""The config text the --workers parent read for each reload, as a worker takes it."""

from __future__ import annotations

import os

import pytest

from gateway.config.schema import ConfigError, read_config_file
from gateway.server.handoff import KEPT, ConfigHandoff


def test_a_worker_parses_the_text_the_parent_read_for_that_reload(tmp_path):
    handoff = ConfigHandoff(str(tmp_path))
    handoff.put(1, text="first")
    handoff.put(2, text="second")
    load = handoff.get(2, parse=lambda text: f"parsed {text}")
    assert load is not None and load() == "parsed second"
    assert handoff.get(1, parse=str)() == "first"
    assert handoff.get(3, parse=str) is None                # not written (yet)
    assert oct(os.stat(tmp_path / "reload-2.json").st_mode & 0o777) == "0o600"


def test_the_parent_keeps_the_last_two(tmp_path):
    handoff = ConfigHandoff(str(tmp_path))
    for seq in range(1, 6):
        handoff.put(seq, text=str(seq))
    assert sorted(os.listdir(tmp_path)) == [f"reload-{seq}.json" for seq in range(6 - KEPT, 6)]
    assert handoff.get(1, parse=str) is None


def test_a_file_the_parent_could_not_read_is_its_error_in_every_worker(tmp_path):
    handoff = ConfigHandoff(str(tmp_path))
    try:
        read_config_file(tmp_path / "gone.yaml")
    except ConfigError as e:
        handoff.put(1, error=e)
        said = str(e)
    load = handoff.get(1, parse=str)
    assert load is not None
    with pytest.raises(ConfigError) as refused:
        load()
    assert str(refused.value) == said and refused.value.key_path == "<file>"
