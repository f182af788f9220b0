"""docs/configuration.md is generated from the config's schema, and the committed page is the
generator's output: a key added in the code without regenerating the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.config.json_schema import config_schema
from gateway.config.reference import Walk, markdown

ROOT = Path(__file__).resolve().parents[4]
PAGE = ROOT / "docs" / "configuration.md"
REGENERATE = "python -m gateway.config.reference > docs/configuration.md"


def test_the_committed_page_is_the_generated_one():
    assert PAGE.read_text() == markdown(), f"docs/configuration.md is out of date; regenerate it: {REGENERATE}"


def test_every_key_path_is_on_the_page_with_its_description():
    walk = Walk(config_schema())
    page = PAGE.read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| [^|]*(?:\\\|[^|]*)* \| .*? \| (.*) \|$", page, re.M))
    expected = [key for top in walk.keys("Config", "") for key, _ in walk.rows(top)[1:]]
    # every block documented once: each key of each block has one row (the top-level ones are headings)
    properties = sum(len(d["properties"]) for d in walk.defs.values())
    assert len(expected) == properties - len(walk.defs["Config"]["properties"])
    missing = [k.path for k in expected if k.path not in rows]
    assert not missing, f"not on the page: {missing}"
    for k in expected:
        assert rows[k.path].startswith(k.prop["description"].replace("|", "\\|"))


def test_the_page_starts_with_what_a_user_does_and_its_headings_are_plain_text():
    page = PAGE.read_text()
    headings = [line for line in page.splitlines() if line.startswith("#")]
    assert headings[:3] == ["# Configuration", "## Write, check, run, reload", "## Conventions"]
    for h in headings:
        assert not re.search(r"[`<>*_\[]", h), f"heading is not plain text: {h!r}"
    for needed in ("--check-config", "SIGHUP", "--print-config-schema", "removed in 0.3.0",
                   "examples/full.yaml", "`least-request`"):
        assert needed in page.replace("\n", " ") or needed in page


def test_the_reload_step_names_what_reloads_and_what_needs_a_restart():
    """Step 4 of the page accounts for every top-level block: applied on reload or refused until a
    restart, as gateway/server/reload.py decides (a block it leaves out would surprise a reader
    either way)."""
    from gateway.server.reload import RESTART_BLOCKS

    page = PAGE.read_text()
    step = " ".join(re.search(r"^4\. Change it while it runs:(.*?)^\S", page, re.S | re.M).group(1).split())
    applied, _, refused = step.partition("Changing")
    for block in RESTART_BLOCKS:
        assert f"`{block}`" in refused, f"step 4 does not say {block} needs a restart"
    assert "`kv_events`" in refused and "turning on API keys, limits or the admin API" in refused
    # what reload.py applies: every other block (routing: "strategies and their settings"; auth: keys)
    words = {"models": "models and endpoints", "aliases": "aliases", "routing": "strategies and their settings",
             "auth": "API keys", "limits": "limits", "kubernetes": "`kubernetes.models`"}
    for block in Walk(config_schema()).defs["Config"]["properties"]:
        if block not in RESTART_BLOCKS:
            assert words.get(block, f"`{block}`") in applied, f"step 4 does not say what a reload does with {block}"
