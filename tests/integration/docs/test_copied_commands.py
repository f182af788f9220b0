"""What a newcomer copies from the README and the manual works as written: each YAML block passes
``--check-config`` (the whole loader: an alias's targets, a roleset's roles, ... not only the
schema), a fragment wrapped in the least config that makes it whole; each ``python -m
gateway.admin_cli`` line is one the CLI parses; each ``make`` target is one the Makefile has;
each ``python -m`` module is one the repository holds; and the error the README quotes for a
wrong URL is the one ``--check-config`` prints.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml

from enginesim.tiny_tokenizer import TINY_DIR
from gateway.__main__ import main

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
# the least endpoint a model fragment gets, where it shows none
ENDPOINTS = ["http://127.0.0.1:8000"]


def _manual() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _yaml_blocks(markdown: str) -> list[tuple[int, str]]:
    return [(markdown[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```ya?ml\n(.*?)^```", markdown, re.S | re.M)]


def _key_sets() -> tuple[set[str], set[str]]:
    from gateway.config.json_schema import config_schema

    defs = config_schema()["$defs"]
    return set(defs["Config"]["properties"]), set(defs["ModelConfig"]["properties"])


def _placeholders(node: object, env: set[str]) -> object:
    """The block with what stands for a deployment's own files and secrets made real here: a
    tokenizer directory is the repository's tiny tokenizer, a ``key_sha256`` written as
    ``<...>`` a sha256, and each ``*_env`` variable named is noted, to be set."""
    if isinstance(node, list):
        return [_placeholders(x, env) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "tokenizer" and isinstance(v, str):
            v = str(TINY_DIR)
        elif k == "key_sha256" and isinstance(v, str) and v.startswith("<"):
            v = "0" * 64
        elif k.endswith("_env") and isinstance(v, str):
            env.add(v)
        out[k] = _placeholders(v, env)
    return out


def _whole(data: dict, top: set[str], model_keys: set[str]) -> dict | None:
    """The least config that makes a block whole: a model's keys shown alone become a model with
    a name, an engine and an endpoint; a config without models gets one (or the ones its aliases
    name); a model shown without endpoints or rolesets gets an endpoint. A block that declares its
    models is taken as it is: what it says of them must hold on its own. None: not a config."""
    if set(data) <= top:
        out = dict(data)
        kube = bool((out.get("kubernetes") or {}).get("enabled"))
        if "models" not in out:
            names = [t["model"] for a in out.get("aliases") or () for t in a.get("targets") or ()]
            names += list((out.get("limits") or {}).get("models") or {})
            out["models"] = [] if kube else [{"name": n, "engine": "vllm", "endpoints": ENDPOINTS}
                                            for n in dict.fromkeys(names or ["m"])]
        elif not kube:
            out["models"] = [m if m.get("endpoints") or m.get("rolesets") else {**m, "endpoints": ENDPOINTS}
                             for m in out["models"]]
        return out
    if set(data) <= model_keys:
        model = {"name": "m", "engine": "vllm", **data}
        if not model.get("endpoints") and not model.get("rolesets"):
            model["endpoints"] = ENDPOINTS
        if "tokenizer" not in model and ("kv_events" in model or any(
                isinstance(e, dict) and "kv_events" in e for e in model.get("endpoints") or ())):
            model["tokenizer"] = str(TINY_DIR)      # shown on the model the block is part of
        return {"models": [model]}
    return None


def test_every_config_block_of_the_manual_passes_check_config(tmp_path, capsys, monkeypatch):
    """Beyond the schema (checked in test_docs_build.py): the loader's own checks, as a reader
    who copies a block into switchyard.yaml meets them."""
    top, model_keys = _key_sets()
    wrong = []
    n = 0
    for page in _manual():
        for line, block in _yaml_blocks(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{line}"
            data = yaml.safe_load(block)
            env: set[str] = set()
            whole = _whole(_placeholders(data, env), top, model_keys) if isinstance(data, dict) else None
            if whole is None:
                wrong.append(f"{where}: neither a config nor a model's keys")
                continue
            for name in env:
                monkeypatch.setenv(name, "placeholder-secret")
            path = tmp_path / f"block{n}.yaml"
            n += 1
            path.write_text(yaml.safe_dump(whole, sort_keys=False), encoding="utf-8")
            rc = main(["--check-config", str(path)])
            said = capsys.readouterr()
            if rc != 0 or said.err:
                wrong.append(f"{where}: {said.err.strip().replace(str(path), 'switchyard.yaml')}")
    assert n > 20
    assert not wrong, "config blocks of the manual --check-config refuses or warns about:\n" + "\n".join(wrong)


def test_the_wrapper_completes_fragments_and_keeps_whole_configs():
    top, model_keys = _key_sets()
    assert _whole({"kv_events": {"enabled": True}}, top, model_keys) == {
        "models": [{"name": "m", "engine": "vllm", "kv_events": {"enabled": True}, "endpoints": ENDPOINTS,
                    "tokenizer": str(TINY_DIR)}]}
    aliased = _whole({"aliases": [{"name": "c", "targets": [{"model": "a"}, {"model": "b"}]}]}, top, model_keys)
    assert [m["name"] for m in aliased["models"]] == ["a", "b"]
    declared = {"models": [{"name": "a", "endpoints": ["http://x:1"]}], "aliases": [{"name": "c", "targets": [{"model": "b"}]}]}
    assert _whole(declared, top, model_keys) == declared
    assert _whole({"models": [{"name": "a", "migration_limit": 2}]}, top, model_keys)["models"][0]["endpoints"] == ENDPOINTS
    assert _whole({"nope": 1}, top, model_keys) is None
    assert [m["name"] for m in _whole({"limits": {"models": {"x": {"rps": 1}}}}, top, model_keys)["models"]] == ["x"]
    assert _whole({"endpoints": [{"url": "http://x:1", "kv_events": {"port": 1}}]}, top, model_keys)["models"][0]["tokenizer"] == str(TINY_DIR)
    env: set[str] = set()
    assert _placeholders({"auth": {"admin_token_env": "T"}, "models": [{"tokenizer": "/x"}]}, env)["models"][0]["tokenizer"] == str(TINY_DIR)
    assert env == {"T"}


# --- command lines ---------------------------------------------------------------------------

def _command_lines(text: str, program: str) -> list[tuple[int, str]]:
    """Each ``python -m <program> ...`` command of a page (continuation lines joined), up to a
    backtick, a comment or a line's end, with its line."""
    out = []
    for m in re.finditer(rf"python3? -m {re.escape(program)}(?![\w.])((?:\\\n|[^`\n#])*)", text):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1).replace("\\\n", " ").strip()))
    return out


