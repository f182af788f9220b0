"""Tokenize a request the way the engine will: a model's Hugging Face tokenizer directory.

Precise prefix routing (``gateway.kv.index``) compares the engine's cached token blocks with the
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
  found in an LRU cache (bounded in characters); only the new turn is tokenized. With several
  workers, what one worker tokenizes reaches its siblings' caches (``on_store``, ``adopt``), so a
  conversation whose next turn another worker takes is not tokenized again there.
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
import contextlib
import json
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from itertools import islice, repeat
from pathlib import Path
from typing import Any

from gateway.kv.fast_bpe import CHECK_EVERY as FAST_CHECK_EVERY
from gateway.kv.fast_bpe import CHECK_FIRST as FAST_CHECK_FIRST
from gateway.kv.fast_bpe import fast_encoder

TOKEN_CACHE_CHARS = 64 * 1024 * 1024     # text held by the segment → token ids cache
KEY_CACHE_BLOCKS = 4 * 1024 * 1024       # block keys held by the prefix → keys cache
INLINE_CHARS = 1024                      # shorter uncached segments are tokenized on the loop
AHEAD_CHARS = 2048                       # a chat's unreached segments this short are tokenized after routing
PROBE_CHARS = 256                        # an uncached segment this long is probed before it is tokenized
DEEP_PROBE_BLOCKS = 4                    # a probe held throughout is taken this many blocks further once
SHARE_CHARS = 32                         # segments this long that are tokenized are shared with sibling workers
_PROBES_KEPT = 4096                      # segments whose probe is remembered (``prepare`` then ``match``)
SHAPES_KEPT = 512                        # chat shapes (sequences of roles) whose pieces are kept
SHAPE_MESSAGES = 128                     # a longer chat is rendered (its shape would not be met again)
CHECK_EVERY = 64                         # one chat in this many put together by its shape is also rendered
ANSWERS_KEPT = 4096                      # answers tokenized ahead whose next turn is still awaited
ANSWERS_UNHELD = 64                      # next turns in a row with their answer held nowhere: answers paused
ANSWER_SAMPLE = 16                       # while paused, one answer in this many is tokenized ahead still
# marks a text's first segment for a tokenizer that treats it apart: a Metaspace pre-tokenizer with
# ``prepend_scheme: first`` (Llama-2, Mistral) prepends "▁" to the first piece of a text only, not to
# the text after a special token (a user text that starts with it only shifts its routing keys)
_FIRST = "\x00"
_MARK = re.compile("\x02p(\\d+)\x02")      # a placeholder content in a chat's shape (``_learn_shape``)
_PADDED = re.compile("( \n)?\x02p(\\d+)\x02(\n )?")   # ... padded, as the template wrote it


# a chat's shape (``ModelTokenizer._learn_shape``): its segments with placeholders, the segments
# that hold one content, those that hold several, whether each content is trimmed
_Shape = tuple[list[str], list[tuple[int, str, int, str]], list[tuple[int, list[Any]]], tuple[bool, ...]]


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
    """A request's chained block keys at one block size, and its token count. ``exact`` is false when
    the keys stop where no engine's cache reaches (``block_keys`` with ``reach``): the keys then end
    there (past it no engine can match) and ``tokens`` counts the rest from its characters."""

    keys: list[int]
    tokens: int
    exact: bool = True
    rest: int = -1             # not exact: the index of the first segment left untokenized


class ModelTokenizer:
    """One model's tokenizer with its chat template and caches. The caches belong to the event
    loop; only ``prepare`` hands text to another thread, and stores the ids back on the loop."""

    def __init__(self, directory: str | Path, *, token_cache_chars: int = TOKEN_CACHE_CHARS,
                 key_cache_blocks: int = KEY_CACHE_BLOCKS, fast: bool = True) -> None:
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
        self._encode_batch_first = _batch_call(self.tokenizer)
        rest = _rest_tokenizer(d / "tokenizer.json")
        # segments after the first: the same tokenizer, unless it treats the first piece apart
        self._encode_batch = _batch_call(rest) if rest is not None else self._encode_batch_first
        self._first_differs = rest is not None
        self._whole = False
        self._fast: Callable[[str], list[int]] | None = None     # set below, once the pieces are known to agree
        if not self._pieces_agree(template if isinstance(template, str) else ""):
            # the pieces do not add up to the whole text's ids (e.g. a special token that strips the
            # spaces around it): tokenize every text whole, uncached by segment, but right
            self._whole, self._first_differs = True, False
            self._encode_batch = self._encode_batch_first
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._segment_chars = 0
        self._token_cache_chars = token_cache_chars
        self._prefixes: OrderedDict[int, tuple[list[int], int, list[int], int]] = OrderedDict()
        self._prefix_blocks = 0
        self._key_cache_blocks = key_cache_blocks
        self.segment_hits = 0
        self.segment_misses = 0
        self.segments_off_loop = 0           # segments ``prepare`` tokenized in the executor
        self.segments_unreached = 0          # segments left untokenized: no engine's cache reaches them
        self._probes: dict[str, list[int]] = {}    # segment → ids of its first characters
        self._seen_chars = 0                 # characters and tokens tokenized so far: the ratio that
        self._seen_tokens = 0                # estimates a segment left untokenized
        self._pending: dict[str, asyncio.Future] = {}    # segment → its tokenization under way
        # told of each segment of SHARE_CHARS or more cached here (its ids tokenized here, not adopted):
        # the shared view sends them to the sibling workers (gateway.view.service)
        self.on_store: Callable[[str, list[int]], None] | None = None
        self._answer_form: tuple[str, str, bool] | None | bool = False     # False: not learned yet
        # a plain chat put together from its shape's pieces (``chat_segments``)
        self._shapes: OrderedDict[tuple[str, ...], _Shape | None] = OrderedDict()
        self._once: OrderedDict[int, None] = OrderedDict()     # hashes of the shapes met once, not learned
        self._apart_memo: dict[tuple[str, str], bool] = {}
        self.shapes_off = self._template is None or self._split is None or self._whole
        self._check_in = 1
        self.renders = {"shape": 0, "template": 0, "mismatch": 0}    # chats keyed, by how they were rendered
        self.on_mismatch: Callable[[], None] | None = None          # told when a check turns shapes off
        # a content's screening for special tokens: their first characters found by ``in`` (memchr)
        starts = {t[:1] for t in added}
        self._special_starts = tuple(starts) if len(starts) <= 4 else None
        self._token_ends: tuple[set[str], set[str]] | None = None   # special tokens' proper heads, tails
        # the answers tokenized ahead (hashes of their pieces) until a next turn sends one back: is the
        # block with its first tokens held by an engine then? (``answers_wanted``)
        self._answers: dict[int, None] = {}
        self.answers_met = {"held": 0, "not_held": 0}
        self._unheld_run = 0                 # next turns in a row whose answer's block was held nowhere
        self._answer_lead_n: int | None = None
        self._answer_draws = 0
        # tiktoken in the library's place where it encodes alike (``gateway.kv.fast_bpe``), checked on
        # the first segments and one in CHECK_EVERY; the first difference turns it off for good
        self.fast_why = "off (kv_events.fast_tokenizer)"
        self.fast_checks = {"agreed": 0, "differed": 0}
        self._fast_n = 0
        self._fast_stale = False             # a check differed: what it encoded is dropped on the loop
        self._generation = 0                 # bumped when cached ids are dropped (thread results landing later)
        self.on_fast_differs: Callable[[], None] | None = None
        if fast:
            self._use_fast()

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
        """The text cut at special tokens (kept as their own segments); the first one marked when
        the tokenizer treats a text's first piece apart (``_FIRST``)."""
        if self._split is None or self._whole:
            return [text]
        out = [s for s in self._split.split(text) if s]
        if self._first_differs and out and out[0] not in self._special_ids:
            out[0] = _FIRST + out[0]
        return out

    # -- a chat by its shape ------------------------------------------------------------------------

    def chat_segments(self, messages: Any) -> list[str] | None:
        """The segments of a plain chat (every message exactly a ``role`` and a string ``content``),
        put together from the pieces the template rendered once for its shape, the sequence of its
        roles, with placeholders as contents (``_learn_shape``): the same segments as ``segments(
        render(messages))`` without rendering the template or scanning the whole text for special
        tokens. ``None`` when the chat is not plain, the template's shape was not recognized, a
        content is empty or holds a special token's text, or shapes are off (``shapes_off``).

        A shape is learned at its second chat (the first is rendered). Checked: the first chat put
        together from each shape, and one in ``CHECK_EVERY``, is also rendered whole
        and compared. A template that writes some contents otherwise than its placeholders (one
        that rewrites earlier answers, say) differs at some point; shapes are then off for good
        (counted in ``renders["mismatch"]``, ``on_mismatch`` told) and every chat is rendered."""
        if self.shapes_off or type(messages) is not list or not messages or len(messages) > SHAPE_MESSAGES:
            return None
        roles: list[str] = []
        contents: list[str] = []
        for m in messages:
            if type(m) is not dict or len(m) != 2:
                return None
            role, content = m.get("role"), m.get("content")
            if type(role) is not str or type(content) is not str or len(role) > 32:
                return None              # (a long role is no role a template knows; shapes keep roles)
            roles.append(role)
            contents.append(content)
        key = tuple(roles)
        shapes = self._shapes
        shape = shapes.get(key, False)
        if shape is False:
            # learned at its second chat: a shape met once (or a stream of made-up ones) costs the
            # template's render as before, not the learning's two renders and checks
            once, h = self._once, hash(key)  # by hash: a collision only learns a shape early
            if h not in once:
                once[h] = None
                if len(once) > 4 * SHAPES_KEPT:
                    once.popitem(last=False)
                return None
            del once[h]
            shape = shapes[key] = self._learn_shape(key)
            if len(shapes) > SHAPES_KEPT:
                shapes.popitem(last=False)
            if shape is not None:
                self._check_in = 1           # a new shape's first chat is checked
        if shape is None:
            return None
        base, slots, spread, trims = shape
        starts, split = self._special_starts, self._split
        one = starts[0] if starts is not None and len(starts) == 1 else None
        for i, trim in enumerate(trims):
            c = contents[i].strip() if trim else contents[i]
            if not c:
                return None
            if (one in c if one is not None else starts is None or any(x in c for x in starts)) \
                    and split.search(c):     # type: ignore[union-attr]
                return None
            contents[i] = c
        out = base[:]
        for at, before, i, after in slots:
            out[at] = before + contents[i] + after
        for at, parts in spread:
            out[at] = "".join([x if x.__class__ is str else contents[x] for x in parts])
        self._check_in -= 1
        if self._check_in <= 0:
            self._check_in = CHECK_EVERY
            if out != self.segments(self.render(messages)):
                self.shapes_off = True
                self.renders["mismatch"] += 1
                if self.on_mismatch is not None:
                    self.on_mismatch()
                return None
        self.renders["shape"] += 1
        return out

    def _learn_shape(self, roles: tuple[str, ...]) -> _Shape | None:
        """The pieces of a chat whose roles are ``roles``: its segments rendered with placeholders as
        contents; where a segment holds one content, ``(place, before, i, after)`` (message i's
        content between two texts); where it holds several, ``(place, [texts and message indices])``;
        and whether the template trims each content. ``None`` when the template refuses the shape, or does not write each
        placeholder (``\x02p<i>\x02``: a letter in it, so a template that changes a content's case
        does not write it as given) once, as it was given (or trimmed) and away from text that
        could make a special token with it."""
        n = len(roles)
        try:
            text = self.render([{"role": r, "content": f"\x02p{i}\x02"} for i, r in enumerate(roles)])
            spaced = self.render([{"role": r, "content": f" \n\x02p{i}\x02\n "} for i, r in enumerate(roles)])
        except Exception:                # a template may refuse a shape (or raise its own errors)
            return None
        # one pass over each text (a chat of many messages must not cost a pass per message)
        seen = [int(m.group(1)) for m in _MARK.finditer(text)]
        if len(seen) != n or set(seen) != set(range(n)):    # each placeholder written once
            return None
        trims = [True] * n
        for m in _PADDED.finditer(spaced):
            left, right, i = m.group(1), m.group(3), int(m.group(2))
            if (left is None) != (right is None) or i >= n:
                return None              # trimmed on one side only (or not a placeholder of ours)
            trims[i] = left is None
        expect = _MARK.sub(lambda m: m.group(0) if trims[int(m.group(1))] else f" \n{m.group(0)}\n ", text)
        if expect != spaced:             # written differently with the padding
            return None
        longest = max(map(len, self._special_ids))
        for m in _MARK.finditer(text):
            at, end = m.span()
            if not self._apart(text[max(0, at - longest):at], text[end:end + longest]):
                return None
        base: list[str] = []
        slots: list[tuple[int, str, int, str]] = []
        spread: list[tuple[int, list[Any]]] = []
        for at, seg in enumerate(self.segments(text)):
            parts = _MARK.split(seg)     # texts at even places, message indices at odd ones
            base.append(sys.intern(seg) if len(parts) == 1 else seg)    # shapes share their texts
            if len(parts) == 3:
                slots.append((at, parts[0], int(parts[1]), parts[2]))
            elif len(parts) > 3:
                spread.append((at, [int(x) if i % 2 else x for i, x in enumerate(parts) if x]))
        return base, slots, spread, tuple(trims)

    def _apart(self, before: str, after: str) -> bool:
        """No special token's text could start in the text ``before`` a content and end in the
        content, or start in the content and end in the text ``after`` it (the content would then be
        split where its placeholder was not)."""
        memo = self._apart_memo
        found = memo.get((before, after))
        if found is not None:
            return found
        if self._token_ends is None:
            self._token_ends = ({t[:k] for t in self._special_ids for k in range(1, len(t))},
                                {t[k:] for t in self._special_ids for k in range(1, len(t))})
        heads, tails = self._token_ends
        found = not any(before[-k:] in heads for k in range(1, len(before) + 1)) and \
            not any(after[:k] in tails for k in range(1, len(after) + 1))
        if len(memo) < 4096:             # the texts around contents: a few per template
            memo[(before, after)] = found
        return found

    def answer_segment(self, answer: str) -> str | None:
        """The segment a chat's next turn will hold for ``answer``, the assistant message it sends
        back: the text the chat template puts around an assistant message's content up to the
        special tokens on either side, with the content as the template writes it (trimmed or not).
        ``None`` when the template's form for it was not recognized (``_learn_answer_form``), or the
        answer holds a special token's text (it would span several segments)."""
        form = self.answer_form
        if form is None or (self._split is not None and self._split.search(answer)):
            return None
        before, after, trimmed = form
        return before + (answer.strip() if trimmed else answer) + after

    @property
    def answer_form(self) -> tuple[str, str, bool] | None:
        """(text before an answer's content, after it, whether it is trimmed) in its segment, learned
        from the template on first use; ``None`` when not recognized."""
        if self._answer_form is False:
            self._answer_form = self._learn_answer_form()
        return self._answer_form or None      # type: ignore[return-value]

    def _learn_answer_form(self) -> tuple[str, str, bool] | None:
        """How the template writes an assistant message between two user messages (the shape of a
        conversation's next turn): (text before the content, text after it, whether it is trimmed)
        within the content's segment, read off that shape (``_learn_shape``). ``None`` when the
        shape is not recognized, or the content does not have a segment of its own (no special
        token between it and the user messages) or is the text's first piece."""
        if self._template is None or self._split is None or self._whole:
            return None
        shape = self._learn_shape(("user", "assistant", "user"))
        if shape is None:
            return None
        for _, before, i, after in shape[1]:
            if i == 1:
                return None if before.startswith(_FIRST) else (before, after, shape[3][1])
        return None

    def expect_answer(self, segment: str) -> None:
        """``segment``, an answer's piece, was tokenized ahead: the first request to send it back
        tells whether an engine held the block with its first generated tokens (``block_keys``)."""
        answers = self._answers
        if len(answers) >= ANSWERS_KEPT:
            del answers[next(iter(answers))]
        answers[hash(segment)] = None

    def _answer_lead(self) -> int:
        """The token in an answer's piece that is surely one the engine generated: past the text the
        template writes before the content (which the turn's generation prompt held already), and one
        more, in case that text's last token merged with the content's first."""
        lead = self._answer_lead_n
        if lead is None:
            form = self.answer_form
            lead = self._answer_lead_n = (len(self._encode_one(form[0])) if form and form[0] else 0) + 1
        return lead

    def _answer_met(self, held: bool) -> None:
        if held:
            self.answers_met["held"] += 1
            self._unheld_run = 0
        else:
            self.answers_met["not_held"] += 1
            self._unheld_run += 1

    def answers_paused(self, limit: int) -> bool:
        """Whether the last ``limit`` next turns that sent back an answer tokenized ahead found the
        block with its first tokens held by no engine (0: never paused). An engine that does not cache
        what it generates, or a chat template that changes the earlier answers (dropping a reasoning
        block), or tokens the engine generated otherwise than the text tokenizes, make that block
        one no engine holds: tokenizing answers ahead would then cost the relay and the thread for
        nothing."""
        return 0 < limit <= self._unheld_run

    def answers_wanted(self, limit: int) -> bool:
        """Whether to tokenize the next answer ahead: yes unless ``answers_paused``; while paused, one
        in ``ANSWER_SAMPLE``, so that a next turn finding its answer held ends the pause."""
        if not self.answers_paused(limit):
            return True
        self._answer_draws += 1
        return self._answer_draws % ANSWER_SAMPLE == 0

    def _use_fast(self) -> None:
        if self._whole or self._first_differs:
            self.fast_why = "the tokenizer treats a text's pieces apart"
            return
        try:
            spec = json.loads((self.directory / "tokenizer.json").read_text())
        except (OSError, ValueError) as e:
            self.fast_why = str(e)
            return
        self._fast, why = fast_encoder(spec, self._library_ids)
        self.fast_why = why or "tiktoken"

    @property
    def fast(self) -> bool:
        """Whether segments are encoded by tiktoken (``gateway.kv.fast_bpe``) rather than the library."""
        return self._fast is not None

    def _library_ids(self, segment: str) -> list[int]:
        return self._encode_batch([segment], add_special_tokens=False)[0].ids

    def _encode_one(self, segment: str) -> list[int]:
        fast = self._fast
        if fast is not None:
            ids = fast(segment)
            n = self._fast_n = self._fast_n + 1
            if n <= FAST_CHECK_FIRST or n % FAST_CHECK_EVERY == 0:
                return self._check_fast(segment, ids)
            return ids
        if self._first_differs and segment.startswith(_FIRST):
            return self._encode_batch_first([segment[1:]], add_special_tokens=False)[0].ids
        return self._encode_batch([segment], add_special_tokens=False)[0].ids

    def _check_fast(self, segment: str, ids: list[int]) -> list[int]:
        """``ids`` (tiktoken's) when the library agrees; else the library's, and tiktoken off: the
        segments it encoded are dropped from the caches on the loop (``_drop_fast``), so keys made
        from them are made again."""
        library = self._library_ids(segment)
        if library == ids:
            self.fast_checks["agreed"] += 1
            return ids
        self.fast_checks["differed"] += 1
        self._fast = None
        self.fast_why = "differed from the library"
        self._fast_stale = True
        return library

    def _dropped_since(self, generation: int) -> bool:
        """Whether ids encoded since ``generation`` may hold tiktoken's from before a check differed
        (then they are not stored)."""
        return self._fast_stale or generation != self._generation

    def _drop_fast(self) -> None:
        """On the loop, after a check differed: every cached id and key goes (they may hold tiktoken's)."""
        self._fast_stale = False
        self._generation += 1
        self._segments.clear()
        self._segment_chars = 0
        self._prefixes.clear()
        self._prefix_blocks = 0
        self._probes.clear()
        if self.on_fast_differs is not None:
            self.on_fast_differs()

    def _pieces_agree(self, template: str) -> bool:
        """Whether tokenizing a text piece by piece (cut at special tokens) gives the library's ids
        for the whole text, checked on a few texts around the special tokens the chat template, BOS
        and EOS use."""
        if self._split is None:
            return True
        used = [t for t in self._special_ids if t in template or t in (self.bos_token, self.eos_token)]
        for sp in (used or list(self._special_ids))[:16]:
            for text in (f"Hello world {sp} How are you?\n{sp}\nfine,  thanks", f"{sp}x{sp} y {sp}", f"a{sp}b"):
                whole = self.tokenizer.encode(text, add_special_tokens=False).ids
                pieces = [i for seg in self.segments(text) for i in (
                    [self._special_ids[seg]] if seg in self._special_ids else self._encode_one(seg))]
                if pieces != whole:
                    return False
        return True

    def is_cached(self, segment: str) -> bool:
        return segment in self._segments

    def needs_tokens(self, segment: str) -> bool:
        """Neither cached nor a special token."""
        return segment not in self._segments and segment not in self._special_ids

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
        ids = self._encode_one(segment)
        self._store(segment, ids)
        return ids

    def _store(self, segment: str, ids: list[int]) -> None:
        if self._keep(segment, ids):
            hook = self.on_store
            if hook is not None and len(segment) >= SHARE_CHARS:
                hook(segment, ids)

    def _keep(self, segment: str, ids: list[int]) -> bool:
        self._seen_chars += len(segment)
        self._seen_tokens += len(ids)
        if len(segment) > self._token_cache_chars // 4 or segment in self._segments:
            return False
        self._segments[segment] = ids
        self._segment_chars += len(segment)
        while self._segment_chars > self._token_cache_chars:
            old, _ = self._segments.popitem(last=False)
            self._segment_chars -= len(old)
        return True

    def adopt(self, segment: str, ids: list[int]) -> bool:
        """Cache ids another process tokenized (a sibling worker's ``on_store``), without telling
        ``on_store`` again; whether they were new here."""
        return self._keep(segment, ids)

    def _encode_all(self, segments: list[str]) -> list[list[int]]:
        """Runs in the executor: no cache is touched here. The batch call, not ``encode``: the
        library releases the GIL only in its batch calls (its single ``encode`` holds it throughout,
        which would stall the event loop for as long as the thread encodes). One segment a call:
        given several, the library spreads them over its own pool of threads, whose workers then
        spin a while for more work, CPU the gateway's ``tokenize_threads`` do not account for."""
        return [self._encode_one(s) for s in segments]

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
            generation = self._generation
            try:
                out = await asyncio.wrap_future(executor.submit(self._encode_all, list(todo)))
                if self._dropped_since(generation):
                    out = None               # made again inline
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

    def ahead(self, segments: Sequence[str], executor: Executor) -> asyncio.Future | None:
        """Tokenize ``segments`` (those uncached and not under way) in ``executor`` with no task on
        the loop: the thread's result is stored by one callback the loop runs (``_stored_ahead``).
        Returns a future of the loop that resolves to how many segments were stored (0 on an
        encode error), or ``None`` when there is nothing to do. The segments are marked under way
        meanwhile, so a request's ``prepare`` awaits them instead of tokenizing them twice."""
        cache, special, pending = self._segments, self._special_ids, self._pending
        longest = self._token_cache_chars // 4
        todo = list(dict.fromkeys(s for s in segments if s not in cache and s not in special
                                  and s not in pending and len(s) <= longest))
        if not todo:
            return None
        loop = asyncio.get_running_loop()
        mine = loop.create_future()
        for seg in todo:
            pending[seg] = mine
        generation = self._generation
        try:
            job = executor.submit(self._encode_all, todo)
        except RuntimeError:                 # the executor is shut down
            self._stored_ahead(todo, mine, generation, None)
            return mine

        def landed(job: Any) -> None:        # in the thread
            out = None if job.cancelled() or job.exception() is not None else job.result()
            with contextlib.suppress(RuntimeError):      # the loop is closed: nothing to store
                loop.call_soon_threadsafe(self._stored_ahead, todo, mine, generation, out)

        job.add_done_callback(landed)
        return mine

    def _stored_ahead(self, todo: list[str], mine: asyncio.Future, generation: int,
                      out: list[list[int]] | None) -> None:
        pending = self._pending
        for seg in todo:
            if pending.get(seg) is mine:
                del pending[seg]
        n = 0
        if self._dropped_since(generation):
            out = None
        if out is not None and not mine.done():
            n = len(todo)
            self.segment_misses += n
            self.segments_off_loop += n
            for seg, ids in zip(todo, out, strict=True):
                self._store(seg, ids)
        if not mine.done():
            mine.set_result(n)

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
            if not extra and not self.shapes_off:
                segments = self.chat_segments(data["messages"])
                if segments is not None:
                    return segments, []
            self.renders["template"] += 1
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
                   max_blocks: int, reach: Callable[[int], bool] | None = None,
                   probe_chars: int = PROBE_CHARS, defer_chars: int | None = None,
                   extends: Callable[[int], bool] | None = None,
                   held: Callable[[int], bool] | None = None) -> Keys | int:
        """Chained keys of the full blocks of the request's tokens: ``key[i] = hash((key[i-1],
        block tokens))`` from ``root``. The chain state after each prefix of segments is cached, so
        only the segments after the longest known prefix are tokenized and hashed.

        With ``reach`` (is a key held by some engine, or about to be), an uncached segment of
        ``probe_chars`` or more is tokenized only if some engine's cache reaches into it: when the
        chain before it is held nowhere, or the blocks its first characters complete (``_probe``) are
        not, no engine can match deeper, so the keys end there (``Keys.exact`` false). A long unique
        prompt then costs a probe of a few dozen tokens instead of its whole tokenization.
        With ``extends`` too (does some engine hold, or is about to hold, a block chained on this
        key), an uncached segment of any length is not tokenized when nothing is held past the
        last full block before it: no engine can match deeper, so the keys end there as well. A
        conversation's new message, behind blocks only its own engine holds, then costs nothing.
        (Not before the first full block: there, on a cold index, the probe's blocks are what a burst
        on a new prefix follows until the engine reports them.)
        With ``defer_chars``, an uncached segment that long which must be tokenized is not: its
        index is returned instead, for ``prepare`` to tokenize it off the loop.
        With ``held`` (as ``reach``), an answer tokenized ahead (``expect_answer``) met here for the
        first time tells ``answers_paused`` whether the block with its first generated tokens is held
        (when the keys reach that far)."""
        if segments is None:                 # token ids given
            return _chain(root, [], lead, block_size, max_blocks)
        if self._fast_stale:
            self._drop_fast()
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
        cache, special, longest = self._segments, self._special_ids, self._token_cache_chars // 4
        answers = self._answers if held is not None else None
        for j in range(start, len(segments)):
            seg = segments[j]
            mark = -1
            if answers and hash(seg) in answers:     # an answer tokenized ahead, sent back: watch its first block
                del answers[hash(seg)]
                mark = (total + self._answer_lead()) // block_size
            if seg not in cache and seg not in special:
                if extends is not None and keys and len(keys) < max_blocks and not extends(keys[-1]):
                    self.segments_unreached += 1
                    if mark >= 0:                # nothing held past the blocks before the answer
                        self._answer_met(False)
                    return Keys(keys[:], total + self._estimate(segments, j), exact=False, rest=j)
                if reach is not None and len(seg) >= probe_chars and len(keys) < max_blocks:
                    probed = self._beyond_reach(keys, tail, seg, root, block_size, max_blocks - len(keys), reach)
                    if probed is not None:
                        self.segments_unreached += 1
                        keys.extend(probed)
                        return Keys(keys[:], total + self._estimate(segments, j), exact=False, rest=j)
                if defer_chars is not None and defer_chars <= len(seg) <= longest:
                    return j
            ids = self._segment_ids(seg)
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
            if 0 <= mark < len(keys) and held is not None:
                self._answer_met(held(keys[mark]))
            self._remember(idents[j], keys, tail, total)
        return Keys(keys[:], total)

    def _beyond_reach(self, keys: list[int], tail: list[int], seg: str, root: int, block_size: int,
                      room: int, reach: Callable[[int], bool]) -> list[int] | None:
        """Whether no engine's cache reaches into ``seg`` (which follows ``keys`` and ``tail``): the
        keys of the blocks its probe completes when so (the walk stops at the first one not held; they
        are kept for the speculative entries), ``None`` when ``seg`` must be tokenized."""
        if keys and not reach(keys[-1]):
            return []                        # the chain is held nowhere before this segment
        need = block_size - len(tail)        # tokens to complete the block under way
        for want in (need, need + DEEP_PROBE_BLOCKS * block_size):
            probe = self._probe(seg, want)
            if probe is None:
                return None
            ids = tail + probe
            n = min(len(ids) // block_size, room)
            out = _chain(keys[-1] if keys else root, [], ids, block_size, n).keys
            if out and not all(reach(k) for k in out):
                return out
            # held as far as the probe goes: the engine may hold more, or the segment only opens as
            # others do (a form's preamble, "Summarize the following:"); once, a deeper probe tells
        return None

    def _probe(self, seg: str, need: int) -> list[int] | None:
        """Ids of ``seg``'s first characters, at least ``need`` of them if it can: the text cut at a
        space and its last two tokens dropped, so they are the ids the whole segment starts with
        (tokenizers do not merge across a space; the margin covers the word at the cut). ``None``
        when the probe would be most of the segment (then it is tokenized whole)."""
        ids = self._probes.get(seg)
        if ids is not None and len(ids) >= need:
            return ids
        per_token = self._seen_chars / self._seen_tokens if self._seen_tokens else 4.0
        chars = int((need + 4) * per_token * 1.5) + 16
        if chars * 2 > len(seg):
            return None
        cut = seg.rfind(" ", 0, chars)
        if cut < chars // 2:
            cut = chars
        ids = self._encode_one(seg[:cut])
        self._seen_chars += cut
        self._seen_tokens += len(ids)
        ids = ids[:-2]
        if len(self._probes) >= _PROBES_KEPT:
            self._probes.pop(next(iter(self._probes)))
        self._probes[seg] = ids
        return ids

    def _estimate(self, segments: list[str], start: int) -> int:
        """Tokens in ``segments[start:]``: cached ones counted, the rest from their characters."""
        cache, special = self._segments, self._special_ids
        per_token = self._seen_chars / self._seen_tokens if self._seen_tokens else 4.0
        n = 0
        for seg in islice(segments, start, None):
            if seg in special:
                n += 1
            else:
                ids = cache.get(seg)
                n += len(ids) if ids is not None else round(len(seg) / per_token)
        return n

    def _remember(self, ident: int, keys: list[int], tail: list[int], total: int) -> None:
        if ident in self._prefixes:
            return
        self._prefixes[ident] = (keys, len(keys), list(tail), total)
        self._prefix_blocks += len(keys) + 1      # counted whole although lists are shared
        while self._prefix_blocks > self._key_cache_blocks and self._prefixes:
            _, (_k, n, _t, _n) = self._prefixes.popitem(last=False)
            self._prefix_blocks -= n + 1


def _batch_call(tokenizer: Any) -> Callable[..., Any]:
    return getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch


def _rest_tokenizer(path: Path) -> Any | None:
    """The tokenizer for the pieces after a text's first, when it differs: a Metaspace pre-tokenizer
    with ``prepend_scheme: first`` prepends only to the first piece, so the others are tokenized with
    ``never``. ``None`` when every piece tokenizes alike."""
    from tokenizers import Tokenizer

    spec = json.loads(path.read_text())
    changed = False

    def walk(node: Any) -> None:
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(spec)) if changed else None


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


def load_tokenizers(dirs: dict[str, str], slow: Collection[str] = ()) -> dict[str, ModelTokenizer]:
    """model → its tokenizer; a directory that cannot be read is an error naming the model. The
    models in ``slow`` (``kv_events.fast_tokenizer: false``) keep the library's encoder, and so does
    any other model that shares their tokenizer directory."""
    out: dict[str, ModelTokenizer] = {}
    cache: dict[str, ModelTokenizer] = {}
    keys = {model: str(Path(d).resolve()) for model, d in dirs.items()}
    slow_keys = {keys[m] for m in slow if m in keys}
    for model, d in dirs.items():
        key = keys[model]
        if key not in cache:
            try:
                cache[key] = ModelTokenizer(d, fast=key not in slow_keys)
            except TokenizerError as e:
                raise TokenizerError(f"models[{model}].tokenizer: {e}") from None
        out[model] = cache[key]
    return out
