"""ONNX Runtime GenAI's files for an ONNX export: genai_config.json, and a tokenizer GenAI reads for the byte-level one.

    config = genai_config(cfg, generation={"eos_token_id": 2})   # genai_config.json's content (a dict)
    files = byte_tokenizer_files(vocab_size=256)                  # {"tokenizer.json": text, "tokenizer_config.json": text}

converters/onnx_export.py writes them into the export's folder (inside its atomic write); onnxruntime_genai then runs
the graph with its own generator: og.Model(folder), og.GeneratorParams, og.Generator (append_tokens,
generate_next_token, get_next_tokens). Tested with onnxruntime-genai 0.18.0 (tests/converters/test_onnx_genai.py).

How the graph maps onto GenAI's decoder (converters/onnx_graph.py has the graph):
  - names: the graph's inputs and outputs are GenAI's defaults (input_ids, attention_mask, position_ids,
    past_key_values.%d.key/value -> logits, present.%d.key/value); genai_config.json names them anyway.
  - the KV cache: past and present are [B, Hkv, P, Dh] for every model kind. Expert KV keeps each of the E attention
    experts' G heads side by side on the heads axis (Hkv = E*G, runtime.ModelKVCache.kv_heads), shared KV and dense
    attention G; GenAI only allocates these tensors, feeds them and takes them back, so num_key_value_heads = Hkv is
    the whole description. num_attention_heads and hidden_size are informational for this kind of graph.
  - past_present_share_buffer false: the graph appends the new keys to the past (present is P+T long), where a
    shared buffer would hand it the whole max_length cache as past.
  - model.type "decoder": GenAI's generic decoder-only LLM (no architecture-specific inputs).
  - token ids, as bam-surgery generate takes them from the checkpoint's generation config: eos_token_id (a row
    stops after emitting one), pad_token_id (fills finished rows; runtime.generate's fill: the pad id, else the
    first eos id) and bos_token_id; ids outside the vocabulary are left out (the model cannot emit them).
    GenAI cannot run without an eos id (none given, it takes its pad id, 0; an id outside the vocabulary is an
    error), so a checkpoint without one gets DEFAULT_EOS, 0: end of text for train's byte-level tokenizer and for the
    BPE the pipeline trains (train/bpe.py). There GenAI stops at 0 where bam-surgery generate, given no eos id,
    runs on to --max-new-tokens.
  - search: greedy (do_sample false), max_length the model's max_positions (context_length).
GenAI 0.18 feeds an all-ones attention mask (tokens equal to pad_token_id in a prompt are attended): batch only
prompts of equal length.

The byte-level tokenizer (train/tokenize.py:ByteTokenizer: ids 1..255 the raw bytes, 0 end of text, NUL bytes
dropped) as a tokenizer.json GenAI's tokenizer (and `tokenizers`) reads: a byte-level BPE with no merges whose
vocabulary is the 255 byte symbols at their byte values, no unknown token (a NUL byte encodes to nothing) and no
special tokens (id 0 and ids past 255 decode to nothing, as ByteTokenizer.decode); tokenizer_config.json, which
GenAI's tokenizer requires, names the class. Two differences, both GenAI's (0.18): its encode reads text as a C
string, so text stops at a NUL byte where ByteTokenizer goes on past it; and its decode ends at the first byte that
is not UTF-8 (one U+FFFD) where ByteTokenizer replaces each such byte and goes on. Token ids are the same.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.runtime.config import ModelConfig

from .byte_tokenizer import BYTE_VOCAB, byte_symbols
from .onnx_graph import PAST_NAME, PRESENT_NAME

GENAI_CONFIG = "genai_config.json"
MODEL_TYPE = "decoder"  # GenAI's generic decoder-only LLM
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # a tokenizer.json read as it is
DEFAULT_EOS = 0  # end of text for train/tokenize.py's byte-level tokenizer and train/bpe.py's BPE
BYTE_IDS = range(1, BYTE_VOCAB)  # the byte-level tokenizer's byte tokens: id = byte value (0 is end of text)


def genai_config(cfg: ModelConfig, generation: Mapping[str, Any] | None = None, graph_file: str = "model.onnx"
                 ) -> dict[str, Any]:
    """genai_config.json's content for the graph of `cfg` exported with its KV cache (see the module docstring)."""
    decoder = {
        "filename": graph_file,
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": cfg.head_dim,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": ModelKVCache.kv_heads(cfg),
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": _per_layer(PAST_NAME, "key"), "past_value_names": _per_layer(PAST_NAME, "value")},
        "outputs": {"logits": "logits", "present_key_names": _per_layer(PRESENT_NAME, "key"),
                    "present_value_names": _per_layer(PRESENT_NAME, "value")},
    }
    model = {"type": MODEL_TYPE, "vocab_size": cfg.vocab_size, "context_length": cfg.max_positions,
             **token_ids(cfg.vocab_size, generation or {}), "decoder": decoder}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": cfg.max_positions,
              "min_length": 0, "past_present_share_buffer": False, "temperature": 1.0, "top_p": 1.0,
              "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "early_stopping": True}
    return {"model": model, "search": search}


def _per_layer(template: str, kind: str) -> str:
    """GenAI's pattern of a per-layer name: the layer number as %d."""
    return template.format(layer="%d", kind=kind)


def token_ids(vocab_size: int, generation: Mapping[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids for genai_config.json's model section: the generation config's, inside the vocabulary; eos
    defaults to DEFAULT_EOS (GenAI needs one), pad to the first eos id (runtime.generate's fill)."""
    def inside(value) -> list[int]:
        ids = value if isinstance(value, list) else [value]
        return [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size]

    eos = inside(generation.get("eos_token_id")) or [DEFAULT_EOS]
    pad = inside(generation.get("pad_token_id")) or eos[:1]
    out: dict[str, Any] = {"eos_token_id": eos if len(eos) > 1 else eos[0], "pad_token_id": pad[0]}
    bos = inside(generation.get("bos_token_id"))
    if bos:
        out["bos_token_id"] = bos[0]
    return out


def byte_tokenizer_files() -> dict[str, str]:
    """{file name: text} of the byte-level tokenizer for GenAI (see the module docstring)."""
    symbols = byte_symbols()
    level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level}, "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {symbols[b]: b for b in BYTE_IDS}, "merges": []},
    }
    config = {"tokenizer_class": TOKENIZER_CLASS, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
