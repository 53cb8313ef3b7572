"""The generate use case: continue a prompt with any checkpoint the tool opens (canonical file or directory, HF
directory or hub id, a GGUF, our Mixtral and HF BAM exports, a run folder), through runtime.generate (fused path,
static KV cache). `bam-surgery generate` and the Python API call `generate`.

    out = generate("mix.safetensors", "def fib(n):", max_new_tokens=40)
    out.text, out.tokens, out.seconds
    generate("mix/", tokens=[1, 2, 3], temperature=0.8, top_p=0.95, seed=1)

The tokenizer is found as train, eval and merge find theirs (train.tokenize.resolve_tokenizer): `tokenizer` (a
tokenizer.json, a folder holding one, or `bytes`), else the checkpoint's own, else the byte-level tokenizer for
vocabularies of at most 512. Every bad input (option value, device, checkpoint, tokenizer) is a one-line UserError
naming the option as the CLI spells it; options are taken as numbers or as the CLI's text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from bam_surgery.runtime.blocks import ModelKVCache
from bam_surgery.runtime.generation import generate as generate_tokens
from bam_surgery.runtime.loading import model_from_reader
from bam_surgery.runtime.memory import check_fits
from bam_surgery.surgery.card import generation_config
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.plan_reader import all_finite
from bam_surgery.train.errors import TrainError
from bam_surgery.train.tokenize import HFTokenizer, checkpoint_tokenizer, resolve_tokenizer

from .inputs import open_input
from .reporter import Reporter

DTYPES = ("float32", "bfloat16", "float16")
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Generation:
    """What generate wrote: the new token ids, their text (None when only ids were given and no tokenizer
    applies), and how long it took where."""

    tokens: list[int]
    text: str | None
    prompt_tokens: int
    seconds: float
    device: str  # cpu or cuda
    dtype: str  # the weights' dtype as it ran: float32, bfloat16, float16

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.seconds, 1e-9)


def generate(checkpoint: str, prompt: str | None = None, *, tokens: str | Sequence[int] | None = None,
             tokenizer: str | None = None, max_new_tokens: int | str = 32, temperature: float | str = 0,
             top_p: float | str = 1, seed: int | str | None = None, device: str = "cpu", dtype: str | None = None,
             reporter: Reporter | None = None) -> Generation:
    """Continue `prompt` (text, encoded with the tokenizer) or `tokens` (ids, or their comma-separated text) with
    `checkpoint`: greedy at temperature 0, else sampled from softmax(logits / T) within nucleus top_p, with a
    seeded private generator (same seed, same tokens); stops at the checkpoint's eos or after max_new_tokens.
    device: cpu, cuda or cuda:N; dtype: the weights' for the run (default float32 on cpu, the checkpoint's own on
    cuda). reporter: the note on an option that has no effect."""
    reporter = reporter or Reporter()
    n_new = _number("--max-new-tokens", max_new_tokens, int, lambda v: v >= 0, "an integer >= 0")
    temp = _number("--temperature", temperature, float, lambda v: v >= 0, "a number >= 0")
    nucleus = _number("--top-p", top_p, float, lambda v: 0 < v <= 1, "a number in (0, 1]")
    sampler_seed = None if seed is None else _number("--seed", seed, int, lambda v: 0 <= v <= MAX_SEED,
                                                     f"an integer from 0 to {MAX_SEED} (2**64 - 1)")
    where = run_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if (prompt is None) == (tokens is None):
        raise BamSurgeryError("give the input as exactly one of --prompt TEXT and --tokens ID,ID,...")
    ids = _token_ids(tokens) if tokens is not None else None
    if prompt is not None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: bytes of the command line that are not UTF-8
            raise BamSurgeryError(f"--prompt: not valid text at character {e.start + 1} (a lone surrogate "
                                  f"{prompt[e.start]!r}: the argument holds bytes that are not UTF-8)") from None
    if nucleus < 1 and temp == 0:
        reporter.note(f"--top-p {top_p} is unused under greedy decoding (--temperature 0); give --temperature above "
                      "0 to sample")

    with open_input(checkpoint) as reader:
        cfg = reader.config
        eos = generation_config(reader).get("eos_token_id")
        tok = find_tokenizer(tokenizer, reader, cfg.vocab_size, eos, needed=ids is None)
        if ids is None:
            ids = encode_prompt(tok, prompt)
            if not ids:
                raise BamSurgeryError("--prompt: the text encodes to no tokens")
        bad = [i for i in ids if i >= cfg.vocab_size]
        if bad:
            raise BamSurgeryError(f"token id {bad[0]} is out of range: {checkpoint} has vocab_size {cfg.vocab_size}")
        if len(ids) + n_new > cfg.max_positions:  # learned or RoPE: train and eval refuse longer sequences too
            raise BamSurgeryError(f"{len(ids)} prompt tokens + --max-new-tokens {n_new} = {len(ids) + n_new} exceed "
                                  f"the model's max_positions={cfg.max_positions}")
        weight_dtype = getattr(torch, dtype) if dtype else (
            torch.float32 if where.type == "cpu" else reader.dtype("embed.weight"))
        _check_cache_fits(cfg, len(ids) + n_new, weight_dtype, where)
        model = model_from_reader(reader, where, weight_dtype)
        _check_finite(model, checkpoint)

    start = time.perf_counter()
    new = generate_tokens(model, torch.tensor([ids]), n_new, temperature=temp, top_p=nucleus, seed=sampler_seed,
                          eos_token_id=eos)[0].tolist()
    seconds = time.perf_counter() - start
    return Generation(new, tok.decode(new) if tok is not None else None, len(ids), seconds, where.type,
                      str(weight_dtype)[6:])


def _check_cache_fits(cfg, tokens: int, dtype, device) -> None:
    """The static KV cache (allocated whole, before the first token) against the memory of the device it goes
    to (runtime.memory: the same rule and message as every other size a user gives)."""
    per_token = ModelKVCache.bytes_per_token(cfg, dtype)
    check_fits(per_token * tokens, f"the KV cache of {tokens:,} tokens ({per_token:,} bytes per token)",
               BamSurgeryError, device)


def _check_finite(model, checkpoint: str) -> None:
    """merge's check (surgery.plan_reader.all_finite) on the weights as they run: NaN or Inf gives no text."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise BamSurgeryError(f"{checkpoint}: tensor {name} has {bad} non-finite value(s) (NaN or Inf); "
                                  "a model with non-finite weights generates nothing meaningful")


def _number(option: str, given: Any, kind: type, ok: Callable[[Any], bool], what: str):
    """An option's value: its text read as `kind` (the CLI's), or a number as it is (the API's), within `ok`."""
    try:
        value = kind(given) if isinstance(given, str) else given
    except ValueError:
        value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)) \
            or not ok(value):
        raise BamSurgeryError(f"{option}: {given!r} is not {what}")
    return value


def _token_ids(given: str | Sequence[int]) -> list[int]:
    if not isinstance(given, str):
        ids = list(given)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise BamSurgeryError(f"--tokens: cannot read {ids!r}; give token ids (integers >= 0), e.g. [1, 2, 3]")
        return ids
    try:
        ids = [int(p) for p in given.split(",") if p.strip()]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise BamSurgeryError(f"--tokens: cannot read {given!r}; write comma-separated token ids, e.g. 1,2,3")
    return ids


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


__all__ = ["DTYPES", "Generation", "encode_prompt", "find_tokenizer", "generate", "run_device"]
