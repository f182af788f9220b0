"""The configuration reference (docs/configuration.md) and examples/full.yaml, generated from the
config's JSON Schema (gateway/config/json_schema.py), so both say what the code says.

    python -m gateway.config.reference > docs/configuration.md
    python -m gateway.config.reference --full-example > examples/full.yaml

The suite fails when a committed file differs from what this module generates.

The walk: every block is documented once, under the first key path that reaches it
(breadth-first from the top-level keys, in the order ``Config`` declares them); a key elsewhere
that holds the same block (a model's ``pd:``, a roleset's endpoints) points there.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.config.deprecated import MOVED_PD_KEYS, REMOVED_IN, RETRY_FLAG
from gateway.config.json_schema import config_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Values of keys that have no default, for the one example entry of a list or map in full.yaml
PLACEHOLDERS: dict[str, Any] = {
    "models[].name": "my-model",
    "models[].endpoints[].url": "http://127.0.0.1:8000",
    "models[].rolesets[].name": "rs-0",
    "models[].rolesets[].prefill": ["http://127.0.0.1:8100"],
    "models[].rolesets[].decode": ["http://127.0.0.1:8200"],
    "aliases[].name": "my-alias",
    "aliases[].targets[].model": "my-model",
    "auth.api_keys[].key_sha256": hashlib.sha256(b"sk-change-me").hexdigest(),
}
# map entries shown in full.yaml, by the map's key path
ENTRY_NAMES = {"limits.users": "alice", "limits.models": "my-model", "kubernetes.models": "my-model"}
# blocks full.yaml leaves null although they are documented here: giving an endpoint its own
# kv_events subscribes it to events, which needs the model's tokenizer directory; engine_priority
# writes a priority engines without priority scheduling refuse
NOT_EXPANDED = {"models[].endpoints[].kv_events", "admission.engine_priority"}


@dataclass
class Key:
    path: str            # models[].endpoints[].url
    name: str            # url
    prop: dict[str, Any]
    required: bool


class Walk:
    def __init__(self, schema: dict[str, Any] | None = None) -> None:
        self.schema = schema or config_schema()
        self.defs: dict[str, dict[str, Any]] = self.schema["$defs"]
        self.home = self._homes()

    # -- shapes ------------------------------------------------------------------------------

    @staticmethod
    def branches(s: dict[str, Any]) -> list[dict[str, Any]]:
        """The non-null alternatives of a schema."""
        if "anyOf" in s:
            return [b for x in s["anyOf"] for b in Walk.branches(x)]
        t = s.get("type")
        if t == "null":
            return []
        if isinstance(t, list):
            return [{**s, "type": x} for x in t if x != "null"]
        return [s]

    def block(self, s: dict[str, Any]) -> tuple[str, str] | None:
        """(suffix, def name) when ``s`` holds a block: directly (``""``), as a list's items
        (``"[]"``) or as a map's values (``".<name>"``)."""
        for b in self.branches(s):
            if "$ref" in b:
                return "", b["$ref"].rsplit("/", 1)[1]
            if b.get("type") == "array":
                inner = self.block(b["items"])
                if inner is not None and inner[0] == "":
                    return "[]", inner[1]
            if b.get("type") == "object" and isinstance(b.get("additionalProperties"), dict):
                inner = self.block(b["additionalProperties"])
                if inner is not None and inner[0] == "":
                    return ".<name>", inner[1]
        return None

    def keys(self, def_name: str, prefix: str) -> list[Key]:
        d = self.defs[def_name]
        req = set(d.get("required", ()))
        return [Key(f"{prefix}.{k}" if prefix else k, k, p, k in req) for k, p in d["properties"].items()]

    def _homes(self) -> dict[str, str]:
        """Each block's documented path: the first that reaches it, breadth first."""
        home = {"Config": ""}
        queue = deque(self.keys("Config", ""))
        while queue:
            key = queue.popleft()
            found = self.block(key.prop)
            if found is None or found[1] in home:
                continue
            home[found[1]] = key.path + found[0]
            queue.extend(self.keys(found[1], key.path + found[0]))
        return home

    def rows(self, key: Key) -> list[tuple[Key, str | None]]:
        """``key`` and, for a block documented here, its keys in turn; with each key the path of
        the block it shares with another key (None when its keys follow)."""
        found = self.block(key.prop)
        if found is None:
            return [(key, None)]
        suffix, def_name = found
        if self.home[def_name] != key.path + suffix:
            return [(key, self.home[def_name])]
        out: list[tuple[Key, str | None]] = [(key, None)]
        for sub in self.keys(def_name, key.path + suffix):
            out.extend(self.rows(sub))
        return out

    # -- text --------------------------------------------------------------------------------

    def type_text(self, s: dict[str, Any]) -> str:
        parts = [self._one(b) for b in self.branches(s)]
        if "default" in s and s["default"] is None and any(x.get("type") == "null" for x in _flat(s)):
            parts.append("null")
        return " or ".join(dict.fromkeys(parts))

    def _one(self, b: dict[str, Any]) -> str:
        if "$ref" in b:
            return "block"
        if "enum" in b:
            values = [str(v) for v in b["enum"] if v is not None]
            return values[0] if len(values) == 1 else "one of " + ", ".join(values)
        t = b.get("type")
        if t == "array":
            return f"list of {_plural(self.type_text(b['items']))}"
        if t == "object":
            return f"map of name to {self.type_text(b.get('additionalProperties', {}))}"
        if t == "string":
            if b.get("pattern", "").startswith("^https?"):
                return "URL"
            return "string" + (" (not empty)" if b.get("minLength") else "")
        words = {"integer": "integer", "number": "number", "boolean": "boolean"}
        text = words.get(t, str(t))
        lo = b.get("minimum", b.get("exclusiveMinimum"))
        hi = b.get("maximum", b.get("exclusiveMaximum"))
        if lo is not None and hi is not None:
            text += f" {_num(lo)}..{_num(hi)}"
        elif lo is not None:
            text += f" {'>' if 'exclusiveMinimum' in b else '≥'} {_num(lo)}"
        elif hi is not None:
            text += f" {'<' if 'exclusiveMaximum' in b else '≤'} {_num(hi)}"
        return text


