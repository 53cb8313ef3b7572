"""The export paths of the CLI end to end, from Hugging Face Llama directories made with transformers:

  * `merge --format mixtral`: loads as transformers' MixtralForCausalLM with the logits of our runtime on
    the same merge written canonical; N identical inputs give the dense Llama; tokenizer, model card and
    generation config carried over;
  * `merge --format hf` (bam, bam-shared-kv): loads with trust_remote_code, same logits, generates;
  * capability errors before any I/O (exit 2, one line, nothing at OUT, no tensor read);
  * tokenizer checks across inputs (a differing tokenizer warns, a differing vocab size refuses);
  * `convert`: HF -> canonical -> HF is bit exact, Mixtral -> canonical gives back the merge;
  * `inspect` / `count-params` on an exported Mixtral directory.

Inputs: a tiny Llama seed (V 100, D 32, 2 layers, 4 heads, 2 KV heads, untied) with a WordLevel tokenizer,
and three specialists = seed + 0.004 * N(0, 1) on every attention/MLP matrix (norms and embeddings stay the
seed's, as the recipes average them). Offline; fp32; max abs diff <= 1e-4 on logits.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import error_line, merge_family, run_cli
from bam_surgery.runtime import load_model
from bam_surgery.runtime.checkpoint import CheckpointReader

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
V = 100
NOISE = 0.004
SPECIALISTS = ("code", "math", "law")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json")


# ---- inputs ---------------------------------------------------------------------------------------
def llama_config(vocab_size: int = V):
    return transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_tokenizer(directory: Path, vocab_size: int = V, prefix: str = "w") -> None:
    """A WordLevel tokenizer: <pad> <s> </s> <unk> (ids 0..3), then words {prefix}4 .. {prefix}{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"{prefix}{i}": i for i in range(len(specials), vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>", unk_token="<unk>").save_pretrained(directory)


def branch(seed_model, seed: int):
    """seed + NOISE * N(0, 1) on every attention and MLP matrix; norms and embeddings unchanged."""
    model = transformers.LlamaForCausalLM(seed_model.config).eval()
    model.load_state_dict(seed_model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".self_attn." in name or ".mlp." in name:
                p.add_(NOISE * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """{"seed": dir, "code": dir, ...} and the transformers models, keyed the same."""
    root = tmp_path_factory.mktemp("family")
    torch.manual_seed(0)
    seed = transformers.LlamaForCausalLM(llama_config()).eval()
    models = {"seed": seed, **{name: branch(seed, 10 + i) for i, name in enumerate(SPECIALISTS)}}
    dirs = {}
    for name, model in models.items():
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        save_tokenizer(dirs[name])
    return dirs, models


def merge(dirs, out, *args, experts=SPECIALISTS, code: int | None = 0):
    """conftest.merge_family over the family's folders: the seed and `experts` by name."""
    return merge_family([dirs["seed"], *(dirs[e] for e in experts)], out, *args, code=code)


def tokens(seed: int = 0, batch: int = 2, length: int = 11) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def hf_mixtral(path: Path):
    model, info = transformers.MixtralForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                  output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], f"{kind}: {info[kind]}"
    return model.eval()


@pytest.fixture(scope="module")
def btx(family, tmp_path_factory):
    """The same btx merge (top-2 of 4, renormalized gates) written canonical and as Mixtral."""
    dirs, _ = family
    root = tmp_path_factory.mktemp("btx")
    opts = ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2", "--quiet")
    merge(dirs, root / "mix.safetensors", *opts, "--format", "canonical")
    result = merge(dirs, root / "mixtral", *opts, "--format", "mixtral")
    return root / "mix.safetensors", root / "mixtral", result


# ---- 1. merge --format mixtral ----------------------------------------------------------------
def test_btx_mixtral_export_matches_runtime(family, btx):
    dirs, models = family
    canonical, out, _ = btx
    x = tokens()
    ours = logits(load_model(canonical), x)
    theirs = logits(hf_mixtral(out), x)
    assert max_diff(ours, theirs) <= TOL
    # the comparison can fail: the experts are far enough apart, and the mixture is no single specialist
    for model in models.values():
        assert max_diff(ours, logits(model, x)) > 100 * TOL

    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert not list(out.glob("*.partial")) and not list(out.parent.glob(".*.partial"))


def test_mixtral_export_carries_tokenizer_card_and_generation_config(family, btx):
    dirs, _ = family
    _, out, _ = btx
    for name in TOKENIZER_NAMES:
        assert (out / name).read_bytes() == (dirs["seed"] / name).read_bytes(), name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w9 w42")["input_ids"] == [5, 9, 42]

    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2

    card = (out / "README.md").read_text()
    assert "**btx**" in card and "tags: [mixture-of-experts, bam-surgery, btx]" in card
    for name in ("seed", *SPECIALISTS):
        assert f"`{dirs[name]}`" in card, name
    table = card[card.index("## Parameters"):card.index("## Load")]
    assert "group" in table and "tensors" in table and "total" in table and "active" in table
    n_params = sum(p.numel() for p in hf_mixtral(out).parameters())
    assert f"Total {n_params:,}," in card
    assert "MixtralForCausalLM" in card


def test_identical_inputs_mixtral_equals_dense_llama(family, tmp_path):
    dirs, models = family
    same = {"seed": dirs["seed"], "a": dirs["seed"], "b": dirs["seed"], "c": dirs["seed"]}
    result = merge(same, tmp_path / "mixtral", "--recipe", "btx", "--format", "mixtral", "--ffn-top-k", "2",
                   "--gate-norm", "topk_softmax", "--quiet", experts=("a", "b", "c"))
    assert "identical to the seed" in result.stderr  # the branch check notices, and the merge goes on
    x = tokens(1)
    mixtral = hf_mixtral(tmp_path / "mixtral")
    assert mixtral.config.num_local_experts == 4
    assert max_diff(logits(mixtral, x), logits(models["seed"], x)) <= TOL


# ---- 3. merge --format hf (remote code) -----------------------------------------------------------
@pytest.mark.parametrize("recipe", ["bam", "bam-shared-kv"])
def test_bam_hf_export_matches_runtime_and_generates(family, tmp_path, hf_modules, recipe):
    dirs, models = family
    merge(dirs, tmp_path / "mix.safetensors", "--recipe", recipe, "--quiet")
    merge(dirs, tmp_path / "hf", "--recipe", recipe, "--format", "hf", "--quiet")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    ours = load_model(tmp_path / "mix.safetensors")
    assert (ours.config.attn_experts, ours.config.kv_mode) == (4, "shared" if recipe == "bam-shared-kv" else "expert")
    x = tokens(2)
    assert max_diff(logits(hf, x), logits(ours, x)) <= TOL
    assert max_diff(logits(ours, x), logits(models["seed"], x)) > 100 * TOL

    prompt = tokens(3, batch=1, length=5)
    with torch.no_grad():
        generated = hf.generate(prompt, max_new_tokens=3, do_sample=False)
        seq = prompt
        for _ in range(3):  # greedy from the runtime, whole sequence each step
            seq = torch.cat([seq, ours(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated.shape == (1, 8) and torch.equal(generated, seq)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (dirs["seed"] / "tokenizer.json").read_bytes()
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"**{recipe}**" in card and "trust_remote_code=True" in card


# ---- 4. capability errors before any I/O -------------------------------------------------------
@pytest.mark.slow
def test_bam_to_mixtral_refused_in_one_line(family, tmp_path):
    dirs, _ = family
    out = tmp_path / "mixtral"
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "bam-surgery"), "merge", "--recipe", "bam",
                           "--format", "mixtral", "--seed", str(dirs["seed"]), "--experts",
                           ",".join(str(dirs[e]) for e in SPECIALISTS), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bam-surgery: error: mixtral export needs "), proc.stderr
    assert "dense attention" in lines[0] and "4 attention experts" in lines[0] and "recipe bam" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bam_to_mixtral_reads_no_tensor_data(family, tmp_path, monkeypatch):
    from bam_surgery.converters.hf.reader import HFCheckpointReader

    def no_reads(self, name):
        raise AssertionError(f"tensor data read: {name}")

    monkeypatch.setattr(HFCheckpointReader, "get", no_reads)
    dirs, _ = family
    result = merge(dirs, tmp_path / "mixtral", "--recipe", "bam", "--format", "mixtral", code=None)
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("bam-surgery: error: mixtral export needs dense attention")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["mixtral", "hf"])
def test_export_formats_refuse_a_safetensors_out(family, tmp_path, fmt):
    dirs, _ = family
    out = tmp_path / "mix.safetensors"
    result = merge(dirs, out, "--recipe", "btx", "--gate-norm", "topk_softmax", "--format", fmt, code=None)
    assert result.exit_code == 2
    assert error_line(result) == (f"bam-surgery: error: --format {fmt}: writes a directory; {out} names a "
                                  ".safetensors file")
    result = run_cli("convert", dirs["seed"], "--out", out, "--format", fmt, code=None)
    assert result.exit_code == 2 and "names a .safetensors file" in error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_btx_softmax_gates_refused_for_mixtral(family, tmp_path):
    """Plain softmax gates of top-2 of 4 do not sum to 1; Mixtral renormalizes, so it would differ."""
    dirs, _ = family
    result = merge(dirs, tmp_path / "mixtral", "--recipe", "btx", "--ffn-top-k", "2", "--gate-norm", "softmax",
                   "--format", "mixtral", code=None)
    assert result.exit_code == 2
    assert "gate_norm topk_softmax" in error_line(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["hf", "qwen2_moe"])
def test_convert_of_a_merged_checkpoint_writes_a_model_card(family, tmp_path, fmt):
    """Every HF export carries README.md: `convert mix --format hf` (HF BAM) and a native format name the merge's
    recipe and inputs from the checkpoint's provenance, the config's numbers and how to load the folder."""
    dirs, _ = family
    merge(dirs, tmp_path / "mix.safetensors", "--recipe", "bam" if fmt == "hf" else "btx", "--quiet")
    run_cli("convert", tmp_path / "mix.safetensors", "--format", fmt, "--out", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    recipe = "bam" if fmt == "hf" else "btx"
    assert card.startswith("---\nlibrary_name: transformers\ntags: [bam-surgery, mixture-of-experts]\n---\n# out\n")
    assert f"recipe **{recipe}**" in card and f"`{dirs['code']}`" in card and "## Config" in card
    assert ("trust_remote_code=True" in card) == (fmt == "hf")
    if fmt == "qwen2_moe":
        assert "Qwen2MoeForCausalLM, no remote code" in card and "a shared expert, which this model has not" in card


# ---- 5. tokenizers across inputs --------------------------------------------------------------------
def test_differing_tokenizer_warns_and_differing_vocab_refuses(family, tmp_path):
    dirs, models = family
    odd = tmp_path / "odd"  # the law specialist's weights with other token strings (same vocab size)
    models["law"].save_pretrained(odd)
    save_tokenizer(odd, prefix="t")
    result = merge({**dirs, "odd": odd}, tmp_path / "mixtral", "--recipe", "btx", "--gate-norm", "topk_softmax",
                   "--format", "mixtral", "--quiet", experts=("code", "math", "odd"))
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, result.stderr
    assert f"{odd}: tokenizer.json differs from the seed's" in warnings[0]
    # the seed's tokenizer is the one carried over
    assert (tmp_path / "mixtral" / "tokenizer.json").read_bytes() == (dirs["seed"] / "tokenizer.json").read_bytes()

    wide = tmp_path / "wide"  # vocab 101: the config disagrees with the seed's
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(llama_config(V + 1)).save_pretrained(wide)
    save_tokenizer(wide, vocab_size=V + 1)
    out = tmp_path / "refused"
    result = merge({**dirs, "wide": wide}, out, "--recipe", "btx", "--gate-norm", "topk_softmax",
                   "--format", "mixtral", experts=("code", "wide"), code=None)
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(f"bam-surgery: error: {wide}: config disagrees with the seed") and "vocab_size=101" in line
    assert not out.exists()


# ---- 6. convert ---------------------------------------------------------------------------------
def test_convert_hf_to_canonical_and_back_is_exact(family, tmp_path):
    dirs, models = family
    canonical = tmp_path / "seed.safetensors"
    run_cli("convert", dirs["seed"], "--out", canonical)
    with CheckpointReader(canonical) as reader:
        assert not reader.config.is_mixture and reader.config.vocab_size == V
    x = tokens(4)
    assert max_diff(logits(load_model(canonical), x), logits(models["seed"], x)) <= TOL

    # a canonical file does not know its HF architecture: the user must name one
    result = run_cli("convert", canonical, "--out", tmp_path / "no-arch", "--format", "hf", code=None)
    assert result.exit_code == 2 and "--architecture" in error_line(result)
    assert not (tmp_path / "no-arch").exists()

    back = tmp_path / "llama"
    run_cli("convert", canonical, "--out", back, "--format", "hf", "--architecture", "llama")
    original = load_file(dirs["seed"] / "model.safetensors")
    written = {}
    for f in sorted(back.glob("*.safetensors")):
        written.update(load_file(f))
    assert written.keys() == original.keys()
    for name, t in original.items():
        assert written[name].dtype == t.dtype and torch.equal(written[name], t), name
    reloaded = transformers.LlamaForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert json.loads((back / "config.json").read_text())["model_type"] == "llama"
    assert torch.equal(logits(reloaded, x), logits(models["seed"], x))


def test_convert_hf_to_hf_keeps_tokenizer(family, tmp_path):
    dirs, models = family
    out = tmp_path / "llama"
    run_cli("convert", dirs["code"], "--out", out, "--format", "hf")  # architecture from the input
    for name in TOKENIZER_NAMES:
        assert (out / name).read_bytes() == (dirs["code"] / name).read_bytes(), name
    card = (out / "README.md").read_text()
    assert f"as the `hf` format from\n`{dirs['code']}`" in card and "LlamaForCausalLM" not in card
    assert "| rope_theta " in card or "rope_theta" in card
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = tokens(5)
    assert torch.equal(logits(reloaded, x), logits(models["code"], x))


def assert_same_checkpoint(want_path, got_path, ignore_config=()) -> None:
    """Same tensors bit for bit, same config except the fields in ignore_config."""
    with CheckpointReader(want_path) as want, CheckpointReader(got_path) as got:
        blank = {f: getattr(want.config, f) for f in ignore_config}
        assert got.config.replace(**blank) == want.config
        assert set(got.names()) == set(want.names())
        for name in want.names():
            a, b = want.get(name), got.get(name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_convert_mixtral_back_to_canonical_equals_merge(btx, tmp_path):
    canonical, mixtral, _ = btx
    back = tmp_path / "back.safetensors"
    run_cli("convert", mixtral, "--out", back)
    with CheckpointReader(back) as got:
        assert got.config.ffn_experts == 4 and got.config.ffn_top_k == 2
        assert got.config.gate_norm == "topk_softmax"
    # Mixtral's config has no z-loss coefficient and no name: compare the rest exactly
    assert_same_checkpoint(canonical, back, ignore_config=("z_coef", "name"))


def test_convert_hf_bam_export_back_to_canonical_equals_merge(family, tmp_path):
    dirs, _ = family
    canonical, exported = tmp_path / "bam.safetensors", tmp_path / "bam-hf"
    merge(dirs, canonical, "--recipe", "bam-shared-kv", "--quiet")
    merge(dirs, exported, "--recipe", "bam-shared-kv", "--format", "hf", "--quiet")
    back = tmp_path / "back.safetensors"
    run_cli("convert", exported, "--out", back)
    assert_same_checkpoint(canonical, back)


def test_convert_quiet_prints_nothing(family, tmp_path):
    dirs, _ = family
    loud = run_cli("convert", dirs["seed"], "--out", tmp_path / "loud.safetensors")
    assert loud.stderr == f"wrote {tmp_path / 'loud.safetensors'} (canonical)\n"
    for flag, fmt in (("-q", "canonical"), ("--quiet", "hf")):
        out = tmp_path / f"quiet-{fmt}"
        result = run_cli("convert", dirs["seed"], "--out", out, "--format", fmt, flag)
        assert (result.stdout, result.stderr) == ("", "") and (out / "config.json").is_file()


def test_convert_refuses_existing_out_without_force(family, tmp_path):
    dirs, _ = family
    out = tmp_path / "seed.safetensors"
    out.write_bytes(b"keep me")
    result = run_cli("convert", dirs["seed"], "--out", out, code=None)
    assert result.exit_code == 2
    assert error_line(result) == f"bam-surgery: error: {out}: already exists; pass --force to replace it"
    assert out.read_bytes() == b"keep me"
    result = run_cli("convert", dirs["seed"], "--out", out, "--force", code=None)  # not ours: kept
    assert result.exit_code == 2 and "did not write" in error_line(result) and out.read_bytes() == b"keep me"
    out.unlink()
    run_cli("convert", dirs["seed"], "--out", out)
    run_cli("convert", dirs["seed"], "--out", out, "--force")
    with CheckpointReader(out) as reader:
        assert reader.config.vocab_size == V


# ---- 7. inspect / count-params on an exported Mixtral directory ----------------------------------
def test_inspect_and_count_params_on_mixtral_export(btx):
    canonical, mixtral, _ = btx
    counts = {}
    for path in (canonical, mixtral):
        result = run_cli("count-params", path, "--json")
        counts[path] = json.loads(result.stdout)
    assert counts[mixtral]["total"] == counts[canonical]["total"]
    assert counts[mixtral]["active"] == counts[canonical]["active"]
    assert counts[mixtral]["groups"] == counts[canonical]["groups"]
    assert counts[mixtral]["total"] == sum(p.numel() for p in hf_mixtral(mixtral).parameters())

    result = run_cli("inspect", mixtral)
    assert "ok: every tensor name and shape matches the config" in result.stdout
    assert f"{counts[canonical]['total']:,}" in result.stdout
    inspected = json.loads(run_cli("inspect", mixtral, "--json").stdout)
    assert (inspected["params"], inspected["active_params"]) == (counts[canonical]["total"], counts[canonical]["active"])
    assert inspected["config"]["ffn_experts"] == 4 and inspected["mismatches"] == []


# ---- --force over outputs ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mixtral", "hf"])
def test_merge_force_replaces_its_own_export(family, tmp_path, fmt):
    dirs, _ = family
    opts = ("--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2", "--format", fmt, "--quiet")
    merge(dirs, tmp_path / "out", *opts)
    merge(dirs, tmp_path / "out", *opts, "--router-seed", "1", "--force")


def test_convert_force_keeps_a_directory_holding_other_files(family, tmp_path):
    dirs, _ = family
    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("not a checkpoint")
    result = run_cli("convert", dirs["seed"], "--out", out, "--force", code=None)
    assert (out / "notes.txt").exists()
    assert result.exit_code == 2


def test_convert_refuses_to_overwrite_its_input(family, tmp_path):
    dirs, models = family
    source = tmp_path / "copy"
    models["law"].save_pretrained(source)
    save_tokenizer(source)
    result = run_cli("convert", source, "--out", source, "--force", code=None)
    assert (source / "tokenizer.json").exists()
    assert result.exit_code == 2
