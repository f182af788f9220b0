"""The manual builds without a warning, the READMEs' relative links lead somewhere, and the config
snippets a reader copies from either are ones the gateway takes without a complaint.

``mkdocs build --strict`` fails on a broken link, a missing anchor or a page left out of the nav
(see ``validation`` in mkdocs.yml), so a renamed heading or a moved page fails the suite rather
than a reader. The READMEs are read on GitHub, not through MkDocs: their relative links are checked
here against the files of the repository (and the headings of the Markdown files they name).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import aiohttp
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc extension (and GitHub, for these headings) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(markdown: str) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.add(_slug(m.group(1)))
    return out


def _links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)     # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)                      # nor does inline code
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


@pytest.mark.parametrize("name", ["README.md", "enginesim/README.md", "bench/README.md"])
def test_readme_relative_links_resolve(name):
    """The READMEs read on GitHub: each relative link from the file's own folder."""
    page = ROOT / name
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):            # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {path or name}")
    assert not broken, f"{name} links that lead nowhere:\n" + "\n".join(broken)


def test_readme_link_checker_sees_links_and_anchors():
    md = "# A `b` c/d\n\n[x](docs/a.md#e) `[y](no.md)` ![p](pic.png)\n```\n[z](no.md)\n```\n"
    assert _links(md) == ["docs/a.md#e", "pic.png"]
    assert _anchors(md) == {"a-b-cd"}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None and os.environ.get("CI") != "true",
                    reason="mkdocs is not installed (the dev extra); CI always builds the site")
def test_docs_build_strict(tmp_path):
    # Built from a copy, so that a checkout without the generated configuration reference (it is
    # written from the config schema) still checks every other page, and nothing is written here.
    work = tmp_path / "src"
    shutil.copytree(ROOT / "docs", work / "docs")
    shutil.copy(ROOT / "mkdocs.yml", work / "mkdocs.yml")
    config = work / "docs" / "configuration.md"
    if not config.exists():
        config.write_text("# Configuration\n\nGenerated from the config schema.\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=work, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{output}"


# --- the manual's config snippets ------------------------------------------------------------------

def _yaml_blocks(markdown: str) -> list[tuple[int, str]]:
    """Each ```yaml block of a page with the line it starts on."""
    return [(markdown[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```ya?ml\n(.*?)^```", markdown, re.S | re.M)]


def _snippet_validator():
    """The config's JSON Schema, with a key the schema marks ``deprecated`` counted as an error: a
    snippet a reader copies should not earn a deprecation warning from ``--check-config``."""
    import jsonschema

    from gateway.config.json_schema import config_schema

    def deprecated(validator, flag, instance, schema):
        if flag:
            yield jsonschema.ValidationError("deprecated: " + schema.get("description", ""))

    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"deprecated": deprecated})
    return cls, config_schema()


def _snippet_errors(cls, schema: dict, data: object) -> list[str]:
    """What is wrong with ``data``, each error at the key it is about (the deepest of an anyOf's)."""
    out = []
    for e in cls(schema).iter_errors(data):
        while e.context:          # an anyOf (a block or null): the branch that got furthest in
            e = max(e.context, key=lambda c: (len(c.absolute_path), c.validator != "type"))
        out.append(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}")
    return out


def test_config_snippets_in_the_manual_are_valid_and_current():
    """Every YAML block of the README and docs/ is a config (or a model's part of one, for the
    blocks that show a model's keys alone) the schema accepts, with no key it marks deprecated."""
    import yaml

    cls, schema = _snippet_validator()
    defs = schema["$defs"]
    # a model's keys shown alone (an endpoint's kv_events, say) need not repeat its name
    schema["$defs"]["ModelPart"] = {k: v for k, v in defs["ModelConfig"].items() if k != "required"}
    kinds = {name: {**schema, "$ref": f"#/$defs/{name}"} for name in ("Config", "ModelPart")}
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line, block in _yaml_blocks(page.read_text(encoding="utf-8")):
            where = f"{page.relative_to(ROOT)}:{line}"
            data = yaml.safe_load(block)
            kind = next((k for k in kinds if isinstance(data, dict) and set(data) <= set(defs[k]["properties"])),
                        None)
            if kind is None:
                wrong.append(f"{where}: neither a config nor a model's keys")
                continue
            wrong += [f"{where}: {error}" for error in _snippet_errors(cls, kinds[kind], data)]
    assert not wrong, "config snippets in the manual that the gateway would refuse or warn about:\n" + "\n".join(wrong)


def test_the_snippet_check_sees_a_deprecated_key_and_a_wrong_value():
    cls, schema = _snippet_validator()
    errors = _snippet_errors(cls, schema, {"upstream": {"retry_on_connect_error": True}, "server": {"workers": "many"}})
    assert len(errors) == 2
    assert any(e.startswith("upstream.retry_on_connect_error: deprecated:") for e in errors), errors
    assert any(e.startswith("server.workers: ") for e in errors), errors


# --- tables ----------------------------------------------------------------------------------------

def _stray_rows(markdown: str) -> list[tuple[int, str]]:
    """Lines outside code blocks that look like a table's rows but belong to no table: a run of
    ``|`` lines that does not start after a blank line with a header row and its delimiter row. A
    paragraph written between two rows of a table ends it, and Markdown (MkDocs, GitHub) renders the
    rows after it as that paragraph's text, pipes and all, without a warning."""
    out = []
    lines = markdown.splitlines()
    fenced = in_table = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced, in_table = not fenced, False
        elif fenced or not line.startswith("|"):
            in_table = False
        elif not in_table:
            in_table = True
            after_blank = i == 0 or not lines[i - 1].strip()
            delimited = i + 1 < len(lines) and re.match(r"^\|?\s*:?-+:?\s*(\||$)", lines[i + 1])
            if not (after_blank and delimited):
                out.append((i + 1, line))
    return out


def test_every_table_row_of_the_manual_is_in_a_table():
    """A row a reader should see in a table (a header of docs/apis.md, a metric) is in one."""
    wrong = [f"{page.relative_to(ROOT)}:{line}: {row[:80]}"
             for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                          ROOT / "enginesim" / "README.md", ROOT / "bench" / "README.md"]
             for line, row in _stray_rows(page.read_text(encoding="utf-8"))]
    assert not wrong, "table rows that render as a paragraph's text:\n" + "\n".join(wrong)


def test_the_table_check_sees_rows_a_paragraph_cut_off():
    md = ("| a | b |\n|---|---|\n| 1 | 2 |\nA note.\n| 3 | 4 |\n\n| c |\n|:--|\n| 5 |\n"
          "```\n| not | a row |\n```\ntext\n| x | y |\n")
    assert _stray_rows(md) == [(5, "| 3 | 4 |"), (14, "| x | y |")]


# --- the architecture page's file map --------------------------------------------------------------

def _file_map() -> dict[str, str]:
    """The rows of the architecture page's table of gateway/: module or package → its job."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return dict(re.findall(r"^\| `(gateway/[^`]*)` \| (.*) \|$", page, re.M))


def test_the_architecture_file_map_matches_the_tree():
    """Every module and package of gateway/ has its row; every file a row names is there."""
    rows = _file_map()
    gateway = ROOT / "gateway"
    present = {f"gateway/{p.name}" for p in gateway.glob("*.py") if p.name != "__init__.py"}
    present |= {f"gateway/{p.name}/" for p in gateway.iterdir()
                if p.is_dir() and not p.name.startswith(("_", "."))}
    assert not present - set(rows), f"parts of gateway/ the architecture page leaves out: {sorted(present - set(rows))}"
    assert not set(rows) - present, f"rows of the architecture page for nothing: {sorted(set(rows) - present)}"
    missing = [f"{row}{name}" for row, job in rows.items() if row.endswith("/")
               for name in re.findall(r"`([\w.]+\.(?:py|html))`", job) if not (ROOT / row / name).exists()]
    assert not missing, f"files the architecture page names that are not there: {missing}"
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:gateway|routers|handlers|k8s|enginesim|tests)/[\w/.]*\.py)`", page))
    assert not [p for p in named if not (ROOT / p).exists()], f"no such file: {[p for p in named if not (ROOT / p).exists()]}"


def test_a_package_row_names_each_of_its_modules_when_it_names_any():
    """A row that lists its package's files (server/, pipeline/, ...) lists them all."""
    for row, job in _file_map().items():
        if not row.endswith("/"):
            continue
        named = set(re.findall(r"`([\w.]+\.py)`", job))
        if not named:
            continue
        modules = {p.name for p in (ROOT / row).glob("*.py") if p.name != "__init__.py"}
        assert modules <= named, f"{row}: the architecture page's row leaves out {sorted(modules - named)}"


# --- the status page's example document ------------------------------------------------------------

def test_the_status_json_example_is_valid_for_its_schema():
    """The observability page's trimmed /status.json is one the schema accepts: a field the
    document gained (or lost) shows in the example too. A ``{"...": ...}`` object stands for the
    same fields as its sibling ``minute``."""
    import json

    import jsonschema

    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    example = json.loads(re.search(r"^```json\n(.*?)^```", page, re.S | re.M).group(1))

    def filled(node):
        if isinstance(node, dict):
            out = {k: filled(v) for k, v in node.items()}
            if isinstance(out.get("window"), dict) and "..." in out["window"]:
                out["window"] = out["minute"]
            return out
        return [filled(x) for x in node] if isinstance(node, list) else node

    schema = json.loads((ROOT / "docs" / "status.schema.json").read_text(encoding="utf-8"))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(filled(example))]
    assert not errors, "docs/observability.md's /status.json example:\n" + "\n".join(errors)


