"""The ``chat-bpe`` workload of ``bench.routing``: chats in English-like text, a real-sized BPE tokenizer.

``python -m bench.routing --workload chat-bpe`` (or ``python -m bench.chat_bpe [DIR]`` to build the
tokenizer alone). The default workload writes short pseudo-words that the shared test tokenizer
(``enginesim.tiny_tokenizer``, 7.8k tokens) holds whole, so tokenizing costs the gateway little; a
deployed model's tokenizer is a byte-level BPE of 32k–128k tokens splitting English with a regex,
several times slower per character. This module builds such a tokenizer offline and a text to
match, both seeded, so the benchmark is the same on any machine and needs no model hub:

* a *lexicon* of 30,000 made-up words (syllables of English-like onsets, vowels and codas), ranked
  by a Zipf law behind 120 common English words, so a text has the long tail of rare words a BPE
  cuts into several tokens (about 1.3 tokens a word, 4.2 characters a token, as English on Llama-3);
* sentences of 5–24 words with commas, numbers, capitals and paragraphs;
* a tokenizer trained on 4 MB of that text (a different seed from the benchmark's prompts): a
  byte-level BPE of 32,000 tokens behind Llama-3's pre-tokenizer regex, Llama-3's special tokens
  and Llama-3.1's chat template (``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>``
  after a system header with a knowledge-cutoff and a date line that every prompt shares), in the
  standard directory layout (``tokenizer.json``, ``tokenizer_config.json``). Training takes a
  minute; the directory is cached under ``bench/out/`` by a name that carries the build's version.

The engines (``enginesim``'s ``tokenizer`` knob) and the gateway (``models[].tokenizer``) load the
same directory, so the engines count and cache real token ids and the gateway keys its requests the
same way. The workload's shape (``WORKLOAD``): 4 engines, multi-turn chats on 16 long shared system
prompts chosen by Zipf popularity, 2–6 turns each with the whole conversation resent, a few unique
one-off prompts; about 400 streamed requests over 30 s of arrivals.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

VERSION = 2                       # bump when the tokenizer or its corpus changes
VOCAB_SIZE = 32000
_LEXICON_SEED = 20241
_CORPUS_SEED = 4099
_CORPUS_CHARS = 4_000_000
OUT_DIR = Path(__file__).resolve().parent / "out" / f"chat-bpe-tokenizer-v{VERSION}"

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL = (BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>", HEADER_START, HEADER_END,
           "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", EOT)
# Llama-3's pre-tokenizer split (tokenizer.json of Meta-Llama-3-8B-Instruct)
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3.1-Instruct's chat template without its tool calling: every prompt starts with the same
# system header (a knowledge-cutoff and a date line), then the system message, if any, and the turns
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\n' }}"
    "{{- 'Today Date: ' + date_string + '\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

_COMMON = ("the of and to a in is you that it he was for on are as with his they I at be this have from or "
           "one had by word but not what all were we when your can said there use an each which she do how "
           "their if will up other about out many then them these so some her would make like him into time "
           "has look two more write go see number no way could people my than first water been call who oil "
           "its now find long down day did get come made may part over new sound take only little work know "
           "place year live me back give most very after thing our just name good sentence man think say "
           "great where help through much before line right too mean old any same tell boy follow came want "
           "show also around form three small set").split()
# words of chat prompts and of the template's header, frequent enough in the corpus to be tokens
_CHAT = ("system user assistant question answer prompt request unique conversation team helpful "
         "Cutting Knowledge Date December Today Jul").split()
_ONSETS = ("b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sm sn sp st "
           "str sw th tr tw wh").split() + [""] * 6
_VOWELS = "a e i o u a e i o ea ee ai ou oo ie".split()
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "d", "m", "ng", "nd", "st", "ck", "sh", "th", "rt", "nt", "ll", "ss")
_SUFFIXES = ("", "", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "al")


def lexicon(n: int = 30_000, seed: int = _LEXICON_SEED) -> tuple[list[str], list[float]]:
    """``n`` words, most frequent first, and their Zipf weights (common English words first)."""
    rng = random.Random(seed)
    words: list[str] = list(_COMMON) + list(_CHAT)
    seen = set(words)
    while len(words) < n:
        syllables = rng.choices((1, 2, 3, 4), (30, 40, 22, 8))[0]
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        w += rng.choice(_SUFFIXES)
        if w not in seen:
            seen.add(w)
            words.append(w)
    # rarer words are longer, as in English: sort the made-up ones by length, loosely
    fixed = len(_COMMON) + len(_CHAT)
    made = words[fixed:]
    made.sort(key=lambda w: len(w) + rng.random() * 6)
    words[fixed:] = made
    weights = [1.0 / (i + 2.7) ** 1.07 for i in range(n)]
    return words, weights


class TextSource:
    """English-like text of a given length in words, from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words, weights = lexicon()
        total = 0.0
        self._cum = []
        for wt in weights:
            total += wt
            self._cum.append(total)

    def text(self, words: int) -> str:
        rng, vocab = self.rng, self.words
        picked = rng.choices(vocab, cum_weights=self._cum, k=words)
        out: list[str] = []
        i = 0
        while i < len(picked):
            n = min(len(picked) - i, rng.randint(5, 24))
            sent = picked[i:i + n]
            i += n
            sent[0] = sent[0].capitalize()
            for k in range(1, len(sent) - 1):
                r = rng.random()
                if r < 0.08:
                    sent[k] += ","
                elif r < 0.10:
                    sent[k] = str(rng.randint(2, 2048))
                elif r < 0.12:
                    sent[k] = sent[k].capitalize()
            end = rng.choices((".", "?", "!", ":"), (85, 8, 3, 4))[0]
            out.append(" ".join(sent) + end)
            if rng.random() < 0.12 and i < len(picked):
                out.append("\n\n")
            else:
                out.append(" ")
        return "".join(out).strip()


def _corpus(chars: int = _CORPUS_CHARS, seed: int = _CORPUS_SEED):
    src = TextSource(random.Random(seed))
    made = 0
    while made < chars:
        t = src.text(src.rng.randint(20, 400))
        made += len(t)
        yield t


def build(directory: str | Path = OUT_DIR) -> Path:
    """Train the tokenizer and write its directory; return it."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")      # a deterministic merge order
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    out = Path(directory)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOT, "pad_token": None, "unk_token": None,
        "model_max_length": 131072,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL},
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    if out.exists():                   # another run built it meanwhile
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    else:
        tmp.rename(out)
    return out


def tokenizer_dir() -> Path:
    """The built tokenizer's directory, building it the first time (about a minute)."""
    if not (OUT_DIR / "tokenizer_config.json").exists():
        print(f"building the chat-bpe tokenizer ({VOCAB_SIZE} tokens) in {OUT_DIR} ...", file=sys.stderr, flush=True)
        build(OUT_DIR)
    return OUT_DIR


if __name__ == "__main__":
    print(build(sys.argv[1]) if len(sys.argv) > 1 else tokenizer_dir())
