"""The import graph of the gateway's packages, read statically.

Every ``import`` / ``from ... import`` in a file counts, wherever it is: at module level, under
``if TYPE_CHECKING:``, inside a function or a ``try``. A cycle that only exists for the type
checker, or only once a function runs, is still a cycle for a reader and for the next refactor.

The graph is module level (``a.b`` imports ``a.c``), restricted to our own packages. Importing a
package's submodule does not count as importing the package's ``__init__``; ``from pkg import x``
counts as importing ``pkg.x`` when that is a module, else ``pkg`` itself.

"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "routers", "handlers", "k8s", "enginesim")
GATEWAY_SIDE = ("gateway", "routers", "handlers", "k8s")

@dataclass(frozen=True)
class Import:
    """One resolved import statement: ``src`` imports ``dst`` (and from it ``names``, if any)."""

    src: str
    dst: str
    names: tuple[str, ...]
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of our packages."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = path
    return out


def _in_scope(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _known(name: str) -> str | None:
    """The module ``name`` refers to: itself, or its longest prefix that is one of our modules."""
    modules = _sources()
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _resolve_from(src: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module of a ``from X import ...`` (relative imports resolved)."""
    if node.level == 0:
        return node.module
    package = src.split(".") if is_package else src.split(".")[:-1]
    if node.level - 1 > len(package):
        return None
    base = package[:len(package) - (node.level - 1)]
    if node.module:
        base = [*base, *node.module.split(".")]
    return ".".join(base) or None


def _imports_of(src: str, path: Path) -> list[Import]:
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    rel = path.relative_to(ROOT).as_posix()
    is_package = path.name == "__init__.py"
    out: list[Import] = []

    def add(dst: str | None, names: tuple[str, ...], node: ast.stmt) -> None:
        if dst is None or not _in_scope(dst):
            return
        target = _known(dst)
        if target is None:
            return  # a module of ours that does not exist: the import itself fails, not our concern
        statement = " ".join((ast.get_source_segment(text, node) or "").split())  # one line, even if wrapped
        out.append(Import(src, target, names, rel, node.lineno, statement))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, (), node)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(src, is_package, node)
            if base is None:
                continue
            plain: list[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in _sources():
                    add(sub, (), node)  # ``from pkg import module``
                else:
                    plain.append(alias.name)
            if plain:
                add(base, tuple(plain), node)
    return out


@cache
def _all_imports() -> tuple[Import, ...]:
    out: list[Import] = []
    for name, path in _sources().items():
        out.extend(_imports_of(name, path))
    return tuple(out)


def _in_packages(module: str, packages: tuple[str, ...]) -> bool:
    return module.split(".")[0] in packages


def _graph(packages: tuple[str, ...]) -> dict[str, dict[str, list[Import]]]:
    """src -> dst -> the import statements behind that edge, both ends inside ``packages``."""
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in _sources() if _in_packages(m, packages)}
    for imp in _all_imports():
        if imp.src != imp.dst and _in_packages(imp.src, packages) and _in_packages(imp.dst, packages):
            graph[imp.src].setdefault(imp.dst, []).append(imp)
    return graph


