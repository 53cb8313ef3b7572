"""What an export carries, over every route a checkpoint takes (issue 30): an HF folder with a byte-level BPE
tokenizer.json that has special tokens, a chat template (chat_template.jinja) and a generation config, taken

    HF -> each format          HF -> canonical (folder and single file) or GGUF -> each format
    merge -> each format       train run -> each format

into every format the model allows (canonical, hf, mixtral, qwen2_moe, qwen3_moe, flex_olmo, onnx, gguf). In each
output, read back as a user would (open_checkpoint, the GGUF's rebuilt tokenizer, the ONNX folder's files): the
tokenizer encodes a sample of code, prose and special tokens to the source's ids, the chat template is the
source's, and the eos id is the source's (in generation_config.json, and config.json or genai_config.json too).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from conftest import branch_state, export_carries, random_hf_model, run_cli  # noqa: E402
from bam_surgery.app.exports import export_inputs  # noqa: E402
from bam_surgery.converters import open_checkpoint  # noqa: E402
from bam_surgery.converters.hf import save_hf  # noqa: E402

CORPUS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
          "The quick brown fox jumps over the lazy dog; the experts are branched from one seed.",
          "Numbers 1234 and 56789, prices $3.50 and 12%, dates 2024-01-31."] * 8
SAMPLE = ("<|im_start|>user\ndef fib(n): return n if n < 2 else fib(n - 1)  # the seed's code<|im_end|>\n"
          "<|im_start|>assistant\nThe fox merges 42 experts.<|im_end|><|endoftext|>")
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # after the BPE's 300 tokens (<|endoftext|> is 0): ids 300, 301
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BOS, EOS, VOCAB = 0, 301, 320
SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=BOS)
FAMILIES = {"llama": ("LlamaConfig", SMALL), "qwen3": ("Qwen3Config", dict(SMALL, head_dim=8)),
            "olmo2": ("Olmo2Config", SMALL)}
FORMATS = ("canonical", "hf", "mixtral", "qwen2_moe", "qwen3_moe", "flex_olmo", "onnx", "gguf")
HF_FORMATS = ("hf", "mixtral", "qwen2_moe", "qwen3_moe", "flex_olmo")


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (a byte-level BPE of 300 tokens and two special tokens), tokenizer_config.json naming the
    special tokens, chat_template.jinja: the files a SmolLM2-like model folder holds."""
    from bam_surgery.train.bpe import build_bpe

    tok = build_bpe(CORPUS, 300)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "model_max_length": 2048}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(TEMPLATE)


def hf_family(root: Path, family: str) -> list[Path]:
    """A seed HF folder of `family` with the tokenizer files, and two specialists carrying the same files."""
    cls_name, kwargs = FAMILIES[family]
    random_hf_model(cls_name, kwargs).save_pretrained(root / "seed")
    write_tokenizer(root / "seed")
    with open_checkpoint(root / "seed") as seed:
        state = {n: seed.get(n) for n in seed.names()}
        for j, name in enumerate(("one", "two"), 1):
            save_hf(branch_state(state, lambda n: False, 10 * j), root / name, seed.architecture, config=seed.config,
                    **export_carries(seed))
    return [root / n for n in ("seed", "one", "two")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, one_thread):
    """{route: checkpoint}, the families' HF folders ("folders") and the seeds' tokenizer.json ("tokenizer")."""
    root = tmp_path_factory.mktemp("routes")
    folders = {f: hf_family(root / f, f) for f in FAMILIES}
    llama = folders["llama"]
    run_cli("convert", llama[0], "--out", root / "canon")
    run_cli("convert", llama[0], "--out", root / "canon.safetensors")
    run_cli("export-gguf", llama[0], "--out", root / "seed.gguf")
    return {"tokenizer": llama[0] / "tokenizer.json", "folders": folders, "hf": llama[0], "canonical-dir": root / "canon",
            "canonical-file": root / "canon.safetensors", "gguf": root / "seed.gguf", "root": root}


@pytest.fixture(scope="module")
def trained(sources):
    """A train run (2 steps) of a BTX merge of the llama family: the run folder."""
    root, (seed, *experts) = sources["root"], sources["folders"]["llama"]
    run_cli("merge", "--quiet", "--seed", seed, "--experts", ",".join(map(str, experts)), "--out", root / "btx",
            "--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2")
    (root / "text.txt").write_text("\n\n".join(CORPUS))
    run_cli("train", "--init", root / "btx", "--data", f"code={root / 'text.txt'}", "--out", root / "run",
            "--steps", "2", "--seq-len", "16", "--micro-batch", "2", "--eval-tokens", "32", "--no-plot")
    return root / "run"


