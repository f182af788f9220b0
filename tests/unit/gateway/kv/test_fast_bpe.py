"""tiktoken in the tokenizers library's place: built only for the byte-level BPEs it encodes alike,
the same ids on any text, checked as it runs, and off for good at the first difference."""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor, wait

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from bench.chat_bpe import tokenizer_dir as bpe_dir
from enginesim.tiny_tokenizer import TINY_DIR
from gateway.endpoints import Endpoint, EndpointPool
from gateway.kv import tokenization
from gateway.kv.events import KVEventsManager
from gateway.kv.fast_bpe import fast_encoder
from gateway.kv.settings import KVEventsConfig
from gateway.kv.tokenization import ModelTokenizer, chain_keys, load_tokenizers
from gateway.request import CHAT, parse

DIRS = {"tiny": TINY_DIR, "bpe": None}      # the chat-bpe tokenizer is built on first use


def _dir(name):
    return DIRS[name] or bpe_dir()


def _spec(name):
    return json.loads((_dir(name) / "tokenizer.json").read_text())


def _library(name):
    lib = Tokenizer.from_file(str(_dir(name) / "tokenizer.json"))
    return lambda s: lib.encode(s, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def encoders():
    out = {}
    for name in DIRS:
        enc, why = fast_encoder(_spec(name), _library(name))
        assert enc is not None, why
        out[name] = (enc, _library(name), [t["content"] for t in _spec(name)["added_tokens"]])
    return out


@settings(max_examples=300)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=120),
       name=st.sampled_from(sorted(DIRS)))
def test_tiktoken_gives_the_librarys_ids_on_any_text(encoders, text, name):
    enc, library, added = encoders[name]
    if any(a in text for a in added):     # texts are cut at added tokens before they are encoded
        return
    assert enc(text) == library(text)


def _changed(spec, path, value):
    spec = json.loads(json.dumps(spec))
    d = spec
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return spec


@pytest.mark.parametrize(("path", "value", "why"), [
    (("normalizer",), {"type": "Lowercase"}, "normalizer"),
    (("pre_tokenizer",), {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}, "pre-tokenizer"),
    (("pre_tokenizer", "add_prefix_space"), True, "pre-tokenizer"),
    (("model", "type"), "WordPiece", "not a BPE"),
    (("model", "byte_fallback"), True, "byte fallback"),
    (("model", "continuing_subword_prefix"), "##", "subword"),
])
def test_other_tokenizers_keep_the_library(path, value, why):
    enc, reason = fast_encoder(_changed(_spec("tiny"), path, value), _library("tiny"))
    assert enc is None and why in reason


def test_merges_out_of_the_order_of_their_ids_or_a_missing_byte_keep_the_library():
    spec = _spec("tiny")
    merges = spec["model"]["merges"]
    swapped = _changed(spec, ("model", "merges"), [merges[1], merges[0], *merges[2:]])
    assert fast_encoder(swapped, _library("tiny"))[1] == "merges not in the order of their tokens' ids"
    vocab = dict(spec["model"]["vocab"])
    del vocab["Ā"]                          # the byte 0's character
    assert fast_encoder(_changed(spec, ("model", "vocab"), vocab), _library("tiny"))[1] == \
        "bytes without a token of their own"


def test_a_sample_text_encoded_differently_keeps_the_library():
    library = _library("tiny")

    def off_by_one(text):                   # differs on one sample text only
        ids = library(text)
        return [*ids, 0] if text.startswith("Hello, world!") else ids

    enc, why = fast_encoder(_spec("tiny"), off_by_one)
    assert enc is None and why.startswith('encodes a sample text differently: "Hello, world!')


def test_the_model_tokenizer_uses_it_unless_told_not_to_and_keys_stay_the_librarys(tmp_path):
    fast, slow = ModelTokenizer(TINY_DIR), ModelTokenizer(TINY_DIR, fast=False)
    assert fast.fast and fast.fast_why == "tiktoken" and not slow.fast
    text = "system prompt here. " * 40 + "\n" + "user: ünïcödé ✓ 123456 and   spaces"
    segs, lead = fast.request_segments(CHAT, {"messages": [{"role": "user", "content": text}]})
    assert fast.block_keys(segs, lead, 5, 16, 1 << 20).keys == slow.block_keys(segs, lead, 5, 16, 1 << 20).keys
    assert fast.fast_checks == {"agreed": len([s for s in segs if s not in fast._special_ids]), "differed": 0}
    # one directory named by two models: off for both when either says so
    other = tmp_path / "copy"
    shutil.copytree(TINY_DIR, other)
    toks = load_tokenizers({"a": str(TINY_DIR), "b": str(TINY_DIR), "c": str(other)}, slow={"b"})
    assert toks["a"] is toks["b"] and not toks["a"].fast and toks["c"].fast


