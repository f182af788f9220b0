"""vLLM P/D payloads: exact prefill fields, decode body with the prefill's KV params."""

from __future__ import annotations

import orjson
import pytest

from handlers import vllm as vl

# -- vLLM payloads ---------------------------------------------------------------------------------

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
          "stream_options": {"include_usage": True}, "max_tokens": 50, "min_tokens": 5, "temperature": 0.2}


def test_vllm_prefill_body_exact_fields():
    body = orjson.loads(vl.prefill_body(CLIENT))
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["messages"] == CLIENT["messages"] and body["temperature"] == 0.2
    assert CLIENT["stream"] is True  # the client's dict is not modified
    # one choice prefilled: the decode's choices all read its blocks
    several = orjson.loads(vl.prefill_body({**CLIENT, "n": 3, "best_of": 4}))
    assert "n" not in several and "best_of" not in several


def test_vllm_decode_body_carries_params_with_rewritten_host():
    kv = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]],
          "remote_host": "localhost", "remote_port": 5600, "remote_request_id": "x"}
    answer = orjson.dumps({"id": "c", "choices": [], "kv_transfer_params": kv})
    got = vl.kv_params_from_answer(answer)
    body = orjson.loads(vl.decode_body(CLIENT, got, "192.168.1.100"))
    assert body["kv_transfer_params"]["remote_host"] == "192.168.1.100"
    assert body["kv_transfer_params"]["remote_engine_id"] == "e1"
    assert body["stream"] is True and body["max_tokens"] == 50 and body["min_tokens"] == 5
    assert orjson.loads(vl.decode_body(CLIENT, got, None))["kv_transfer_params"]["remote_host"] == "localhost"


def test_vllm_prefill_answers():
    assert vl.kv_params_from_answer(b'{"choices":[],"kv_transfer_params":null}') is None
    assert orjson.loads(vl.decode_body(CLIENT, None, "h")) == CLIENT   # no params: the original request
    for bad in (b"not json", b"[1]", b'{"kv_transfer_params": 5}', b'{"error": {"message": "kv failed"}}',
                b'{"object": "error", "message": "kv failed", "code": 500}'):
        with pytest.raises(vl.BadPrefillAnswer):
            vl.kv_params_from_answer(bad)
