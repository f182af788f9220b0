"""A fake but deterministic tokenizer, chat renderer and output-token source.

Real tokenizers are large; what the gateway can observe is only that token counts are stable, that
the same text always gives the same ids (so prefix caching works on shared prefixes) and that about
four characters make a token. Pieces are "leading whitespace + up to four visible characters", so
``decode(encode(text)) == text`` for any text, and ids come from a stable hash of the piece.

Generated text is drawn from a fixed vocabulary of short pseudo-words (each one piece long, so the
output re-tokenizes to the same count), each token chosen by a hash of (seed, model, the context's
ids so far): the same request always produces the same answer, and a request continued from a
partial answer (as ids, or as text that re-tokenizes to them) produces the rest of it.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from enginesim.wire import dumps

# Pieces: optional whitespace run, then 1-4 non-space characters; or trailing whitespace.
_PIECE = re.compile(r"\s*\S{1,4}|\s+")

EOS_TOKEN_ID = 2
_FIRST_ID = 1000
_ID_SPACE = 1 << 24
ID_SPACE = _ID_SPACE        # the ids a piece may get: the fake vocabulary's size
_MAX_REMEMBERED_PIECES = 500_000
_MASK64 = (1 << 64) - 1

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
# " ka", " kalo", ...: at most space + 4 letters, i.e. exactly one piece each.
OUTPUT_WORDS: tuple[str, ...] = tuple(" " + s for s in _SYLLABLES) + tuple(
    " " + a + b for a in _SYLLABLES for b in _SYLLABLES)


def piece_id(piece: str) -> int:
    """Stable id of a piece (independent of process, hash seed and call order)."""
    digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return _FIRST_ID + int.from_bytes(digest, "little") % (_ID_SPACE - _FIRST_ID)


def ids_bytes(token_ids: Iterable[int]) -> bytes:
    """Token ids as bytes for hashing (any int, masked to 64 bits)."""
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    try:
        return array("Q", token_ids).tobytes()      # ids are 0 ≤ id < 2**64: no masking needed
    except OverflowError:
        return array("Q", [t & _MASK64 for t in token_ids]).tobytes()


def split_pieces(text: str) -> list[str]:
    return _PIECE.findall(text)


class FakeTokenizer:
    """Text <-> ids. Remembers pieces it has seen so ``/detokenize`` can answer for them.

    Two pieces whose hashes collide get different ids (the later one probes to the next free id),
    so ``decode(encode(text)) == text`` always holds for remembered pieces.
    """

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {EOS_TOKEN_ID: ""}
        self._ids: dict[str, int] = {}
        self.output_ids: tuple[int, ...] = tuple(self._remember(w) for w in OUTPUT_WORDS)

    def _remember(self, piece: str) -> int:
        known = self._ids.get(piece)
        if known is not None:
            return known
        tid = piece_id(piece)
        if len(self._ids) >= _MAX_REMEMBERED_PIECES:
            return tid  # memory bound reached: still a stable id, just not decodable
        while tid in self._pieces:
            tid = _FIRST_ID + (tid + 1 - _FIRST_ID) % (_ID_SPACE - _FIRST_ID)
        self._pieces[tid] = piece
        self._ids[piece] = tid
        return tid

    def encode(self, text: str) -> list[int]:
        return [self._remember(p) for p in split_pieces(text)]

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return render_chat(messages, tools=tools)

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(render_chat(messages, tools=tools))

    def encode_open_chat(self, messages: Sequence[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A chat whose last message stays open (``continue_final_message``): no end of turn, no
        generation prompt. The open message's text is tokenized apart from its role header, as a
        real template's special tokens separate it, so a partial answer sent back as text gets the
        ids the model generated for it (output words are one piece each)."""
        if not messages:
            return self.encode_chat(messages, tools)
        last = messages[-1]
        head = (render_chat(messages[:-1], add_generation_prompt=False, tools=tools)
                + f"<|{last.get('role', 'user')}|>\n")
        return self.encode(head) + self.encode(content_text(last.get("content")))

    def piece(self, token_id: int) -> str:
        """The text of one id; unknown ids decode to a visible placeholder."""
        found = self._pieces.get(token_id)
        return found if found is not None else f"<unk:{token_id}>"

    def pieces(self, token_ids: Iterable[int]) -> list[str]:
        return [self.piece(t) for t in token_ids]

    def decode(self, token_ids: Iterable[int]) -> str:
        return "".join(self.pieces(token_ids))


def content_text(content: Any) -> str:
    """Text of a message ``content``: a string, or a list of parts (text, image_url, ...)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                kind = part.get("type", "text")
                if kind == "text" or "text" in part:
                    out.append(str(part.get("text", "")))
                else:
                    out.append(f"<{kind}>")
        return "\n".join(out)
    return str(content)


def calls_text(calls: Any) -> str:
    """The tool calls of an assistant message as a template renders them after its text: each
    call's name and its arguments (the JSON string the chat message carries)."""
    if not isinstance(calls, list):
        return ""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out.append(f"\n<|call|>{fn.get('name') or ''} {fn.get('arguments') or ''}")
    return "".join(out)


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
    """A Llama-ish template: the same conversation prefix always renders to the same text.

    An assistant message's ``tool_calls`` render after its text (``calls_text``).
    ``tools`` (the chat request's, ``enginesim.tools.rendered_tools``) render first, as their JSON
    under a ``<|tools|>`` header, where real templates put them in the system prompt: they are
    prompt tokens, about one for every four characters, and requests offering the same tools share
    that prefix.

    ``continue_final`` leaves the last message open (no end-of-turn newline, no generation
    prompt), so a partial assistant message renders exactly as the model's own output did after
    the generation prompt: ``render(m) + partial == render(m + [assistant partial], continue_final)``.
    ``FakeTokenizer.encode_open_chat`` tokenizes such a prompt with the open message's text on its
    own, as a real template's role header (special tokens) separates it.
    """
    parts = [f"<|{m.get('role', 'user')}|>\n{content_text(m.get('content'))}{calls_text(m.get('tool_calls'))}\n"
             for m in messages]
    if continue_final and parts:
        parts[-1] = parts[-1][:-1]
    elif add_generation_prompt:
        parts.append("<|assistant|>\n")
    head = "<|tools|>\n" + dumps(tools).decode() + "\n" if tools else ""
    return head + "".join(parts)


class OutputSource:
    """The deterministic token stream the model "generates" for one prompt.

    Like a greedy language model, the next token is a function of the whole context: the prompt's
    ids and every id generated so far (a streaming hash, so it does not matter how the context is
    split between prompt and output). A request whose prompt is another request's prompt followed
    by the first k ids it generated therefore generates exactly that request's remaining tokens.
    """

    def __init__(self, tokenizer: FakeTokenizer, seed: int, key: str, prompt_ids: Sequence[int]) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self._h.update(f"{seed}\0{key}\0".encode())
        self._h.update(ids_bytes(prompt_ids))
        self._vocab = tokenizer.output_ids

    def next_token(self, allow_eos: bool, eos_probability: float) -> int:
        """The token that follows the context; call ``advance`` with the token actually emitted."""
        digest = self._h.copy().digest()
        roll = int.from_bytes(digest[:8], "little") / 2.0**64
        word = self._vocab[int.from_bytes(digest[8:], "little") % len(self._vocab)]
        if allow_eos and roll < eos_probability:
            return EOS_TOKEN_ID
        return word

    def advance(self, token_id: int) -> None:
        """``token_id`` joins the context."""
        self._h.update(ids_bytes((token_id,)))