def test_checks_run_on_the_first_segments_then_one_in_256(monkeypatch):
    tok = ModelTokenizer(TINY_DIR)
    checked = []
    real = tok._library_ids
    monkeypatch.setattr(tok, "_library_ids", lambda s: checked.append(s) or real(s))
    for i in range(600):
        tok.encode(f"segment number {i}")
    assert len(checked) == tokenization.FAST_CHECK_FIRST + 600 // tokenization.FAST_CHECK_EVERY - \
        tokenization.FAST_CHECK_FIRST // tokenization.FAST_CHECK_EVERY
    assert tok.fast_checks["agreed"] == len(checked) and tok.fast


class _Jobs(ThreadPoolExecutor):
    """An executor that keeps what it was given, for a test to wait for the thread's work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.jobs = []

    def submit(self, *args, **kwargs):
        job = super().submit(*args, **kwargs)
        self.jobs.append(job)
        return job


async def test_a_difference_turns_it_off_drops_what_it_cached_and_late_results_are_not_stored():
    registry = CollectorRegistry()
    tok = ModelTokenizer(TINY_DIR)
    cfg = KVEventsConfig(enabled=True)
    mgr = KVEventsManager(lambda m: cfg, EndpointPool(), registry, {"m": tok}, tokenize_threads=1)
    told = []
    tok.on_fast_differs = lambda: told.append(1)

    def sample(name, **labels):
        return registry.get_sample_value(name, labels)

    assert sample("switchyard_kv_events_fast_tokenizer", model="m") == 1.0
    msgs = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hello there"}]
    segs, lead = tok.request_segments(CHAT, {"messages": msgs})
    tok.block_keys(segs, lead, 9, 16, 1 << 20)
    agreed = sample("switchyard_kv_events_fast_tokenizer_checks_total", model="m", outcome="agreed")
    assert agreed and tok._segments and tok._prefixes
    # a wrong encoder (an extra token): the thread's encode is unchecked, the loop's next one is checked
    real = tok._fast
    tok._fast = lambda s: [*real(s), 7]
    tok._fast_n = tokenization.FAST_CHECK_EVERY - 2
    with _Jobs(1) as pool:
        late = tok.ahead(["an answer the thread tokenized before the flip"], pool)
        assert late is not None
        # the thread has encoded it (tiktoken's ids, wrong) before the check below; its result is
        # stored by the loop, after the flip (the two encodes never race for the one checked place)
        wait(pool.jobs)
        assert tok._fast_n == tokenization.FAST_CHECK_EVERY - 1 and tok.fast_checks["differed"] == 0
        assert tok._encode_one("a new segment") == tok._library_ids("a new segment")     # the library's ids
        assert not tok.fast and tok.fast_checks["differed"] == 1 and tok._fast_stale
        assert await late == 0 and not tok.is_cached("an answer the thread tokenized before the flip")
    # the next request's keys: everything cached before is dropped, and keys are the library's
    keys = tok.block_keys(segs, lead, 9, 16, 1 << 20).keys
    assert told == [1] and not tok._fast_stale
    assert keys == chain_keys(9, _library("tiny")(tok.render(msgs)), 16)
    assert sample("switchyard_kv_events_fast_tokenizer", model="m") == 0.0
    assert sample("switchyard_kv_events_fast_tokenizer_checks_total", model="m", outcome="differed") == 1
    await mgr.close()


async def test_a_request_keyed_with_tiktoken_matches_the_engines_blocks():
    """End to end in the index: an engine's blocks (the library's ids) matched by keys tiktoken made."""
    from gateway.kv.wire import Batch, BlockStored
    tok = ModelTokenizer(TINY_DIR)
    cfg = KVEventsConfig(enabled=True, speculative_ttl_s=0)
    mgr = KVEventsManager(lambda m: cfg, EndpointPool(), CollectorRegistry(), {"m": tok}, tokenize_threads=1)
    ep = Endpoint(url="http://10.0.0.1:8000", model="m")
    msgs = [{"role": "system", "content": "ünïcödé ✓ and words " * 60}, {"role": "user", "content": "q 1"}]
    ids = _library("tiny")(tok.render(msgs))
    n = len(ids) // 16
    mgr.index.track(ep, cfg)
    mgr.index.apply(mgr.index.states[ep], Batch(0.0, [BlockStored(list(range(1, n + 1)), None, ids[:n * 16], 16)], 0))
    req = parse(CHAT, orjson.dumps({"model": "m", "messages": msgs}), {}, "r")
    await mgr.prepare(req, [ep])
    depths, _, _ = mgr.match(req, [ep])
    assert depths[ep] == min(n * 16, (len(ids) - 1) // 16 * 16)
    await asyncio.sleep(0)
    await mgr.close()
