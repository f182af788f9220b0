"""Check PromQL (dashboards, alert rules) against what a gateway's /metrics really exports.

Expressions are parsed by ``promql-parser`` (a port of Prometheus's own parser, with its type
checks: ``rate`` of an instant vector, a wrong argument count or an unknown function are errors),
after Grafana's interval variables are replaced by a duration. From the syntax tree we take what
a query relies on:

- every selector's series name (``foo_bucket``, ``foo_total`` as written: the exposition's
  names, suffixes included) and the label names of its matchers;
- the labels of ``by (...)`` clauses, of ``on (...)`` and ``group_left/right (...)`` vector
  matching, and of the legend's ``{{label}}``s, each of which must be carried by the result of
  the expression it applies to. That result's labels are inferred bottom-up with Prometheus's
  rules: a selector carries its samples' labels, ``sum by (a)`` yields ``a``, ``histogram_quantile``
  drops ``le``, one-to-one matching ``on (a)`` keeps ``a``, ``group_left (b)`` adds ``b``, ...

``check`` compares them with the samples of a scrape: a series name with no sample, or a label
that the series concerned do not carry, is a problem. Labels that Prometheus itself attaches to
every scraped series (``TARGET_LABELS``) are always allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import promql_parser as pp
from prometheus_client.parser import text_string_to_metric_families

# Added by Prometheus at scrape time (the Prometheus Operator's ServiceMonitor adds these; a plain
# scrape config job and instance). Not `endpoint`: the chart's ServiceMonitor keeps the gateway's own.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "container"})
_GRAFANA_INTERVAL = re.compile(r"\$\{?__(?:rate_interval|interval|range)(?:_ms|_s)?\}?")
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<query>.+?)\s*,\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$",
                           re.DOTALL)


def plain(expr: str) -> str:
    """A dashboard expression with Grafana's interval variables ($__rate_interval, ...) replaced by
    a duration, as Grafana does before it sends the query."""
    return _GRAFANA_INTERVAL.sub("5m", expr)


def parse(expr: str):
    """The syntax tree of a dashboard or rule expression (raises ValueError if it does not parse)."""
    return pp.parse(plain(expr))


@dataclass
class Query:
    where: str                                   # "dashboard.json: panel title [A]", "rule SwitchyardX"
    expr: str
    legend: str = ""


def variable_query(where: str, definition: str) -> Query:
    """A Grafana ``label_values(selector, label)`` variable as a Query (the label checked too)."""
    m = _LABEL_VALUES.match(definition)
    if m is None:
        raise ValueError(f"{where}: only label_values(selector, label) variables are supported: {definition}")
    return Query(where, f"count by ({m['label']}) ({m['query']})")


def _selectors(node) -> list:
    found: list = []

    def visit(n):
        if isinstance(n, pp.VectorSelector):
            found.append(n)

    pp.walk(node, visit)
    return found


def _name(sel) -> str | None:
    if sel.name:
        return sel.name
    for m in sel.matchers.matchers:
        if m.name == "__name__" and m.op == pp.MatchOp.Equal:
            return m.value
    return None


def _matcher_labels(sel) -> set[str]:
    labels = {m.name for m in sel.matchers.matchers}
    for group in sel.matchers.or_matchers or ():
        labels |= {m.name for m in group}
    return labels - {"__name__"}


def uses(expr: str) -> dict[str, set[str]]:
    """Series name -> the label names its matchers use, for every selector of ``expr``."""
    out: dict[str, set[str]] = {}
    for sel in _selectors(parse(expr)):
        name = _name(sel)
        if name is None:
            raise ValueError(f"a selector without a metric name: {sel}")
        out.setdefault(name, set()).update(_matcher_labels(sel))
    return out


def exported(metrics_text: str) -> dict[str, set[str]]:
    """Series name -> the label names its samples carry, from Prometheus text exposition."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def check(queries: Iterable[Query], scrape: dict[str, set[str]]) -> list[str]:
    """Every problem, as one readable line each; [] when all queries match the scrape."""
    problems: list[str] = []
    for q in queries:
        try:
            tree = parse(q.expr)
        except ValueError as e:
            problems.append(f"{q.where}: does not parse: {e}\n    {q.expr}")
            continue
        out = _Labels(q.where, scrape, problems).of(tree)
        if out.labels is not None and not out.scalar:
            for label in _LEGEND_LABEL.findall(q.legend):
                if label not in out.labels:
                    problems.append(f"{q.where}: legend {{{{{label}}}}} names a label the query's result does "
                                    f"not carry (it has: {', '.join(sorted(out.labels)) or 'none'})")
    return problems


@dataclass(frozen=True)
class _Out:
    """What an expression yields: a scalar, or a vector whose series carry ``labels`` (None: not
    known, because something under it was already reported)."""

    labels: frozenset[str] | None = frozenset()
    scalar: bool = False


_SCALAR = _Out(scalar=True)
_UNKNOWN = _Out(labels=None)
_KEEP_ALL_AGGS = {"topk", "bottomk", "limitk", "limit_ratio"}


