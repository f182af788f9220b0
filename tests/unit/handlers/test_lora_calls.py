"""The engines' runtime LoRA calls: load and unload bodies, which answers mean done, and which
load errors say the engine is full (the words vLLM and SGLang use)."""

from __future__ import annotations

import orjson
import pytest

from handlers import SGLANG, VLLM


def test_unload_calls_name_the_adapter():
    assert VLLM.lora_unload("sql") == ("/v1/unload_lora_adapter", orjson.dumps({"lora_name": "sql"}))
    assert SGLANG.lora_unload("sql") == ("/unload_lora_adapter", orjson.dumps({"lora_name": "sql"}))


def vllm_error(message: str, type_: str = "BadRequestError", code: int = 400) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


def sglang_answer(error: str = "") -> bytes:
    return orjson.dumps({"success": not error, "error_message": error, "loaded_adapters": {}})


def test_vllm_unload_answers():
    assert VLLM.lora_unload_error(200, b"Success: LoRA adapter 'sql' removed successfully.") is None
    # an adapter that is not there any more is gone, which is what was asked
    assert VLLM.lora_unload_error(404, vllm_error("The lora adapter 'sql' cannot be found.", "NotFoundError",
                                                  404)) is None
    assert VLLM.lora_unload_error(500, vllm_error("boom", "InternalServerError", 500)) == "status 500: boom"


def test_sglang_unload_answers():
    assert SGLANG.lora_unload_error(200, sglang_answer()) is None
    gone = "LoRA with name sql does not exist. Loaded LoRAs: dict_keys(['chat'])"
    assert SGLANG.lora_unload_error(400, sglang_answer(gone)) is None
    assert SGLANG.lora_unload_error(400, sglang_answer("dp_size must be 1")) == "status 400: dp_size must be 1"
    assert SGLANG.lora_unload_error(200, orjson.dumps({"success": False, "error_message": "x"})) == "status 200: x"


@pytest.mark.parametrize(("handler", "status", "answer", "full"), [
    (VLLM, 400, vllm_error("No free adapter slots."), True),
    (VLLM, 404, vllm_error("No adapter found for /a", "NotFoundError", 404), False),
    (SGLANG, 400, sglang_answer("Cannot load LoRA adapter b at path org/b. Maximum number of loaded LoRA adapters "
                                "is 1. Please unload some LoRA adapters before loading new ones."), True),
    (SGLANG, 400, sglang_answer("LoRA is not enabled. Please set `--enable-lora` to enable LoRA."), False),
])
def test_full_is_told_from_the_load_error(handler, status, answer, full):
    error = handler.lora_load_error(status, answer)
    assert error is not None and handler.lora_full(error) is full
