"""A small real tokenizer for tests, demos and benchmarks, built in code: ``build(dir)``.

It is a Hugging Face tokenizer directory in the standard layout, the same files a model checkpoint
ships: ``tokenizer.json`` (a byte-level BPE model of the ``tokenizers`` library) and
``tokenizer_config.json`` (special tokens and a ChatML ``chat_template``). The simulator
(``--tokenizer DIR``), the gateway (``models[].tokenizer``) and the routing benchmark load the same
directory, so all three agree on token ids, which precise prefix routing from KV events needs.

The BPE merges are learned from a fixed, generated corpus (English glue words and the short
pseudo-words the benchmarks write), so building twice gives the same vocabulary. The built
directory is shipped as ``enginesim/tokenizer_data/tiny`` (``TINY_DIR``); tests rebuild it and
compare.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TINY_DIR = Path(__file__).with_name("tokenizer_data") / "tiny"

BOS = "<|bos|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL = (EOS, BOS, IM_START, IM_END)
VOCAB_SIZE = 12288

# ChatML; a content given as parts contributes its text parts. Rendered in a sandboxed environment.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_GLUE = ("the of and to in is you that it he was for on are as with his they at be this have from or "
         "one had by word but not what all were we when your can said there use an each which she do "
         "how their if will up other about out many then them these so some her would make like him "
         "into time has look two more write go see number no way could people my than first water been "
         "call who oil its now find long down day did get come made may part system prompt assistant "
         "user question answer turn request unique conversation context you are number").split()


def _corpus(seed: int = 7919) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pseudo = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 4))) for _ in range(4000)]
    lines = []
    for i in range(3000):
        words = [rng.choice(_GLUE) if rng.random() < 0.3 else rng.choice(pseudo) for _ in range(24)]
        lines.append(f"{rng.choice(_GLUE).capitalize()} {i}: " + " ".join(words) + ".")
    return lines


def build_tokenizer():     # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build(directory: str | Path = TINY_DIR) -> Path:
    """Write the tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``) and return it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL},
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else TINY_DIR))
