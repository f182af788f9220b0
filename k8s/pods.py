"""Pod → endpoint mapping: what a pod's labels, annotations and status say about it, as data.

Pure functions over the pod as the API server sends it (the JSON object, camelCase keys), so the
same code reads list items and watch events, and tests feed it plain dicts. Labels and annotations
are AIBrix's (``aibrix-gateway.md`` §3.1, §8), with two deliberate differences:

- ``model.aibrix.ai/metric-port`` defaults to the serving port, not to a fixed 8000: a pod serving
  on 30000 exposes ``/metrics`` there too.
- the ``model.aibrix.ai/name`` *annotation* wins over the label: labels cannot hold ``/``, so the
  annotation is where a name such as ``meta-llama/Llama-3.1-8B`` is written in full.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config.schema import KubernetesModelConfig, ModelConfig
from gateway.endpoints import ENGINES
from gateway.kv.settings import check_rank_ports

LABEL_MODEL = "model.aibrix.ai/name"
LABEL_PORT = "model.aibrix.ai/port"
LABEL_METRIC_PORT = "model.aibrix.ai/metric-port"
LABEL_ENGINE = "model.aibrix.ai/engine"
LABEL_ROLE = "role-name"
LABEL_ROLESET = "roleset-name"
LABEL_POD_GROUP_INDEX = "stormservice.orchestration.aibrix.ai/pod-group-index"
LABEL_RAY_NODE_TYPE = "ray.io/node-type"
ANNO_MODEL = "model.aibrix.ai/name"
ANNO_BOOTSTRAP_PORT = "model.aibrix.ai/sglang-bootstrap-port"
ANNO_CONFIG = "model.aibrix.ai/config"
# KV-cache events: "true", or JSON {"port", "replay_port", "topic", "data_parallel_size"} (gateway/kv/events.py)
ANNO_KV_EVENTS = "switchyard.io/kv-events"

DEFAULT_PORT = 8000
PD_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PodView:
    """What the gateway needs from one pod. Two views that compare equal except for
    ``routable`` describe the same endpoint (its counters survive a readiness flap)."""

    key: str                       # namespace/name
    uid: str
    name: str
    namespace: str
    model: str
    url: str
    engine: str
    role: str
    roleset: str | None
    bootstrap_port: int | None
    min_prompt_tokens: int
    max_prompt_tokens: int
    metrics_url: str
    routing_strategy: str | None = None          # from the annotation's profile, informational
    kv_events: tuple[tuple[str, Any], ...] | None = None   # the switchyard.io/kv-events annotation
    kv_events_error: str = ""      # why the kv-events annotation was refused (the pod is routed without events)
    routable: bool = field(default=False, compare=False)
    not_routable_reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class Skipped:
    """A pod the gateway will not route to at all, and why (logged once per change)."""

    key: str
    reason: str
    model: str = ""        # the model of a pod that will serve it once it has an address (Pending)


def pod_key(pod: Mapping[str, Any]) -> str:
    md = pod.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"


def is_routable(pod: Mapping[str, Any]) -> tuple[bool, str]:
    """A pod gets new requests when it has an IP, its Ready condition is True and it is not
    terminating (AIBrix's rule; the phase is only checked for finished pods)."""
    md = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if md.get("deletionTimestamp"):
        return False, "terminating"
    if status.get("phase") in ("Succeeded", "Failed"):
        return False, f"phase {status.get('phase')}"
    if not status.get("podIP"):
        return False, "no pod IP"
    for cond in status.get("conditions") or ():
        if cond.get("type") == "Ready":
            return (True, "") if cond.get("status") == "True" else (False, "not ready")
    return False, "not ready"


def _strings(values: Any) -> bool:
    """Whether ``values`` (a pod's labels or annotations) maps strings to strings."""
    return isinstance(values, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in values.items())


def _is_address(value: Any) -> bool:
    """Whether a pod's ``status.podIP`` is an IPv4 or IPv6 address (the endpoint's URL is made of it:
    one with a port, a prefix length or a bracket would name some other address, or none)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return isinstance(value, str)


def _port(value: Any, what: str) -> int:
    """A port written in ASCII digits only: Python's ``int()`` also takes ``8_000``, ``+8000`` and
    other scripts' digits, which the cluster's other readers of the same label (Go's ``strconv``)
    refuse, so a pod would be served here on a port nothing else agrees it has."""
    text = value if isinstance(value, str) else str(value) if isinstance(value, int) else ""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{what} must be a port number, got {value!r}")
    port = int(text)
    if not 0 < port < 65536:
        raise ValueError(f"{what} must be a port number, got {value!r}")
    return port


def parse_profile(text: str | None) -> dict[str, Any]:
    """The default profile of a ``model.aibrix.ai/config`` annotation, flattened.

    ``{"defaultProfile": "pd", "profiles": {"pd": {...}}}``: the profile named by
    ``defaultProfile`` (else ``"default"``, else the only one). Keys may sit on the profile itself
    or under its ``routingConfig``. Raises ``ValueError`` on malformed JSON or shapes.
    """
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:      # (nested too deep to read)
        raise ValueError(f"annotation {ANNO_CONFIG} is not JSON: {type(e).__name__}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"annotation {ANNO_CONFIG} must be a JSON object")
    profiles = doc.get("profiles")
    if profiles is None:
        return {}
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise ValueError(f"annotation {ANNO_CONFIG}: 'profiles' must map names to objects")
    name = doc.get("defaultProfile") or "default"
    if not isinstance(name, str):
        raise ValueError(f"annotation {ANNO_CONFIG}: defaultProfile must be a string")
    profile = profiles.get(name)
    if profile is None and len(profiles) == 1:
        profile = next(iter(profiles.values()))
    if profile is None:
        return {}
    flat = {k: v for k, v in profile.items() if k != "routingConfig"}
    rc = profile.get("routingConfig")
    if isinstance(rc, dict):
        flat.update(rc)
    return flat


def _int_setting(profile: Mapping[str, Any], key: str, default: int) -> int:
    if key not in profile or profile[key] is None:
        return default
    v = profile[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"annotation {ANNO_CONFIG}: {key} must be an integer, got {v!r}")
    return max(v, 0)


def map_pod(pod: Mapping[str, Any], models: Mapping[str, ModelConfig] | None = None,
            k8s_models: Mapping[str, KubernetesModelConfig] | None = None) -> PodView | Skipped:
    """Map one pod to a ``PodView`` (routable or not) or say why it is skipped altogether.

    ``models``: the gateway config's model blocks by name (their engine is the default for pods
    without an engine label); ``k8s_models``: the ``kubernetes.models`` settings.
    """
    md = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels: Mapping[str, str] = md.get("labels") or {}
    annotations: Mapping[str, str] = md.get("annotations") or {}
    key = pod_key(pod)
    name = md.get("name") or ""
    for what, values in (("labels", labels), ("annotations", annotations)):
        if not _strings(values):
            # the API server's always do: a model or a port read from anything else would be
            # a model id, a metric label or a URL that is not a string
            return Skipped(key, f"its {what} must map strings to strings")

    model = annotations.get(ANNO_MODEL) or labels.get(LABEL_MODEL)
    if not model:
        return Skipped(key, f"no {LABEL_MODEL} label or annotation")
    if labels.get(LABEL_POD_GROUP_INDEX, "0") not in ("", "0"):
        return Skipped(key, "pod-group-index > 0 (only the group leader serves HTTP)")
    if labels.get(LABEL_RAY_NODE_TYPE) == "worker":
        return Skipped(key, "Ray worker pod")
    if status.get("phase") in ("Succeeded", "Failed"):
        return Skipped(key, f"phase {status.get('phase')}")
    ip = status.get("podIP")
    if not ip:         # (Pending: not scheduled yet, or its sandbox not made) its model awaits it
        return Skipped(key, "no pod IP yet", model=model)
    if not _is_address(ip):
        return Skipped(key, f"pod IP {str(ip)[:60]!r} is not an IP address")

    mc = (models or {}).get(model)
    engine = (labels.get(LABEL_ENGINE) or (mc.engine if mc else "vllm")).strip().lower()
    if engine not in ENGINES:
        return Skipped(key, f"engine {engine!r} is not supported (supported: {', '.join(ENGINES)})")
    try:
        port = _port(labels[LABEL_PORT], f"label {LABEL_PORT}") if LABEL_PORT in labels else DEFAULT_PORT
        metric_port = (_port(labels[LABEL_METRIC_PORT], f"label {LABEL_METRIC_PORT}")
                       if LABEL_METRIC_PORT in labels else port)
        bootstrap = (_port(annotations[ANNO_BOOTSTRAP_PORT], f"annotation {ANNO_BOOTSTRAP_PORT}")
                     if annotations.get(ANNO_BOOTSTRAP_PORT) else None)
        profile = parse_profile(annotations.get(ANNO_CONFIG))
        kmc = (k8s_models or {}).get(model, KubernetesModelConfig())
        min_tokens = _int_setting(profile, "promptLenBucketMinLength", kmc.min_prompt_tokens)
        max_tokens = _int_setting(profile, "promptLenBucketMaxLength", kmc.max_prompt_tokens)
        combined = profile.get("combined", kmc.combined)
        if not isinstance(combined, bool):
            raise ValueError(f"annotation {ANNO_CONFIG}: combined must be true or false")
        strategy = profile.get("routingStrategy")
        if strategy is not None and not isinstance(strategy, str):
            raise ValueError(f"annotation {ANNO_CONFIG}: routingStrategy must be a string")
    except ValueError as e:
        return Skipped(key, str(e))
    # a bad kv-events annotation refuses the events, not the pod: it serves, routed without them
    kv_events_error = ""
    try:
        kv_events = parse_kv_events(annotations.get(ANNO_KV_EVENTS))
    except ValueError as e:
        kv_events, kv_events_error = None, str(e)

    role_name = (labels.get(LABEL_ROLE) or "").strip()
    roleset = (labels.get(LABEL_ROLESET) or "").strip() or None
    if role_name in PD_ROLES:
        role = role_name
    elif role_name and roleset:
        if not combined:
            return Skipped(key, f"role {role_name!r} in roleset {roleset!r} is neither prefill nor decode, "
                                f"and the model's config does not mark it combined")
        role = "combined"
    else:
        role, roleset = "aggregated", None

    host = f"[{ip}]" if ":" in ip else ip
    routable, reason = is_routable(pod)
    return PodView(
        key=key, uid=md.get("uid") or "", name=name, namespace=md.get("namespace") or "",
        model=model, url=f"http://{host}:{port}", engine=engine, role=role, roleset=roleset,
        bootstrap_port=bootstrap, min_prompt_tokens=min_tokens, max_prompt_tokens=max_tokens,
        metrics_url=f"http://{host}:{metric_port}/metrics", routing_strategy=strategy,
        kv_events=kv_events, kv_events_error=kv_events_error, routable=routable, not_routable_reason=reason,
    )


def parse_kv_events(value: str | None) -> tuple[tuple[str, Any], ...] | None:
    """The ``switchyard.io/kv-events`` annotation: ``"true"`` (the model's ``kv_events`` settings),
    ``"false"``, or a JSON object with any of ``port``, ``replay_port`` (ports), ``topic`` and
    ``data_parallel_size`` (the engine's DP ranks, publishing on ``port + rank``)."""
    if value is None or not value.strip() or value.strip().lower() == "false":
        return None
    if value.strip().lower() == "true":
        return ()
    try:
        data = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError(f"annotation {ANNO_KV_EVENTS} is neither true/false nor JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"annotation {ANNO_KV_EVENTS} must be true, false or a JSON object")
    out: list[tuple[str, Any]] = []
    for key, v in data.items():
        if key in ("port", "replay_port"):
            out.append((key, _port(v, f"annotation {ANNO_KV_EVENTS} {key}")))
        elif key == "topic" and isinstance(v, str):
            out.append((key, v))
        elif key == "data_parallel_size" and isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1024:
            out.append((key, v))
        else:
            raise ValueError(f"annotation {ANNO_KV_EVENTS}: unknown or bad key {key!r}")
    given = dict(out)
    for key in ("port", "replay_port"):
        if key in given and given[key] + given.get("data_parallel_size", 1) - 1 > 65535:
            raise ValueError(f"annotation {ANNO_KV_EVENTS}: {key} + data_parallel_size - 1 is beyond 65535")
    try:
        check_rank_ports(given.get("port"), given.get("replay_port"), given.get("data_parallel_size", 1))
    except ValueError as e:
        raise ValueError(f"annotation {ANNO_KV_EVENTS}: {e}") from None
    return tuple(out)
