"""The project's tokenizer facts the exports need, defined once at the lowest layer that uses them (train, above,
imports them from here; train/tokenize.py:ByteTokenizer runs the byte tokenizer).

The byte tokenizer: ids 1..255 are the UTF-8 bytes, id 0 ends a document (NUL bytes are dropped), so a model
needs vocab_size >= BYTE_VOCAB. A checkpoint trained with it says so in its metadata (TOKENIZER_KEY: BYTES); a
model with no tokenizer and at most BYTE_FALLBACK_MAX_VOCAB tokens is taken to use it. `byte_symbols` spells
each byte as GPT-2's byte-level BPE does, which is how the GGUF and ONNX Runtime GenAI exports write it as a
byte-level BPE vocabulary without merges.
"""
from __future__ import annotations

BYTES = "bytes"
TOKENIZER_KEY = "bam_tokenizer"  # checkpoint metadata: the tokenizer a run trained with, when it is BYTES
UNAVAILABLE = "unavailable: "  # ... or, before why, that the model's own tokenizer could not be rebuilt (a GGUF's)
BYTE_VOCAB = 256
BYTE_FALLBACK_MAX_VOCAB = 512
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (printable Latin-1 bytes as themselves,
    the others from U+0100 on, in byte order), the symbols a ByteLevel pre-tokenizer and decoder use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def uses_byte_tokenizer(says_bytes: bool, has_tokenizer: bool, vocab_size: int) -> bool:
    """The one rule for which models read UTF-8 bytes (train, generate and every export apply it): the checkpoint
    says so (TOKENIZER_KEY: BYTES), or it carries no tokenizer and its vocabulary has at most
    BYTE_FALLBACK_MAX_VOCAB tokens. A model whose own tokenizer could not be rebuilt (unavailable_tokenizer) has one:
    its callers pass has_tokenizer, and ask for --tokenizer, never reading bytes in its place. Whether the
    vocabulary is large enough (BYTE_VOCAB) is each caller's check."""
    return says_bytes or (not has_tokenizer and vocab_size <= BYTE_FALLBACK_MAX_VOCAB)


def unavailable_tokenizer(metadata) -> str | None:
    """Why the checkpoint's own tokenizer is not available (TOKENIZER_KEY: UNAVAILABLE + why, set by the GGUF reader
    for tokenizer metadata it does not rebuild and kept by canonical conversions), or None."""
    value = metadata.get(TOKENIZER_KEY)
    return value[len(UNAVAILABLE):] if isinstance(value, str) and value.startswith(UNAVAILABLE) else None
