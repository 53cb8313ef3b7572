"""A GGUF's tokenizer (tokenizer.ggml.*) rebuilt as Hugging Face files: llama.cpp's gpt2 model (byte-level BPE) here,
its llama model (SentencePiece) in gguf_sentencepiece.py.

    files, note = rebuild_tokenizer(fields, where="model.gguf", context_length=...)
    # [tokenizer.json, tokenizer_config.json, generation_config.json] in the cache, or [] and why there are none

  tokenizer.json         gpt2: BPE over GPT-2's byte symbols: the vocabulary (tokenizer.ggml.tokens), the merges
                         (tokenizer.ggml.merges), the pre-tokenizer of tokenizer.ggml.pre (PRE_TOKENIZERS: the same
                         table the GGUF export matches a tokenizer.json against), CONTROL tokens as special added tokens
                         and USER_DEFINED ones as plain added tokens (both matched whole, as llama.cpp does), UNUSED
                         ones (the [PADn] ids past the tokenizer) left out;
                         llama: transformers' GGUF tokenizer of the same metadata (gguf_sentencepiece.py);
                         both with a post-processor adding BOS / EOS when tokenizer.ggml.add_bos_token / add_eos_token
                         say so (a SentencePiece file that does not say adds BOS, as llama.cpp and transformers do);
  tokenizer_config.json  bos / eos / pad / unk tokens, add_bos_token / add_eos_token, the chat template
                         (tokenizer.chat_template), model_max_length ({arch}.context_length);
  generation_config.json bos_token_id / eos_token_id / pad_token_id (SentencePiece: eos and the end-of-turn tokens
                         llama.cpp also stops at, Gemma's <end_of_turn>: gguf_sentencepiece.EOG_TEXTS).

The files are written once, atomically, never changed, in runtime.cache.cache_root() / "gguf-tokenizers" / KEY, KEY a
digest of the bytes of the tokenizer metadata and of this code (runtime.cache.cached_build: entries private to the
user and checked against a digest of their files on every use), so that a rebuild is found without redoing it
(Gemma's 262,144 tokens: ~3 s to rebuild) and the files outlive the reader (a training run copies them into its
checkpoints) and travel into every output as an HF directory's tokenizer files do. Not rebuilt, with the reason in
the reader's metadata (TOKENIZER_KEY: byte_tokenizer.unavailable), so the weights still read and every command that
needs a tokenizer asks for --tokenizer instead of reading bytes: another tokenizer model (t5's Unigram, ...), a
pre-tokenizer outside PRE_TOKENIZERS or a SentencePiece vocabulary naming one, a vocabulary or merge list of more
than MAX_TOKENIZER_ITEMS entries, a SentencePiece vocabulary whose merges cost more than the derivation's bound
(gguf_sentencepiece.MAX_MERGE_WORK). Malformed tokenizer metadata (any value of the wrong kind: gguf_metadata's one
rule; token types not one of llama.cpp's per token, scores not one finite number per token, ids outside the
vocabulary, merges that are not pairs of tokens of the vocabulary whose join is one too: what `tokenizers` refuses
to load) is a CheckpointError naming the file and the key.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from bam_surgery.runtime.cache import cached_build
from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import json_field
from bam_surgery.runtime.shards import MAX_SIDE_FILE_BYTES

from . import gguf_metadata, gguf_sentencepiece
from .base import CapabilityError
from .gguf_metadata import BOOLEAN, INTEGER, INTEGERS, STRING, STRINGS, metadata_value
from .gguf_sentencepiece import sentencepiece_tokenizer
from .gguf_table import TOKENIZER_SHAPES

# tokenizer.json pre-tokenizer regexes that llama.cpp implements (src/llama-vocab.cpp quotes each beside its own)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex}


def _split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, _byte_level(False)]}


# llama.cpp's pre-tokenizer name (tokenizer.ggml.pre) -> (the tokenizer.json pre_tokenizer that splits the same,
# what it is in words, whether BPE ignores merges on whole words)
PRE_TOKENIZERS: dict[str, tuple[dict, str, bool]] = {
    "gpt-2": (_byte_level(True), "ByteLevel (GPT-2's regex)", False),
    "llama-bpe": (_split(LLAMA3_REGEX), "Split (Llama 3's regex) + ByteLevel", True),
    "qwen2": (_split(QWEN2_REGEX), "Split (Qwen2's regex) + ByteLevel", False),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      _byte_level(True)]},
               "Digits (one by one) + ByteLevel (GPT-2's regex)", False),
}
PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "default": "gpt-2"}  # llama.cpp's other names
SPLIT_REGEXES = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}  # the Split pre-tokenizers' names
UNDEFINED, NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 3, 4, 5, 6  # llama.cpp's token types
DIRECTORY = "gguf-tokenizers"
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # tokenizer_texts' names, in order


def pre_tokenizer_name(pre: Any, where: str) -> str:
    """The llama.cpp pre-tokenizer equal to a tokenizer.json pre_tokenizer, or CapabilityError."""
    steps = (json_field(pre, "pretokenizers", list, f"{where}: pre_tokenizer", default=[])
             if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre])
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps or [None]]

    def byte_level(step: dict, regex: bool) -> bool:
        return (step.get("type") == "ByteLevel" and not step.get("add_prefix_space", True)
                and bool(step.get("use_regex", True)) == regex)

    if kinds == ["ByteLevel"] and byte_level(steps[0], True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and byte_level(steps[1], False):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex") if isinstance(split.get("pattern"), dict) else None
        if regex in SPLIT_REGEXES and split.get("behavior") == "Isolated" and not split.get("invert"):
            return SPLIT_REGEXES[regex]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level(steps[1], True):
        return "smollm"
    shown = json.dumps(pre, sort_keys=True)[:120]
    raise CapabilityError(f"{where}: its pre-tokenizer ({shown}) is none llama.cpp implements as written "
                          f"(supported: {'; '.join(f'{k}: {v[1]}' for k, v in PRE_TOKENIZERS.items())}, without a "
                          "prefix space)")


# the most tokens, and merges, a rebuilt tokenizer holds: twice the largest vocabulary in use (Gemma's 262,144), so
# that a rebuild costs at most about twice Gemma's (a few seconds, under 1 GB); a larger one is not rebuilt
MAX_TOKENIZER_ITEMS = 1 << 19


def _token_id(fields: Mapping[str, Any], key: str, n: int, where: str) -> int | None:
    return metadata_value(fields, key, INTEGER, None, low=0, high=n - 1, where=where)


def _flag(fields: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    return metadata_value(fields, key, BOOLEAN, default, where=where)


def _merge_pairs(fields: Mapping[str, Any], vocab: Mapping[str, int], where: str) -> list[list[str]]:
    """tokenizer.ggml.merges as [left, right] pairs, each of two tokens of `vocab` whose join is one too (what
    `tokenizers` needs to load the BPE: a merge naming another string, such as a token left out as UNUSED or emptied,
    was a tokenizer.json it refused to read)."""
    key = "tokenizer.ggml.merges"
    merges = metadata_value(fields, key, STRINGS, [], where=where)
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise CheckpointError(f"{where}: {key}[{i}] is {printable(m)[:40]!r}, not a pair of tokens")
        left, right = parts
        if left not in vocab or right not in vocab or left + right not in vocab:
            missing = next(t for t in (left, right, left + right) if t not in vocab)
            raise CheckpointError(f"{where}: {key}[{i}] ({printable(m)[:40]!r}) names {printable(missing)[:40]!r}, "
                                  "which is no token of tokenizer.ggml.tokens (a merge joins two tokens into a third)")
        pairs.append(parts)
    return pairs


def _byte_level_bpe(fields: Mapping[str, Any], tokens: list[str], types: list[int], ids: dict[str, int | None],
                    add_bos: bool, add_eos: bool, pre: str, where: str) -> dict:
    """tokenizer.json of llama.cpp's gpt2 model."""
    vocab: dict[str, int] = {}
    for i, (t, k) in enumerate(zip(tokens, types)):
        if k != UNUSED:  # padding ids past the tokenizer ([PADn]; the export writes them so)
            vocab.setdefault(t, i)  # a repeated string keeps its first id (the encoder can produce only one)
    pairs = _merge_pairs(fields, vocab, where)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": k == CONTROL}
             for i, (t, k) in enumerate(zip(tokens, types)) if k in (CONTROL, USER_DEFINED) and vocab.get(t) == i]
    pre_json, _, ignore_merges = PRE_TOKENIZERS[pre]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre_json, "post_processor": _post_processor(tokens, ids, add_bos, add_eos, byte_level=True),
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": ignore_merges, "vocab": vocab, "merges": pairs}}