def test_every_admin_cli_command_of_the_manual_is_one_the_cli_parses():
    """`python -m gateway.admin_cli users create carol --rpm 60 ...` as tenancy.md writes it: its
    subcommands and flags are the CLI's, so one renamed there is renamed where a reader copies it
    (the CLI's own docstring, its usage, included)."""
    from gateway.admin_cli import _parser

    docstring = (ROOT / "gateway" / "admin_cli.py").read_text(encoding="utf-8").split('"""')[1]
    texts = [(page.relative_to(ROOT), page.read_text(encoding="utf-8")) for page in _manual()]
    seen, wrong = 0, []
    for page, text in [*texts, (Path("gateway/admin_cli.py"), docstring)]:
        for line, args in _command_lines(text, "gateway.admin_cli"):
            # a placeholder (<id>, ID) stands for an argument; [--url URL] and a | b alternatives are usage
            args = re.sub(r"\[[^\]]*\]", "", args).split("|")[0].replace("<id>", "ID")
            if not args.strip():
                continue
            seen += 1
            try:
                _parser().parse_args(shlex.split(args))
            except SystemExit:
                wrong.append(f"{page}:{line}: python -m gateway.admin_cli {args}")
    assert seen >= 6
    assert not wrong, "admin CLI commands the CLI does not take:\n" + "\n".join(wrong)


