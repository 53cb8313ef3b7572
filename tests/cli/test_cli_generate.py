"""`bam-surgery generate` end to end: canonical file and directory, HF BAM export, HF Llama directory; the
tokenizer carried by the checkpoint (its folder, the HF input), given with --tokenizer, or the byte tokenizer
(`--tokenizer bytes`, and the default for small vocabularies, as in the other commands); greedy output equal
to runtime.generate; seeded sampling; the note on --top-p under greedy decoding; eos from the checkpoint's
generation config; and every bad input refused with one `bam-surgery: error:` line and exit status 2.
Offline, tiny models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from conftest import error_line, random_state, run_cli, tiny_config
from bam_surgery.converters.hf_bam import export_hf_bam
from bam_surgery.runtime import Model, generate, save_model
from bam_surgery.runtime.checkpoint import CheckpointReader
from bam_surgery.cli.commands import cli
from bam_surgery.train.tokenize import ByteTokenizer

V = 64
SPECIALS = ["<unk>", "<pad>", "</s>"]  # ids 0, 1, 2; words w3 .. w63


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), V)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens(SPECIALS)  # decoding skips them
    words.save(str(path))


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids if i >= len(SPECIALS))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny BAM mixture as a canonical directory (with tokenizer.json), a lone canonical file, and an HF BAM
    export carrying the tokenizer and an eos id; plus the model itself."""
    root = tmp_path_factory.mktemp("generate")
    cfg = tiny_config(vocab_size=V, attn_experts=3, ffn_experts=3, ffn_top_k=2, n_kv_heads=2, max_positions=64)
    model = Model(cfg)
    model.load_state_dict(random_state(cfg, 3))
    model.eval()
    save_model(model, root / "canonical")
    save_tokenizer(root / "canonical" / "tokenizer.json")
    (root / "lone").mkdir()
    save_model(model, root / "lone" / "mix.safetensors")
    with CheckpointReader(root / "canonical") as reader:
        export_hf_bam(reader, root / "hf", tokenizer_files=[root / "canonical" / "tokenizer.json"],
                      generation={"eos_token_id": 2})
    return root, model


def run(*args, ok: bool = True):
    return run_cli("generate", *args, code=0 if ok else None)


def greedy(model, ids: list[int], n: int, **kwargs) -> list[int]:
    return generate(model, torch.tensor([ids]), n, **kwargs)[0].tolist()


def test_prompt_with_the_tokenizer_next_to_the_checkpoint(checkpoints):
    root, model = checkpoints
    result = run(root / "canonical", "--prompt", "w5 w9 w12 w40", "--max-new-tokens", 6)
    assert result.stdout.strip() == words(greedy(model, [5, 9, 12, 40], 6))
    summary = result.stderr.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("6 new tokens after 4 prompt tokens")


def test_token_ids_without_a_tokenizer_print_ids(checkpoints):
    root, model = checkpoints
    result = run(root / "lone" / "mix.safetensors", "--tokens", "5,9,12", "--max-new-tokens", 5)
    assert result.stdout.strip() == ",".join(map(str, greedy(model, [5, 9, 12], 5)))


@pytest.mark.parametrize("where", ["file", "directory"])
def test_explicit_tokenizer(checkpoints, where):
    root, model = checkpoints
    tok = root / "canonical" / "tokenizer.json"
    result = run(root / "lone" / "mix.safetensors", "--prompt", "w7 w8", "--max-new-tokens", 4,
                 "--tokenizer", tok if where == "file" else tok.parent)
    assert result.stdout.strip() == words(greedy(model, [7, 8], 4))


def test_hf_export_stops_at_its_eos(checkpoints):
    root, model = checkpoints
    prompt = [4]  # greedy decoding emits </s> (id 2) as its 6th token, then goes on
    free = greedy(model, prompt, 20)
    assert 2 in free[:-1]
    result = run(root / "hf", "--prompt", words(prompt), "--max-new-tokens", 20)
    assert result.stdout.strip() == words(free[:free.index(2)])
    assert result.stderr.startswith(f"{free.index(2) + 1} new tokens")