class _Labels:
    """Infers the labels each sub-expression's result carries and reports a clause that needs a
    label its input does not carry."""

    def __init__(self, where: str, scrape: dict[str, set[str]], problems: list[str]) -> None:
        self.where, self.scrape, self.problems = where, scrape, problems

    def need(self, clause: str, labels, have: _Out) -> None:
        if have.labels is None or have.scalar:
            return
        missing = set(labels) - have.labels
        if missing:
            self.problems.append(f"{self.where}: `{clause}` uses {', '.join(sorted(missing))}, which the "
                                 f"expression under it does not carry (it has: {', '.join(sorted(have.labels))})")

    def of(self, n) -> _Out:
        if isinstance(n, pp.VectorSelector):
            return self.selector(n)
        if isinstance(n, pp.MatrixSelector):
            return self.of(n.vector_selector)
        if isinstance(n, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
            return self.of(n.expr)
        if isinstance(n, (pp.NumberLiteral, pp.StringLiteral)):
            return _SCALAR
        if isinstance(n, pp.Call):
            return self.call(n)
        if isinstance(n, pp.AggregateExpr):
            return self.aggregate(n)
        if isinstance(n, pp.BinaryExpr):
            return self.binary(n)
        raise ValueError(f"{self.where}: unexpected expression node {type(n).__name__}")

    def selector(self, sel) -> _Out:
        name = _name(sel)
        if name is None:
            self.problems.append(f"{self.where}: a selector without a metric name: {sel}")
            return _UNKNOWN
        if name not in self.scrape:
            self.problems.append(f"{self.where}: {name} is not exported (no sample in the demo scrape)")
            return _UNKNOWN
        have = self.scrape[name]
        missing = _matcher_labels(sel) - have - TARGET_LABELS
        if missing:
            self.problems.append(f"{self.where}: {name} has no label {', '.join(sorted(missing))} "
                                 f"(it has: {', '.join(sorted(have)) or 'none'})")
        return _Out(frozenset(have | TARGET_LABELS))

    def call(self, n) -> _Out:
        name = n.func.name
        args = [self.of(a) for a in n.args]
        if name in ("time", "scalar", "pi"):
            return _SCALAR
        if name in ("vector", "absent", "absent_over_time"):
            return _Out()
        if name == "histogram_quantile":
            self.need("histogram_quantile", {"le"}, args[1])
            return args[1] if args[1].labels is None else _Out(args[1].labels - {"le"})
        if name in ("label_replace", "label_join"):
            dst = str(n.args[1]).strip('"')
            return args[0] if args[0].labels is None else _Out(args[0].labels | {dst})
        vectors = [a for a in args if not a.scalar]
        return vectors[0] if vectors else _SCALAR

    def aggregate(self, n) -> _Out:
        inner = self.of(n.expr)
        if n.param is not None:
            self.of(n.param)
        op, mod = str(n.op), n.modifier
        by = mod is not None and mod.type == pp.AggModifierType.By
        labels = list(mod.labels) if mod is not None and mod.labels else []
        if by and labels:
            self.need(f"{op} by ({', '.join(labels)})", labels, inner)
        if inner.labels is None:
            return _UNKNOWN
        if op in _KEEP_ALL_AGGS:
            return inner
        if by:
            out = frozenset(labels)
        elif mod is not None:                          # without (...)
            out = inner.labels - set(labels)
        else:
            out = frozenset()
        if op == "count_values":
            out |= {str(n.param).strip('"')}
        return _Out(out)

    def binary(self, n) -> _Out:
        lhs, rhs = self.of(n.lhs), self.of(n.rhs)
        op, mod = str(n.op), n.modifier
        matching = mod.matching if mod is not None else None
        on = ignoring = None
        if matching is not None and matching.type == pp.LabelModifierType.Include:
            on = list(matching.labels)
        elif matching is not None:
            ignoring = list(matching.labels)
        if on:
            self.need(f"on ({', '.join(on)}), left side", on, lhs)
            self.need(f"on ({', '.join(on)}), right side", on, rhs)
        include = list(mod.group_labels or ()) if mod is not None else []
        card = mod.card if mod is not None else None
        if include:             # group_left copies labels from the right side, group_right from the left
            self.need(f"group ({', '.join(include)})", include,
                      rhs if card == pp.VectorMatchCardinality.ManyToOne else lhs)
        if lhs.scalar and rhs.scalar:
            return _SCALAR
        if lhs.scalar:
            return rhs
        if rhs.scalar:
            return lhs
        if lhs.labels is None or rhs.labels is None:
            return _UNKNOWN
        if op in ("and", "unless"):
            return lhs
        if op == "or":
            return _Out(lhs.labels | rhs.labels)
        if card == pp.VectorMatchCardinality.ManyToOne:
            return _Out(lhs.labels | set(include))
        if card == pp.VectorMatchCardinality.OneToMany:
            return _Out(rhs.labels | set(include))
        if on is not None:          # one-to-one on (...): the result keeps only those labels
            return _Out(frozenset(on))
        return _Out(lhs.labels - set(ignoring or ()))
