"""The public Python API (bam_surgery, docs/api.md): its names are listed and documented, its session runs, its
functions are the CLI's (the same outputs), and its refusals are one-line UserErrors."""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import bam_surgery as bs
from bam_surgery.app.errors import one_line_errors, user_error
from conftest import hf_llama_family

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
# three tiny HF Llama folders, a byte vocabulary (the byte tokenizer applies: at most 512 tokens)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 0}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_every_public_name_is_documented():
    """__all__ is what the page's table lists, each a function or class with a docstring."""
    text = API_DOC.read_text(encoding="utf-8")
    table = set(re.findall(r"^\| `([A-Za-z_]+)[(`]", text, flags=re.M))
    public = set(bs.__all__) - {"__version__"}
    assert table == public
    for name in public:
        assert (getattr(bs, name).__doc__ or "").strip(), name


@pytest.mark.parametrize("error, line", [
    (OSError(28, "No space left on device", "out/x"), "out/x: No space left on device (free some space"),
    (ModuleNotFoundError("no onnx", name="onnx"), "needs the Python package 'onnx'"),
    (bs.UserError("two\nlines"), "two\\nlines"),  # a line break shown escaped (runtime.errors.one_line)
])
def test_refusals_are_one_line_user_errors(error, line):
    @one_line_errors
    def failing():
        raise error

    with pytest.raises(bs.UserError) as e:
        failing()
    assert line in str(e.value) and "\n" not in str(e.value)
    assert user_error(ValueError("a bug")) is None  # anything else keeps its traceback


def test_options_are_checked_by_name(tmp_path):
    with pytest.raises(bs.UserError, match="merge takes no option 'ffn_topk'"):
        bs.merge("seed", ["code"], tmp_path / "x.safetensors", ffn_topk=1)
    with pytest.raises(bs.UserError, match="format gguf takes no option 'opset'"):
        bs.convert("seed", tmp_path / "x.gguf", "gguf", opset=17)
    with pytest.raises(bs.UserError, match="count_params takes no option 'weights'"):
        bs.count_params(preset="tiny", recipe="bam", experts=2, weights=[1, 1])
    with pytest.raises(bs.UserError, match="--dtype: unknown dtype 'fp8'"):
        bs.export_onnx("seed", tmp_path / "x", dtype="fp8")


def test_options_given_as_text_are_read_as_their_flags_read_them():
    """A number or yes/no option given as text is the flag's value (router_seed="7" is 7, not a string that would seed
    another generator), and text that is not one is refused in one line."""
    from bam_surgery.app.api import options_from
    from bam_surgery.surgery.options import MergeOptions

    opts = options_from(MergeOptions, {"router_seed": "7", "ffn_granularity": "4", "seed_expert": "no",
                                       "router_temperature": "0.5"}, "merge")
    assert opts == options_from(MergeOptions, {"router_seed": 7, "ffn_granularity": 4, "seed_expert": False,
                                               "router_temperature": 0.5}, "merge")
    with pytest.raises(bs.UserError, match="merge: option router_seed='seven' is not an integer"):
        options_from(MergeOptions, {"router_seed": "seven"}, "merge")


def test_generate_takes_a_loaded_model(tmp_path, one_thread):
    """generate(load(x)) runs the model load() built, with its tokenizer (no second load from x): the same tokens and
    text as generate(x); a device or dtype other than the loaded model's is refused in one line."""
    hf_llama_family(tmp_path, LLAMA, ("seed",))
    path = str(tmp_path / "seed")
    loaded = bs.load(path)
    by_path = bs.generate(path, "def add(a, b):", max_new_tokens=6)
    by_model = bs.generate(loaded, "def add(a, b):", max_new_tokens=6)
    assert by_model.tokens == by_path.tokens and len(by_model.tokens) == 6 and by_model.text == by_path.text
    assert by_model.prompt_tokens == len(loaded.encode("def add(a, b):")) == by_path.prompt_tokens
    assert by_model.prefill_seconds > 0 and by_model.decode_seconds > 0 and by_model.decode_tokens_per_second > 0
    assert "prefill 14 tokens in" in by_model.speeds() and ", decode 5 tokens in" in by_model.speeds()
    again = bs.generate(loaded, tokens=[5, 6, 7], max_new_tokens=1)
    assert again.tokens == bs.generate(path, tokens=[5, 6, 7], max_new_tokens=1).tokens
    assert again.decode_tokens_per_second is None and ", decode" not in again.speeds()
    with pytest.raises(bs.UserError, match="^--dtype bfloat16: the loaded model's weights are float32; load it with "):
        bs.generate(loaded, "x", dtype="bfloat16")
    with pytest.raises(bs.UserError, match="^no chat template travels with this model's tokenizer"):
        bs.generate(loaded, chat="hi")


@pytest.mark.slow
def test_the_documented_session_runs(tmp_path, monkeypatch, one_thread):
    """docs/api.md's Python blocks, run in order in a folder holding what the page says; then the CLI's merge of
    the same inputs and options writes the same model as the API's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    (tmp_path / "data").symlink_to(ROOT / "data", target_is_directory=True)
    hf_llama_family(tmp_path, LLAMA, ("seed", "code", "law"))
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        for block in python_blocks(API_DOC.read_text(encoding="utf-8")):
            exec(compile(block, str(API_DOC), "exec"), namespace)  # noqa: S102 (the page's own code)
    out = printed.getvalue()
    assert "mix.safetensors 3 3" in out
    assert "ffn_top_k: top-3 routing needs between 1 and 2 FFN experts" in out
    assert namespace["report"].domains["code"].tokens > 0 and namespace["run"].steps == 4
    assert (tmp_path / "mix-hf" / "config.json").is_file() and (tmp_path / "seed.gguf").is_file()
    assert namespace["seed"].model.config.vocab_size == 256 and "torch" in namespace

    from bam_surgery.cli.commands import cli
    result = CliRunner().invoke(cli, ["merge", "--seed", "seed", "--experts", "code=code,law=law", "--recipe", "bam",
                                      "--ffn-top-k", "1", "--gate-norm", "softmax", "--out", "cli.safetensors",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    api, cli_model = bs.load("mix.safetensors").model, bs.load("cli.safetensors").model
    assert api.config == cli_model.config
    assert all(torch.equal(a, b) for a, b in zip(api.state_dict().values(), cli_model.state_dict().values()))
    assert os.path.getsize("mix.safetensors") == os.path.getsize("cli.safetensors")
