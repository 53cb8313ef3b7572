"""A GGUF's SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 2, Mistral, Phi-3, Gemma) as a tokenizer.json.

    body, extra = sentencepiece_tokenizer(fields, tokens, types, ids, where, shape)

The result is the tokenizer transformers' own GGUF loader builds from the same metadata
(AutoTokenizer.from_pretrained(folder, gguf_file=...): integrations/gguf/gguf_tokenizer_mapping.py), rebuilt here
without transformers:

  model          BPE with byte fallback (the <0x00>..<0xFF> tokens) and fused unknowns over the vocabulary as the file
                 spells it; the merges the vocabulary implies (a GGUF of SentencePiece stores none): every token cut
                 in two where both halves are tokens, the cuts ranked by the token's score (tokenizer.ggml.scores),
                 higher first, then by the longer left half, then the longer right half, then file order. Gemma's
                 scores do not follow its merge order, its token order does: there a token's rank is its position
                 (earlier first), and its tokens of two or more spaces, stored as spaces, are spelled with U+2581 as
                 the normalized text is. Each token's cuts are looked up in a dict, never pairwise over the
                 vocabulary: cutting a token of L characters slices about L * L characters, and a vocabulary whose
                 tokens together take more than MAX_MERGE_WORK (three times Gemma 3's 10.8 M), or that implies more
                 than MAX_IMPLIED_MERGES merges (twice Gemma's 514,906), is not rebuilt; so the derivation and the
                 merges it writes cost time and memory within those bounds, whatever the file (a vocabulary of "a",
                 "aa", ... up to 4,096 a's implied 23 G characters of merges: a MemoryError, once).
  normalizer     Gemma: spaces -> U+2581; Phi-3: U+2581 prepended, spaces -> U+2581; Llama: none.
  pre-tokenizer  Gemma: Split on " " (merged with the previous piece; after the normalizer it never cuts);
                 Llama: Metaspace (U+2581, prepended to the first piece only, no split); Phi-3: none.
  decoder        U+2581 -> space, byte fallback, fuse; Llama and Phi-3 then strip the one leading space.
  added tokens   CONTROL tokens and the named bos/eos/unk/pad (and Gemma's <mask>) as special tokens, USER_DEFINED
                 ones (Gemma's "\\n", runs of tabs, ...) as plain added tokens; all matched whole on the raw text.

`extra`: tokenizer_config.json entries beyond the shared ones (Gemma's mask_token) and the end-of-generation ids
(EOG_TEXTS: Gemma's <end_of_turn>, ...) that llama.cpp stops at besides eos.
Malformed metadata (scores not one finite number per token: gguf_metadata's rule; required but for Gemma, checked
whenever present) is a CheckpointError naming the file and the key.
"""
from __future__ import annotations

from typing import Any, Mapping

from .gguf_metadata import NUMBERS, metadata_value

SPACE = "\u2581"  # SentencePiece's visible space
SHAPES = ("llama", "gemma", "phi3")  # LlamaTokenizer's, transformers' gemma_tokenizer, phi3_tokenizer (a GGUF's
# architecture has its shape in its family record: hf/families.py Gguf.tokenizer, gguf_table.TOKENIZER_SHAPES)
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
MAX_MERGE_WORK = 1 << 25  # characters sliced cutting every token into pairs (sum of L * (L - 1)): Gemma 3's 10.8 M
MAX_IMPLIED_MERGES = 1 << 20  # merges a vocabulary may imply: Gemma 3's 514,906
# control tokens llama.cpp ends generation at besides eos (llama-vocab.cpp's end-of-turn names)
EOG_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>", "<EOT>")


def _scores(fields: Mapping[str, Any], n: int, where: str) -> list[float]:
    return metadata_value(fields, "tokenizer.ggml.scores", NUMBERS, length=n, per="one score per token",
                          where=where).tolist()


