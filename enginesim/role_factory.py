"""Picking the serving role for a config: the one place that knows every role class.

It sits above ``roles.py`` and the P/D modules (which import ``roles`` for ``BaseRole``), so the
choice lives here rather than in ``roles.py``; the engine calls it when it is built.
"""

from __future__ import annotations

from enginesim.config import SimConfig
from enginesim.pd_sglang import SglangDecodeRole, SglangPrefillRole
from enginesim.pd_vllm import NixlRole
from enginesim.roles import AggregatedRole, Role, RoleHost


def make_role(cfg: SimConfig, engine: RoleHost) -> Role:
    if cfg.role == "aggregated":
        return AggregatedRole(cfg, engine)
    if cfg.engine == "vllm":
        return NixlRole(cfg, engine)
    if cfg.role == "prefill":
        return SglangPrefillRole(cfg, engine)
    return SglangDecodeRole(cfg, engine)
