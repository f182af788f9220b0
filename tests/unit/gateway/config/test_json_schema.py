"""The config's JSON Schema: every key described, with its default, accepting what the loader
accepts (URL strings for endpoints, nulls, the older flat P/D keys) and refusing what it refuses."""

from __future__ import annotations

import tomllib
import types
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import jsonschema
import msgspec
import pytest
import yaml

from gateway.__main__ import main
from gateway.config.json_schema import config_schema
from gateway.config.schema import Config, ConfigError, parse_config
from gateway.version import VERSION, version

ROOT = Path(__file__).resolve().parents[4]


def _structs(tp, seen: dict[str, type]) -> None:
    """Every Struct reachable from ``tp`` through its fields' types."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if tp.__name__ in seen:
            return
        seen[tp.__name__] = tp
        for f in msgspec.structs.fields(tp):
            _structs(f.type, seen)
    elif get_origin(tp) in (Annotated, Union, types.UnionType, tuple, dict, list) or get_args(tp):
        for arg in get_args(tp):
            _structs(arg, seen)


def reachable() -> dict[str, type]:
    seen: dict[str, type] = {}
    _structs(Config, seen)
    return seen


def test_every_field_of_every_struct_reachable_from_config_has_a_description():
    structs = reachable()
    assert len(structs) >= 30
    missing = [f"{name}.{f.name}" for name, cls in structs.items() for f in msgspec.structs.fields(cls)
               if not _description(f.type)]
    assert not missing, f"fields without Meta(description=...): {missing}"


def _description(tp) -> str:
    """The description of a field's annotation: ``Annotated[T, ..., Meta(description=...)]``."""
    if get_origin(tp) is not Annotated:
        return ""
    return next((m.description for m in tp.__metadata__ if getattr(m, "description", None)), "")


def test_every_property_in_the_schema_has_a_description_and_every_optional_one_a_default():
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    count = 0
    for name, d in schema["$defs"].items():
        for key, prop in d["properties"].items():
            count += 1
            assert prop.get("description"), f"{name}.{key} has no description"
            if key not in d.get("required", ()) and not prop.get("deprecated") and key != "name":
                assert "default" in prop, f"{name}.{key} has no default"
    fields = sum(len(msgspec.structs.fields(c)) for c in reachable().values())
    assert count == fields + 4      # the four older flat pd keys, marked deprecated


VALID = [
    "",
    "models: [{name: a, endpoints: [http://x:1, {url: 'http://y:2', engine: sglang}]}]",
    "models: [{name: a, rolesets: [{prefill: [http://p:1], decode: [{url: 'http://d:1'}]}]}]",
    "listen: {host: null, port: null}\nrouting: {strategy: round-robin}",
    "pd: {abort_timeout_s: 2, rewrite_remote_host: false}",
    "limits: {users: {alice: {rpm: 60}, bob: null}}",
    "server: {workers: auto}",
    "kubernetes: {enabled: true, namespaces: [llm]}",
]
INVALID = [
    ("listen: {prot: 1}", "listen.prot"),
    ("listen: {port: 70000}", "listen.port"),
    ("server: {workers: many}", "server.workers"),
    ("models: [{engine: vllm, endpoints: [http://x:1]}]", "models[0].name"),
    ("models: [{name: a, endpoints: [ftp://x]}]", "models[0].endpoints[0]"),
    ("models: [{name: a, engine: tgi, endpoints: [http://x:1]}]", "models[0].engine"),
    ("watchdog: {idle_timeout_s: -1}", "watchdog.idle_timeout_s"),
    ("responses: {state: client}", "responses.state"),
]


@pytest.mark.parametrize("text", VALID)
def test_schema_and_loader_both_accept(text):
    jsonschema.validate(yaml.safe_load(text), config_schema())
    parse_config(text)


@pytest.mark.parametrize("text,path", INVALID)
def test_schema_and_loader_both_refuse(text, path):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(text), config_schema())
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    assert e.value.key_path.startswith(path)


def test_print_config_schema_prints_the_schema(capsys):
    assert main(["--print-config-schema"]) == 0
    printed = msgspec.json.decode(capsys.readouterr().out)
    assert printed == config_schema()
    ms = printed["$defs"]["ServerConfig"]["properties"]["max_body_bytes"]
    assert ms["default"] == 16 * 1024 * 1024 and "413" in ms["description"]


def test_version_comes_from_the_package_and_the_constant_matches_pyproject(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert VERSION == project["version"]
    assert version() == project["version"]
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"switchyard {project['version']}"