def test_the_architecture_layout_names_every_top_level_folder():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", page, re.S | re.M).group(1)
    listed = set(re.findall(r"^([\w.-]+)/ ", block, re.M))
    tracked = subprocess.run(["git", "ls-tree", "-d", "--name-only", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    folders = {d for d in tracked.stdout.split() if not d.startswith(".")}
    assert listed == folders, f"layout: missing {sorted(folders - listed)}, not there {sorted(listed - folders)}"


# --- names the prose gives ---------------------------------------------------------------------

def _manual() -> list[Path]:
    """The pages a reader reads: the README and the manual (the generated configuration page too)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(markdown: str) -> str:
    """A page without its fenced blocks (commands, configs and outputs are checked elsewhere),
    each left as its blank lines so that the lines keep their numbers."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), markdown, flags=re.S | re.M)


def _named_strategies(markdown: str) -> set[str]:
    """What the prose calls a strategy: "the `x` strategy", "`x` and `y` strategies", "strategy `x`"."""
    text = _prose(markdown)
    out = set()
    for m in re.finditer(r"((?:`[a-z0-9-]+`(?:,|\s+and|\s+or)?\s+)+)strateg(?:y|ies)\b", text):
        out |= set(re.findall(r"`([a-z0-9-]+)`", m.group(1)))
    out |= set(re.findall(r"\bstrateg(?:y|ies),?\s+`([a-z0-9-]+)`", text))
    out |= set(re.findall(r"^routing-strategy: ([a-z0-9-]+)$", markdown, re.M))
    return out


def test_every_strategy_the_manual_names_is_one_the_gateway_has():
    from routers.base import RouterContext
    from routers.registry import default_registry

    known = set(default_registry(RouterContext()).names())
    wrong = [f"{page.relative_to(ROOT)}: `{name}`" for page in _manual()
             for name in sorted(_named_strategies(page.read_text(encoding="utf-8"))) if name not in known]
    assert not wrong, f"strategies the manual names that the gateway does not have (it has {sorted(known)}):\n" + "\n".join(wrong)


def test_the_strategy_check_sees_each_way_of_naming_one():
    md = ("the `pd` strategy; the `slo` and\n`lora` strategies; strategy\n`random`;\n"
          "```\nthe `nope` strategy\n```\nrouting-strategy: least-waiting\n`model` (the strategy's)")
    assert _named_strategies(md) == {"pd", "slo", "lora", "random", "least-waiting"}


def _defined_series() -> set[str]:
    """Every series name the code can export: each ``switchyard_*`` string of the gateway's code
    (a metric's name as its collector is given it), with the names Prometheus derives from it."""
    import ast

    names = set()
    for package in ("gateway", "k8s", "routers", "handlers"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"switchyard_[a-z0-9_]+", node.value):
                    names.add(node.value.removesuffix("_total"))
    return {n + suffix for n in names for suffix in ("", "_total", "_bucket", "_sum", "_count", "_created")}


def _series_named(text: str) -> list[tuple[int, str]]:
    """The ``switchyard_*`` names a page gives, with their lines; ``switchyard_pd_*`` for a family."""
    return [(text[:m.start()].count("\n") + 1, m.group(0))
            for m in re.finditer(r"switchyard_[a-z0-9_]*[a-z0-9](?:_\*)?", text)]


def test_every_metric_the_manual_names_is_one_the_gateway_exports():
    """A metric renamed or removed in the code is renamed or removed in the manual too: a name a
    reader greps /metrics for, or puts in an alert, is one the gateway has."""
    defined = _defined_series()
    pages = [*_manual(), ROOT / "docs" / "status.schema.json", ROOT / "bench" / "README.md",
             ROOT / "enginesim" / "README.md"]
    wrong = []
    for page in pages:
        for line, name in _series_named(page.read_text(encoding="utf-8")):
            ok = any(d.startswith(name[:-1]) for d in defined) if name.endswith("*") else name in defined
            if not ok:
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "metrics the manual names that the gateway does not export:\n" + "\n".join(wrong)


def test_the_metric_check_knows_derived_names_and_families():
    defined = _defined_series()
    assert {"switchyard_requests_total", "switchyard_e2e_request_latency_seconds_bucket",
            "switchyard_kubernetes_requests_total", "switchyard_endpoint_ready"} <= defined
    assert "switchyard_requests" in defined and "switchyard_request_total" not in defined
    assert _series_named("`switchyard_pd_*` and\nswitchyard_x_total.") == [(1, "switchyard_pd_*"), (2, "switchyard_x_total")]


def _calls_naming_a_metric():
    """(file, call) for each call in the code whose first argument is a metric's name
    (``switchyard_…``): where the code creates its metrics, among others."""
    import ast

    for package in ("gateway", "k8s", "routers", "handlers"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)
                        and re.fullmatch(r"switchyard_[a-z0-9_]+", node.args[0].value)):
                    yield path, node


def _metrics_created() -> dict[str, str]:
    """Each metric the code creates (``Counter("switchyard_x", ...)``, ``GaugeMetricFamily(...)``,
    ...), its name without ``_total``, with the file that creates it."""
    import ast

    out = {}
    for path, node in _calls_naming_a_metric():
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func.endswith(("Counter", "Gauge", "Histogram", "Summary", "MetricFamily")):
            out.setdefault(node.args[0].value.removesuffix("_total"), str(path.relative_to(ROOT)))
    return out


def _metrics_listed(markdown: str) -> tuple[set[str], set[str]]:
    """The metrics a page's tables list: the names a row gives whole, with those it gives as a tail
    of the row's first name (``switchyard_engine_running_requests``, ``_waiting_requests``), each
    read as any of the names the tail can end; and the families it gives (``switchyard_pd_*``)."""
    names: set[str] = set()
    families: set[str] = set()
    for row in re.findall(r"^\|(.*)\|$", markdown, re.M):
        whole = re.findall(r"`(switchyard_[a-z0-9_]+)`", row)
        families |= set(re.findall(r"`(switchyard_[a-z0-9_]*)\*`", row))
        names |= {n.removesuffix("_total") for n in whole}
        for tail in re.findall(r"`(_[a-z0-9_]+)`", row.split("|")[0]):
            if whole:
                cuts = [i for i, ch in enumerate(whole[0]) if ch == "_"]
                names |= {(whole[0][:i] + tail).removesuffix("_total") for i in cuts}
    return names, families


def test_every_metric_the_code_creates_is_in_the_observability_tables():
    """docs/observability.md's tables are where a reader looks a metric up: each metric the gateway
    creates is a row there, or falls in a family a row sends to the page that describes it."""
    listed, families = _metrics_listed((ROOT / "docs" / "observability.md").read_text(encoding="utf-8"))
    created = _metrics_created()
    assert len(created) > 100 and "switchyard_requests" in created
    missing = [f"{name} ({path})" for name, path in sorted(created.items())
               if name not in listed and not any((name + "_total").startswith(f) for f in families)]
    assert not missing, "metrics docs/observability.md does not list:\n" + "\n".join(missing)


def test_the_metric_table_check_reads_tails_and_families():
    md = ("| `switchyard_engine_running_requests`, `_waiting_requests` | gauge | `model` |\n"
          "| P/D: `switchyard_pd_*` | | see |\n| `switchyard_a_total` | counter | `_not_a_tail` |\n")
    names, families = _metrics_listed(md)
    assert {"switchyard_engine_running_requests", "switchyard_engine_waiting_requests", "switchyard_a"} <= names
    assert "switchyard_engine_waiting_requests_requests" not in names and families == {"switchyard_pd_"}
    assert not any(n.endswith("_not_a_tail") for n in names)


@pytest.mark.timeout(90)
async def test_every_metric_a_running_gateway_exports_is_in_the_observability_tables(sims, tmp_path):
    """What a scrape of a running gateway shows, with two workers, P/D, streams and errors behind
    it: each family is a row of docs/observability.md's tables (or in a family a row sends on to
    its page), and each series' labels are ones its row gives. The checks above read the code, so
    they miss a metric whose name or labels the code builds (an endpoint's gauges from a table of
    names, ``switchyard_prefix_index_{key}``, the process collector's)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.gateway_process import gateway_process, post_new
    from tests.support.ports import listen_port

    a, b = await sims("vllm", "m"), await sims("vllm", "m")
    prefill, decode = await sims("vllm", "p", role="prefill"), await sims("vllm", "p", role="decode")
    port = listen_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "server: {drain_delay_s: 0, shutdown_grace_s: 5}\n"
                   "models:\n"
                   f"  - {{name: m, engine: vllm, strategy: prefix-cache, endpoints: ['{a.url}', '{b.url}']}}\n"
                   "  - name: p\n    engine: vllm\n"
                   f"    rolesets: [{{name: rs, prefill: ['{prefill.url}'], decode: ['{decode.url}']}}]\n")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with gateway_process(cfg, port, "--workers", "2", ready_workers=2):
        for model, extra, headers, want in (("m", {}, None, 200), ("m", {"stream": True}, None, 200),
                                            ("p", {}, None, 200), ("p", {"stream": True}, None, 200),
                                            ("nope", {}, None, 404), ("m", {}, {"x-sim-fault": "status=503"}, 503)):
            async with aiohttp.ClientSession() as s, \
                    s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": model, **chat, **extra},
                           headers=headers or {}) as r:
                await r.read()
                assert r.status == want, (model, extra, headers)
        status, _, _ = await post_new(port, "/v1/embeddings", {"model": "m", "input": "hi"})
        assert status == 200
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            page = await r.text()
    md = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    listed, families = _metrics_listed(md)
    rows = {m.removesuffix("_total"): (line, labels) for line, metrics, labels in _table_labels(md) for m in metrics}
    exported = [f for f in text_string_to_metric_families(page) if not f.name.endswith("_created")]
    assert {"switchyard_requests", "switchyard_endpoint_ready", "switchyard_pd_pending_decode"} <= {f.name for f in exported}
    wrong = []
    for fam in exported:
        if not fam.name.startswith("switchyard_"):
            if f"`{fam.name}" not in md:
                wrong.append(f"{fam.name}: not named on the page")
            continue
        if fam.name not in listed and not any((fam.name + "_total").startswith(f) for f in families):
            wrong.append(f"{fam.name}: no row")
        elif fam.name in rows:
            line, labels = rows[fam.name]
            seen = {k for s in fam.samples for k in s.labels} - {"le", "quantile"}
            if not seen <= labels:
                wrong.append(f"{fam.name}: exported with {sorted(seen)}, its row (line {line}) gives {sorted(labels)}")
    assert not wrong, "what the gateway exports that docs/observability.md does not describe:\n" + "\n".join(wrong)


def _config_paths() -> tuple[set[str], set[str]]:
    """Every key path of the config (``models.endpoints.url``: lists' ``[]`` left out, a map's
    entry as ``*``), and the names of the keys that hold a block."""
    from gateway.config.json_schema import config_schema

    schema = config_schema()
    defs = schema["$defs"]
    paths: set[str] = set()
    blocks: set[str] = set()

    def shapes(s: dict) -> list[dict]:
        s = defs[s["$ref"].rsplit("/", 1)[1]] if "$ref" in s else s
        return [b for x in s["anyOf"] for b in shapes(x)] if "anyOf" in s else [s]

    def walk(s: dict, prefix: str, depth: int) -> None:
        for shape in shapes(s):
            for key, sub in shape.get("properties", {}).items() if depth < 8 else ():
                path = f"{prefix}.{key}" if prefix else key
                paths.add(path)
                if any("properties" in x or "items" in x or isinstance(x.get("additionalProperties"), dict)
                       for x in shapes(sub)):
                    blocks.add(key)
                walk(sub, path, depth + 1)
            if "items" in shape:
                walk(shape["items"], prefix, depth + 1)
            if isinstance(shape.get("additionalProperties"), dict):
                walk(shape["additionalProperties"], f"{prefix}.*", depth + 1)

    walk(schema, "", 0)
    return paths, blocks


# dotted names the prose gives that start like a config key and are something else
NOT_CONFIG_KEYS = {
    "server.address", "server.port",            # OpenTelemetry attributes of the engine spans
    "batch.runs_here", "admission.slo",         # fields of /status.json
}


def _key_paths_named(markdown: str) -> list[tuple[int, str]]:
    """The dotted key paths a page names in inline code: `server.workers`, `models[].adapters`,
    `server.log_level: warning` (the path before the colon), with their lines."""
    text = _prose(markdown)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"`([a-z_]+(?:\[\])?(?:\.[a-z0-9_]+(?:\[\])?)+)(?::[^`\n]*)?`", text)
            if not re.search(r"\.(py|ya?ml|json|md|html|lock|txt)$", m.group(1))]       # a file's name


def _is_key(path: str, paths: set[str]) -> bool:
    """A path of the config, or the tail of one (a model's `watchdog.idle_timeout_s`), a map's
    entry standing for its ``*``."""
    segs = path.replace("[]", "").split(".")
    candidates = {".".join(segs)} | {".".join(segs[:i] + ["*"] + segs[i + 1:]) for i in range(1, len(segs))}
    return any(p == c or p.endswith("." + c) for p in paths for c in candidates)


def test_every_config_key_the_manual_names_is_one_the_schema_has():
    """A key renamed or moved in the schema is renamed in the prose too: `server.x`, `view.y` and
    a block's keys named by their own path (`kv_events.chat_shapes`) are keys a reader can set."""
    paths, blocks = _config_paths()
    top = {p for p in paths if "." not in p}
    wrong = []
    for page in _manual():
        if page.name == "configuration.md":      # generated from the schema itself
            continue
        for line, path in _key_paths_named(page.read_text(encoding="utf-8")):
            first = path.replace("[]", "").split(".")[0]
            if first not in top | blocks or path in NOT_CONFIG_KEYS:
                continue
            if not _is_key(path, paths):
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {path}")
    assert not wrong, "key paths the manual names that the config does not have:\n" + "\n".join(wrong)


def test_the_key_check_sees_paths_tails_and_map_entries():
    paths, blocks = _config_paths()
    assert {"server.workers", "models.endpoints.url", "limits.users.*.rpm"} <= paths
    assert {"server", "models", "kv_events", "watchdog"} <= blocks and "url" not in blocks
    assert _is_key("models[].endpoints[].url", paths) and _is_key("kv_events.chat_shapes", paths)
    assert _is_key("limits.users.alice.rpm", paths)
    assert not _is_key("server.worker", paths) and not _is_key("watchdog.idle_s", paths)
    md = "`server.workers: auto` and `view.x`\n```\n`server.nope`\n```\n`models[].adapters` `kubernetes.yaml`"
    assert _key_paths_named(md) == [(1, "server.workers"), (1, "view.x"), (5, "models[].adapters")]


def _defined_labels() -> dict[str, set[str]]:
    """A metric's label names, as the code gives them where it creates the metric:
    ``Counter("switchyard_x", "doc", ["a", "b"])``, ``GaugeMetricFamily(..., labels=[...])``. A
    metric whose labels are not written out there (a variable) is left out."""
    import ast

    def names(node) -> tuple[str, ...] | None:
        if isinstance(node, (ast.List, ast.Tuple)) \
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            return tuple(e.value for e in node.elts)
        return None

    out: dict[str, set[str]] = {}
    unclear: set[str] = set()
    for _, node in _calls_naming_a_metric():
        name = node.args[0].value.removesuffix("_total")
        given = [kw.value for kw in node.keywords if kw.arg in ("labelnames", "labels")] or node.args[2:3]
        labels = names(given[0]) if given else ()
        if labels is None or (name in out and out[name] != set(labels)):
            unclear.add(name)
        else:
            out[name] = set(labels)
    return {k: v for k, v in out.items() if k not in unclear}


def _outside_parentheses(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def _table_labels(markdown: str) -> list[tuple[int, list[str], set[str]]]:
    """A page's rows of metrics: (line, the metrics a row names, the labels it gives:
    the names in code before the row's first colon, outside parentheses)."""
    rows = []
    for m in re.finditer(r"^\| (`switchyard_[^|]*?) \| [^|]* \| (.*) \|$", markdown, re.M):
        metrics = re.findall(r"`(switchyard_[a-z0-9_]+)`", m.group(1))
        labels = set(re.findall(r"`([a-z_]+)`", _outside_parentheses(m.group(2)).split(":")[0]))
        rows.append((markdown.count("\n", 0, m.start()) + 1, metrics, labels))
    return rows


def test_the_labels_the_manual_gives_a_metric_are_the_ones_it_has():
    """A metric's row in a table of metrics names its labels (a row of several metrics, the labels
    of all of them), and `switchyard_x_total{a, b="v"}` in the prose names labels it has."""
    defined = _defined_labels()
    assert len(defined) > 100
    wrong = []
    for page in _manual():
        text = page.read_text(encoding="utf-8")
        for line, metrics, labels in _table_labels(text):
            known = [defined.get(m.removesuffix("_total")) for m in metrics]
            if None not in known and labels != set().union(*known):
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {', '.join(metrics)}: the row gives {sorted(labels)}, "
                             f"the code {sorted(set().union(*known))}")
        for m in re.finditer(r"(switchyard_[a-z0-9_]+)\{([^}]*)\}", text):
            has = defined.get(m.group(1).removesuffix("_total"))
            named = set(re.findall(r"([a-z_]+)\s*(?:=|!=|=~|!~|,|$)", m.group(2)))
            if has is not None and not named <= has:
                wrong.append(f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}: "
                             f"it has {sorted(has)}")
    assert not wrong, "labels the manual gives that the metrics do not have:\n" + "\n".join(wrong)


def test_the_label_check_reads_rows_and_the_code():
    defined = _defined_labels()
    assert defined["switchyard_requests"] == {"model", "status", "strategy"}
    assert defined["switchyard_kubernetes_requests"] == {"verb", "result"}
    md = ("| `switchyard_a_total`, `switchyard_b` | counter | `model`, `x` / `y` (`not_a_label`): text `z` |\n"
          "| `switchyard_c` | gauge | (`none`) open connections |\n")
    assert _table_labels(md) == [(1, ["switchyard_a_total", "switchyard_b"], {"model", "x", "y"}),
                                 (2, ["switchyard_c"], set())]


# headers the manual names that the gateway reads nowhere, on purpose
IGNORED_HEADERS = {
    "x-forwarded-host",       # a client's claim of another host: the edge serves its pool
    "x-stainless-*",          # the openai SDK's own, which a browser's CORS preflight asks to send
}


def _headers_named(markdown: str) -> list[tuple[int, str]]:
    """The ``x-...`` header names a page gives in inline code (``x-ratelimit-*`` for a family)."""
    text = _prose(markdown)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).lower())
            for m in re.finditer(r"`(x-[A-Za-z0-9-]*[A-Za-z0-9*])(?::[^`\n]*)?`", text, re.I)]