def test_seeded_sampling_is_repeatable(checkpoints):
    root, model = checkpoints
    args = (root / "canonical", "--tokens", "5,9", "--max-new-tokens", 8, "--temperature", 1.0, "--top-p", 0.9)
    a = run(*args, "--seed", 3).stdout
    assert a == run(*args, "--seed", 3).stdout
    assert a.strip() == words(greedy(model, [5, 9], 8, temperature=1.0, top_p=0.9, seed=3))


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny model with a byte-sized vocabulary (256, like the demo's), saved as a lone file: no tokenizer."""
    cfg = tiny_config(vocab_size=256, ffn_experts=2, max_positions=64)
    model = Model(cfg)
    model.load_state_dict(random_state(cfg, 5))
    model.eval()
    return save_model(model, tmp_path_factory.mktemp("bytes") / "mix.safetensors"), model


@pytest.mark.parametrize("spelling", [None, "bytes"])
def test_byte_tokenizer_by_default_and_by_name(byte_model, spelling):
    """As in train, eval and merge: `--tokenizer bytes`, and the default for vocabularies of at most 512."""
    path, model = byte_model
    chosen = () if spelling is None else ("--tokenizer", spelling)
    result = run(path, "--prompt", "def fib(n):", "--max-new-tokens", 12, *chosen)
    new = greedy(model, list(b"def fib(n):"), 12)
    assert result.stdout == ByteTokenizer().decode(new) + "\n"
    assert result.stderr.startswith("12 new tokens after 11 prompt tokens")


def test_byte_tokenizer_decodes_token_ids(byte_model):
    path, model = byte_model
    result = run(path, "--tokens", "100,101", "--max-new-tokens", 5)
    assert result.stdout == ByteTokenizer().decode(greedy(model, [100, 101], 5)) + "\n"


def test_top_p_under_greedy_decoding_gets_a_note(checkpoints):
    root, model = checkpoints
    result = run(root / "canonical", "--tokens", "5,9", "--max-new-tokens", 4, "--top-p", "0.9")
    assert result.stdout.strip() == words(greedy(model, [5, 9], 4))
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == ("bam-surgery: note: --top-p 0.9 is unused under greedy decoding "
                                            "(--temperature 0); give --temperature above 0 to sample")
    sampled = run(root / "canonical", "--tokens", "5,9", "--max-new-tokens", 4, "--top-p", "0.9",
                  "--temperature", "1", "--seed", "1")
    assert "note:" not in sampled.stderr


def test_bf16_run(checkpoints):
    root, _ = checkpoints
    result = run(root / "canonical", "--tokens", "5,9", "--max-new-tokens", 3, "--dtype", "bfloat16")
    assert len(result.stdout.split()) == 3 and "bfloat16" in result.stderr


def test_hf_llama_directory_with_its_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    llama.save_pretrained(tmp_path / "llama")
    save_tokenizer(tmp_path / "llama" / "tokenizer.json")
    result = run(tmp_path / "llama", "--prompt", "w5 w6 w7", "--max-new-tokens", 5)
    with torch.no_grad():
        want = llama.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    assert result.stdout.strip() == words(want)


def test_bad_input_is_one_line_and_exit_2(checkpoints, tmp_path):
    root, _ = checkpoints
    ckpt = root / "canonical"
    (tmp_path / "notes.txt").write_text("not a model")
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))  # tensors, but no model config
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    cases = [
        ((ckpt, "--tokens", "1,2", "--dtype", "float64"), "--dtype: unknown dtype 'float64'"),
        ((ckpt, "--tokens", "1,2", "--device", "tpu"), "--device: unknown device 'tpu'"),
        ((ckpt, "--tokens", "1,x"), "--tokens: cannot read '1,x'"),
        ((ckpt, "--tokens", "1,999"), "token id 999 is out of range"),
        ((ckpt, "--tokens", "1", "--max-new-tokens", "-3"), "--max-new-tokens: '-3' is not an integer >= 0"),
        ((ckpt, "--tokens", "1", "--temperature", "hot"), "--temperature: 'hot' is not a number >= 0"),
        ((ckpt, "--tokens", "1", "--top-p", "0"), "--top-p: '0' is not a number in (0, 1]"),
        ((ckpt,), "exactly one of --prompt TEXT, --tokens"),
        ((ckpt, "--prompt", "w5", "--tokens", "5"), "exactly one of --prompt TEXT, --tokens"),
        # no tokenizer carried, and the byte fallback does not fit a vocabulary of 64
        ((root / "lone" / "mix.safetensors", "--prompt", "w5"), "tokenizer bytes has 256 tokens"),
        ((ckpt, "--prompt", "w5", "--tokenizer", "bytes"), "tokenizer bytes has 256 tokens"),
        ((ckpt, "--prompt", "w5", "--tokenizer", tmp_path / "nope.json"), "--tokenizer"),
        ((ckpt, "--prompt", "w5", "--tokenizer", tmp_path / "broken"), "not a readable tokenizer.json"),
        ((tmp_path / "notes.txt", "--tokens", "1"), "not a checkpoint"),
        ((tmp_path / "plain.safetensors", "--tokens", "1"), "not a bam-surgery canonical checkpoint"),
        ((tmp_path / "missing", "--tokens", "1"), "missing"),
    ]
    if not torch.cuda.is_available():
        cases.append(((ckpt, "--tokens", "1", "--device", "cuda"), "CUDA is not available"))
    for args, message in cases:
        line = error_line(run(*args, ok=False))
        assert message in line, (args, line)


