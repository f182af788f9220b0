"""Tokenize a request the way the engine will: a model's Hugging Face tokenizer directory.

Precise prefix routing (``gateway.kv_index``) compares the engine's cached token blocks with the
request's tokens, so the gateway needs the engine's tokens, without asking the engine (a
``/tokenize`` call per request costs a round trip on the hot path). A model's ``tokenizer:`` is a
directory in the standard layout: ``tokenizer.json`` (read by the ``tokenizers`` library) and
``tokenizer_config.json`` (its ``chat_template``, ``bos_token``, ``eos_token``).

* Chat messages are rendered with the template in a sandboxed Jinja environment (templates come
  from model checkpoints; the sandbox refuses attribute tricks), as the engines render them with
  ``add_generation_prompt=true``; the rendered text is tokenized without adding special tokens
  (the template writes them). A completions prompt is tokenized with them; a token-id prompt is
  taken as it is.
* Cached by segment: the ``tokenizers`` library splits the text at added (special) tokens before
  anything else, so the text between two of them tokenizes on its own. The template puts special
  tokens between messages, so a long shared system prompt is one segment, tokenized once and then
  found in an LRU cache (bounded in characters); only the new turn is tokenized.
* Block keys are cached too (``ModelTokenizer.block_keys``): the chained keys of the blocks a
  prefix of segments fills, so a 128k-token conversation hashes only its new turn.
* Off the event loop (``ModelTokenizer.prepare``): before routing, the segments of at least
  ``INLINE_CHARS`` characters that are not cached are tokenized in a thread (with the library's
  ``encode_batch``, which releases the GIL while it encodes; ``encode`` does not) and stored, so the
  router's synchronous match finds them all cached.
  Shorter ones stay inline: a hop to the thread costs more than they do.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from itertools import islice, repeat
from pathlib import Path
from typing import Any

TOKEN_CACHE_CHARS = 64 * 1024 * 1024     # text held by the segment → token ids cache
KEY_CACHE_BLOCKS = 4 * 1024 * 1024       # block keys held by the prefix → keys cache
INLINE_CHARS = 1024                      # shorter uncached segments are tokenized on the loop


class TokenizerError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _sandbox():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    return env


@dataclass(slots=True)
class Keys:
    """A request's chained block keys at one block size, and its token count."""

    keys: list[int]
    tokens: int