def test_every_x_header_the_manual_names_is_one_the_code_sends_or_reads():
    """A header renamed in the code (a marker header of an error, a routing or SLO header) is
    renamed in the manual too."""
    code = "\n".join(p.read_text(encoding="utf-8").lower() for package in ("gateway", "routers", "handlers", "enginesim")
                     for p in (ROOT / package).rglob("*.py"))
    wrong = []
    for page in _manual():
        for line, header in _headers_named(page.read_text(encoding="utf-8")):
            if header not in IGNORED_HEADERS and header.rstrip("*") not in code:
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {header}")
    assert not wrong, "headers the manual names that the code neither sends nor reads:\n" + "\n".join(wrong)


def test_the_header_check_reads_names_families_and_values():
    md = "`x-retries: N` and `X-Request-Id`\n```\n`x-nope`\n```\n`x-ratelimit-*`, `routing-strategy`"
    assert _headers_named(md) == [(1, "x-retries"), (1, "x-request-id"), (5, "x-ratelimit-*")]


def _code_strings() -> str:
    """Every string literal of the gateway's code (an f-string's constant parts, its fields as NUL),
    one a line: where a log line's event is written."""
    import ast

    out = []
    for package in ("gateway", "k8s", "routers", "handlers"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(node.value)
                elif isinstance(node, ast.JoinedStr):
                    out.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
    return "\n".join(out)


def _log_events_named(markdown: str) -> list[tuple[int, list[str]]]:
    """The log lines' events a page quotes: inline code of two words or more right after "logs",
    "logged", "event", "warning" or "line" (within the clause), as the pieces the page gives of
    it: an elision (``...``, ``…``) splits it, and ``key=value`` fields after it are left out."""
    text = _prose(markdown)
    out, prev = [], 0
    for m in re.finditer(r"`([^`]+)`", text):
        before, prev = text[max(prev, m.start() - 40):m.start()], m.end()
        quoted = " ".join(m.group(1).split())
        if not re.search(r"\b(?:logs?|logged|event|warning|line)\b[^.;:]*$", before, re.I) \
                or not re.search(r"[a-z]+ [a-z]+", quoted) or quoted.startswith(("python ", "curl ", "make ", "kill ")):
            continue
        pieces = [p.strip() for p in re.split(r"\.\.\.|…", re.sub(r" [a-z_]+=\S.*$", "", quoted)) if p.strip()]
        out.append((text.count("\n", 0, m.start()) + 1, pieces))
    return out


def test_every_log_event_the_manual_quotes_is_one_the_code_writes():
    """A reader greps the log for the event the manual quotes (`kubernetes pod not used`, `worker
    stopped`): a message reworded in the code is reworded there too."""
    code = _code_strings()
    wrong = []
    for page in _manual():
        for line, pieces in _log_events_named(page.read_text(encoding="utf-8")):
            if any(p not in code for p in pieces):
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {' ... '.join(pieces)}")
    assert not wrong, "log events the manual quotes that the code does not write:\n" + "\n".join(wrong)


async def test_every_field_of_a_request_log_line_is_in_the_logs_section(sims, gateway):
    """The request log lines of a gateway serving whole and P/D requests, streamed and not, an
    alias, a retry past a dead endpoint and errors: each field is one docs/observability.md's Logs
    section names, where an operator looks up what a field of the line means."""
    from tests.support.factories import model_block, roleset

    a = await sims("vllm", "w")
    prefill, decode = await sims("vllm", "pd", role="prefill"), await sims("vllm", "pd", role="decode")
    gw = await gateway([model_block("w", "vllm", [a.url, "http://127.0.0.1:9"]),
                        {"name": "pd", "engine": "vllm", "rolesets": [roleset("vllm", prefill, decode)]}],
                       aliases=[{"name": "chat", "targets": [{"model": "w", "weight": 1}]}],
                       # no probe takes the closed port out before a request meets it: the first
                       # request sent there, by the round-robin pair below at the latest, is retried
                       health={"enabled": False})
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with gw.gw.request_log.capture() as lines:
        async with aiohttp.ClientSession() as s:
            for model, extra, headers, want in (
                    ("w", {}, {}, 200), ("w", {"stream": True, "n": 2}, {}, 200), ("chat", {}, {}, 200),
                    ("pd", {}, {}, 200), ("pd", {"stream": True}, {}, 200), ("nope", {}, {}, 404),
                    ("w", {}, {"x-sim-fault": "status=400", "x-request-id": "bad id"}, 400),
                    ("w", {"priority": 1}, {"routing-strategy": "round-robin"}, 200)):
                for _ in range(2):      # each endpoint of w in turn for round-robin: the dead one is retried
                    async with s.post(gw.url + "/v1/chat/completions", json={"model": model, **chat, **extra},
                                      headers=headers) as r:
                        await r.read()
                        assert r.status == want, (model, extra, headers)
            async with s.get(gw.url + "/v1/nope") as r:
                assert r.status == 404
    fields = {k for line in lines for k in line} - {"log_level"}
    assert {"prefill_endpoint", "alias", "retry_causes", "finish_reasons", "request_id_replaced",
            "dropped_fields", "method"} <= fields, sorted(fields)
    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    section = page[page.index("\n## Logs\n"):page.index("\n## Tracing\n")]
    missing = sorted(f for f in fields if not re.search(rf"`{f}[`:]", section))
    assert not missing, f"request log fields docs/observability.md's Logs section does not name: {missing}"


def test_the_log_event_check_reads_quotes_elisions_and_fields():
    md = ("logs `worker stopped` (with `worker`); a warning, `kv events: tiktoken encoded ...`;\n"
          "logged (`config reload refused; the running config is kept key_path=models[0] ...`)\n"
          "the event\n`a b`\n```\nlogs `not this one`\n```\nthe `routing-strategy` header, `a b` alone")
    assert _log_events_named(md) == [(1, ["worker stopped"]), (1, ["kv events: tiktoken encoded"]),
                                     (2, ["config reload refused; the running config is kept"]), (4, ["a b"])]


def _repo_paths_named(markdown: str, tops: set[str]) -> list[tuple[int, str]]:
    """The repository paths a page gives in inline code (``gateway/server/edge.py``,
    ``charts/switchyard/``, ``tests/...::test_x``): a code span whose first part is a top-level
    entry of the repository, without a pattern in it (``*``, ``{...}``, ``<...>``)."""
    text = _prose(markdown)
    out = []
    for m in re.finditer(r"`([^`\s]+)`", text):
        path = re.split(r"[:#]", m.group(1))[0].rstrip("/")
        if "/" in path and path.split("/")[0] in tops and not re.search(r"[*{}<>$]", path):
            out.append((text.count("\n", 0, m.start()) + 1, path))
    return out


def test_every_repository_path_the_manual_names_exists():
    """A module, test or chart file the manual points to (where a behaviour is tested, which file
    to edit) is there: a file moved or renamed in the code is moved in the manual too. Paths the
    repository ignores (``bench/out/``: what a benchmark writes) are made by running something."""
    tops = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    ignored = [line.rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if "/" in line.rstrip("/")]
    wrong = []
    for page in [*_manual(), ROOT / "enginesim" / "README.md", ROOT / "bench" / "README.md"]:
        for line, path in _repo_paths_named(page.read_text(encoding="utf-8"), tops):
            if not (ROOT / path).exists() and not any(path == i or path.startswith(i + "/") for i in ignored):
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {path}")
    assert not wrong, "paths the manual names that the repository does not have:\n" + "\n".join(wrong)


def test_the_path_check_reads_files_folders_and_test_ids():
    md = ("`gateway/server/edge.py`, `charts/switchyard/` and `tests/a.py::test_b`; `docs/*.md`, `k8s/{a,b}.py`\n"
          "`POST /v1/chat/completions`, `vllm/x.py`\n```\n`gateway/nope.py`\n```\n")
    assert _repo_paths_named(md, {"gateway", "charts", "tests", "docs", "k8s"}) == [
        (1, "gateway/server/edge.py"), (1, "charts/switchyard"), (1, "tests/a.py")]


# --- the index page's map of the config file ---------------------------------------------------

def test_the_index_says_where_every_config_block_is_described():
    """docs/index.md's config section is a newcomer's map of the file: each top-level block is
    shown in its YAML or named in the prose with the page that describes it."""
    import yaml

    from gateway.config.json_schema import config_schema

    blocks = set(config_schema()["$defs"]["Config"]["properties"])
    page = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = page[page.index("\n## The config file"):]
    shown = set().union(*(yaml.safe_load(block) for _, block in _yaml_blocks(section)))
    named = set(re.findall(r"`([a-z_]+)`", _prose(section)))
    assert not blocks - shown - named, f"config blocks docs/index.md does not place: {sorted(blocks - shown - named)}"



def test_the_index_shows_every_key_at_its_default():
    """docs/index.md's config section shows the blocks most deployments touch "with their
    defaults": each key it sets outside ``models`` and ``aliases`` (examples, not defaults) is at
    the default the schema gives it, so a default changed in the code is changed there too."""
    import yaml

    from gateway.config.json_schema import config_schema

    defs = config_schema()["$defs"]

    def block(node: dict) -> dict:
        while True:
            if "$ref" in node:
                node = defs[node["$ref"].rsplit("/", 1)[-1]]
            elif "anyOf" in node and len(kinds := [n for n in node["anyOf"] if n.get("type") != "null"]) == 1:
                node = kinds[0]
            else:
                return node

    def differences(shown: dict, node: dict, path: str) -> list[str]:
        out = []
        props = block(node).get("properties", {})
        for key, value in shown.items():
            if key not in props:
                out.append(f"{path}{key}: no such key")
            elif isinstance(value, dict):
                out += differences(value, props[key], f"{path}{key}.")
            elif (default := props[key].get("default", block(props[key]).get("default"))) != value:
                out.append(f"{path}{key}: shown {value!r}, default {default!r}")
        return out

    page = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    section = page[page.index("\n## The config file"):]
    wrong = []
    for _, text in _yaml_blocks(section):
        shown = {k: v for k, v in yaml.safe_load(text).items() if k not in ("models", "aliases")}
        wrong += differences(shown, defs["Config"], "")
    assert not wrong, "docs/index.md's config shows values that are not the defaults:\n" + "\n".join(wrong)

# --- what the Python snippets need -----------------------------------------------------------------

def _python_imports(markdown: str) -> set[str]:
    """The top-level modules the ```python blocks of a page import."""
    import ast

    out = set()
    for m in re.finditer(r"^```python\n(.*?)^```", markdown, re.S | re.M):
        for node in ast.walk(ast.parse(m.group(1))):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module.split(".")[0])
    return out