def tokenizer_texts(fields: Mapping[str, Any], where: str, context_length: int | None) -> dict[str, str] | str:
    """{file name: text} of the rebuilt tokenizer, or a sentence saying why there is none."""
    kind = _rebuilt_kind(fields, where)
    if isinstance(kind, str):
        return kind
    model, pre = kind
    tokens = metadata_value(fields, "tokenizer.ggml.tokens", STRINGS, where=where)
    too_many = _too_many(fields, tokens, where)
    if too_many:
        return too_many
    types = _token_types(fields, len(tokens), where)
    ids = {k: _token_id(fields, f"tokenizer.ggml.{k}_token_id", len(tokens), where)
           for k in ("bos", "eos", "padding", "unknown")}
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (transformers follows)
    add_bos = _flag(fields, "tokenizer.ggml.add_bos_token", model == "llama" and ids["bos"] is not None, where)
    add_eos = _flag(fields, "tokenizer.ggml.add_eos_token", False, where)
    for kind_, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and ids[kind_] is None:
            raise CheckpointError(f"{where}: tokenizer.ggml.add_{kind_}_token is set but the file names no "
                                  f"{kind_} token")
    extra: dict = {"config": {}, "eog": []}
    if model == "llama":
        arch = metadata_value(fields, "general.architecture", STRING, None, where=where)
        shape = TOKENIZER_SHAPES.get(arch, "llama")  # its family record's SentencePiece shape
        built = sentencepiece_tokenizer(fields, tokens, types, ids, where, shape)
        if isinstance(built, str):
            return built
        body, extra = built
        body["post_processor"] = _post_processor(tokens, ids, add_bos, add_eos, byte_level=False)
    else:
        body = _byte_level_bpe(fields, tokens, types, ids, add_bos, add_eos, pre, where)
    config, generation = _configs(fields, tokens, ids, add_bos, add_eos, context_length, where)
    config.update(extra["config"])
    if extra["eog"] and ids["eos"] is not None:  # llama.cpp also stops at end-of-turn tokens (Gemma's <end_of_turn>)
        generation["eos_token_id"] = [ids["eos"]] + [i for i in extra["eog"] if i != ids["eos"]]

    def dump(value) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    text = json.dumps(body, ensure_ascii=False)
    size = len(text.encode("utf-8"))
    if size > MAX_SIDE_FILE_BYTES:  # no command would read or copy it (runtime.shards)
        return (f"its tokenizer.ggml.* make a tokenizer.json of {size:,} bytes, more than the {MAX_SIDE_FILE_BYTES:,} "
                "any command reads or copies")
    return {"tokenizer.json": text, "tokenizer_config.json": dump(config), "generation_config.json": dump(generation)}


