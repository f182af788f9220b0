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
    prefill_score_policy: Annotated[PrefillPolicy, msgspec.Meta(description="How a roleset's prefill endpoint is scored: prefix_cache (prefix match, then load), least_request (prefills in flight) or token_load (tokens being prefilled).")] = "prefix_cache"
    decode_score_policy: Annotated[DecodePolicy, msgspec.Meta(description="How a roleset's decode endpoint is scored: load_balancing (running requests, throughput and free KV cache) or least_request (running plus pending).")] = "load_balancing"
    prefill_imbalance_spread: Annotated[_Count, msgspec.Meta(description="When prefills in flight differ by more than this between prefill endpoints, take the least loaded one.")] = 16
    decode_imbalance_spread: Annotated[_Count, msgspec.Meta(description="When running requests differ by at least this between decode endpoints, take the least running one.")] = 16
    decode_throughput_spread: Annotated[_Amount, msgspec.Meta(description="When generation throughput differs by more than this between decode endpoints, take the slowest one, in tokens per second.")] = 2048.0
    prefill_load_std_factor: Annotated[_Amount, msgspec.Meta(description="Skip prefill endpoints whose prefills in flight exceed mean + this x standard deviation.")] = 2.0
    decode_lb_weight_running: Annotated[_Amount, msgspec.Meta(description="load_balancing decode score: weight of running requests.")] = 1.0
    decode_lb_weight_throughput: Annotated[_Amount, msgspec.Meta(description="load_balancing decode score: weight of generation throughput.")] = 1.0
    combined_load_ratio: Annotated[_Amount, msgspec.Meta(description="Choose a combined endpoint when its load is below this share of the least loaded prefill's.")] = 0.25
    token_kv_weight: Annotated[_Amount, msgspec.Meta(description="token_load prefill score: weight of the tokens resident in KV cache next to the tokens being computed.")] = 0.3
