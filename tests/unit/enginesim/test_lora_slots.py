"""enginesim's adapter registry: the max_loaded cap, unloading, and what state reports."""

from __future__ import annotations

import pytest

from enginesim.lora import LoraError, LoraFull, LoraSlots


def test_cap_counts_registered_adapters_and_unload_frees_room():
    slots = LoraSlots(max_loras=2, load_ms=0, modules={"a": "org/a"}, max_loaded=2)
    slots.load("b", "org/b")
    with pytest.raises(LoraFull) as e:
        slots.load("c", "org/c")
    assert (e.value.status, e.value.name, e.value.path, e.value.cap) == (400, "c", "org/c", 2)
    slots.unload("a")
    slots.load("c", "org/c")
    assert slots.state()["registered"] == {"b": "org/b", "c": "org/c"}
    assert slots.state()["unloads"] == 1 and slots.state()["max_loaded"] == 2
    with pytest.raises(LoraError) as gone:
        slots.unload("a")
    assert gone.value.status == 404 and "cannot be found" in gone.value.message


def test_no_cap_by_default():
    slots = LoraSlots(max_loras=1, load_ms=0, modules={})
    for i in range(10):
        slots.load(f"a{i}", f"org/a{i}")
    assert len(slots.registered) == 10