def _rebuilt_kind(fields: Mapping[str, Any], where: str) -> tuple[str, str] | str:
    """(llama.cpp's tokenizer model, its pre-tokenizer) when this module rebuilds them, else why not."""
    model = metadata_value(fields, "tokenizer.ggml.model", STRING, None, where=where)
    if model is None:
        return "the file carries no tokenizer (no tokenizer.ggml.model)"
    if model not in ("gpt2", "llama"):
        return (f"its tokenizer.ggml.model is llama.cpp's {printable(model)[:30]!r}; only byte-level BPE (gpt2) and "
                "SentencePiece (llama) are rebuilt as a tokenizer.json")
    pre = metadata_value(fields, "tokenizer.ggml.pre", STRING, "default", where=where)
    pre = PRE_ALIASES.get(pre, pre)
    if model == "llama" and pre != "gpt-2":  # a SentencePiece vocabulary has no pre-tokenizer of llama.cpp's own
        return (f"its SentencePiece tokenizer names the pre-tokenizer {printable(pre)[:30]!r} (tokenizer.ggml.pre), "
                "which no SentencePiece tokenizer this reader rebuilds uses")
    if pre not in PRE_TOKENIZERS:
        return (f"its pre-tokenizer {printable(pre)[:30]!r} (tokenizer.ggml.pre) is none this reader rebuilds "
                f"({', '.join(PRE_TOKENIZERS)})")
    return model, pre


def _too_many(fields: Mapping[str, Any], tokens: list[str], where: str) -> str | None:
    """Why a vocabulary or merge list is too long to rebuild (MAX_TOKENIZER_ITEMS), or None; an empty vocabulary is
    malformed."""
    if not tokens:
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens is empty")
    merges = metadata_value(fields, "tokenizer.ggml.merges", STRINGS, [], where=where)
    for key, n in (("tokenizer.ggml.tokens", len(tokens)), ("tokenizer.ggml.merges", len(merges))):
        if n > MAX_TOKENIZER_ITEMS:
            return (f"its {key} holds {n:,} entries; a rebuilt tokenizer holds at most {MAX_TOKENIZER_ITEMS:,} "
                    "(twice the largest vocabulary in use)")
    return None


def _token_types(fields: Mapping[str, Any], n: int, where: str) -> list[int]:
    """tokenizer.ggml.token_type: one of llama.cpp's token types per token (absent: every token NORMAL)."""
    key = "tokenizer.ggml.token_type"
    types = metadata_value(fields, key, INTEGERS, None, length=n, per="one per token", where=where)
    if types is None:
        return [NORMAL] * n
    bad = np.flatnonzero((types < UNDEFINED) | (types > BYTE))
    if bad.size:
        raise CheckpointError(f"{where}: {key}[{bad[0]}] is {types[bad[0]]}, not a token type of llama.cpp "
                              f"({UNDEFINED} to {BYTE})")
    return types.tolist()


