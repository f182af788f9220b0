"""The ``pd`` strategy's settings (``PDRouteSettings``): what ``routers.pd.PDRouter`` reads.

A module of its own so that ``RouterContext`` (routers/base.py) can name the type while
routers/pd.py imports the context. The gateway's ``pd:`` config block
(``gateway.config.schema.PDConfig``) is this class plus the orchestration and engine settings.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Amount = Annotated[float, msgspec.Meta(ge=0)]

PrefillPolicy = Literal["prefix_cache", "least_request", "token_load"]
DecodePolicy = Literal["load_balancing", "least_request"]


class PDRouteSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    prefill_score_policy: PrefillPolicy = "prefix_cache"
    decode_score_policy: DecodePolicy = "load_balancing"
    prefill_imbalance_spread: _Count = 16       # in-flight prefill spread (strictly greater) → least-loaded prefill
    decode_imbalance_spread: _Count = 16        # running spread (>=) → least-loaded decode
    decode_throughput_spread: _Amount = 2048.0  # tokens/s spread (>) → lowest-throughput decode
    prefill_load_std_factor: _Amount = 2.0      # skip prefills above mean + k·stddev of in-flight prefills
    decode_lb_weight_running: _Amount = 1.0
    decode_lb_weight_throughput: _Amount = 1.0
    combined_load_ratio: _Amount = 0.25         # combined wins when its load < ratio × the least prefill load
    token_kv_weight: _Amount = 0.3              # token-load priority = active + weight · kv
