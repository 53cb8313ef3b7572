"""Load any checkpoint the tool reads into a model with its tokenizer: the public API's door (`bam_surgery.load`).

    m = load("HuggingFaceTB/SmolLM2-135M-Instruct")      # a hub id; or an HF folder, a GGUF, a canonical
    ids = m.encode("def fib(n):")                          # file or folder, a train run folder (its newest)
    logits = m.model(torch.tensor([ids])).logits
    m.decode(ids)

The checkpoint is opened as every command opens it (app/inputs.py: converters.open_checkpoint, a run folder as its
newest checkpoint), the model built by runtime.model_from_reader (the layout checked first), the tokenizer found by
train.tokenize.resolve_tokenizer's rules as generate, train and eval find it (the checkpoint's own tokenizer.json,
the byte tokenizer for vocabularies of at most 512, or the one given), and the generation config read as every
export carries it. runtime.load_model reads canonical checkpoints alone and names this function for the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.loading import model_from_reader
from bam_surgery.runtime.model import Model
from bam_surgery.surgery.card import generation_config
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.train.errors import TrainError
from bam_surgery.train.tokenize import HFTokenizer, checkpoint_tokenizer, resolve_tokenizer

from .inputs import open_input, resolved_input

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Loaded:
    """A checkpoint loaded: its model (runtime.Model, in eval mode) and its tokenizer."""

    model: Model
    tokenizer: Any  # train.tokenize's HFTokenizer or ByteTokenizer; None: the checkpoint carries none
    checkpoint: str  # what was opened (a run folder: its newest checkpoint)
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json's entries (eos_token_id, ...)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def encode(self, text: str) -> list[int]:
        """The ids of `text` as generate reads a prompt (an HF tokenizer adds its special tokens, a BOS)."""
        return encode_prompt(self._tokenizer(), text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer().decode(list(ids))

    def _tokenizer(self):
        if self.tokenizer is None:
            raise BamSurgeryError(f"{self.checkpoint}: carries no tokenizer; load it with tokenizer=PATH "
                                  "(a tokenizer.json, a folder holding one) or tokenizer='bytes'")
        return self.tokenizer


def load(checkpoint: str, *, tokenizer: str | None = None, device: str = "cpu", dtype: str | None = None,
         allow_pickle: bool = False) -> Loaded:
    """The model and tokenizer of `checkpoint`: a GGUF file, an HF folder or hub id, a canonical file or folder,
    our exports (Mixtral, HF BAM, ...), or a train run folder (its newest checkpoint).

    tokenizer: a tokenizer.json, a folder holding one, or 'bytes' (default: the checkpoint's own; none when it
    carries none and its vocabulary is not bytes). device: cpu, cuda or cuda:N; dtype: float32 (default),
    bfloat16 or float16. Refusals are one-line UserErrors."""
    where = run_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    spec = resolved_input(checkpoint)
    with open_input(checkpoint, allow_pickle) as reader:
        generation = generation_config(reader)
        tok = find_tokenizer(tokenizer, reader, reader.config.vocab_size, generation.get("eos_token_id"),
                             needed=False)
        model = model_from_reader(reader, where, getattr(torch, dtype or "float32"))
    return Loaded(model, tok, spec, generation)


def run_device(text: str):
    try:
        device = torch.device(text)
    except RuntimeError:
        raise BamSurgeryError(f"--device: unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise BamSurgeryError(f"--device: unknown device {text!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BamSurgeryError(f"--device {text}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise BamSurgeryError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def find_tokenizer(option: str | None, reader, vocab_size: int, eos, needed: bool):
    """The tokenizer by train.tokenize.resolve_tokenizer's rules (--tokenizer PATH|bytes, the checkpoint's own,
    bytes for vocabularies of at most 512); None when only token ids are given (--tokens) and no tokenizer
    was asked for or carried and the byte fallback does not apply: the output is then printed as ids."""
    # generate stops at the generation config's eos; the tokenizer's own end-of-text id (its document separator
    # in training) is not used here, so a tokenizer that has none is not refused for it
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    try:
        return resolve_tokenizer(option, reader, vocab_size, eos_id=eos if isinstance(eos, int) else 0)
    except TrainError:
        if needed or option is not None or checkpoint_tokenizer(reader) is not None:
            raise
        return None


def encode_prompt(tok, prompt: str) -> list[int]:
    """The prompt's ids. An HF tokenizer adds its special tokens (a BOS), as transformers' generate expects;
    training encodes documents without them (train.tokenize.HFTokenizer.encode_batch)."""
    if isinstance(tok, HFTokenizer):
        try:
            return tok.tok.encode(prompt).ids
        except Exception as e:  # the tokenizers library raises a bare Exception, e.g. a Unigram model without
            # unk_id meeting a character outside its vocabulary ("Encountered an unknown token but `unk_id` is missing")
            reason = " ".join(str(e).split())[:200]
            raise BamSurgeryError(f"{tok.name}: cannot encode --prompt with this tokenizer ({reason})") from None
    return [int(i) for i in tok.encode_batch([prompt])[0]]


__all__ = ["DTYPES", "Loaded", "encode_prompt", "find_tokenizer", "load", "run_device"]
