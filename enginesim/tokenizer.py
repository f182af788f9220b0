"""A fake but deterministic tokenizer, chat renderer and output-token source.

Real tokenizers are large; what the gateway can observe is only that token counts are stable, that
the same text always gives the same ids (so prefix caching works on shared prefixes) and that about
four characters make a token. Pieces are "leading whitespace + up to four visible characters", so
``decode(encode(text)) == text`` for any text, and ids come from a stable hash of the piece.

Generated text is drawn from a fixed vocabulary of short pseudo-words (each one piece long, so the
output re-tokenizes to the same count) by an RNG seeded from (seed, model, prompt ids): the same
request always produces the same answer.
"""

from __future__ import annotations

import hashlib
import random
import re
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

# Pieces: optional whitespace run, then 1-4 non-space characters; or trailing whitespace.
_PIECE = re.compile(r"\s*\S{1,4}|\s+")

EOS_TOKEN_ID = 2
_FIRST_ID = 1000
_ID_SPACE = 1 << 24
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
    return array("Q", (t & _MASK64 for t in token_ids)).tobytes()


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

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        return render_chat(messages)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(render_chat(messages))

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


def render_chat(messages: Sequence[dict[str, Any]]) -> str:
    """A Llama-ish template: the same conversation prefix always renders to the same text."""
    parts = [f"<|{m.get('role', 'user')}|>\n{content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class OutputSource:
    """The deterministic token stream the model "generates" for one prompt."""

    def __init__(self, tokenizer: FakeTokenizer, seed: int, key: str, prompt_ids: Sequence[int]) -> None:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{seed}\0{key}\0".encode())
        h.update(ids_bytes(prompt_ids))
        self._rng = random.Random(int.from_bytes(h.digest(), "little"))
        self._vocab = tokenizer.output_ids

    def next_token(self, allow_eos: bool, eos_probability: float) -> int:
        # Always draw both numbers so allow_eos does not shift the rest of the stream.
        roll = self._rng.random()
        word = self._vocab[self._rng.randrange(len(self._vocab))]
        if allow_eos and roll < eos_probability:
            return EOS_TOKEN_ID
        return word