def _components(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _shortest_cycle(graph: dict[str, dict[str, list[Import]]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of a component: [a, b, ..., a]."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def _cycle_report(packages: tuple[str, ...]) -> str:
    """Every import cycle among ``packages``, each with the import lines that close it; "" if none."""
    graph = _graph(packages)
    parts = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component)
        lines = [f"cycle: {' -> '.join(cycle)}"]
        for src, dst in zip(cycle, cycle[1:], strict=False):
            lines.extend(f"    {imp}" for imp in graph[src][dst])
        if len(component) > len(cycle) - 1:
            lines.append(f"  the same knot also holds {', '.join(sorted(set(component) - set(cycle)))}; "
                         "its other imports:")
        on_cycle = set(zip(cycle, cycle[1:], strict=False))
        for src in component:
            for dst in sorted(set(graph[src]) & set(component)):
                if (src, dst) not in on_cycle:
                    lines.extend(f"    {src} -> {dst}  {imp}" for imp in graph[src][dst])
        parts.append("\n".join(lines))
    return "\n".join(parts)


def _fail_if(found: list[Import] | list[str] | str, what: str) -> None:
    """Fail with ``what`` and the offending cycles / import lines, each on its own line."""
    if not found:
        return
    body = found if isinstance(found, str) else "\n".join(f"    {x}" for x in found)
    pytest.fail(f"{what}:\n{body}", pytrace=False)


# -- the graph reader itself ------------------------------------------------------------------------


def test_reader_sees_guarded_local_and_relative_imports(tmp_path, monkeypatch):
    """TYPE_CHECKING blocks, function bodies and relative imports all produce edges."""
    pkg = tmp_path / "enginesim"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from enginesim.b import B\n"
        "def f():\n"
        "    from . import c\n"
        "    import enginesim.d.e\n")
    (pkg / "b.py").write_text("B = 1\n")
    (pkg / "c.py").write_text("from . import b as bee\n")
    (pkg / "d").mkdir()
    (pkg / "d" / "__init__.py").write_text("from . import e\nfrom .e import *\n")
    (pkg / "d" / "e.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("enginesim",))
    _sources.cache_clear()
    try:
        edges = {(i.src, i.dst) for name, path in _sources().items() for i in _imports_of(name, path)}
    finally:
        _sources.cache_clear()
    assert edges == {("enginesim", "enginesim.b"), ("enginesim.a", "enginesim.b"),
                     ("enginesim.a", "enginesim.c"), ("enginesim.a", "enginesim.d.e"),
                     ("enginesim.c", "enginesim.b"), ("enginesim.d", "enginesim.d.e")}


def test_reader_sees_the_real_packages():
    """Guard against a vacuous pass: every package is found and known edges are there."""
    modules = _sources()
    for pkg in PACKAGES:
        assert pkg in modules, f"{pkg}/__init__.py not found under {ROOT}"
    edges = {(i.src, i.dst) for i in _all_imports()}
    assert ("enginesim.server", "enginesim.engine") in edges
    assert any(_in_packages(src, ("gateway",)) and _in_packages(dst, ("gateway",)) for src, dst in edges)


def test_reader_reports_cycles_with_their_import_lines():
    graph = {"x.a": {"x.b": []}, "x.b": {"x.c": []}, "x.c": {"x.a": []}, "x.d": {"x.a": []}}
    assert _components(graph) == [["x.a", "x.b", "x.c"]]
    assert _shortest_cycle(graph, ["x.a", "x.b", "x.c"]) == ["x.a", "x.b", "x.c", "x.a"]
    assert _shortest_cycle({"x.a": {"x.b": []}, "x.b": {"x.a": []}}, ["x.a", "x.b"]) == ["x.a", "x.b", "x.a"]


# -- enginesim ------------------------------------------------------------------------------------


def test_enginesim_has_no_import_cycle():
    _fail_if(_cycle_report(("enginesim",)), "import cycle inside enginesim (TYPE_CHECKING and local imports count)")


def test_enginesim_imports_nothing_from_the_gateway():
    found = [i for i in _all_imports()
             if _in_packages(i.src, ("enginesim",)) and _in_packages(i.dst, GATEWAY_SIDE)]
    _fail_if(found, "enginesim must stand alone; these imports reach into " +
                                 "/".join(GATEWAY_SIDE))


# -- the gateway side ------------------------------------------------------


def test_gateway_side_has_no_import_cycle():
    _fail_if(_cycle_report(GATEWAY_SIDE), "import cycle among gateway/routers/handlers/k8s")


ROUTERS_MAY_IMPORT = ("gateway.endpoints", "gateway.request")


def test_routers_import_only_endpoints_and_request_from_gateway():
    found = [i for i in _all_imports() if _in_packages(i.src, ("routers",))
             and _in_packages(i.dst, ("gateway",)) and i.dst not in ROUTERS_MAY_IMPORT]
    _fail_if(found, f"routers may import only {', '.join(ROUTERS_MAY_IMPORT)} "
                                 "from gateway; these import more")


PIPELINE_IMPORTERS = ("gateway.server.app", "gateway.pipeline.pipeline")


def test_only_the_app_imports_the_pipeline():
    found = [i for i in _all_imports() if i.dst == "gateway.pipeline.pipeline" and i.src not in PIPELINE_IMPORTERS]
    _fail_if(found, "only gateway/server/app.py may import gateway.pipeline.pipeline; these do too")


# -- the floors of the gateway's packages ----------------------------------------------------------
#
# Every module of the gateway side stands on a floor, and imports only from its own floor or below:
#   0 domain     what routers and handlers may see: errors, the parsed request, endpoints, API paths;
#                the routers and the engine handlers themselves
#   1 parts      the collaborators a request uses: config, state, upstream, kv, resilience, lora, tenants,
#                admission, apis, aliases, observability's recorders, the shared routing view, k8s, and what one request carries
#                (pipeline.context, ledger, sse) plus the small lifecycle pieces the parts share
#   2 request    the request's script: the pipeline, its relay, routing and continuation, and P/D
#   3 server     what wires and serves it all: the app, reload, edge, admin, workers, the status page,
#                the demo and the command line
# A module is placed by its longest listed prefix.

FLOORS: dict[str, int] = {
    "routers": 0, "handlers": 0,
    "gateway.errors": 0, "gateway.request": 0, "gateway.endpoints": 0, "gateway.apis.paths": 0,
    "k8s": 1,
    "gateway.config": 1, "gateway.upstream": 1, "gateway.kv": 1, "gateway.resilience": 1, "gateway.lora": 1,
    "gateway.tenants": 1, "gateway.admission": 1, "gateway.apis": 1, "gateway.aliases": 1, "gateway.state": 1,
    "gateway.observability": 1, "gateway.view": 1, "gateway.batch": 1,
    "gateway.pipeline.context": 1, "gateway.pipeline.ledger": 1, "gateway.pipeline.sse": 1,
    "gateway.server.lifecycle": 1, "gateway.server.periodic": 1, "gateway.server.rundir": 1,
    "gateway.pipeline": 2, "gateway.pd": 2,
    "gateway.server": 3, "gateway.observability.status": 3, "gateway.observability.status_http": 3,
    "gateway.demo": 3, "gateway.__main__": 3, "gateway.admin_cli": 3, "gateway": 3,
}
FLOOR_NAMES = ("domain", "parts", "request", "server")


def _floor(module: str) -> int:
    parts = module.split(".")
    while parts:
        floor = FLOORS.get(".".join(parts))
        if floor is not None:
            return floor
        parts.pop()
    raise KeyError(module)


def test_every_gateway_module_has_a_floor():
    missing = []
    for module in _sources():
        if _in_packages(module, GATEWAY_SIDE):
            try:
                _floor(module)
            except KeyError:
                missing.append(module)
    _fail_if(missing, "these modules stand on no floor; add their package to FLOORS")


def test_imports_point_down_the_floors():
    found = [f"{i}  ({FLOOR_NAMES[_floor(i.src)]} imports {FLOOR_NAMES[_floor(i.dst)]})" for i in _all_imports()
             if _in_packages(i.src, GATEWAY_SIDE) and _in_packages(i.dst, GATEWAY_SIDE)
             and _floor(i.dst) > _floor(i.src)]
    _fail_if(found, "an import points up the floors (domain < parts < request < server)")


# -- engine names stay in the engine-specific code -----------------------

# Where comparing against "vllm"/"sglang" is the point: engine adapters, config parsing, the
# engine-metrics translation, discovery, and the simulator itself.
ENGINE_NAME_ALLOWED = ("handlers/", "gateway/config/schema.py", "gateway/upstream/engine_metrics.py", "k8s/", "enginesim/")

_NAME = r"""(?:["'](?:vllm|sglang)["'])"""
ENGINE_NAME_PATTERNS = re.compile("|".join([
    rf"(?:==|!=)\s*{_NAME}",  # x == "vllm"
    rf"{_NAME}\s*(?:==|!=)",  # "sglang" != x
    rf"\bin\s*[(\[{{][^)\]}}]*{_NAME}",  # x in ("vllm", ...), x not in {"sglang"}
    r"\.engine(?:_type|_name)?\s*(?:==|!=|\bin\b|\bnot\s+in\b)",  # w.engine == ..., cfg.engine in ...
    rf"\bcase\s+{_NAME}",  # match engine: case "vllm":
]))


def _code_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, line, line without its comment) for every line of a Python source."""
    lines = text.splitlines()
    code = list(lines)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            code[row - 1] = code[row - 1][:col]
    return [(n, line, stripped) for n, (line, stripped) in enumerate(zip(lines, code, strict=True), start=1)]


def _engine_name_comparisons() -> list[str]:
    found = []
    for path in _sources().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ENGINE_NAME_ALLOWED):
            continue
        for number, line, code in _code_lines(path.read_text()):
            if ENGINE_NAME_PATTERNS.search(code):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_engine_name_pattern_catches_the_usual_spellings():
    hits = ['if w.engine == "sglang":', "if kind != 'vllm':", 'if e in ("vllm", "sglang"):',
            'if "sglang" == x:', "return cfg.engine in ENGINES", 'case "vllm":']
    misses = ['ENGINES = ("vllm", "sglang")', 'name = "vllm"', "engine = choose(w)",
              "x = 1  # w.engine == 'vllm'", "# if kind != 'vllm':", 'label = "#" if kind else "vllm"']
    assert all(ENGINE_NAME_PATTERNS.search(s) for s in hits)
    code = [stripped for _, _, stripped in _code_lines("\n".join(misses) + "\n")]
    assert not any(ENGINE_NAME_PATTERNS.search(c) for c in code), code


def test_no_engine_name_comparisons_outside_engine_code():
    found = _engine_name_comparisons()
    _fail_if(found, "compare engine names only in " + ", ".join(ENGINE_NAME_ALLOWED) +
                                 "; dispatch through the engine handler elsewhere")


def test_floors_place_modules_by_their_longest_prefix():
    assert [_floor(m) for m in ("routers.base", "gateway.kv.index", "gateway.pipeline.context",
                                "gateway.pipeline.relay", "gateway.observability.metrics",
                                "gateway.observability.status", "gateway.server.app")] == [0, 1, 1, 2, 1, 3, 3]