def _flat(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [x for a in s.get("anyOf", [s]) for x in ([a] if "anyOf" not in a else _flat(a))]


def _plural(text: str) -> str:
    plural = {"block": "blocks", "URL": "URLs", "string": "strings"}
    return " or ".join(plural.get(p, p) for p in text.split(" or "))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _yaml_value(v: Any) -> str:
    text = yaml.safe_dump(v, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text.removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# -- docs/configuration.md ---------------------------------------------------------------------

INTRO = """\
# Configuration

The gateway reads one YAML file: `python -m gateway --config FILE`. Every key has a default, so
a file holds only what differs; this page lists every key, its type, its default and what it
does. It is generated from the code (`python -m gateway.config.reference > docs/configuration.md`),
like the JSON Schema that `python -m gateway --print-config-schema` prints.

## Write, check, run, reload

1. Write a file. The smallest useful one names a model and where its engine listens:

    ```yaml
{minimal}
    ```

2. Check it, without starting anything:

    ```console
    $ python -m gateway --check-config gateway.yaml
    gateway.yaml: OK (1 model)
    ```

    An error names the file, the line and column where the key or value at fault is written (a
    missing key: where its mapping is), and the key (`gateway.yaml:4:5: models[0].endpionts:
    unknown key (did you mean 'endpoints'?) ...`), and the command exits non-zero, so it fits a
    CI step or a Kubernetes init container. Old key names that still work are printed as warnings. A file
    that declares no model, with `kubernetes.enabled` false, is an error too (`models: no model is
    declared ...`), as it is at a start or a reload: an empty ConfigMap key or a `models:` block
    lost in an edit would start a gateway that answers every request 404, or, reloaded, remove
    every endpoint of a running one. A key that loads but does nothing is a warning, here and in
    the start's log: a `limits.models` entry that names no model (an alias's or a LoRA adapter's
    requests are limited by their model's name), with `kubernetes.enabled` false. The `OTEL_*`
    variables a start reads for tracing (sampler and its argument, protocol, endpoint, timeouts,
    compression, and with tracing on the exporter's headers and TLS files) are checked as the
    start checks them, in the environment the command runs in: a bad one is an error naming the
    variable (`environment variable OTEL_TRACES_SAMPLER: 'bogus' is not supported ...`).

3. Run it: `python -m gateway --config gateway.yaml`. `--host`, `--port`, `--log-format` and
   `--workers` override `listen.host`, `listen.port`, `server.log_format` and `server.workers`.

4. Change it while it runs: edit the file, then send `SIGHUP` (`kill -HUP <pid>`) or call
   `POST /admin/reload` (with `auth.admin_token`). A reload applies to requests that arrive after
   it: models and endpoints, aliases, strategies and their settings, `pd`, `watchdog`, `breaker`,
   `retry`, `admission`, `lora`, API keys, limits and `kubernetes.models`. Changing `listen`,
   `server`, `upstream`, `health`, `scrape`, `state`, `view`, `status`, `tracing`, `responses`,
   `batch`, the rest of `kubernetes` or a model's `kv_events`, or turning on API keys, limits or
   the admin API on a gateway that started without them, needs a restart: such a file is refused
   as a whole and the running config keeps serving. An invalid file is refused the same way.
   An applied reload is logged as `config reloaded`, with `endpoints_added`, `endpoints_removed`
   and `draining_in_flight`: the requests and prefill legs still running on the removed
   endpoints, which finish there.

Editors that read JSON Schema (VS Code with the YAML extension, and others using
yaml-language-server) complete and check keys as you type:

```console
$ python -m gateway --print-config-schema > switchyard.schema.json
```

and, as the first line of the config file:
`# yaml-language-server: $schema=switchyard.schema.json`.

## Conventions

- **The file** is UTF-8 text of at most 4 MiB (a larger one is refused unread: parsing YAML takes
  seconds a megabyte; a reload parses in a thread, so requests are answered meanwhile).
- **null means the default.** Writing `key: null` is the same as leaving the key out.
- **The file is read as it is written:** no environment variable is expanded (`${{ENGINE_URL}}` is
  those characters, and an error where a URL goes). Secrets come from the environment through the
  keys ending in `_env` (`api_key_env`, `admin_token_env`, `password_env`); a template tool
  (envsubst, Helm) fills anything else in before the gateway reads the file.
- **Durations** are in seconds, in keys ending in `_s`; for most timeouts and intervals, 0 turns
  the limit or the feature off (each key says so). A number is finite: YAML's `.inf` and `.nan`,
  and a number past a double's range (`1.0e+400`), are errors naming the key. YAML reads a
  number with an exponent as one only with a dot and a sign (`1.0e+6`); `1e6` is a string, and an
  error for a key that takes a number.
- **Unknown keys are errors**, not silently ignored: a typo cannot fall back to a default.
  So is a key written twice in one mapping (YAML would keep the last silently). A file that is
  not valid YAML is refused on one line naming where (`gateway.yaml: <yaml>: invalid YAML, line 2,
  column 1: found character that cannot start any token (a tab: YAML indents with spaces)`).
- **YAML anchors, aliases and merge keys** work: `&name` marks a node where it is first written,
  `*name` repeats it, and `<<: *name` lays a mapping under the keys written beside it (those win,
  and are not a key written twice). Since unknown keys are errors, there is no spare key to hold
  templates: set the anchor on the first model or block that uses it. An anchor used inside its
  own node (`aliases: &x [*x]`) is an error that names where it begins; so are aliases that
  repeat more than a million values beyond those the file writes out (anchors each listing the
  one before several times, an alias bomb), naming the top-level key that holds them.
  Mappings and lists nest at most 64 deep (more is an error naming where).
- **Endpoints** are written as a URL string (`http://10.0.0.5:8000`) or as an object
  (`{{url: ..., bootstrap_port: ...}}`), in `endpoints`, and in a roleset's `prefill`, `decode`
  and `combined`. An endpoint's `engine` defaults to its model's.
- **A model's own blocks** (`watchdog`, `pd`, `breaker`, `retry`, `admission`) set only the keys
  they name; the others come from the global block of the same name.
- **Secrets** can stay out of the file: `auth.admin_token_env` and `state.password_env` name an
  environment variable, and `auth.api_keys[].key_sha256` holds a key's hash instead of the key.

## Routing strategies

`routing.strategy`, a model's `strategy` and `lock_strategy`, `lora.strategy` and the
`routing-strategy` request header take one name, or a weighted list of scoring strategies such
as `prefix-cache:2,least-request:1`. The names: {strategies}.

## Examples

The repository's `examples/` folder holds files for the common deployments; the test suite
checks each one against the schema and with `--check-config`.

{examples}

## Deprecated names

These older names still work; each load that meets one logs a warning, and they will be removed
in {removed_in}.

| Old key | Write instead |
|---|---|
{deprecated}

## Reference

Key paths: `models[].name` is the `name` of each entry of the `models` list; `limits.users.<name>.rpm`
is the `rpm` of each entry of the `limits.users` map. "Block" means a mapping of the keys that
follow it.
"""


def _examples() -> str:
    lines = []
    for f in sorted(EXAMPLES.glob("*.yaml")):
        first = f.read_text().splitlines()[0].lstrip("# ").strip()
        lines.append(f"- `examples/{f.name}`: {first}")
    return "\n".join(lines)


def _strategies() -> str:
    from routers.base import RouterContext
    from routers.registry import default_registry
    names = default_registry(RouterContext()).names()
    return ", ".join(f"`{n}`" for n in names)


def markdown(schema: dict[str, Any] | None = None) -> str:
    walk = Walk(schema)
    minimal = (EXAMPLES / "minimal.yaml").read_text() if (EXAMPLES / "minimal.yaml").exists() else ""
    minimal = "\n".join(line for line in minimal.splitlines() if not line.startswith("#")).strip()
    deprecated = [f"| `upstream.{RETRY_FLAG}: false` | `retry.enabled: false` |"]
    deprecated += [f"| `pd.{k}` (also in a model's `pd`) | `pd.{e}.{k}` |" for k, e in MOVED_PD_KEYS.items()]
    out = [INTRO.format(minimal=textwrap.indent(minimal, "    "), strategies=_strategies(),
                        examples=_examples(), removed_in=REMOVED_IN, deprecated="\n".join(deprecated))]
    for top in walk.keys("Config", ""):
        out.append(f"### {top.name}\n")
        out.append(top.prop["description"] + "\n")
        out.append("| Key | Type | Default | Description |\n|---|---|---|---|")
        for key, shared in walk.rows(top)[1:]:       # the block itself is the heading
            out.append(_row(walk, key, shared))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _row(walk: Walk, key: Key, shared: str | None) -> str:
    p = key.prop
    desc = p["description"]
    if shared is not None:
        desc += f" Same keys as `{shared}`."
    if key.required:
        default = "required"
    elif "default" not in p:
        default = "—"
    elif walk.block(p) and walk.block(p)[0] == "" and isinstance(p["default"], dict):
        default = "see below" if shared is None else f"as `{shared}`"
    else:
        default = f"`{_yaml_value(p['default'])}`"
    return f"| `{key.path}` | {_cell(walk.type_text(p))} | {_cell(default)} | {_cell(desc)} |"


# -- examples/full.yaml ------------------------------------------------------------------------

FULL_HEADER = """\
# Every key, at its default (generated: python -m gateway.config.reference --full-example).
# Lists and maps hold one example entry so that their entries' keys show; keys without a
# default there carry a placeholder (a model name, a URL). Blocks a model may lay over the
# global ones (watchdog, pd, breaker, retry, admission) are null, meaning: the global block.
# Each key's comment is its description; docs/configuration.md has the same, with types.
"""


def full_yaml(schema: dict[str, Any] | None = None) -> str:
    walk = Walk(schema)
    lines: list[str] = FULL_HEADER.splitlines()
    for key in walk.keys("Config", ""):
        _emit(walk, key, 0, lines, item=False)
    return "\n".join(lines) + "\n"


def _comment(text: str, indent: int) -> list[str]:
    pad = " " * indent
    return [f"{pad}# {line}" for line in textwrap.wrap(text, 100 - indent - 2, break_on_hyphens=False)]


def _emit(walk: Walk, key: Key, indent: int, lines: list[str], item: bool) -> None:
    """Write ``key`` at ``indent``; ``item``: the first key of a list entry (after ``- ``)."""
    pad = " " * indent
    lead = pad[:-2] + "- " if item else pad
    p = key.prop
    if p.get("deprecated"):
        return                  # old names are listed in docs/configuration.md, not suggested here
    if not lines[-1].endswith(":"):
        lines.append("")
    lines.extend(_comment(p["description"], indent))
    found = walk.block(p)
    if key.path in PLACEHOLDERS:
        lines.append(f"{lead}{key.name}: {_yaml_value(PLACEHOLDERS[key.path])}")
        return
    shared = found is not None and walk.home[found[1]] != key.path + found[0]
    if found is None or shared or key.path in NOT_EXPANDED:
        value = p.get("default")
        if shared and found[0] == "" or key.path in NOT_EXPANDED:
            value = None
        if found is not None and found[0] != "":
            value = p.get("default", [] if found[0] == "[]" else {})
        lines.append(f"{lead}{key.name}: {_yaml_value(value)}")
        return
    suffix, def_name = found
    lines.append(f"{lead}{key.name}:")
    children = walk.keys(def_name, key.path + suffix)
    if suffix == "":
        for sub in children:
            _emit(walk, sub, indent + 2, lines, item=False)
    elif suffix == "[]":
        for i, sub in enumerate(children):
            _emit(walk, sub, indent + 4, lines, item=i == 0)
    else:
        lines.append(f"{pad}  {ENTRY_NAMES[key.path]}:")
        for sub in children:
            _emit(walk, sub, indent + 4, lines, item=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.config.reference",
                                description="Print the configuration reference (Markdown) or, with "
                                            "--full-example, a config file with every key at its default.")
    p.add_argument("--full-example", action="store_true")
    args = p.parse_args(argv)
    sys.stdout.write(full_yaml() if args.full_example else markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
