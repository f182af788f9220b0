"""The metric reader: a Prometheus text page (a gateway's or an engine's ``/metrics``) as numbers."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families


def sample_map(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, keyed ``(name, sorted (label, value) pairs)``, parsed by prometheus_client."""
    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def samples(text: str | bytes) -> dict[str, float]:
    """Every sample, keyed ``name{label=value,...}`` (labels sorted, values unquoted)."""
    return {f"{name}{{{','.join(f'{k}={v}' for k, v in labels)}}}": value
            for (name, labels), value in sample_map(text).items()}


def metric(page: str | bytes | Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when none does); ``page`` is
    the text, or what :func:`samples` made of it."""
    total = 0.0
    for key, value in (page if isinstance(page, Mapping) else samples(page)).items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def series(text: str, name: str) -> dict[str, float]:
    """``{labels as exposed: value}`` of one metric, e.g. ``{'model="m",reason="budget"': 7.0}``."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out