# merges: (family, recipe options, formats)
MERGES = {"btx": ("llama", ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2"),
                  ("canonical", "hf", "mixtral", "onnx", "gguf")),
          "bam": ("llama", ("--recipe", "bam",), ("canonical", "hf", "onnx")),
          "shared": ("llama", ("--recipe", "btx-shared-expert",), ("qwen2_moe", "gguf")),
          "qwen3": ("qwen3", ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2"), ("qwen3_moe",)),
          "olmo2": ("olmo2", ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2"), ("flex_olmo",))}
ROUTES = [(r, f) for r, fmts in (("hf", ("canonical", "hf", "onnx", "gguf")),) for f in fmts]
ROUTES += [(r, f) for r in ("canonical-dir", "canonical-file", "gguf") for f in ("canonical", "hf", "onnx", "gguf")]
RUN_FORMATS = ("canonical", "hf", "mixtral", "onnx", "gguf")
MERGE_ROUTES = [(m, f) for m, (_, _, fmts) in MERGES.items() for f in fmts]


def out_name(fmt: str, single: bool = False) -> str:
    return "out.gguf" if fmt == "gguf" else ("out.safetensors" if single else "out")


def carried(out: Path, fmt: str) -> tuple[Path, str | None, object, object]:
    """(tokenizer.json, chat template, generation eos, config.json / genai_config.json eos) as a user reads them."""
    if fmt == "onnx":
        files = {p.name: p for p in out.iterdir()}
        genai = json.loads((out / "genai_config.json").read_text())["model"]["eos_token_id"]
        generation = json.loads(files["generation_config.json"].read_text())["eos_token_id"]
        return files["tokenizer.json"], _template(files), generation, genai
    with open_checkpoint(out) as reader:  # the files read back: a GGUF's rebuilt, a single file's carried
        inputs = export_inputs(reader, "canonical")
        files = {f.name: f for f in inputs.files}
        config_eos = json.loads((out / "config.json").read_text()).get("eos_token_id") if fmt in HF_FORMATS \
            else inputs.generation.get("eos_token_id")
        return files["tokenizer.json"], _template(files), inputs.generation.get("eos_token_id"), config_eos


def _template(files: dict[str, Path]) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].read_text()
    return json.loads(files["tokenizer_config.json"].read_text()).get("chat_template")


def check_carried(out: Path, fmt: str, source_tokenizer: Path) -> None:
    tokenizer, template, eos, config_eos = carried(out, fmt)
    want = tokenizers.Tokenizer.from_file(str(source_tokenizer)).encode(SAMPLE).ids
    assert tokenizers.Tokenizer.from_file(str(tokenizer)).encode(SAMPLE).ids == want, (out, fmt)
    assert EOS in want and 300 in want  # the sample holds the special tokens as single ids
    assert template == TEMPLATE, (out, fmt)
    assert eos in (EOS, [EOS]) and config_eos in (EOS, [EOS]), (out, fmt, eos, config_eos)


@pytest.mark.parametrize("route,fmt", ROUTES)
def test_route_carries_tokenizer_template_and_eos(sources, tmp_path, route, fmt):
    spec = sources[route]
    args = ("--architecture", "llama") if fmt == "hf" and route != "hf" else ()
    run_cli("convert", spec, "--format", fmt, "--out", tmp_path / out_name(fmt), *args)
    check_carried(tmp_path / out_name(fmt), fmt, sources["tokenizer"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", RUN_FORMATS)
def test_run_carries_tokenizer_template_and_eos(sources, trained, tmp_path, fmt):
    """convert RUN --format F: the run carries the seed's files (train copies them into each checkpoint)."""
    run_cli("convert", trained, "--format", fmt, "--out", tmp_path / out_name(fmt))
    check_carried(tmp_path / out_name(fmt), fmt, sources["tokenizer"])


@pytest.mark.parametrize("merge,fmt", MERGE_ROUTES)
def test_merge_carries_tokenizer_template_and_eos(sources, tmp_path, merge, fmt):
    family, recipe, _ = MERGES[merge]
    seed, *experts = sources["folders"][family]
    out = tmp_path / out_name(fmt)
    run_cli("merge", "--quiet", "--seed", seed, "--experts", ",".join(map(str, experts)), "--out", out, *recipe,
            "--format", fmt)
    check_carried(out, fmt, sources["tokenizer"])


def test_merge_to_a_single_file_carries_them(sources, tmp_path):
    seed, *experts = sources["folders"]["llama"]
    run_cli("merge", "--quiet", "--seed", seed, "--experts", ",".join(map(str, experts)), "--out",
            tmp_path / "mix.safetensors")
    check_carried(tmp_path / "mix.safetensors", "canonical", sources["tokenizer"])


@pytest.mark.slow
def test_export_commands_of_a_run(sources, trained, tmp_path):
    """export-gguf and export-onnx of a run folder carry what convert carries."""
    run = trained
    run_cli("export-gguf", run, "--out", tmp_path / "run.gguf")
    check_carried(tmp_path / "run.gguf", "gguf", sources["tokenizer"])
    run_cli("export-onnx", run, "--out", tmp_path / "onnx")
    check_carried(tmp_path / "onnx", "onnx", sources["tokenizer"])


@pytest.mark.slow
def test_open_checkpoint_reads_a_run_folder(trained):
    run = trained
    with open_checkpoint(run) as reader:
        assert reader.path.name == "step-00000002" and reader.config.ffn_experts == 3


@pytest.mark.slow
def test_generate_on_the_run_stops_at_its_eos(trained):
    """The run carries the seed's generation config, so generate stops at <|im_end|> (301) as on the seed."""
    from bam_surgery.surgery.card import generation_config

    run = trained
    with open_checkpoint(run) as reader:
        assert generation_config(reader)["eos_token_id"] == EOS
    out = run_cli("generate", run, "--tokens", "300,5,6", "--max-new-tokens", "3").output
    assert out.strip()


def test_binary_side_file_in_a_single_file_is_refused(sources, tmp_path):
    """A tokenizer.model (binary) cannot ride in a single file's metadata: one line, naming the way out."""
    from conftest import error_line

    folder = tmp_path / "sp"
    seed = sources["folders"]["llama"][0]
    folder.mkdir()
    for p in seed.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "tokenizer.model").write_bytes(bytes(range(256)))
    line = error_line(run_cli("convert", folder, "--out", tmp_path / "sp.safetensors", code=2), "tokenizer.model",
                      "directory")
    assert not (tmp_path / "sp.safetensors").exists(), line
    run_cli("convert", folder, "--out", tmp_path / "sp-dir")
    assert (tmp_path / "sp-dir" / "tokenizer.model").read_bytes() == bytes(range(256))


@pytest.mark.slow
def test_a_byte_level_run_carries_its_seed_s_generation_config(tmp_path, one_thread):
    """The byte tokenizer has no folder of its own: each checkpoint takes the init's generation config and chat
    template, and generate stops where the seed says."""
    from conftest import random_state, tiny_config
    from bam_surgery.runtime.checkpoint import save_checkpoint

    cfg = tiny_config(vocab_size=256, max_positions=32)
    save_checkpoint(random_state(cfg), cfg, tmp_path / "seed")
    (tmp_path / "seed" / "generation_config.json").write_text(json.dumps({"eos_token_id": 10}))
    (tmp_path / "seed" / "chat_template.jinja").write_text(TEMPLATE)
    (tmp_path / "text.txt").write_text("\n\n".join(CORPUS))
    run_cli("train", "--init", tmp_path / "seed", "--data", f"code={tmp_path / 'text.txt'}", "--out", tmp_path / "run",
            "--steps", "1", "--seq-len", "16", "--micro-batch", "2", "--eval-tokens", "32", "--no-plot")
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert json.loads((step / "generation_config.json").read_text()) == {"eos_token_id": 10}
    assert (step / "chat_template.jinja").read_text() == TEMPLATE


@pytest.mark.parametrize("entry", [{"../x.json": "{}"}, {"tokenizer.json": 3}, ["tokenizer.json"]])
def test_hostile_side_files_in_a_single_file(tmp_path, entry):
    """A single file's carried side files: names from the list only, text only; else one line naming the file."""
    from safetensors.torch import save_file

    from conftest import random_state, tiny_config
    from bam_surgery.runtime.checkpoint import CONFIG_KEY, SIDE_FILES_KEY, CheckpointReader
    from bam_surgery.runtime.errors import CheckpointError

    cfg = tiny_config()
    path = tmp_path / "x.safetensors"
    save_file(random_state(cfg), path, metadata={"format": "bam-surgery/1", CONFIG_KEY: cfg.to_json(),
                                                 SIDE_FILES_KEY: json.dumps(entry)})
    with CheckpointReader(path) as reader, pytest.raises(CheckpointError) as e:
        reader.tokenizer_files()
    assert str(path) in str(e.value) and "\n" not in str(e.value)
