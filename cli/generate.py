"""`bam-surgery generate`: continue a prompt with any checkpoint the tool opens (canonical file or directory,
HF directory or hub id, our Mixtral and HF BAM exports), through runtime.generate (fused path, static KV cache): a
declaration of app/generate.py:generate, the use case, which holds the checks, the tokenizer and the run.

    bam-surgery generate mix.safetensors --prompt "def fib(n):" --max-new-tokens 40
    bam-surgery generate mix/ --tokens 1,2,3 --temperature 0.8 --top-p 0.95 --seed 1
    bam-surgery generate model.gguf --chat "What is BAM?" --system "Answer briefly."

The tokenizer is found as train, eval and merge find theirs (train.tokenize.resolve_tokenizer): --tokenizer
(a tokenizer.json, a folder holding one, or `bytes`), else the checkpoint's own, else the byte-level tokenizer
for vocabularies of at most 512. --chat renders a user turn (after --system's) through the checkpoint's own chat
template, or --chat-template FILE's, as transformers' apply_chat_template(add_generation_prompt=True) does
(train/chat.py). Prints the continuation on stdout (text, decoded with that tokenizer; token ids, comma-separated,
when --tokens is given and no tokenizer applies) and one summary line on stderr: the prefill (the prompt's forward
pass and the first token) and the decoding of the other tokens timed apart. Every
bad input (option value, device, checkpoint, tokenizer) is one `bam-surgery: error:` line with exit status 2.
"""
from __future__ import annotations

import re
import sys

import click

from bam_surgery.app.generate import generate
from bam_surgery.app.load import DTYPES

from .options import CommandReporter

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
    out = generate(checkpoint, prompt, tokens=tokens, chat=chat, system=system, chat_template=chat_template,
                   tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                   temperature=temperature, top_p=top_p, seed=seed, device=device, dtype=dtype,
                   reporter=CommandReporter())
    if out.text is not None:
        click.echo(_for_terminal(out.text) if sys.stdout.isatty() else out.text)
    else:
        click.echo(",".join(str(i) for i in out.tokens))
    click.echo(f"{len(out.tokens)} new tokens after {out.prompt_tokens} prompt tokens: {out.speeds()} "
               f"({out.device}, {out.dtype})", err=True)


def _for_terminal(text: str) -> str:
    return _TERMINAL_UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)
