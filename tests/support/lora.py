"""The LoRA tests' engines (simulated with adapter slots), their request, and the adapter loads an engine saw."""

from __future__ import annotations

from tests.support.http import chat_body, post

MSG = [{"role": "user", "content": "Summarise the adapter's task in one line."}]
LORA_SIM = {"enable_lora": True, "max_loras": 2, "lora_load_ms": 5.0}
FAST_LORA = {"discovery_interval_s": 0.1}


async def chat(gw, model: str, headers=None):
    """A chat request to ``model`` (an adapter's name, or the base model): status, headers, JSON body."""
    r = await post(gw, chat_body(MSG, model=model), headers)
    return r.status, r.headers, r.json()


def load_calls(state: dict) -> list[dict]:
    return [r for r in state["received"] if r["path"] in ("/v1/load_lora_adapter", "/load_lora_adapter")]