def merge_work(tokens) -> int:
    """Characters sliced cutting every token into two (each cut slices at most the token's length): the bound the
    derivation's time and its merges' size stay within."""
    return sum(n * (n - 1) for n in map(len, tokens))


def implied_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[list[str]] | None:
    """The merges a vocabulary implies: for each token of `rank` (in its order), every cut into two tokens of `vocab`;
    the cuts sorted by (the token's rank, len(left), len(right)), highest first, ties in `rank`'s order (Python's sort
    keeps it under reverse=True), as transformers' generate_merges orders them. None once there are more than
    MAX_IMPLIED_MERGES."""
    cuts: list[tuple[float, int, int, str, str]] = []
    for token, score in rank.items():
        for i in range(1, len(token)):
            left = token[:i]
            if left in vocab:
                right = token[i:]
                if right in vocab:
                    cuts.append((score, i, len(token) - i, left, right))
        if len(cuts) > MAX_IMPLIED_MERGES:
            return None
    cuts.sort(key=lambda c: c[:3], reverse=True)
    return [[c[3], c[4]] for c in cuts]


def _derivation_cost(tokens: list[str]) -> str | None:
    """Why deriving the vocabulary's merges would cost more than MAX_MERGE_WORK, counted from the tokens' lengths
    alone, or None."""
    work = merge_work(set(tokens))
    if work <= MAX_MERGE_WORK:
        return None
    return (f"its tokenizer.ggml.tokens (SentencePiece, {len(tokens):,} tokens of up to {max(map(len, tokens)):,} "
            f"characters) imply merges whose derivation slices {work:,} characters, more than the "
            f"{MAX_MERGE_WORK:,} the rebuild takes (Gemma 3's 262,144 tokens: 10.8 M)")


def sentencepiece_tokenizer(fields: Mapping[str, Any], tokens: list[str], types: list[int],
                            ids: dict[str, int | None], where: str, shape: str = "llama") -> tuple[dict, dict] | str:
    """(tokenizer.json body without its post-processor, {"config": {...}, "eog": [ids]}) or why it is not rebuilt;
    `shape` one of SHAPES."""
    too_costly = _derivation_cost(tokens)
    if too_costly:
        return too_costly
    gemma = shape == "gemma"
    if not gemma or "tokenizer.ggml.scores" in fields:  # Gemma's are unused, but checked as any file's
        scores = _scores(fields, len(tokens), where)
    if gemma:
        spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}  # a repeated string keeps its last id, as transformers' does
        merges = implied_merges(vocab, {t: -i for i, t in enumerate(spelled)})
    else:
        spelled = tokens
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = implied_merges(vocab, dict(zip(tokens, scores)))
    if merges is None:
        return (f"its tokenizer.ggml.tokens (SentencePiece, {len(tokens):,} tokens) imply more than "
                f"{MAX_IMPLIED_MERGES:,} merges, the most the rebuild derives (Gemma 3's 262,144 tokens: 514,906)")
    named = {tokens[i] for i in ids.values() if i is not None}
    config: dict[str, Any] = {}
    if gemma and "<mask>" in vocab:  # GemmaTokenizer's mask token
        named.add("<mask>")
        config["mask_token"] = "<mask>"
    special = {t for t, k in zip(tokens, types) if k == CONTROL} | named
    plain = {t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab} - special
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t in special}
             for t in special | plain if t in vocab]
    added.sort(key=lambda a: a["id"])
    strip = [] if gemma else [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, *strip]}
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if gemma:
        normalizer: dict | None = replace
        pre: dict | None = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                            "invert": False}
    elif shape == "phi3":
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]}
        pre = None
    else:
        normalizer = None
        pre = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "first", "split": False}
    body = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
            "pre_tokenizer": pre, "post_processor": None, "decoder": decoder,
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>" if gemma else None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges}}
    eog = [vocab[t] for t in EOG_TEXTS if t in special and t in vocab]
    return body, {"config": config, "eog": eog}