class ModelTokenizer:
    """One model's tokenizer with its chat template and caches. The caches belong to the event
    loop; only ``prepare`` hands text to another thread, and stores the ids back on the loop."""

    def __init__(self, directory: str | Path, *, token_cache_chars: int = TOKEN_CACHE_CHARS,
                 key_cache_blocks: int = KEY_CACHE_BLOCKS) -> None:
        from tokenizers import Tokenizer

        d = Path(directory)
        try:
            self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:   # the library raises its own exception types
            raise TokenizerError(f"{d / 'tokenizer.json'}: {e}") from None
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").exists():
            try:
                cfg = json.loads((d / "tokenizer_config.json").read_text())
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{d / 'tokenizer_config.json'}: {e}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):      # named templates: the "default" one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.directory = d
        self.bos_token = _token_text(cfg.get("bos_token")) or ""
        self.eos_token = _token_text(cfg.get("eos_token")) or ""
        self._template = _sandbox().from_string(template) if isinstance(template, str) else None
        added = sorted((t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
                       key=len, reverse=True)
        self._special_ids = {t: self.tokenizer.token_to_id(t) for t in added}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in added) + ")") if added else None
        # what a completions prompt gets around it with special tokens added (e.g. a BOS)
        self._prefix_ids = self.tokenizer.encode("", add_special_tokens=True).ids
        # the library's batch call without character offsets (ids only, ~20% less CPU) where it has one
        # (tokenizers >= 0.20); either releases the GIL while it encodes
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", None) or self.tokenizer.encode_batch
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._segment_chars = 0
        self._token_cache_chars = token_cache_chars
        self._prefixes: OrderedDict[int, tuple[list[int], int, list[int], int]] = OrderedDict()
        self._prefix_blocks = 0
        self._key_cache_blocks = key_cache_blocks
        self.segment_hits = 0
        self.segment_misses = 0
        self.segments_off_loop = 0           # segments ``prepare`` tokenized in the executor
        self._pending: dict[str, asyncio.Future] = {}    # segment → its tokenization under way

    # -- text --------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[Any], **extra: Any) -> str:
        if self._template is None:
            raise TokenizerError(f"{self.directory}: tokenizer_config.json has no chat_template")
        return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                     eos_token=self.eos_token, **extra)

    def segments(self, text: str) -> list[str]:
        """The text cut at special tokens (kept as their own segments)."""
        if self._split is None:
            return [text]
        return [s for s in self._split.split(text) if s]

    def _segment_ids(self, segment: str) -> list[int]:
        special = self._special_ids.get(segment)
        if special is not None:
            return [special]
        ids = self._segments.get(segment)
        if ids is not None:
            self._segments.move_to_end(segment)
            self.segment_hits += 1
            return ids
        self.segment_misses += 1
        ids = self._encode_batch([segment], add_special_tokens=False)[0].ids
        self._store(segment, ids)
        return ids

    def _store(self, segment: str, ids: list[int]) -> None:
        if len(segment) <= self._token_cache_chars // 4 and segment not in self._segments:
            self._segments[segment] = ids
            self._segment_chars += len(segment)
            while self._segment_chars > self._token_cache_chars:
                old, _ = self._segments.popitem(last=False)
                self._segment_chars -= len(old)

    def _encode_all(self, segments: list[str]) -> list[list[int]]:
        """Runs in the executor: no cache is touched here. The batch call, not ``encode``: the
        library releases the GIL only in its batch calls (its single ``encode`` holds it throughout,
        which would stall the event loop for as long as the thread encodes). One segment a call:
        given several, the library spreads them over its own pool of threads, whose workers then
        spin a while for more work, CPU the gateway's ``tokenize_threads`` do not account for."""
        batch = self._encode_batch
        return [batch([s], add_special_tokens=False)[0].ids for s in segments]

    async def prepare(self, segments: Sequence[str] | None, executor: Executor | None,
                      inline_chars: int = INLINE_CHARS) -> int:
        """Tokenize the uncached segments of ``inline_chars`` characters or more in ``executor``
        and cache them, so ``block_keys`` then tokenizes nothing long on the loop. No hop when there
        is nothing long to tokenize; when there is, the short uncached segments go along in the same
        hop (they cost the loop more than they cost the thread). Returns how many segments it
        tokenized there. A segment another request is tokenizing already is awaited, not tokenized
        twice; an encode error leaves the segment uncached (the router's match meets it and counts it)."""
        if segments is None or executor is None:
            return 0
        cache, special, pending = self._segments, self._special_ids, self._pending
        longest = self._token_cache_chars // 4
        todo: dict[str, None] = {}           # long ones, in order, once each
        short: dict[str, None] = {}
        waits: list[asyncio.Future] = []
        short_waits: list[asyncio.Future] = []    # worth awaiting only when this request hops anyway
        done = 0
        for seg in segments:
            if seg in cache or seg in special or len(seg) > longest:
                continue
            fut = pending.get(seg)
            if fut is not None:
                (waits if len(seg) >= inline_chars else short_waits).append(fut)
            elif len(seg) >= inline_chars:
                todo[seg] = None
            else:
                short[seg] = None
        if todo:
            todo.update(short)
            waits += short_waits
            loop = asyncio.get_running_loop()
            mine = loop.create_future()
            for seg in todo:
                pending[seg] = mine
            try:
                out = await asyncio.wrap_future(executor.submit(self._encode_all, list(todo)))
            except Exception:                # left to the inline path, which counts the error
                out = None
            finally:
                for seg in todo:
                    pending.pop(seg, None)
                if not mine.done():
                    mine.set_result(None)
            if out is not None:
                done = len(todo)
                self.segment_misses += len(todo)
                self.segments_off_loop += len(todo)
                for seg, ids in zip(todo, out, strict=True):
                    self._store(seg, ids)
        for fut in waits:
            await asyncio.shield(fut)
        return done

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, cached by segment (equal to the library's own encode)."""
        out: list[int] = list(self._prefix_ids) if add_special_tokens else []
        for segment in self.segments(text):
            out.extend(self._segment_ids(segment))
        return out

    # -- a request ---------------------------------------------------------------------------------

    def request_segments(self, path: str, data: dict[str, Any]) -> tuple[list[str] | None, list[int] | None]:
        """(segments, leading ids) of a chat or completions body, or ``(None, ids)`` for a token-id
        prompt; raises ``TokenizerError`` (or a template error) when it cannot be tokenized."""
        if "messages" in data:
            extra = {k: data[k] for k in ("tools", "documents") if k in data}
            kwargs = data.get("chat_template_kwargs")
            if isinstance(kwargs, dict):
                extra.update({k: v for k, v in kwargs.items() if isinstance(k, str) and k != "messages"})
            return self.segments(self.render(data["messages"], **extra)), []
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.segments(prompt), list(self._prefix_ids)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise TokenizerError("no prompt to tokenize")

    def block_keys(self, segments: list[str] | None, lead: list[int], root: int, block_size: int,
                   max_blocks: int) -> Keys:
        """Chained keys of the full blocks of the request's tokens: ``key[i] = hash((key[i-1],
        block tokens))`` from ``root``. The chain state after each prefix of segments is cached, so
        only the segments after the longest known prefix are tokenized and hashed."""
        if segments is None:                 # token ids given
            return _chain(root, [], lead, block_size, max_blocks)
        ident = (root, block_size, tuple(lead))
        state: tuple[list[int], int, list[int], int] | None = None
        start = 0
        idents = []
        for seg in segments:
            ident = hash((ident, seg))
            idents.append(ident)
        prefixes = self._prefixes
        for j in range(len(segments) - 1, -1, -1):
            found = prefixes.get(idents[j])
            if found is not None:
                prefixes.move_to_end(idents[j])
                state, start = found, j + 1
                break
        if state is None:
            keys, tail, total = [], list(lead), len(lead)
        else:
            # cached states share key lists: a state is (list, length); the list is extended in place
            # when no other continuation extended it yet, else its prefix is copied
            ref, n, tail0, total = state
            keys = ref if len(ref) == n else ref[:n]
            tail = list(tail0)
        for j in range(start, len(segments)):
            ids = self._segment_ids(segments[j])
            total += len(ids)
            tail.extend(ids)
            if len(tail) >= block_size and len(keys) < max_blocks:
                h = keys[-1] if keys else root
                n = min(len(tail) // block_size, max_blocks - len(keys))
                it = iter(tail)               # blocks as tuples, cut in C (as the event index cuts them)
                for block in islice(zip(*repeat(it, block_size), strict=False), n):
                    h = hash((h, block))
                    keys.append(h)
                tail = tail[n * block_size:]
            self._remember(idents[j], keys, tail, total)
        return Keys(keys[:], total)

    def _remember(self, ident: int, keys: list[int], tail: list[int], total: int) -> None:
        if ident in self._prefixes:
            return
        self._prefixes[ident] = (keys, len(keys), list(tail), total)
        self._prefix_blocks += len(keys) + 1      # counted whole although lists are shared
        while self._prefix_blocks > self._key_cache_blocks and self._prefixes:
            _, (_k, n, _t, _n) = self._prefixes.popitem(last=False)
            self._prefix_blocks -= n + 1


def _chain(root: int, keys: list[int], ids: list[int], block_size: int, max_blocks: int) -> Keys:
    h = root
    n = min(len(ids) // block_size, max_blocks)
    for b in range(n):
        h = hash((h, tuple(ids[b * block_size:(b + 1) * block_size])))
        keys.append(h)
    return Keys(keys, len(ids))


def chain_keys(root: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of ``token_ids``' full blocks from ``root`` (what events are hashed into)."""
    return _chain(root, [], list(token_ids), block_size, len(token_ids)).keys


def load_tokenizers(dirs: dict[str, str]) -> dict[str, ModelTokenizer]:
    """model → its tokenizer; a directory that cannot be read is an error naming the model."""
    out: dict[str, ModelTokenizer] = {}
    cache: dict[str, ModelTokenizer] = {}
    for model, d in dirs.items():
        key = str(Path(d).resolve())
        if key not in cache:
            try:
                cache[key] = ModelTokenizer(d)
            except TokenizerError as e:
                raise TokenizerError(f"models[{model}].tokenizer: {e}") from None
        out[model] = cache[key]
    return out
