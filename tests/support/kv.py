"""Helpers of the KV-events tests: a small tokenizer with a chat template of the test's choosing,
random words for prompts, and a gateway routing on the events of an enginesim engine."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from gateway.kv.tokenization import ModelTokenizer
from tests.support.waiting import until

CORPUS = ["hello world how are you", "fine thanks and you hello there", "the quick brown fox jumps"] * 40
SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# no special token anywhere between the messages
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
REFUSES = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception('no assistant') }}"
           "{% endif %}[INST]{{ m['content'] }}[/INST]{% endfor %}")


def toy_tokenizer(directory: Path, template: str, scheme: str = "always") -> ModelTokenizer:
    """A BPE of 200 tokens (a ``Metaspace`` pre-tokenizer with ``prepend_scheme`` ``scheme``) with
    ``SPECIALS``, and ``template`` as its chat template, written to ``directory`` and loaded."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    tok.add_special_tokens([AddedToken(t) for t in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    return ModelTokenizer(directory)


def words(seed: int, n: int = 500) -> list[str]:
    """``n`` random lower-case words of one to seven letters."""
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 7))) for _ in range(n)]


def text(vocabulary: list[str], seed: int, n: int) -> str:
    """``n`` words of ``vocabulary``, drawn with ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(n))


async def events_gateway(sims: Any, gateway: Any, tokenizer: str, engine: dict[str, Any] | None = None,
                         **kv: Any) -> tuple[Any, Any, Any]:
    """(engine, gateway, its KV-events manager): one vLLM enginesim engine publishing KV events (with
    ``engine``'s settings) and a gateway routing model ``m`` with ``prefix-cache`` on them, ``kv``
    laid over its ``kv_events``; returns once the gateway is subscribed."""
    sim = await sims("vllm", model="m", tokenizer=tokenizer, kv_events_port=0, kv_blocks=4096, **(engine or {}))
    s = sim.engine.kv_events
    gw = await gateway([{"name": "m", "engine": "vllm", "endpoints": [sim.url], "tokenizer": tokenizer,
                         "strategy": "prefix-cache", "kv_events": {"enabled": True, "port": s.port, **kv}}])
    manager = gw.gw.routing.ctx.precise_index
    await until(lambda: manager.subscribers)
    await until(lambda: s.subscriptions >= 1)      # subscribed (a slow joiner misses what came before)
    return sim, gw, manager


class FakeSub:
    """A ZeroMQ SUB socket holding some messages, as ``gateway.kv.events.Subscriber._readable``
    reads one (``getsockopt(EVENTS)``, ``recv_multipart``)."""

    def __init__(self, messages):
        self.messages = list(messages)

    def getsockopt(self, opt):
        import zmq

        return zmq.POLLIN if self.messages and opt == zmq.EVENTS else 0

    def recv_multipart(self, flags=0):
        return self.messages.pop(0)
