"""Build the tiny byte-level BPE tokenizer shipped in gyre/assets/tiny-tokenizer/.

Gyre's `tiny` model (see gyre/models.py) needs a real tokenizer that loads offline. This
script trains a byte-level BPE with the HF `tokenizers` library on text that every Python
installation carries (the top-level standard-library sources plus the pydoc topic texts,
in sorted order so the result is reproducible) and writes tokenizer.json and
tokenizer_config.json (with Gyre's ChatML-with-tools chat template). The output is
committed; rerun only to change the vocabulary:

    python tools/build_tiny_tokenizer.py [--vocab-size 4096] [--out gyre/assets/tiny-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added, non-special tokens: they appear in the decoded text (tool calls are parsed from it).
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def corpus() -> Iterator[str]:
    """Standard-library sources and pydoc topics, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")
    topics = stdlib / "pydoc_data" / "topics.py"
    if topics.exists():
        yield topics.read_text(encoding="utf-8", errors="replace")


def build(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens(ADDED_TOKENS)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "gyre/assets/tiny-tokenizer")
    args = parser.parse_args()
    tok = build(args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    template = (REPO / "gyre/assets/chatml_tools.jinja").read_text()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main()
