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
digest of the tokenizer metadata and of this code (runtime.cache.cached_build), so that a rebuild is found without
redoing it (Gemma's 262,144 tokens: ~3 s to rebuild) and the files outlive the reader (a training run copies them
into its checkpoints) and travel into every output as an HF directory's tokenizer files do. Another tokenizer model
(t5's Unigram, ...), a pre-tokenizer outside PRE_TOKENIZERS or a SentencePiece vocabulary naming one is not rebuilt:
the weights still read, the reader's metadata says why there is no tokenizer, and the commands that need one ask for
--tokenizer. Malformed tokenizer metadata (tokens that are not strings, token types not one integer of llama.cpp's
per token, scores not one finite number per token, ids outside the vocabulary, flags that are not booleans, merges
that are not pairs) is a CheckpointError naming the file and the key.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from bam_surgery.runtime.cache import cached_build
from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import json_field

from .base import CapabilityError
from .gguf_table import TOKENIZER_SHAPES

from . import gguf_sentencepiece
from .gguf_sentencepiece import sentencepiece_tokenizer

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


def _strings(fields: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = fields.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where}: {key} is not a list of strings")
    return value


def _token_id(fields: Mapping[str, Any], key: str, n: int, where: str) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise CheckpointError(f"{where}: {key} {str(value)[:20]} is not a token id of the {n:,}-token vocabulary")
    return value


def _flag(fields: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = fields.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} is {printable(str(value))[:20]!r}, not a boolean")
    return value


def _byte_level_bpe(fields: Mapping[str, Any], tokens: list[str], types: list[int], ids: dict[str, int | None],
                    add_bos: bool, add_eos: bool, pre: str, where: str) -> dict:
    """tokenizer.json of llama.cpp's gpt2 model."""
    merges = _strings(fields, "tokenizer.ggml.merges", where) if "tokenizer.ggml.merges" in fields else []
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2 or not all(parts):
            raise CheckpointError(f"{where}: tokenizer.ggml.merges holds {printable(m)[:40]!r}, not a pair of tokens")
        pairs.append(parts)
    vocab: dict[str, int] = {}
    for i, (t, k) in enumerate(zip(tokens, types)):
        if k != UNUSED:  # padding ids past the tokenizer ([PADn]; the export writes them so)
            vocab.setdefault(t, i)  # a repeated string keeps its first id (the encoder can produce only one)
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
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        return "the file carries no tokenizer (no tokenizer.ggml.model)"
    if model not in ("gpt2", "llama"):
        return (f"its tokenizer is llama.cpp's {printable(str(model))[:30]!r} model; only byte-level BPE (gpt2) and "
                "SentencePiece (llama) are rebuilt as a tokenizer.json (pass --tokenizer)")
    pre = fields.get("tokenizer.ggml.pre", "default")
    pre = PRE_ALIASES.get(pre, pre)
    if model == "llama" and pre != "gpt-2":  # a SentencePiece vocabulary has no pre-tokenizer of llama.cpp's own
        return (f"its SentencePiece tokenizer names the pre-tokenizer {printable(str(pre))[:30]!r}, which no "
                "SentencePiece tokenizer this reader rebuilds uses; pass --tokenizer")
    if pre not in PRE_TOKENIZERS:
        return (f"its pre-tokenizer {printable(str(pre))[:30]!r} is none this reader rebuilds "
                f"({', '.join(PRE_TOKENIZERS)}); pass --tokenizer")
    tokens = _strings(fields, "tokenizer.ggml.tokens", where)
    types = fields.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type is not one integer per token ({len(tokens):,} "
                              f"tokens)")
    bad = next((i for i, t in enumerate(types) if not UNDEFINED <= t <= BYTE), None)
    if bad is not None:
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type[{bad}] is {types[bad]}, not a token type of "
                              f"llama.cpp ({UNDEFINED} to {BYTE})")
    ids = {k: _token_id(fields, f"tokenizer.ggml.{k}_token_id", len(tokens), where)
           for k in ("bos", "eos", "padding", "unknown")}
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (transformers follows)
    add_bos = _flag(fields, "tokenizer.ggml.add_bos_token", model == "llama" and ids["bos"] is not None, where)
    add_eos = _flag(fields, "tokenizer.ggml.add_eos_token", False, where)
    for kind, wanted in (("bos", add_bos), ("eos", add_eos)):
        if wanted and ids[kind] is None:
            raise CheckpointError(f"{where}: tokenizer.ggml.add_{kind}_token is set but the file names no {kind} token")
    extra: dict = {"config": {}, "eog": []}
    if model == "llama":
        shape = TOKENIZER_SHAPES.get(fields.get("general.architecture"), "llama")
        built = sentencepiece_tokenizer(fields, tokens, types, ids, where, shape)
        if isinstance(built, str):
            return built
        body, extra = built
        body["post_processor"] = _post_processor(tokens, ids, add_bos, add_eos, byte_level=False)
    else:
        body = _byte_level_bpe(fields, tokens, types, ids, add_bos, add_eos, pre, where)
    config, generation = _configs(fields, tokens, ids, add_bos, add_eos, context_length)
    config.update(extra["config"])
    if extra["eog"] and ids["eos"] is not None:  # llama.cpp also stops at end-of-turn tokens (Gemma's <end_of_turn>)
        generation["eos_token_id"] = [ids["eos"]] + [i for i in extra["eog"] if i != ids["eos"]]

    def dump(value) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
    return {"tokenizer.json": json.dumps(body, ensure_ascii=False), "tokenizer_config.json": dump(config),
            "generation_config.json": dump(generation)}


def _configs(fields: Mapping[str, Any], tokens: list[str], ids: dict[str, int | None], add_bos: bool, add_eos: bool,
             context_length: int | None) -> tuple[dict, dict]:
    """(tokenizer_config.json, generation_config.json) bodies."""
    names = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
                              **{names[k]: tokens[i] for k, i in ids.items() if i is not None}}
    if context_length:
        config["model_max_length"] = context_length
    template = fields.get("tokenizer.chat_template")
    if isinstance(template, str):
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
    reuses an old one."""
    digest = hashlib.sha256()
    for source in (__file__, gguf_sentencepiece.__file__):
        digest.update(Path(source).read_bytes())
    used = sorted(k for k in fields if k.startswith("tokenizer.") or k == "general.architecture")
    shape = TOKENIZER_SHAPES.get(fields.get("general.architecture"))  # the records' SentencePiece shape of it
    digest.update(repr([(k, fields[k]) for k in used] + [context_length, shape]).encode("utf-8", "surrogatepass"))
    return "in-" + digest.hexdigest()[:32]


def rebuild_tokenizer(fields: Mapping[str, Any], where: str, context_length: int | None) -> tuple[list[Path], str]:
    """(the rebuilt files in the cache, "") or ([], why there are none). A rebuild is cached under a digest of its
    inputs (a SentencePiece vocabulary of 262,144 tokens takes seconds to rebuild, milliseconds to find)."""
    files = cached_build(DIRECTORY, _input_key(fields, context_length), FILES,
                         lambda: tokenizer_texts(fields, where, context_length), where)
    return ([], files) if isinstance(files, str) else (files, "")
