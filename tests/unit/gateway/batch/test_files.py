"""Temporary files under a batch.dir: the one a process writes is its own until it is renamed into
place or removed; those a process that died left are cleared by the next start or sweep."""

from __future__ import annotations

import os

from gateway.batch import files


def test_a_batchs_output_written_while_another_process_starts_on_the_dir_is_whole(tmp_path):
    """A worker restarted (or another gateway) prepares the directory while this one writes a
    batch's output: the output's temporary file is not cleared under it, and the file comes out
    whole, where its rename failed (the runner failed and wrote the batch's files again)."""
    d = str(tmp_path)
    files.prepare(d)

    def lines():
        yield b'{"a":1}'
        for name in os.listdir(os.path.join(d, "tmp")):       # made long enough ago to be cleared
            os.utime(os.path.join(d, "tmp", name), (1, 1))
        files.prepare(d)
        yield b'{"b":2}'

    f = files.write_lines(d, "b_output.jsonl", lines(), 0)
    with open(files.path_of(d, f["id"]), "rb") as out:
        assert out.read() == b'{"a":1}\n{"b":2}\n'
    assert os.listdir(os.path.join(d, "tmp")) == []


def test_only_temporary_files_no_process_holds_are_cleared_once_old_enough(tmp_path):
    d = str(tmp_path)
    files.prepare(d)
    held_path, held = files.claim_temp(d)
    young_path, young = files.claim_temp(d)
    os.close(young)                                   # its writer died just now
    orphan_path, orphan = files.claim_temp(d)
    os.close(orphan)                                  # its writer died a while ago
    for p in (held_path, orphan_path):
        os.utime(p, (1, 1))
    try:
        files.clear_temps(d)
        assert os.path.exists(held_path) and os.path.exists(young_path) and not os.path.exists(orphan_path)
    finally:
        os.close(held)
