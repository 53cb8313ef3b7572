"""Chat prompts: a conversation rendered through the checkpoint's own chat template, as transformers'
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` renders and encodes it.

    template = chat_template(tok)                         # the tokenizer's, or None
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "Hi"}], template)

Where the template comes from (transformers' order): `chat_template.jinja` beside the tokenizer.json, else
tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one named "default"). A GGUF
file's `tokenizer.chat_template` is in the tokenizer_config.json its rebuilt tokenizer carries
(converters/gguf_tokenizer.py); a train run carries chat_template.jinja into each checkpoint.

How it is rendered, as transformers' chat_template_utils does: Jinja2's ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loop-controls extension and a `generation` block tag that renders its body (the
assistant-mask marker); the globals `raise_exception(message)` (the template refuses: one line saying its message),
`strftime_now(format)` (the local time now), `dict` and `namespace`; the `tojson` filter as json.dumps (no HTML
escaping, ensure_ascii false, indent / separators / sort_keys); the variables `messages`, `tools` (none),
`documents` (none), `add_generation_prompt` and the tokenizer's named special tokens as strings (bos_token,
eos_token, unk_token, sep_token, pad_token, cls_token, mask_token: tokenizer_config.json's, else
special_tokens_map.json's). The text is then encoded without the tokenizer's own special tokens
(add_special_tokens=False): a template that wants a BOS writes {{ bos_token }}.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import MAX_JSON_BYTES, read_bounded, read_json
from bam_surgery.runtime.shards import read_side_file

from .errors import TrainError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_TEMPLATE_BYTES = 1 << 20


def chat_template(tok: Any) -> tuple[str, str] | None:
    """(template, where it was found) from the files a tokenizer carries (train.tokenize.HFTokenizer.files), or None
    when none of them has one (the byte tokenizer has none)."""
    files = {Path(f).name: Path(f) for f in getattr(tok, "files", ())}
    if TEMPLATE_FILE in files:
        return _text(read_side_file(files[TEMPLATE_FILE], TEMPLATE_FILE, MAX_TEMPLATE_BYTES), files[TEMPLATE_FILE]), \
            str(files[TEMPLATE_FILE])
    config_file = files.get("tokenizer_config.json")
    if config_file is None:
        return None
    template = _config(config_file).get("chat_template")
    where = f"{config_file}: chat_template"
    if isinstance(template, list):  # named templates ({"name": ..., "template": ...}): transformers takes "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template, where = named.get("default"), f"{where} 'default'"
    if template is None:
        return None
    if not isinstance(template, str):
        raise TrainError(f"{where}: expected a Jinja template (a string), got {type(template).__name__}")
    return template, where


def template_file(path: str | Path) -> tuple[str, str]:
    """(template, where) from a file the user names (--chat-template FILE): a Jinja chat template."""
    where = f"--chat-template {printable(str(path))}"
    try:
        data = read_bounded(path, where, error=TrainError, max_bytes=MAX_TEMPLATE_BYTES, what="a chat template")
    except FileNotFoundError:
        raise TrainError(f"{where}: no such file") from None
    return _text(data, where), where


def special_tokens(tok: Any) -> dict[str, str]:
    """The tokenizer's named special tokens as strings, as transformers passes them to a chat template."""
    files = {Path(f).name: Path(f) for f in getattr(tok, "files", ())}
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # tokenizer_config.json's win
        if name in files:
            body = _config(files[name])
            for key in SPECIAL_TOKENS:
                value = body.get(key)
                if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
                    value = value.get("content")
                if isinstance(value, str):
                    found[key] = value
    return found


def render_chat(template: str, messages: list[Mapping[str, Any]], tokens: Mapping[str, str], *,
                add_generation_prompt: bool = True, where: str = "chat template") -> str:
    """The conversation rendered by the template, as transformers renders it (module docstring)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=_Namespace)
    try:
        compiled = env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TrainError(f"{where}: not a valid Jinja template (line {e.lineno}: {_line(e.message)})") from None
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **tokens)
    except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined names, the sandbox's refusals
        raise TrainError(f"{where}: the template refuses this conversation: {_line(e.message or str(e))}") from None
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError) as e:
        raise TrainError(f"{where}: the template failed on this conversation ({type(e).__name__}: "
                         f"{_line(str(e))})") from None


class _Generation(Extension):
    """{% generation %}...{% endgeneration %}, transformers' assistant-mask marker: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace(...) as transformers': no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        if any(isinstance(k, str) and k.startswith("_") for k in attrs):
            raise jinja2.exceptions.SecurityError("a namespace cannot hold underscore-prefixed attributes")
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("a namespace cannot hold underscore-prefixed attributes")
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Jinja's tojson without HTML escaping, with json.dumps' options (transformers')."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_messages(message: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn, after a system turn when given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": message}]


def chat_prompt_ids(tok: Any, messages: list[Mapping[str, Any]], template: tuple[str, str] | None = None
                    ) -> list[int]:
    """The token ids transformers' apply_chat_template(messages, add_generation_prompt=True) gives: `template`
    ((text, where), e.g. from template_file) or the tokenizer's own (chat_template), rendered, then encoded without
    the tokenizer's special tokens. No template: one TrainError saying what the user can do."""
    template = template or chat_template(tok)
    if template is None:
        raise TrainError(f"no chat template travels with this model's tokenizer ({printable(tok.name)}: neither "
                         f"{TEMPLATE_FILE} nor tokenizer_config.json's chat_template beside it); pass --chat-template "
                         "FILE (a Jinja chat template), or --tokenizer a folder whose tokenizer has one, or write the "
                         "turns out yourself with --prompt")
    text = render_chat(template[0], messages, special_tokens(tok), where=template[1])
    if not hasattr(tok, "tok"):
        return [int(i) for i in tok.encode_batch([text])[0]]
    try:
        return tok.tok.encode(text, add_special_tokens=False).ids
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
        raise TrainError(f"{tok.name}: cannot encode the chat prompt ({_line(str(e))})") from None


def _config(path: Path) -> dict:
    try:
        return read_json(path, expect=dict, error=TrainError, max_bytes=MAX_JSON_BYTES)
    except CheckpointError as e:
        raise TrainError(str(e)) from None


def _text(data: bytes, where: str | Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"{where}: not UTF-8 text (byte {e.start})") from None


def _line(text: str) -> str:
    return printable(" ".join(str(text).split()))[:300]


__all__ = ["chat_messages", "chat_prompt_ids", "chat_template", "render_chat", "special_tokens", "template_file"]
