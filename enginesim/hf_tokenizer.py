"""A Hugging Face tokenizer directory as the simulator's tokenizer (``--tokenizer DIR``).

Same interface as ``enginesim.tokenizer.FakeTokenizer`` (``encode``, ``encode_chat``, ``piece``,
``decode``, ``output_ids``), backed by the ``tokenizers`` library and the directory's
``chat_template`` rendered in a sandboxed Jinja environment, the way vLLM renders chat requests
(``add_generation_prompt``, the template writes the special tokens, none added on top). A gateway
given the same directory computes the same token ids, so its prefix routing on KV events lines up
with the blocks this engine reports. ``enginesim.tiny_tokenizer`` builds a small such directory.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

_CACHE_CHARS = 32 * 1024 * 1024
_LOADED: dict[str, HFTokenizer] = {}


def load(directory: str | Path) -> HFTokenizer:
    """One tokenizer (and cache) per directory in a process: simulators started in one process share it."""
    key = str(Path(directory).resolve())
    tok = _LOADED.get(key)
    if tok is None:
        tok = _LOADED[key] = HFTokenizer(directory)
    return tok


def forget_segments() -> None:
    """Empty the segment caches of every tokenizer this process loaded (``load``), so simulators
    started after it tokenize every prompt as engines started in a fresh process would.
    ``bench/routing.py`` calls it before each strategy's engines start: the first strategy's engines
    would otherwise tokenize every prompt while the later ones find them cached, which costs the
    first run CPU the others do not spend on the same cores."""
    for tok in _LOADED.values():
        tok.forget_segments()


def _special(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class HFTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(directory)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.vocab_size: int = self.tokenizer.get_vocab_size()
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _special(cfg.get("bos_token"))
        self.eos_token = _special(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if isinstance(template, str) else None
        specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        # what the model "generates": whole-word vocabulary entries, in id order (stable)
        vocab = self.tokenizer.get_vocab()
        words = sorted(i for t, i in vocab.items() if t not in specials and len(t) > 2 and t[0] == "\u0120"
                       and t[1:].isalpha() and t[1:].islower())
        self.output_ids: tuple[int, ...] = tuple(words[:512]) or tuple(sorted(vocab.values())[:512])
        # the library cuts text at added tokens first, so the text between two of them tokenizes
        # alone: chat prompts are tokenized per message, and a repeated message comes from a cache
        added = sorted(specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._ids = {t: self.tokenizer.token_to_id(t) for t in added}
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def forget_segments(self) -> None:
        self._cache.clear()
        self._cached_chars = 0

    def _encode_plain(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for seg in self._split.split(text):
            if not seg:
                continue
            special = self._ids.get(seg)
            if special is not None:
                out.append(special)
                continue
            ids = self._cache.get(seg)
            if ids is None:
                ids = self.tokenizer.encode(seg, add_special_tokens=False).ids
                self._cache[seg] = ids
                self._cached_chars += len(seg)
                while self._cached_chars > _CACHE_CHARS:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
            else:
                self._cache.move_to_end(seg)
            out.extend(ids)
        return out

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: the chat request's, handed to the template as vLLM hands them (``tools``),
        for it to render where it puts them (a template without ``tools`` ignores them)."""
        if self._template is None:
            raise ValueError("the tokenizer has no chat_template")
        extra = {"tools": tools} if tools else {}
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                     eos_token=self.eos_token, **extra)

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._encode_plain(self.render_chat(messages, tools))

    def encode_open_chat(self, messages: Sequence[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``continue_final_message``: the conversation without a generation prompt, cut right
        after the last message's text (its end-of-turn tokens dropped), as transformers does."""
        if self._template is None:
            raise ValueError("the tokenizer has no chat_template")
        extra = {"tools": tools} if tools else {}
        text = self._template.render(messages=messages, add_generation_prompt=False, bos_token=self.bos_token,
                                     eos_token=self.eos_token, **extra)
        content = messages[-1].get("content") if messages else None
        if isinstance(content, str) and content:
            cut = text.rfind(content)
            if cut >= 0:
                text = text[:cut + len(content)]
        return self._encode_plain(text)

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def pieces(self, token_ids: Iterable[int]) -> list[str]:
        return [self.piece(t) for t in token_ids]

    def decode(self, token_ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)
