"""`bam-surgery generate`: continue a prompt with any checkpoint the tool opens (canonical file or directory,
HF directory or hub id, our Mixtral and HF BAM exports), through runtime.generate (fused path, static KV cache).

    bam-surgery generate mix.safetensors --prompt "def fib(n):" --max-new-tokens 40
    bam-surgery generate mix/ --tokens 1,2,3 --temperature 0.8 --top-p 0.95 --seed 1
    bam-surgery generate model.gguf --chat "What is BAM?" --system "Answer briefly."

The tokenizer is found as train, eval and merge find theirs (train.tokenize.resolve_tokenizer): --tokenizer
(a tokenizer.json, a folder holding one, or `bytes`), else the checkpoint's own, else the byte-level tokenizer
for vocabularies of at most 512. --chat renders a user turn (after --system's) through the checkpoint's own chat
template, or --chat-template FILE's, as transformers' apply_chat_template(add_generation_prompt=True) does
(train/chat.py). Prints the continuation on stdout (text, decoded with that tokenizer; token
ids, comma-separated, when --tokens is given and no tokenizer applies) and one summary line on stderr: the prefill
(the prompt's forward pass and the first token) and the decoding of the other tokens timed apart. Every
bad input (option value, device, checkpoint, tokenizer) is one `bam-surgery: error:` line with exit status 2.
"""
from __future__ import annotations

import re
import sys

import click
import torch

from bam_surgery.app.inputs import open_input
from bam_surgery.runtime import ModelKVCache, generate, model_from_reader
from bam_surgery.runtime.memory import check_fits
from bam_surgery.surgery.card import generation_config
from bam_surgery.surgery.errors import BamSurgeryError
from bam_surgery.surgery.plan_reader import all_finite
from bam_surgery.train.chat import chat_messages, chat_prompt_ids, template_file
from bam_surgery.train.errors import TrainError
from bam_surgery.train.tokenize import HFTokenizer, checkpoint_tokenizer, resolve_tokenizer

DTYPES = ("float32", "bfloat16", "float16")
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
# control characters but newline and tab: an untrained model's bytes could move the cursor, clear the screen or
# retitle the terminal; on a terminal they are shown escaped (\x1b), into a pipe or file they go as they are
_TERMINAL_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


@click.command("generate")
@click.argument("checkpoint", metavar="CKPT")
@click.option("--prompt", metavar="TEXT", help="Text to continue; encoded with the tokenizer (see --tokenizer).")
@click.option("--tokens", metavar="ID,ID,...",
              help="Token ids to continue instead of --prompt, comma-separated, e.g. 1,2,3.")
@click.option("--chat", metavar="TEXT", help="A user message instead of --prompt, rendered through the checkpoint's chat "
                                           "template with the assistant's turn opened (as transformers' "
                                           "apply_chat_template(add_generation_prompt=True)).")
@click.option("--system", metavar="TEXT", help="A system message before --chat's.")
@click.option("--chat-template", metavar="FILE",
              help="A Jinja chat template for --chat (default: the one beside the tokenizer: chat_template.jinja, "
                   "or tokenizer_config.json's chat_template).")
@click.option("--tokenizer", metavar="PATH|bytes",
              help="Tokenizer of --prompt and of the printed text: a tokenizer.json, a folder holding one, or bytes "
                   "(default: the checkpoint's own; bytes for vocabularies of at most 512).")
@click.option("--max-new-tokens", default="32", show_default=True, metavar="N",
              help="Most tokens to generate; fewer if the checkpoint's eos token comes first.")
@click.option("--temperature", default="0", show_default=True, metavar="T",
              help="0 decodes greedily; above 0 samples from softmax(logits / T).")
@click.option("--top-p", default="1", show_default=True, metavar="P",
              help="Nucleus sampling: sample among the most likely tokens whose probability reaches P (0 < P <= 1); "
                   "unused at --temperature 0 (a note says so).")
@click.option("--seed", default=None, metavar="N", help="Seed of the sampler (same seed, same text). Default: random.")
@click.option("--device", default="cpu", show_default=True, metavar="cpu|cuda",
              help="Where the model runs: cpu, cuda or cuda:N.")
@click.option("--dtype", default=None, metavar="|".join(DTYPES),
              help="Weight dtype for the run. Default: float32 on cpu, the checkpoint's own on cuda.")