def test_a_python_snippet_needs_only_what_make_demo_installs_or_says_what_to_install():
    """`make demo` installs the gateway's own dependencies (requirements.lock), not the dev extra's
    SDKs: a page whose Python snippet imports a package from outside them says to install it."""
    import importlib.metadata

    runtime = {name.lower() for name in re.findall(r"^([A-Za-z0-9_.-]+)==", (ROOT / "requirements.lock").read_text(), re.M)}
    dists = importlib.metadata.packages_distributions()
    wrong = []
    for page in [*_manual(), ROOT / "enginesim" / "README.md", ROOT / "bench" / "README.md"]:
        text = page.read_text(encoding="utf-8")
        for module in sorted(_python_imports(text) - set(sys.stdlib_module_names)):
            names = {d.lower() for d in dists.get(module, [module])}
            if module in ("gateway", "enginesim", "routers", "handlers", "k8s", "bench") or names & runtime:
                continue
            if not any(re.search(rf"pip install [^`\n]*\b{re.escape(n)}\b", text, re.I) for n in names):
                wrong.append(f"{page.relative_to(ROOT)}: imports {module}")
    assert not wrong, "Python snippets that need a package `make demo` does not install, with no word of it:\n" + "\n".join(wrong)


def test_the_import_check_reads_snippets():
    md = "```python\nimport json, openai.types\nfrom anthropic import A\nfrom . import x\n```\n`import nope`\n"
    assert _python_imports(md) == {"json", "openai", "anthropic"}


