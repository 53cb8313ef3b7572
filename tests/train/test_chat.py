"""Chat prompts (train/chat.py): the checkpoint's chat template rendered and encoded as transformers'
apply_chat_template(add_generation_prompt=True) does, on templates in the shapes real models ship (ChatML with a
default system prompt as SmolLM2's, Gemma's with {{ bos_token }} and raise_exception on roles, Llama 3's with
strftime_now and a namespace, one with tojson, loop controls and {% generation %}), from chat_template.jinja or
tokenizer_config.json (a string, or named templates); one-line refusals: no template, a template that refuses the
conversation, bad syntax, the sandbox; `generate --chat` end to end; hostile templates fuzzed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import GEMMA3_CHAT_TEMPLATE as GEMMA, error_line, run_cli, tiny_config
from bam_surgery.runtime import Model, generate, save_model
from bam_surgery.train.chat import chat_messages, chat_prompt_ids, chat_template, render_chat, special_tokens
from bam_surgery.train.errors import TrainError
from bam_surgery.train.tokenize import HFTokenizer

import torch

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["You are a helpful AI assistant named SmolLM, trained by Hugging Face", "What is the capital of France?",
          "Answer briefly. The user asks; the model answers.", "Cutting Knowledge Date: December 2023 Today Date"] * 8

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = """{{- bos_token }}
{%- set ns = namespace(system="") %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\n\n" }}
{{- ns.system }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
TOOLS = """{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% generation %}{{ m | tojson }}{% endgeneration %}
  {{ dict(role=m.role) | tojson(indent=2, sort_keys=True) }} {{ eos_token }} {{ tools is none }} {{ documents is none }}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"""
TEMPLATES = {"chatml": CHATML, "gemma": GEMMA, "llama3": LLAMA3, "tools": TOOLS}
CONVERSATIONS = [chat_messages("What is the capital of France?"),
                 chat_messages("What is the capital of France?", "Answer briefly."),
                 chat_messages("  naïve café — 日本語 🦙 \"quoted\" <b>html</b>\n", "  spaced system  ")]


def save_chat_tokenizer(folder: Path, template: str | list | None, in_file: bool = False) -> Path:
    """A byte-level BPE (train/bpe.py's kind) with the chat tokens added as special tokens, a tokenizer_config.json
    naming bos/eos/unk/pad, and the template in tokenizer_config.json or chat_template.jinja."""
    from bam_surgery.train.bpe import build_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_bpe(CORPUS, 320)
    tok.add_special_tokens(SPECIALS[1:])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}, "unk_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}
    if template is not None and not in_file:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and in_file:
        (folder / "chat_template.jinja").write_text(template)
    return folder / "tokenizer.json"


def theirs(folder: Path, messages) -> tuple[str, list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return text, list(ids)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("in_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
def test_prompt_ids_equal_transformers(tmp_path, name, in_file):
    path = save_chat_tokenizer(tmp_path / "tok", TEMPLATES[name], in_file)
    tok = HFTokenizer(path)
    for messages in CONVERSATIONS:
        text, ids = theirs(path.parent, messages)
        found = chat_template(tok)
        assert found is not None and found[0] == TEMPLATES[name]
        assert render_chat(found[0], messages, special_tokens(tok)) == text
        assert chat_prompt_ids(tok, messages) == ids, (name, messages)


def test_named_templates_take_the_default(tmp_path):
    path = save_chat_tokenizer(tmp_path / "tok", [{"name": "tool_use", "template": TOOLS},
                                                  {"name": "default", "template": CHATML}])
    messages = CONVERSATIONS[1]
    assert chat_prompt_ids(HFTokenizer(path), messages) == theirs(path.parent, messages)[1]


def test_refusals_are_one_line(tmp_path):
    path = save_chat_tokenizer(tmp_path / "none", None)
    with pytest.raises(TrainError, match="no chat template travels with this model's tokenizer .*--chat-template FILE"):
        chat_prompt_ids(HFTokenizer(path), CONVERSATIONS[0])
    gemma = HFTokenizer(save_chat_tokenizer(tmp_path / "gemma", GEMMA))
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TrainError, match="the template refuses this conversation: Conversation roles must alternate"):
        chat_prompt_ids(gemma, twice)
    for bad, needle in (("{% for m in messages %}", "not a valid Jinja template (line 1"),
                        ("{{ ''.__class__.__mro__ }}", "the template refuses this conversation"),
                        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
                        ("{{ messages[0]['content'] + 1 }}", "the template failed on this conversation")):
        with pytest.raises(TrainError, match="^[^\n]*" + needle.replace("(", r"\(")):
            render_chat(bad, CONVERSATIONS[0], {})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("{}%#-+~|.()[]'\" abcmesgtrloopfin_0123\n")), max_size=80))
def test_any_template_renders_or_refuses_in_one_line(template):
    try:
        text = render_chat(template, CONVERSATIONS[1], {"bos_token": "<bos>"})
    except TrainError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(text, str)


def test_generate_chat_end_to_end(tmp_path):
    """`generate --chat --system` continues the rendered prompt's ids; --chat-template FILE replaces the template;
    a model whose tokenizer has none is refused in one line saying what to do."""
    cfg = tiny_config(vocab_size=336, max_positions=256)
    model = Model(cfg)
    model.reset_parameters(seed=2)
    folder = save_model(model.eval(), tmp_path / "model")
    save_chat_tokenizer(folder, CHATML)
    messages = chat_messages("What is the capital of France?", "Answer briefly.")
    ids = theirs(folder, messages)[1]
    expected = generate(model, torch.tensor([ids]), 5)[0].tolist()
    result = run_cli("generate", folder, "--chat", messages[1]["content"], "--system", messages[0]["content"],
                     "--max-new-tokens", 5)
    assert result.stdout == HFTokenizer(folder / "tokenizer.json").decode(expected) + "\n"
    assert result.stderr.startswith(f"5 new tokens after {len(ids)} prompt tokens: prefill {len(ids)} tokens in ")
    assert ", decode 4 tokens in " in result.stderr
    (tmp_path / "gemma.jinja").write_text(GEMMA)
    gemma_ids = chat_prompt_ids(HFTokenizer(folder / "tokenizer.json"), messages, (GEMMA, "gemma"))
    result = run_cli("generate", folder, "--chat", messages[1]["content"], "--system", messages[0]["content"],
                     "--chat-template", tmp_path / "gemma.jinja", "--max-new-tokens", 3)
    assert result.stderr.startswith(f"3 new tokens after {len(gemma_ids)} prompt tokens")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    line = error_line(run_cli("generate", folder, "--chat", "hi", code=2))
    assert "no chat template travels with this model's tokenizer" in line and "--chat-template FILE" in line
    for args, needle in ((("--chat", "hi", "--prompt", "x"), "exactly one of --prompt TEXT, --tokens"),
                         (("--prompt", "x", "--system", "s"), "--system goes with --chat"),
                         (("--chat", "hi", "--chat-template", tmp_path / "missing.jinja"), "missing.jinja: no such file")):
        assert needle in error_line(run_cli("generate", folder, *args, code=2))
