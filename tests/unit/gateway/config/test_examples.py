"""examples/: each file is valid for the JSON Schema and for ``--check-config``; full.yaml is
generated, holds every key, and every value in it is the key's default (bar placeholders)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from gateway.__main__ import main
from gateway.config.json_schema import config_schema
from gateway.config.reference import NOT_EXPANDED, PLACEHOLDERS, Walk, full_yaml

ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = ROOT / "examples"
NAMES = ["minimal.yaml", "vllm-aggregated.yaml", "sglang-pd.yaml", "kubernetes.yaml", "tenants-redis.yaml",
         "kv-events.yaml", "full.yaml"]
TINY_TOKENIZER = ROOT / "enginesim" / "tokenizer_data" / "tiny"
# what the examples read from the environment (secrets kept out of the files)
ENV = {"SWITCHYARD_ADMIN_TOKEN": "example-admin-token", "REDIS_PASSWORD": "example-password"}


def test_the_examples_are_there():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(NAMES)
    for name in NAMES:
        first = (EXAMPLES / name).read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) > 20, f"{name}: the first line says what the file is for"


@pytest.mark.parametrize("name", NAMES)
def test_each_example_is_valid_for_the_schema(name):
    jsonschema.validate(yaml.safe_load((EXAMPLES / name).read_text()), config_schema())


def _checkable(name: str, tmp_path: Path) -> Path:
    """The example as --check-config can read it here: a tokenizer directory it names stands in
    for the repository's tiny tokenizer (the path in the file is where a deployment keeps it)."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    swapped = False
    for m in data.get("models") or ():
        if m.get("tokenizer"):
            m["tokenizer"], swapped = str(TINY_TOKENIZER), True
    if not swapped:
        return EXAMPLES / name
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_each_example_passes_check_config(name, tmp_path, capsys, monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    rc = main(["--check-config", str(_checkable(name, tmp_path))])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert " OK (" in out.out and out.err == "", out.err     # no deprecated name in an example


def test_check_config_as_a_command(tmp_path):
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
    for name, said in (("vllm-aggregated.yaml", "OK (2 models)"), ("tenants-redis.yaml", "OK (1 model)")):
        done = subprocess.run([sys.executable, "-m", "gateway", "--check-config", str(EXAMPLES / name)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{EXAMPLES / name}: {said}"
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: a, endpoints: [http://x:1], strategy: round-robbin}]\n")
    done = subprocess.run([sys.executable, "-m", "gateway", "--check-config", str(bad)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "models[0].strategy:" in done.stderr and "did you mean 'round-robin'?" in done.stderr


def test_a_tokenizer_directory_that_does_not_exist_is_the_only_complaint_about_kv_events(capsys):
    assert main(["--check-config", str(EXAMPLES / "kv-events.yaml")]) == 2
    assert "models[0].tokenizer: no tokenizer.json in '/models/Llama-3.1-8B-Instruct'" in capsys.readouterr().err


def test_full_yaml_is_the_generated_one():
    assert (EXAMPLES / "full.yaml").read_text() == full_yaml(), (
        "examples/full.yaml is out of date; regenerate it: "
        "python -m gateway.config.reference --full-example > examples/full.yaml")


def test_full_yaml_holds_every_key_at_its_default():
    walk = Walk(config_schema())
    data = yaml.safe_load((EXAMPLES / "full.yaml").read_text())
    missing: list[str] = []
    wrong: list[str] = []
    seen: set[str] = set()

    def visit(node: dict, def_name: str, prefix: str) -> None:
        seen.add(def_name)
        for key in walk.keys(def_name, prefix):
            if key.prop.get("deprecated"):
                assert key.name not in node, f"{key.path}: an old name in full.yaml"
                continue
            if key.name not in node:
                missing.append(key.path)
                continue
            value = node[key.name]
            if key.path in PLACEHOLDERS:
                assert value == PLACEHOLDERS[key.path]
                continue
            found = walk.block(key.prop)
            if found is not None and walk.home[found[1]] == key.path + found[0] and key.path not in NOT_EXPANDED:
                suffix, inner = found
                entries = {"": [value], "[]": value}.get(suffix) or list(value.values())
                assert len(entries) == 1, f"{key.path}: one example entry"
                visit(entries[0], inner, key.path + suffix)
            elif value != key.prop.get("default"):
                wrong.append(f"{key.path}: {value!r} != default {key.prop.get('default')!r}")

    visit(data, "Config", "")
    assert not missing, f"keys missing from full.yaml: {missing}"
    assert not wrong, f"values that are not the default: {wrong}"
    # NOT_EXPANDED: kv_events needs a tokenizer, engine_priority engines with priority scheduling
    assert seen == set(walk.defs) - {"KVEventsEndpointConfig", "EnginePriorities"}