def generate_cmd(checkpoint, prompt, tokens, chat, system, chat_template, tokenizer, max_new_tokens, temperature,
                 top_p, seed, device, dtype) -> None:
    """Continue a prompt with a checkpoint (greedy, or sampled with --temperature)."""
    n_new = _number("--max-new-tokens", max_new_tokens, int, lambda v: v >= 0, "an integer >= 0")
    temp = _number("--temperature", temperature, float, lambda v: v >= 0, "a number >= 0")
    nucleus = _number("--top-p", top_p, float, lambda v: 0 < v <= 1, "a number in (0, 1]")
    sampler_seed = None if seed is None else _number("--seed", seed, int, lambda v: 0 <= v <= MAX_SEED,
                                                     f"an integer from 0 to {MAX_SEED} (2**64 - 1)")
    run_device = _device(device)
    if dtype is not None and dtype not in DTYPES:
        raise BamSurgeryError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if [prompt, tokens, chat].count(None) != 2:
        raise BamSurgeryError("give the input as exactly one of --prompt TEXT, --tokens ID,ID,... and --chat TEXT")
    if chat is None and (system is not None or chat_template is not None):
        raise BamSurgeryError(f"{'--system' if system is not None else '--chat-template'} goes with --chat")
    ids = _token_ids(tokens) if tokens is not None else None
    for option, text in (("--prompt", prompt), ("--chat", chat), ("--system", system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: bytes of the command line that are not UTF-8
            raise BamSurgeryError(f"{option}: not valid text at character {e.start + 1} (a lone surrogate "
                                  f"{text[e.start]!r}: the argument holds bytes that are not UTF-8)") from None
    if nucleus < 1 and temp == 0:
        click.echo(f"bam-surgery: note: --top-p {top_p} is unused under greedy decoding (--temperature 0); give "
                   "--temperature above 0 to sample", err=True)

    with open_input(checkpoint) as reader:
        cfg = reader.config
        eos = generation_config(reader).get("eos_token_id")
        tok = _tokenizer(tokenizer, reader, cfg.vocab_size, eos, needed=ids is None)
        if chat is not None:
            ids = chat_prompt_ids(tok, chat_messages(chat, system), template_file(chat_template) if chat_template
                                  else None)
        if ids is None:
            ids = _encode(tok, prompt)
            if not ids:
                raise BamSurgeryError("--prompt: the text encodes to no tokens")
        bad = [i for i in ids if i >= cfg.vocab_size]
        if bad:
            raise BamSurgeryError(f"token id {bad[0]} is out of range: {checkpoint} has vocab_size {cfg.vocab_size}")
        if len(ids) + n_new > cfg.max_positions:  # learned or RoPE: train and eval refuse longer sequences too
            raise BamSurgeryError(f"{len(ids)} prompt tokens + --max-new-tokens {n_new} = {len(ids) + n_new} exceed "
                                  f"the model's max_positions={cfg.max_positions}")
        weight_dtype = getattr(torch, dtype) if dtype else (
            torch.float32 if run_device.type == "cpu" else reader.dtype("embed.weight"))
        _check_cache_fits(cfg, len(ids) + n_new, weight_dtype, run_device)
        model = model_from_reader(reader, run_device, weight_dtype)
        _check_finite(model, checkpoint)

    timings: dict[str, float] = {}
    new = generate(model, torch.tensor([ids]), n_new, temperature=temp, top_p=nucleus, seed=sampler_seed,
                   eos_token_id=eos, timings=timings)[0].tolist()
    if tok is not None:
        click.echo(_for_terminal(tok.decode(new)) if sys.stdout.isatty() else tok.decode(new))
    else:
        click.echo(",".join(str(i) for i in new))
    click.echo(f"{len(new)} new tokens after {len(ids)} prompt tokens: {_speeds(len(ids), len(new), timings)} "
               f"({run_device.type}, {str(weight_dtype)[6:]})", err=True)


def _speeds(prompt: int, new: int, timings: dict[str, float]) -> str:
    """Prefill (the prompt's forward pass, which gives the first new token) and decode (one step per later token)
    apart: a short answer's rate is not its prompt's."""
    prefill, decode = timings.get("prefill_s", 0.0), timings.get("decode_s", 0.0)
    out = f"prefill {prompt} tokens in {prefill:.2f} s ({prompt / max(prefill, 1e-9):.1f} tokens/s)"
    if new > 1:
        out += f", decode {new - 1} tokens in {decode:.2f} s ({(new - 1) / max(decode, 1e-9):.1f} tokens/s)"
    return out


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


def _number(option: str, text: str, kind: type, ok, what: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise BamSurgeryError(f"{option}: {text!r} is not {what}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise BamSurgeryError(f"--tokens: cannot read {text!r}; write comma-separated token ids, e.g. 1,2,3")
    return ids


def _device(text: str):
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


def _tokenizer(option: str | None, reader, vocab_size: int, eos, needed: bool):
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


def _encode(tok, prompt: str) -> list[int]:
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


def _for_terminal(text: str) -> str:
    return _TERMINAL_UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)
