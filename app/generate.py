"""The generate use case: continue a prompt with any checkpoint the tool opens (canonical file or directory, HF
directory or hub id, a GGUF, our Mixtral and HF BAM exports, a run folder), or with a model already loaded
(app/load.py's Loaded), through runtime.generate (fused path, static KV cache). `bam-surgery generate` and the
Python API call `generate`.

    out = generate("mix.safetensors", "def fib(n):", max_new_tokens=40)
    out.text, out.tokens, out.prefill_seconds, out.decode_seconds
    generate("mix/", tokens=[1, 2, 3], temperature=0.8, top_p=0.95, seed=1)
    generate(load("model.gguf"), chat="What is BAM?", system="Answer briefly.")

The tokenizer is found as train, eval and merge find theirs (train.tokenize.resolve_tokenizer): `tokenizer` (a
tokenizer.json, a folder holding one, or `bytes`), else the checkpoint's own, else the byte-level tokenizer for
vocabularies of at most 512 (a loaded model's: the one it was loaded with). `chat` renders a user turn (after
`system`'s) through the checkpoint's own chat template, or `chat_template` FILE's, as transformers'
apply_chat_template(add_generation_prompt=True) does (train/chat.py). The prefill (the prompt's forward pass, which
gives the first new token) and the decoding of the later tokens are timed apart: a short answer's rate is not its
prompt's. Every bad input (option value, device, checkpoint, tokenizer, template) is a one-line UserError naming the
option as the CLI spells it; options are taken as numbers or as the CLI's text.
"""
from __future__ import annotations

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
from bam_surgery.train.chat import chat_messages, chat_prompt_ids, template_file

from .inputs import open_input
from .load import DTYPES, Loaded, encode_prompt, find_tokenizer, run_device
from .reporter import Reporter

MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class Generation:
    """What generate wrote: the new token ids, their text (None when only ids were given and no tokenizer
    applies), and how long it took where: the prefill (the prompt's forward pass and the first new token) and the
    decoding of every later token, apart."""

    tokens: list[int]
    text: str | None
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    device: str  # cpu or cuda
    dtype: str  # the weights' dtype as it ran: float32, bfloat16, float16

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens per second of the prefill."""
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """New tokens per second after the first (None: at most one new token, no decoding step)."""
        return (len(self.tokens) - 1) / max(self.decode_seconds, 1e-9) if len(self.tokens) > 1 else None

    def speeds(self) -> str:
        """The summary line's timings: prefill and decode apart."""
        out = (f"prefill {self.prompt_tokens} tokens in {self.prefill_seconds:.2f} s "
               f"({self.prefill_tokens_per_second:.1f} tokens/s)")
        if self.decode_tokens_per_second is not None:
            out += (f", decode {len(self.tokens) - 1} tokens in {self.decode_seconds:.2f} s "
                    f"({self.decode_tokens_per_second:.1f} tokens/s)")
        return out


def generate(checkpoint, prompt: str | None = None, *, tokens: str | Sequence[int] | None = None,
             chat: str | None = None, system: str | None = None, chat_template: str | None = None,
             tokenizer: str | None = None, max_new_tokens: int | str = 32, temperature: float | str = 0,
             top_p: float | str = 1, seed: int | str | None = None, device: str | None = None,
             dtype: str | None = None, reporter: Reporter | None = None) -> Generation:
    """Continue `prompt` (text, encoded with the tokenizer), `tokens` (ids, or their comma-separated text) or `chat`
    (a user message, after `system`'s, rendered through the chat template: the checkpoint's own, or `chat_template`,
    a Jinja file) with `checkpoint`: a path or hub id, or a model load() returned (it runs where it was loaded, with
    its tokenizer unless `tokenizer` is given). Greedy at temperature 0, else sampled from softmax(logits / T) within
    nucleus top_p, with a seeded private generator (same seed, same tokens); stops at the checkpoint's eos or after
    max_new_tokens. device: cpu (default), cuda or cuda:N; dtype: the weights' for the run (default float32 on cpu,
    the checkpoint's own on cuda); a loaded model refuses others. reporter: the note on an option that has no
    effect."""
    reporter = reporter or Reporter()
    n_new = _number("--max-new-tokens", max_new_tokens, int, lambda v: v >= 0, "an integer >= 0")
    temp = _number("--temperature", temperature, float, lambda v: v >= 0, "a number >= 0")
    nucleus = _number("--top-p", top_p, float, lambda v: 0 < v <= 1, "a number in (0, 1]")
    sampler_seed = None if seed is None else _number("--seed", seed, int, lambda v: 0 <= v <= MAX_SEED,
                                                     f"an integer from 0 to {MAX_SEED} (2**64 - 1)")
    where = run_device(device or "cpu")
    if dtype is not None and dtype not in DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    given = _Prompt.of(prompt, tokens, chat, system, chat_template)
    if nucleus < 1 and temp == 0:
        reporter.note(f"--top-p {top_p} is unused under greedy decoding (--temperature 0); give --temperature above "
                      "0 to sample")
    if isinstance(checkpoint, Loaded):
        model, tok, eos, ids = _loaded_run(checkpoint, given, tokenizer, n_new, where if device else None, dtype)
    else:
        model, tok, eos, ids = _checkpoint_run(str(checkpoint), given, tokenizer, n_new, where, dtype)
    param = next(model.parameters())
    timings: dict[str, float] = {}
    new = generate_tokens(model, torch.tensor([ids], device=param.device), n_new, temperature=temp, top_p=nucleus,
                          seed=sampler_seed, eos_token_id=eos, timings=timings)[0].tolist()
    return Generation(new, tok.decode(new) if tok is not None else None, len(ids), timings.get("prefill_s", 0.0),
                      timings.get("decode_s", 0.0), param.device.type, str(param.dtype)[6:])


