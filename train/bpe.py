"""Train a byte-level BPE tokenizer on the training split of data sources (the pipeline's tokenizer stage).

    path = train_bpe([open_source(d, "train") for d in domains], vocab_size=8192, out=Path("DIR/tokenizer"))

The tokenizer is GPT-2's kind, built with the `tokenizers` package: a byte-level pre-tokenizer (every text is
encodable, no unknown token), BPE merges learnt from the documents of the sources' train split only (never the
held-out split the evaluation reads), and one special token, `<|endoftext|>` (id 0), the end-of-text token
put between documents. The result has exactly `vocab_size` tokens (an error otherwise: too little text for so
many merges), so the model's vocabulary is filled.

Deterministic: the same documents in the same order give byte-identical files (the trainer counts words and
breaks ties between equally frequent merges by the pair itself, not by thread timing); tests check it.
The folder gets tokenizer.json and tokenizer_config.json (eos_token), written atomically (temp names, renamed).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from bam_surgery.runtime.atomic import write_text_atomic

from .data import Source
from .errors import TrainError

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 byte-level symbols and the end-of-text token
MAX_VOCAB = 1 << 20


def _documents(sources: Iterable[Source]) -> Iterator[str]:
    for source in sources:
        yield from source.documents()


def build_bpe(documents: Iterable[str], vocab_size: int, min_frequency: int = 2) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer of exactly vocab_size tokens learnt from `documents`."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TrainError(f"BPE vocab_size {vocab_size}: must be in [{MIN_VOCAB}, {MAX_VOCAB}] (256 byte symbols and "
                         "the end-of-text token at least)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise TrainError(f"BPE: the training text gave {got} tokens, fewer than vocab_size {vocab_size} (too little "
                         f"text, or min_frequency {min_frequency} too high); lower vocab_size")
    return tok


def train_bpe(sources: list[Source], vocab_size: int, out: Path, min_frequency: int = 2) -> Path:
    """Learn the tokenizer from the sources' documents (in order) and write OUT/tokenizer.json and
    OUT/tokenizer_config.json; returns the tokenizer.json path."""
    tok = build_bpe(_documents(sources), vocab_size, min_frequency)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
              "unk_token": EOS_TOKEN, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    write_text_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    write_text_atomic(out / "tokenizer.json", tok.to_str(pretty=True))  # last: its presence means complete
    return out / "tokenizer.json"