# --- the engine simulator's README -----------------------------------------------------------------

def test_the_simulator_layout_names_every_module():
    """enginesim/README.md's Layout lists each module of enginesim/ (the package's own files), and
    no file that is not there."""
    page = (ROOT / "enginesim" / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", page, re.S | re.M).group(1)
    listed = set(re.findall(r"^([\w.]+\.py) ", block, re.M))
    present = {p.name for p in (ROOT / "enginesim").glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert listed == present, f"enginesim layout: missing {sorted(present - listed)}, not there {sorted(listed - present)}"


def test_every_simulator_knob_is_in_its_readme():
    """Each SimConfig field (a CLI flag each) is named in enginesim/README.md, as the field or as
    its flag: `python -m enginesim --help` lists them, the README says what they do."""
    import dataclasses

    from enginesim import SimConfig

    page = (ROOT / "enginesim" / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([a-z_]+)`", page)) | {f.replace("-", "_") for f in re.findall(r"--([a-z][a-z0-9-]*)", page)}
    missing = [f.name for f in dataclasses.fields(SimConfig) if f.name not in named]
    assert not missing, f"SimConfig knobs enginesim/README.md does not name: {missing}"


# --- the command lines a reader copies --------------------------------------------------------------

def _command_flags(text: str, program: str) -> list[tuple[int, str]]:
    """The ``--flags`` of each ``python -m <program> ...`` command line of a page (continuation
    lines joined), with their lines; a command ends at a backtick, a comment, a pipe or a line's end."""
    out = []
    for m in re.finditer(rf"python3? -m {re.escape(program)}(?![\w.])((?:\\\n|[^`\n#|]|\|(?=[a-z]))*)", text):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line, f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(1))]
    return out


def test_every_flag_of_a_documented_command_is_one_the_cli_has():
    """`python -m gateway --...` and `python -m enginesim --...` as the README, the manual, the
    examples and the simulator's README write them: each flag is one the command takes."""
    from enginesim.config import build_parser

    helps = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    known = {"gateway": set(re.findall(r"(--[a-z][a-z0-9-]*)", helps)),
             "enginesim": {s for a in build_parser()._actions for s in a.option_strings}}
    assert "--check-config" in known["gateway"] and "--kv-events-port" in known["enginesim"]
    pages = [*_manual(), *sorted((ROOT / "examples").glob("*.yaml")), ROOT / "enginesim" / "README.md",
             ROOT / "bench" / "README.md"]
    wrong = [f"{page.relative_to(ROOT)}:{line}: python -m {program} {flag}" for page in pages
             for program in known for line, flag in _command_flags(page.read_text(encoding="utf-8"), program)
             if flag not in known[program]]
    assert not wrong, "flags the documented commands do not take:\n" + "\n".join(wrong)


def test_the_flag_check_reads_command_lines():
    md = ("`python -m gateway --config f --workers auto` and --nope\n"
          "python -m gateway --demo \\\n  --port 1 # --not-this\npython -m gateway.admin_cli --url u\n"
          "python -m gateway --log-format auto|json | grep --count x\n")
    assert _command_flags(md, "gateway") == [(1, "--config"), (1, "--workers"), (2, "--demo"), (2, "--port"),
                                             (5, "--log-format")]


# each program's --help, run in one process (the bench scripts import the gateway: a process each
# would take seconds apiece); a script's own folder first on its path, as `python bench/x.py` has it
_HELPS = """
import contextlib, io, json, os, runpy, sys
out = {}
for prog in sys.argv[1:]:
    text, path = io.StringIO(), list(sys.path)
    sys.argv = [prog, "--help"]
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        if prog.endswith(".py"):
            sys.path.insert(0, os.path.dirname(os.path.abspath(prog)))
            runpy.run_path(prog, run_name="__main__")
        else:
            runpy.run_module(prog, run_name="__main__", alter_sys=True)
    sys.path[:] = path
    out[prog] = text.getvalue()
print(json.dumps(out))
"""


def _bench_flags(text: str) -> list[tuple[int, str, str]]:
    """(line, program, flag) for each ``--flag`` of a ``python -m bench.x ...`` or ``python
    bench/x.py ...`` command line of a page, read as ``_command_flags`` reads the gateway's."""
    out = []
    for m in re.finditer(r"python3? (?:-m (bench\.[a-z_]+)|(bench/[a-z_]+\.py))(?![\w.])((?:\\\n|[^`\n#|]|\|(?=[a-z]))*)", text):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line, m.group(1) or m.group(2), f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(3))]
    return out


def test_every_flag_of_a_documented_benchmark_command_is_one_its_script_has(tmp_path):
    """`python bench/overhead.py --...` and `python -m bench.routing --...` as the benchmarks page,
    the manual and bench/README.md write them: each flag is one the script's --help lists."""
    import json

    pages = [*_manual(), ROOT / "bench" / "README.md"]
    uses = [(page, *use) for page in pages for use in _bench_flags(page.read_text(encoding="utf-8"))]
    programs = sorted({prog for _, _, prog, _ in uses})
    assert len(programs) > 20 and "bench/overhead.py" in programs and "bench.routing" in programs
    # run elsewhere, so that a script that takes --help for a path of its output writes nothing here
    args = [str(ROOT / prog) if prog.endswith(".py") else prog for prog in programs]
    proc = subprocess.run([sys.executable, "-c", _HELPS, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    helps = dict(zip(programs, json.loads(proc.stdout.splitlines()[-1]).values(), strict=True))
    known = {prog: set(re.findall(r"(--[a-z][a-z0-9-]*)", text)) for prog, text in helps.items()}
    assert not [prog for prog in programs if "--help" not in known[prog]], "scripts whose --help printed nothing"
    wrong = [f"{page.relative_to(ROOT)}:{line}: {prog} {flag}" for page, line, prog, flag in uses
             if flag not in known[prog]]
    assert not wrong, "flags the documented benchmark commands do not take:\n" + "\n".join(wrong)


def test_the_benchmark_flag_check_reads_both_ways_of_running_a_script():
    md = ("`python bench/overhead.py --full \\\n  --peers x` and python -m bench.routing --seeds 3 # --not\n"
          "python -m bench.routing_sim --n 1 | grep --count y\n")
    assert _bench_flags(md) == [(1, "bench/overhead.py", "--full"), (1, "bench/overhead.py", "--peers"),
                                (2, "bench.routing", "--seeds"), (3, "bench.routing_sim", "--n")]