@dataclass(frozen=True)
class _Prompt:
    """What to continue: token ids, a text, or a chat turn (with its system message and template file)."""

    ids: list[int] | None
    text: str | None
    chat: str | None
    system: str | None
    chat_template: str | None

    @classmethod
    def of(cls, prompt, tokens, chat, system, chat_template) -> _Prompt:
        """The options checked: exactly one input, --system and --chat-template with --chat, text that is UTF-8."""
        if [prompt, tokens, chat].count(None) != 2:
            raise BamSurgeryError("give the input as exactly one of --prompt TEXT, --tokens ID,ID,... and --chat TEXT")
        if chat is None and (system is not None or chat_template is not None):
            raise BamSurgeryError(f"{'--system' if system is not None else '--chat-template'} goes with --chat")
        for option, text in (("--prompt", prompt), ("--chat", chat), ("--system", system)):
            try:
                (text or "").encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: bytes of the command line that are not UTF-8
                raise BamSurgeryError(f"{option}: not valid text at character {e.start + 1} (a lone surrogate "
                                      f"{text[e.start]!r}: the argument holds bytes that are not UTF-8)") from None
        return cls(_token_ids(tokens) if tokens is not None else None, prompt, chat, system, chat_template)

    def token_ids(self, tok) -> list[int]:
        """The ids: as given, the chat turn rendered through its template, or the text encoded."""
        if self.chat is not None:
            template = template_file(self.chat_template) if self.chat_template is not None else None
            return chat_prompt_ids(tok, chat_messages(self.chat, self.system), template)
        if self.ids is not None:
            return self.ids
        ids = encode_prompt(tok, self.text)
        if not ids:
            raise BamSurgeryError("--prompt: the text encodes to no tokens")
        return ids


def _checkpoint_run(name: str, given: _Prompt, tokenizer: str | None, n_new: int, where, dtype: str | None):
    """(model, tokenizer, eos, prompt ids) of a checkpoint opened by name, its model built on `where`."""
    with open_input(name) as reader:
        cfg = reader.config
        eos = generation_config(reader).get("eos_token_id")
        tok = find_tokenizer(tokenizer, reader, cfg.vocab_size, eos, needed=given.ids is None)
        ids = given.token_ids(tok)
        _check_length(ids, n_new, cfg, name)
        weight_dtype = getattr(torch, dtype) if dtype else (
            torch.float32 if where.type == "cpu" else reader.dtype("embed.weight"))
        _check_cache_fits(cfg, len(ids) + n_new, weight_dtype, where)
        model = model_from_reader(reader, where, weight_dtype)
    _check_finite(model, name)
    return model, tok, eos, ids


def _loaded_run(loaded: Loaded, given: _Prompt, tokenizer: str | None, n_new: int, device, dtype: str | None):
    """(model, tokenizer, eos, prompt ids) of a model load() returned: its own tokenizer unless one is given."""
    model, name = loaded.model, loaded.checkpoint
    _same_place(model, device, dtype)
    eos = loaded.generation.get("eos_token_id")
    tok = loaded.tokenizer if tokenizer is None else find_tokenizer(tokenizer, None, model.config.vocab_size, eos,
                                                                    needed=True)
    if tok is None and given.ids is None:
        loaded.encode("")  # the one-line refusal of a loaded model without a tokenizer
    ids = given.token_ids(tok)
    _check_length(ids, n_new, model.config, name)
    param = next(model.parameters())
    _check_cache_fits(model.config, len(ids) + n_new, param.dtype, param.device)
    _check_finite(model, name)
    return model, tok, eos, ids


def _check_length(ids: list[int], n_new: int, cfg, name: str) -> None:
    bad = [i for i in ids if i >= cfg.vocab_size]
    if bad:
        raise BamSurgeryError(f"token id {bad[0]} is out of range: {name} has vocab_size {cfg.vocab_size}")
    if len(ids) + n_new > cfg.max_positions:  # learned or RoPE: train and eval refuse longer sequences too
        raise BamSurgeryError(f"{len(ids)} prompt tokens + --max-new-tokens {n_new} = {len(ids) + n_new} exceed "
                              f"the model's max_positions={cfg.max_positions}")


def _same_place(model, device, dtype: str | None) -> None:
    """A loaded model runs where and as it was loaded: a device or dtype that differs is refused, naming load's."""
    param = next(model.parameters())
    here = f"{param.device.type}{'' if param.device.index is None else f':{param.device.index}'}"
    if device is not None and (device.type, device.index or 0) != (param.device.type, param.device.index or 0):
        raise BamSurgeryError(f"--device {device}: the loaded model is on {here}; load it with device= to run it "
                              "elsewhere")
    if dtype is not None and getattr(torch, dtype) != param.dtype:
        raise BamSurgeryError(f"--dtype {dtype}: the loaded model's weights are {str(param.dtype)[6:]}; load it with "
                              "dtype= to run it so")


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


__all__ = ["Generation", "generate"]
