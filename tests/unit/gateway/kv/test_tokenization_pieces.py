"""Tokenizing piece by piece (cut at special tokens, cached per piece) gives the library's ids for
the whole text, also for tokenizers that treat a text's first piece apart (Metaspace with
``prepend_scheme: first``, Llama-2/Mistral style), and for those whose pieces cannot add up (a special
token that strips the spaces around it), which are then tokenized whole."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from gateway.kv.tokenization import ModelTokenizer, chain_keys
from gateway.request import CHAT, COMPLETIONS

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CORPUS = ["hello world how are you", "fine thanks and you hello there", "the quick brown fox jumps"] * 40
MESSAGES = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine thanks"},
            {"role": "user", "content": "how are you  the fox"}]


def _dir(tmp_path, scheme: str = "first", lstrip: bool = False):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.add_special_tokens([AddedToken("[INST]", lstrip=lstrip), AddedToken("[/INST]")])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return tmp_path


def _whole(tok: ModelTokenizer, text: str, special: bool = False) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("scheme", ["first", "always", "never"])
def test_chat_and_prompt_keys_match_the_whole_texts_ids(tmp_path, scheme):
    tok = ModelTokenizer(_dir(tmp_path, scheme))
    assert not tok._whole and tok._first_differs == (scheme == "first")
    text = tok.render(MESSAGES)
    for _ in range(2):                     # uncached, then from the caches
        segs, lead = tok.request_segments(CHAT, {"messages": MESSAGES})
        assert tok.block_keys(segs, lead, 5, 4, 1000).keys == chain_keys(5, _whole(tok, text), 4)
        assert tok.encode(text) == _whole(tok, text)
    prompt = "hello there[INST] the fox [/INST] you"   # a completions prompt: its first piece at offset 0
    segs, lead = tok.request_segments(COMPLETIONS, {"prompt": prompt})
    assert lead + tok.encode(prompt) == _whole(tok, prompt, special=True)
    assert tok.block_keys(segs, lead, 5, 4, 1000).keys == chain_keys(5, _whole(tok, prompt, special=True), 4)


def test_the_first_piece_and_the_same_text_later_are_told_apart(tmp_path):
    tok = ModelTokenizer(_dir(tmp_path))
    first = tok.encode("hello there")
    later = tok.encode("[INST]hello there")[1:]
    assert first != later and first == _whole(tok, "hello there")
    assert later == _whole(tok, "[INST]hello there")[1:]


def test_pieces_that_cannot_add_up_are_tokenized_whole(tmp_path):
    tok = ModelTokenizer(_dir(tmp_path, "always", lstrip=True))    # "[INST]" swallows the space before it
    assert tok._whole
    text = tok.render(MESSAGES)
    segs, lead = tok.request_segments(CHAT, {"messages": MESSAGES})
    assert segs == [text]
    assert tok.block_keys(segs, lead, 5, 4, 1000).keys == chain_keys(5, _whole(tok, text), 4)


def test_the_projects_tokenizer_is_cut_in_pieces():
    from enginesim.tiny_tokenizer import TINY_DIR
    tok = ModelTokenizer(TINY_DIR)
    assert not tok._whole and not tok._first_differs
