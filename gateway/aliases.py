"""Model aliases and weighted traffic splits: the ``aliases:`` config block.

A client names an alias in ``model``; the gateway picks one of the alias's target models by weight,
puts that model's name in the body it forwards, and from there on the request is an ordinary
request for the target: its strategy, endpoints, watchdog, limits and metrics. The answer carries
``x-served-model``; the log line an ``alias`` field.

Assignment hashes, it keeps nothing per caller. The caller's key (``sticky: user``: the API key's
user, else the ``user`` header or body field, else the client address; ``sticky: session``: the
``x-session-id`` header, else as ``user``) and the alias name go through BLAKE2b to a point ``u``
in [0, 1); the targets, in config order, cover [0, total weight) with one band each, and the band
holding ``u * total`` is the caller's target. So:

- one caller stays on one target for as long as the weights are unchanged (and across replicas,
  workers and restarts: nothing is random and nothing is stored);
- the shares converge to the weights over many callers (the hash is uniform);
- raising the last target's weight at the expense of the others, total unchanged (a canary going
  from 10 to 20), only moves callers onto it: whoever was on the canary stays there;
- two aliases split independently (the alias name is hashed with the key).

``sticky: none`` draws per request. A target without a ready endpoint is passed over while it
has none: its callers go to the other targets, by the same point, until it is back.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from gateway.config.block import Block
from gateway.observability.metrics import Counter
from gateway.request import body_bytes

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from gateway.endpoints import EndpointPool
    from gateway.pipeline.context import RequestContext

_HASH_SPACE = float(1 << 64)


class AliasTarget(Block):
    model: Annotated[str, Meta(min_length=1, description="A model named in models (or, with kubernetes.enabled, a discovered one).")]
    weight: Annotated[int, Meta(ge=0, description="Share of the alias's callers sent to this model, relative to the other targets (0: none).")] = 1


class AliasConfig(Block):
    """One entry of ``aliases:``; checked against the models in ``check_aliases``."""

    name: Annotated[str, Meta(min_length=1, description="The name clients write in model (no whitespace at its ends).")]
    targets: Annotated[tuple[AliasTarget, ...], Meta(min_length=1, description="The models the alias splits traffic over, by weight.")]
    sticky: Annotated[Literal["user", "session", "none"], Meta(description="What keeps one caller on one target: user, session (x-session-id) or none (a new draw per request).")] = "user"

    def __post_init__(self) -> None:
        seen: dict[str, int] = {}
        for i, t in enumerate(self.targets):
            if t.model in seen:
                raise ValueError(f"targets[{i}].model: {t.model!r} is listed twice (targets[{seen[t.model]}])")
            seen[t.model] = i
        if not any(t.weight > 0 for t in self.targets):
            raise ValueError("targets: at least one weight must be greater than 0")


def check_aliases(aliases: Sequence[AliasConfig], models: Sequence[str], discovered: bool,
                  adapters: Mapping[str, tuple[int, str]] | None = None) -> None:
    """The checks that need the whole config (``Config.__post_init__``): an alias may not shadow a
    model, an adapter the config lists (``adapters``: name → the index and name of its model) or
    another alias, and its targets are models, not adapters the config lists (a target is placed by
    its model's ready endpoints, which an adapter has none of). With Kubernetes discovery on, a
    target that no ``models:`` entry names may still come from discovered pods, so it is accepted. (An alias is
    resolved before the LoRA stage: one named as an adapter would have its targets answer that
    adapter's requests without it.)"""
    model_names = set(models)
    alias_names: dict[str, int] = {}
    for i, a in enumerate(aliases):
        if a.name in model_names:
            raise ValueError(f"aliases[{i}].name: {a.name!r} is a model; an alias may not shadow a model")
        if adapters and a.name in adapters:
            at, model = adapters[a.name]
            raise ValueError(f"aliases[{i}].name: {a.name!r} is a LoRA adapter of model {model!r} "
                             f"(models[{at}].adapters); an alias may not shadow an adapter")
        if a.name in alias_names:
            raise ValueError(f"aliases[{i}].name: duplicate alias {a.name!r} (aliases[{alias_names[a.name]}])")
        alias_names[a.name] = i
    for i, a in enumerate(aliases):
        for j, t in enumerate(a.targets):
            if t.model in alias_names:
                raise ValueError(f"aliases[{i}].targets[{j}].model: {t.model!r} is an alias; "
                                 "an alias points at models, not at other aliases")
            if adapters and t.model in adapters:
                at, model = adapters[t.model]
                raise ValueError(f"aliases[{i}].targets[{j}].model: {t.model!r} is a LoRA adapter of model "
                                 f"{model!r} (models[{at}].adapters); an alias's targets are models")
            if t.model not in model_names and not discovered:
                known = ", ".join(sorted(model_names)) or "none"
                raise ValueError(f"aliases[{i}].targets[{j}].model: unknown model {t.model!r} (models: {known})")


def hash_point(alias: str, key: str) -> float:
    """``key``'s point in [0, 1) for ``alias``: uniform, stable across processes and versions."""
    digest = hashlib.blake2b(f"{alias}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPACE


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    sticky: str
    models: tuple[str, ...]
    weights: tuple[int, ...]

    @classmethod
    def of(cls, cfg: AliasConfig) -> Alias:
        return cls(cfg.name, cfg.sticky, tuple(t.model for t in cfg.targets), tuple(t.weight for t in cfg.targets))

    def pick(self, u: float, usable: Sequence[bool] | None = None) -> str:
        """The target whose band holds ``u`` (in [0, 1)), counting only the ``usable`` targets
        (all, when ``None``); the first target if none is usable (its errors say why)."""
        weights = self.weights if usable is None else tuple(w if ok else 0 for w, ok in zip(self.weights, usable,
                                                                                             strict=True))
        total = sum(weights)
        if total <= 0:
            return self.models[0]
        x = u * total
        for model, w in zip(self.models, weights, strict=True):
            if x < w:
                return model
            x -= w
        return next(m for m, w in zip(reversed(self.models), reversed(weights), strict=True) if w > 0)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sticky": self.sticky,
                "targets": [{"model": m, "weight": w} for m, w in zip(self.models, self.weights, strict=True)]}


def caller_key(sticky: str, user: str | None, session: str | None, address: str | None) -> str | None:
    """What a caller is known by for ``sticky`` (``None`` with ``sticky: none``): see the module
    docstring. The prefixes keep a user named like an address apart from that address."""
    if sticky == "none":
        return None
    if sticky == "session" and session:
        return "s:" + session
    if user:
        return "u:" + user
    return "a:" + (address or "")


class AliasMetrics:
    def __init__(self, registry) -> None:
        self.requests = Counter("switchyard_alias_requests", "Requests that named an alias, by the target chosen",
                                ["alias", "target"], registry=registry)


class NoAliases:
    """A config without aliases: every model name is its own."""

    __slots__ = ()

    def __contains__(self, name: str) -> bool:
        return False

    def describe(self) -> list[dict[str, Any]]:
        return []

    def targets_of(self, name: str) -> tuple[str, ...] | None:
        return None

    def target_for(self, name: str, user: str | None, address: str | None) -> str | None:
        return None

    def resolve(self, ctx: RequestContext, api_user: str | None) -> None:
        pass


NO_ALIASES = NoAliases()


class Aliases:
    """The aliases of one config generation; ``resolve`` is the pipeline's hook."""

    def __init__(self, configs: Sequence[AliasConfig], pool: EndpointPool, metrics: AliasMetrics,
                 rng: random.Random | None = None) -> None:
        self.by_name = {a.name: Alias.of(a) for a in configs}
        self.pool = pool
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._children: dict[tuple[str, str], Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def describe(self) -> list[dict[str, Any]]:
        return [a.describe() for a in self.by_name.values()]

    def targets_of(self, name: str) -> tuple[str, ...] | None:
        """The models alias ``name`` may send a request to; None when ``name`` is no alias."""
        alias = self.by_name.get(name)
        return alias.models if alias is not None else None

    def target_for(self, name: str, user: str | None, address: str | None) -> str | None:
        """The model alias ``name`` would send a caller's request to (``user``: the API key's, if
        known; ``address``: the client's), as ``resolve`` chooses it but without counting it; None
        when ``name`` is no alias. A request refused before its alias was resolved is counted
        under it."""
        alias = self.by_name.get(name)
        if alias is None:
            return None
        return self.choose(alias, caller_key(alias.sticky, user, None, address))

    def choose(self, alias: Alias, key: str | None) -> str:
        u = self.rng.random() if key is None else hash_point(alias.name, key)
        target = alias.pick(u)
        if self.pool.ready(target) or len(alias.models) == 1:
            return target
        usable = [bool(self.pool.ready(m)) for m in alias.models]
        return alias.pick(u, usable) if any(usable) else target

    def resolve(self, ctx: RequestContext, api_user: str | None) -> None:
        """If the request names an alias: choose its target, and make the request one for the
        target (``model`` in the parsed request, its data and the body bytes forwarded)."""
        ireq = ctx.ireq
        assert ireq is not None
        alias = self.by_name.get(ireq.model)
        if alias is None:
            return
        key = caller_key(alias.sticky, api_user or ireq.user, ireq.session_id, ctx.http.remote)
        target = self.choose(alias, key)
        if ctx.api is not None:     # its own body format (a multipart form keeps its file)
            ctx.api.with_model(ireq, target)
        else:
            ireq.data["model"] = target
            ireq.model = target
            # re-encoded once; a later rewrite (include_usage for streams) encodes the data again
            ireq.body = body_bytes(ireq.data, ireq.body)
        ctx.rec.alias = alias.name
        child = self._children.get((alias.name, target))
        if child is None:
            child = self._children[(alias.name, target)] = self.metrics.requests.labels(alias.name, target)
        child.inc()