def test_listed_in_the_command_line_help():
    result = CliRunner().invoke(cli, ["--help"])
    assert "generate" in result.output


def test_generated_text_is_escaped_on_a_terminal_only():
    from bam_surgery.cli.generate import _for_terminal

    raw = "def f():\n\treturn 1\x1b[2J\x07\r"  # clear-screen, bell and carriage return from an untrained model
    assert _for_terminal(raw) == "def f():\n\treturn 1\\x1b[2J\\x07\\r"
    assert _for_terminal("plain text, ünïcode") == "plain text, ünïcode"


def test_refused_up_front_with_the_bound(checkpoints, tmp_path, monkeypatch):
    """Issue 20, items 7 and 9: NaN weights, a sequence past max_positions of a RoPE model, a KV cache larger
    than the machine's memory, a seed torch cannot take: each one error line, refused before generating."""
    root, model = checkpoints
    ckpt = root / "canonical"
    assert model.config.position == "rope" and model.config.max_positions == 64
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["layers.0.attn_norm.weight"][1] = float("nan")
    broken = Model(model.config)
    broken.load_state_dict(state)
    save_model(broken, tmp_path / "nan.safetensors")
    line = error_line(run(tmp_path / "nan.safetensors", "--tokens", "1,2", ok=False))
    assert "tensor layers.0.attn_norm.weight has 1 non-finite value(s) (NaN or Inf)" in line
    ids = ",".join(["5"] * 60)
    assert "60 prompt tokens + --max-new-tokens 5 = 65 exceed the model's max_positions=64" in \
        error_line(run(ckpt, "--tokens", ids, "--max-new-tokens", 5, ok=False))
    assert "--max-new-tokens 1000000000000 = 1000000000001 exceed the model's max_positions=64" in \
        error_line(run(ckpt, "--tokens", "1", "--max-new-tokens", 10**12, ok=False))
    assert "--seed: '" + "9" * 30 + "' is not an integer from 0 to 18446744073709551615" in \
        error_line(run(ckpt, "--tokens", "1", "--temperature", "1", "--seed", "9" * 30, ok=False))
    run(ckpt, "--tokens", "1", "--temperature", "1", "--seed", 2**64 - 1)
    import bam_surgery.runtime.memory as memory

    monkeypatch.setattr(memory, "memory_limit", lambda device=None: 1000)
    line = error_line(run(ckpt, "--tokens", "1,2", "--max-new-tokens", 8, ok=False))
    per_token = 2 * model.config.n_layers * 3 * 2 * model.config.head_dim * 4  # K and V, E*G heads, fp32
    assert f"the KV cache of 10 tokens ({per_token:,} bytes per token) needs at least " in line
    assert "this machine has 0.0 GiB (RAM)" in line


@pytest.mark.parametrize("eos", [[], "2", ["x"], 2.5])
def test_a_generation_config_with_a_wrong_eos_is_one_line(checkpoints, tmp_path, eos):
    """Issue 33: eos_token_id [] was an IndexError while generating; a string is refused the same way."""
    root, _ = checkpoints
    shutil.copytree(root / "hf", tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    line = error_line(run(tmp_path / "hf", "--tokens", "1,2", ok=False))
    assert "generation_config.json: eos_token_id: expected a token id" in line