def _configs(fields: Mapping[str, Any], tokens: list[str], ids: dict[str, int | None], add_bos: bool, add_eos: bool,
             context_length: int | None, where: str) -> tuple[dict, dict]:
    """(tokenizer_config.json, generation_config.json) bodies."""
    names = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
                              **{names[k]: tokens[i] for k, i in ids.items() if i is not None}}
    if context_length:
        config["model_max_length"] = context_length
    template = metadata_value(fields, "tokenizer.chat_template", STRING, None, where=where)
    if template is not None:
        config["chat_template"] = template
    generation = {f"{k}_token_id": ids[g] for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
                  if ids[g] is not None}

    return config, generation


def _post_processor(tokens: list[str], ids: dict[str, int | None], add_bos: bool, add_eos: bool,
                    byte_level: bool) -> dict:
    """BOS / EOS around each sequence as transformers' update_post_processor writes them (the pair's second one of
    type 1); a byte-level BPE adding neither keeps the ByteLevel post-processor."""
    if byte_level and not (add_bos or add_eos):
        return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    first = [tokens[ids["bos"]]] if add_bos else []
    last = [tokens[ids["eos"]]] if add_eos else []

    def seq(name: str, type_id: int) -> list[dict]:
        return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in first]
                + [{"Sequence": {"id": name, "type_id": type_id}}]
                + [{"SpecialToken": {"id": t, "type_id": type_id}} for t in last])
    special = {tokens[ids[kind]]: {"id": tokens[ids[kind]], "ids": [ids[kind]], "tokens": [tokens[ids[kind]]]}
               for kind, wanted in (("bos", add_bos), ("eos", add_eos)) if wanted}
    return {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
            "special_tokens": special}


def _input_key(fields: Mapping[str, Any], context_length: int | None) -> str:
    """A digest of everything the rebuild reads: the tokenizer.* metadata, the architecture, the context length and
    this code (its source files), so a cached rebuild is found without rebuilding it and a changed rule never
    reuses an old one. The values' bytes are hashed (_digest_value), in time and memory linear in their size."""
    digest = hashlib.sha256()
    for source in (__file__, gguf_sentencepiece.__file__, gguf_metadata.__file__):
        digest.update(Path(source).read_bytes())
    used = sorted(k for k in fields if k.startswith("tokenizer.") or k == "general.architecture")
    for key in used:
        _digest_value(digest, key)
        _digest_value(digest, fields[key])
    _digest_value(digest, context_length)
    arch = fields.get("general.architecture")
    _digest_value(digest, TOKENIZER_SHAPES.get(arch) if isinstance(arch, str) else None)  # the record's shape of it
    return "in-" + digest.hexdigest()[:32]


def _digest_value(digest, value: Any) -> None:
    """A metadata value into `digest`, each kind tagged and sized so that no two values feed the same bytes: a numpy
    array as its dtype and buffer, a list of strings as their lengths and their UTF-8 text, a scalar as its bytes."""
    def put(tag: bytes, data: bytes | memoryview) -> None:
        digest.update(tag + struct.pack("<Q", len(data)))
        digest.update(data)
    if isinstance(value, np.ndarray):
        put(b"a" + value.dtype.str.encode(), memoryview(np.ascontiguousarray(value)).cast("B"))
    elif isinstance(value, str):
        put(b"s", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        put(b"l", np.fromiter(map(len, value), dtype=np.int64, count=len(value)).tobytes())
        put(b"t", "".join(value).encode("utf-8", "surrogatepass"))
    elif isinstance(value, list):  # a caller's list of other values: each in turn
        put(b"L", struct.pack("<Q", len(value)))
        for v in value:
            _digest_value(digest, v)
    elif isinstance(value, bool) or value is None:
        put(b"b", repr(value).encode())
    elif isinstance(value, int):
        put(b"i", str(value).encode())
    elif isinstance(value, float):
        put(b"f", struct.pack("<d", value))
    else:
        put(b"?" + type(value).__name__.encode(), repr(value).encode("utf-8", "surrogatepass"))


def rebuild_tokenizer(fields: Mapping[str, Any], where: str, context_length: int | None) -> tuple[list[Path], str]:
    """(the rebuilt files in the cache, "") or ([], why there are none). A rebuild is cached under a digest of its
    inputs (a SentencePiece vocabulary of 262,144 tokens takes seconds to rebuild, milliseconds to find)."""
    files = cached_build(DIRECTORY, _input_key(fields, context_length), FILES,
                         lambda: tokenizer_texts(fields, where, context_length), where)
    return ([], files) if isinstance(files, str) else (files, "")
