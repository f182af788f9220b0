"""The ``kubernetes:`` config block: what discovery reads (``gateway.config.schema.Config.kubernetes``)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from k8s.selector import parse_selector

_Count = Annotated[int, Meta(ge=0)]
_Seconds = Annotated[float, Meta(ge=0)]
_NAMESPACE = Annotated[str, Meta(pattern=r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")]


class KubernetesModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Routing settings for one model's discovered pods; a pod's ``model.aibrix.ai/config``
    annotation, where present, wins over these."""

    combined: Annotated[bool, Meta(description="Pods of a roleset whose role-name is neither prefill nor decode serve whole requests (combined); false: such pods are skipped.")] = False
    min_prompt_tokens: Annotated[_Count, Meta(description="P/D prompt-length bucket of the model's pods: prompts of at least this many tokens.")] = 0
    max_prompt_tokens: Annotated[_Count, Meta(description="P/D prompt-length bucket of the model's pods: prompts of at most this many tokens (0: no upper bound).")] = 0

    def __post_init__(self) -> None:
        if self.max_prompt_tokens and self.min_prompt_tokens > self.max_prompt_tokens:
            raise ValueError("min_prompt_tokens: must not exceed max_prompt_tokens")


class KubernetesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: Annotated[bool, Meta(description="Discover engine pods (their model label, role and ports) from the Kubernetes API.")] = False
    kubeconfig: Annotated[str | None, Meta(description="Path of a kubeconfig file; null: the in-cluster service account.")] = None
    context: Annotated[str | None, Meta(description="Context of the kubeconfig to use; null: its current-context.")] = None
    namespaces: Annotated[tuple[_NAMESPACE, ...], Meta(description="Namespaces to watch; empty: every namespace.")] = ()
    label_selector: Annotated[str, Meta(description="Label selector of the pods to watch (the default: every pod carrying model.aibrix.ai/name, the label that names its model).")] = "model.aibrix.ai/name"
    resync_interval_s: Annotated[_Seconds, Meta(description="Full relist that repairs missed watch events, in seconds (0: never).")] = 300.0
    watch_timeout_s: Annotated[float, Meta(ge=1, description="Server-side timeout of one watch request, in seconds.")] = 300.0
    watch_idle_timeout_s: Annotated[_Seconds, Meta(description="A watch that brought nothing (no event, no bookmark) for this long is taken for a connection that died without a word (a NAT or load balancer that forgot it, a node cut off) and opened again from the last resourceVersion, in seconds (0: never; then such a watch is given up only watch_timeout_s + 15 s after it was opened). The API server sends a watch that asked for bookmarks one about every minute.")] = 180.0
    retry_backoff_s: Annotated[float, Meta(gt=0, description="First retry delay after an API error, doubling up to 30 s, in seconds; an answer's Retry-After (429, 503) is waited out when longer, up to 30 s.")] = 1.0
    models: Annotated[dict[str, KubernetesModelConfig], Meta(description="Settings per model name for its discovered pods; a pod's model.aibrix.ai/config annotation wins over them.")] = {}

    def __post_init__(self) -> None:
        for i, ns in enumerate(self.namespaces):
            if ns in self.namespaces[:i]:
                raise ValueError(f"namespaces[{i}]: duplicate namespace {ns!r}")
        try:        # a malformed selector fails at config load, not at every list call
            parse_selector(self.label_selector)
        except ValueError as e:
            raise ValueError(f"label_selector: {e}") from None