def _make_targets(text: str) -> list[tuple[int, str]]:
    """The ``make <target>`` of the command blocks of a page (a line that starts with it, or a
    ``VAR=... make <target>``), with their lines."""
    out = []
    for m in re.finditer(r"^```(?:sh|bash|console)?\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, m.start()) + 2
        for i, row in enumerate(m.group(1).splitlines()):
            if t := re.match(r"^(?:\$ )?(?:[A-Z_]+=\S+ )*make ([a-z][\w-]*)", row):
                out.append((first + i, t.group(1)))
    return out


def test_every_make_target_of_the_manual_is_in_the_makefile():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    pages = [*_manual(), ROOT / "bench" / "README.md", ROOT / "enginesim" / "README.md"]
    named = [(page, line, t) for page in pages for line, t in _make_targets(page.read_text(encoding="utf-8"))]
    assert {"demo", "test", "lint"} <= {t for *_, t in named}
    wrong = [f"{page.relative_to(ROOT)}:{line}: make {t}" for page, line, t in named if t not in targets]
    assert not wrong, "make targets the Makefile does not have:\n" + "\n".join(wrong)


def test_every_python_module_the_manual_runs_is_there():
    """`python -m bench.routing ...`, `python -m gateway.config.reference ...`: a module moved or
    renamed is moved where a reader runs it."""
    pages = [*_manual(), ROOT / "bench" / "README.md", ROOT / "enginesim" / "README.md",
             *sorted((ROOT / "examples").glob("*.yaml"))]
    named = {(page, text.count("\n", 0, m.start()) + 1, m.group(1))
             for page in pages for text in [page.read_text(encoding="utf-8")]
             for m in re.finditer(r"python3? -m ([a-z_][\w.]*[a-z_])", text)}
    assert any(mod == "bench.routing" for *_, mod in named)
    wrong = []
    for page, line, mod in sorted(named):
        if mod == "pytest":
            continue
        head = mod.split(".")[0]
        found = (ROOT / head).is_dir() and importlib.util.find_spec(mod) is not None
        if not found:
            wrong.append(f"{page.relative_to(ROOT)}:{line}: python -m {mod}")
    assert not wrong, "modules the manual runs that the repository does not have:\n" + "\n".join(wrong)


def test_the_check_config_error_the_readme_quotes_is_the_one_printed(tmp_path, capsys):
    """README: errors "name the file, the place in it (row:column) and the key path (`switchyard.yaml:6:9:
    models[0].endpoints[1].url: must be an http(s):// URL`)"; the home page quotes the same line."""
    quoted = re.search(r"\(`(switchyard\.yaml:6:9:\s+models\[0\]\.endpoints\[1\]\.url: must\s+be\s+an[^`]*)`\)",
                       (ROOT / "README.md").read_text(encoding="utf-8"))
    assert quoted, "the README no longer quotes the error"
    quoted_text = re.sub(r"\s+", " ", quoted.group(1))
    assert quoted_text in re.sub(r"\s+", " ", (ROOT / "docs" / "index.md").read_text(encoding="utf-8"))
    path = tmp_path / "switchyard.yaml"
    path.write_text("models:\n  - name: llama-8b\n    engine: vllm\n    endpoints:\n"
                    "      - http://10.0.0.5:8000\n      - 10.0.0.6:8000\n", encoding="utf-8")
    assert main(["--check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6:9: models[0].endpoints[1].url: must be an http(s):// URL" in err, err
    assert quoted_text.startswith("switchyard.yaml:6:9: models[0].endpoints[1].url: must be an http(s):// URL")


def test_the_demo_banner_shows_a_continuation_its_lines_run_in_order_can_see():
    """The banner's lines are run top to bottom. Its breakers section leaves :8102's breaker open
    (ejected for base_ejection_s, 10 s), so a continuation section after it sends every stream to
    :8101 and no stream is continued; and streams sent one after the other each find both
    replicas idle, so least-request may put none of them on the replica that drops them. The
    continuation comes first, its streams sent at once (least-request spreads them)."""
    from gateway.demo import BANNER

    migration = BANNER.index("Mid-stream continuation")
    breakers = BANNER.index("Breakers and retries")
    assert migration < breakers, "the continuation section runs after the breakers opened :8102's"
    section = BANNER[migration:BANNER.index("\n\n", migration)]
    assert re.search(r"for i in [^;]*; do .*?& done; wait", section, re.S), f"the streams are sent one after another:\n{section}"


def test_every_flag_of_the_gateway_cli_is_in_the_readme_and_the_manual(capsys):
    """The other way from the flags check of test_docs_build.py: what `python -m gateway --help`
    lists, a reader finds in the README and in the manual (a flag added to the parser is written
    up where a newcomer looks)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", capsys.readouterr().out)) - {"--help"}
    assert {"--config", "--check-config", "--workers"} <= flags
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    manual = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    unwritten = [f"{flag}: not in {where}" for flag in sorted(flags)
                 for where, text in (("README.md", readme), ("docs/", manual))
                 if not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert not unwritten, "flags of python -m gateway the README or the manual do not name:\n" + "\n".join(unwritten)


def _weighted_lists(text: str) -> list[tuple[int, str]]:
    """The ``a:N,b:M`` strategy lists a page gives, with their lines."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0))
            for m in re.finditer(r"(?<![\w-])[a-z][a-z-]*:\d+(?:, ?[a-z][a-z-]*(?::\d+)?)+", text)]


def test_every_weighted_list_of_the_manual_is_one_the_gateway_takes():
    """A weighted list shown as an example (a config comment, a benchmark's row, the prose) is one
    the config and the routing-strategy header take; lists of names that are not strategies (llm-d's
    ``prefix:3,queue:2,kv:2``, the simulator's engine mix) are another tool's."""
    from routers.base import RouterContext
    from routers.registry import StrategyError, default_registry

    registry = default_registry(RouterContext())
    known = set(registry.names())
    seen, wrong = 0, []
    for page in _manual():
        for line, spec in _weighted_lists(page.read_text(encoding="utf-8")):
            names = {item.split(":")[0].strip() for item in spec.split(",")}
            if not names & known:
                continue
            seen += 1
            try:
                registry.validate(spec)
            except StrategyError as e:
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {spec}: {e}")
    assert seen >= 5
    assert not wrong, "weighted lists of the manual the gateway refuses:\n" + "\n".join(wrong)
    assert _weighted_lists('x "least-request:2,random:1" y prefix:3,queue:2') == [(1, "least-request:2,random:1"),
                                                                                (1, "prefix:3,queue:2")]
