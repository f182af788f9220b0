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

    combined: bool = False               # pods of a roleset whose role-name is not prefill/decode
    min_prompt_tokens: _Count = 0
    max_prompt_tokens: _Count = 0        # 0: no upper bound

    def __post_init__(self) -> None:
        if self.max_prompt_tokens and self.min_prompt_tokens > self.max_prompt_tokens:
            raise ValueError("min_prompt_tokens: must not exceed max_prompt_tokens")


class KubernetesConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = False
    kubeconfig: str | None = None        # null: in-cluster service account
    context: str | None = None           # kubeconfig context (null: its current-context)
    namespaces: tuple[_NAMESPACE, ...] = ()   # (): all namespaces
    label_selector: str = "model.aibrix.ai/name"
    resync_interval_s: _Seconds = 300.0  # full relist that repairs missed events (0: never)
    watch_timeout_s: Annotated[float, Meta(ge=1)] = 300.0   # server-side timeout of one watch request
    retry_backoff_s: Annotated[float, Meta(gt=0)] = 1.0     # first retry delay after an API error; doubles up to 30 s
    models: dict[str, KubernetesModelConfig] = {}

    def __post_init__(self) -> None:
        for i, ns in enumerate(self.namespaces):
            if ns in self.namespaces[:i]:
                raise ValueError(f"namespaces[{i}]: duplicate namespace {ns!r}")
        try:        # a malformed selector fails at config load, not at every list call
            parse_selector(self.label_selector)
        except ValueError as e:
            raise ValueError(f"label_selector: {e}") from None
