"""Hostile inputs against every command: one line `bam-surgery: error: ...`, exit status 2, fast.

Each case is a file or an option a hostile (or unlucky) user can hand the tool: configs declaring
3,000,000 layers in every config format, 10^8 experts, JSON and YAML that are not UTF-8, nested
100,000 deep or carry 5000-digit integers, configs with fields of the wrong type, indexes naming
files outside their folder, hub revisions with `..`, pickles that want to run code, tensor names
that would forge output lines, overflowing sizes, non-finite numbers. Also click's own usage errors
and Ctrl-C follow the same contract.
"""
from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from conftest import LLAMA_HF, error_line, llama_state, random_state, run_cli, tiny_config, write_llama_dir
from bam_surgery.runtime.checkpoint import CONFIG_KEY, save_checkpoint
from bam_surgery.cli.commands import cli

CFG = tiny_config(block="parallel", norm="layernorm")
COMMANDS = ("inspect", "count-params", "convert", "merge")


def run(*args, timed: bool = False):
    start = time.perf_counter()
    result = CliRunner().invoke(cli, [str(a) for a in args])
    result.seconds = time.perf_counter() - start
    return result


def command(name: str, ckpt: Path, tmp_path: Path) -> list:
    """Each command, pointed at one checkpoint."""
    return {"inspect": ["inspect", ckpt], "count-params": ["count-params", ckpt],
            "convert": ["convert", ckpt, "--out", tmp_path / "converted.safetensors"],
            "merge": ["merge", "--seed", ckpt, "--recipe", "upcycle", "--extra-ffn-experts", 1,
                      "--out", tmp_path / "merged.safetensors"]}[name]


# ---- hostile sizes: answered at once, whatever the config format ---------------------------------
def _canonical_file(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "big.safetensors"
    save_file(random_state(CFG), str(path), metadata={"format": "bam-surgery/1", CONFIG_KEY: json.dumps(config)})
    return path


def _canonical_dir(tmp_path: Path, config: dict) -> Path:
    path = save_checkpoint(random_state(CFG), CFG, tmp_path / "big")
    body = json.loads((path / "config.json").read_text())
    body[CONFIG_KEY] = config
    (path / "config.json").write_text(json.dumps(body))
    return path


def _hf_dir(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "hf"
    write_llama_dir(path, llama_state(0), "x")
    (path / "config.json").write_text(json.dumps({**LLAMA_HF, **changes}))
    return path


def _mixtral_dir(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "mixtral"
    write_llama_dir(path, llama_state(0), "x")
    body = {**LLAMA_HF, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
            "num_experts_per_tok": 1, **changes}
    (path / "config.json").write_text(json.dumps(body))
    return path


def _hf_bam_dir(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "bam-hf"
    path.mkdir()
    save_file(random_state(CFG), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "bam_mixture", **CFG.to_dict(), **changes}))
    return path


HUGE = 3_000_000
SOURCES = {
    "canonical-metadata": lambda tmp: _canonical_file(tmp, {**CFG.to_dict(), "n_layers": HUGE}),
    "canonical-config.json": lambda tmp: _canonical_dir(tmp, {**CFG.to_dict(), "n_layers": HUGE}),
    "hf-config.json": lambda tmp: _hf_dir(tmp, num_hidden_layers=HUGE),
    "mixtral-config.json": lambda tmp: _mixtral_dir(tmp, num_hidden_layers=HUGE),
    "hf-bam-config.json": lambda tmp: _hf_bam_dir(tmp, n_layers=HUGE),
    "experts": lambda tmp: _canonical_file(tmp, {**CFG.to_dict(), "ffn_experts": 10**8}),
}


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_config_declaring_millions_of_layers_is_refused_at_once(tmp_path, source, cmd):
    import bam_surgery.converters.hf_bam.configuration_bam  # noqa: F401  (import time is not the point)

    ckpt = SOURCES[source](tmp_path)
    result = run(*command(cmd, ckpt, tmp_path))
    error_line(result, "past the limit")
    assert result.seconds < 2.0, result.seconds
    assert not (tmp_path / "converted.safetensors").exists() and not (tmp_path / "merged.safetensors").exists()


def test_a_config_claiming_more_layers_than_the_file_holds_is_one_mismatch(tmp_path):
    ckpt = _canonical_file(tmp_path, {**CFG.to_dict(), "n_layers": 4096})  # the limit; the file has 2 layers
    result = run("inspect", ckpt)
    assert result.exit_code == 1 and result.seconds < 2.0, result.seconds
    assert "layers 2-4095 are missing: the config declares 4096 layers, the checkpoint holds tensors of 2 (0-1)" \
        in result.stdout
    assert len(result.stdout.splitlines()) < 60
    error_line(run("count-params", ckpt), "layers 2-4095 are missing")
    error_line(run("convert", ckpt, "--out", tmp_path / "c.safetensors"), "layers 2-4095 are missing")


@pytest.mark.parametrize("args", [
    ["--extra-ffn-experts", 100_000_000, "--dry-run"],
    ["--ffn-top-k", 100_000_000, "--dry-run"],
])
def test_hostile_expert_counts_are_refused_at_once(tmp_path, args):
    seed = save_checkpoint(random_state(CFG), CFG, tmp_path / "seed.safetensors")
    result = run("merge", "--seed", seed, "--experts", seed, *args)
    error_line(result)
    assert result.seconds < 2.0
    result = run("count-params", "--preset", "tiny", "--recipe", "btx", "--experts", 100_000_000)
    error_line(result)


# ---- JSON and YAML that are not what they claim --------------------------------------------------
GARBAGE = {
    "not-utf8": (b'{"a": "\xff\xfe"}', "not UTF-8"),
    "nested": (b"[" * 100_000, "nested too deeply"),
    "digits": (b'{"vocab_size": ' + b"9" * 5000 + b"}", "too many digits"),
    "nan": (b'{"vocab_size": NaN}', "NaN is not a JSON number"),
    "list": (b"[1, 2]", "expected a JSON object"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
@pytest.mark.parametrize("where", ["hf-config", "canonical-config", "canonical-index", "hf-index",
                                   "canonical-metadata"])
def test_garbage_json_is_one_line_naming_the_file(tmp_path, where, case):
    data, needle = GARBAGE[case]
    if where == "hf-config":
        ckpt = _hf_dir(tmp_path)
        (ckpt / "config.json").write_bytes(data)
        file = ckpt / "config.json"
    elif where == "canonical-config":
        ckpt = save_checkpoint(random_state(CFG), CFG, tmp_path / "c")
        (ckpt / "config.json").write_bytes(data)
        file = ckpt / "config.json"
    elif where == "canonical-index":
        ckpt = save_checkpoint(random_state(CFG), CFG, tmp_path / "c", max_shard_bytes=20_000)
        file = ckpt / "model.safetensors.index.json"
        file.write_bytes(data)
    elif where == "hf-index":
        ckpt = _hf_dir(tmp_path)
        file = ckpt / "model.safetensors.index.json"
        file.write_bytes(data)
    else:
        ckpt = file = tmp_path / "m.safetensors"
        save_file(random_state(CFG), str(file), metadata={"format": "bam-surgery/1",
                                                          CONFIG_KEY: data.decode("utf-8", "replace")})
        needle = "" if case == "not-utf8" else needle  # metadata is text already: the escape survives
    for cmd in ("inspect", "count-params", "convert"):
        result = run(*command(cmd, ckpt, tmp_path))
        line = error_line(result, str(file), needle)
        assert len(line) < 600


def recipe_with(field: str, value) -> bytes:
    """The shipped btx recipe with one field (dotted path) set."""
    import yaml

    doc = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "btx.yaml").read_text())
    section, key = field.split(".")
    doc.setdefault(section, {})[key] = value
    return yaml.safe_dump(doc).encode()


@pytest.mark.parametrize("data,needle", [
    (b"\xff\xfe", "not UTF-8"),
    (b"[" * 100_000, "nested too deeply"),
    (b"schema: " + b"9" * 5000, "too many digits"),
    (recipe_with("routers.std", float("nan")), "routers.std: must be a finite number"),
    (recipe_with("defaults.lb_coef", float("inf")), "defaults.lb_coef: must be a finite number"),
    (recipe_with("defaults.extra_ffn_experts", 10**8), "defaults.extra_ffn_experts"),
])
def test_garbage_recipes_are_one_line_naming_the_field(tmp_path, data, needle):
    seed = save_checkpoint(random_state(CFG), CFG, tmp_path / "seed.safetensors")
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(data)
    result = run("merge", "--seed", seed, "--experts", seed, "--recipe", recipe, "--dry-run")
    line = error_line(result, "r.yaml", needle)
    assert "--router-std" not in line and "--lb-coef" not in line and result.seconds < 2.0


# ---- wrong types in configs ------------------------------------------------------------------------
@pytest.mark.parametrize("changes,needle", [
    ({"hidden_act": ["silu"]}, "hidden_act"),
    ({"model_type": ["llama"]}, "model_type"),
    ({"rope_theta": "abc"}, "rope_theta"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"vocab_size": "64"}, "vocab_size"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
])
def test_wrong_typed_hf_config_fields_name_the_key(tmp_path, changes, needle):
    ckpt = _hf_dir(tmp_path, **changes)
    for cmd in COMMANDS:
        error_line(run(*command(cmd, ckpt, tmp_path)), "config.json", needle)


def test_gpt_neox_with_zero_heads_names_the_key(tmp_path):
    ckpt = _hf_dir(tmp_path, model_type="gpt_neox", num_attention_heads=0)
    error_line(run("inspect", ckpt), "num_attention_heads")


@pytest.mark.parametrize("changes,needle", [
    ({"num_local_experts": "8"}, "num_local_experts"),
    ({"rope_parameters": [1]}, "rope_parameters"),
    ({"sliding_window": "x"}, "sliding_window"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
])
def test_wrong_typed_mixtral_config_fields_name_the_key(tmp_path, changes, needle):
    error_line(run("inspect", _mixtral_dir(tmp_path, **changes)), "config.json", needle)


@pytest.mark.parametrize("value", [5, None, [1, 2], "text"])
def test_a_bam_config_that_is_not_an_object(tmp_path, value):
    error_line(run("inspect", _canonical_dir(tmp_path, value)), "config.json")
    path = tmp_path / "m.safetensors"
    save_file(random_state(CFG), str(path), metadata={"format": "bam-surgery/1", CONFIG_KEY: json.dumps(value)})
    error_line(run("inspect", path), "m.safetensors")


def test_hf_bam_config_with_wrong_types(tmp_path):
    error_line(run("inspect", _hf_bam_dir(tmp_path, ffn_experts="four")), "ffn_experts")


@pytest.mark.parametrize("body,needle", [(b"[1, 2]", "expected a JSON object"),
                                         (b'{"eos_token_id": "x"}', "eos_token_id"),
                                         (b"{not json", "not valid JSON")])
def test_a_malformed_generation_config_on_the_seed(tmp_path, body, needle):
    seed = _hf_dir(tmp_path)
    (seed / "generation_config.json").write_bytes(body)
    out = tmp_path / "out"
    error_line(run("merge", "--seed", seed, "--recipe", "upcycle", "--extra-ffn-experts", 1, "--gate-norm",
                 "topk_softmax", "--format", "mixtral", "--out", out), "generation_config.json", needle)
    error_line(run("convert", seed, "--format", "hf", "--out", out), "generation_config.json", needle)
    assert not out.exists()


# ---- numbers that overflow -------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--weights", "1e308,1e308"], None),
    (["--weights", "1e309,1"], "--weights"),
    (["--max-shard-size", "9" * 400], "--max-shard-size"),
    (["--router-std", "1e300"], "--router-std: 1e+300 overflows"),
    (["--router-std", "nan"], "--router-std"),
    (["--lb-coef", "inf"], "--lb-coef"),
    (["--z-coef", "nan"], "--z-coef"),
    (["--router-seed", "9" * 5000], "--router-seed"),
])
def test_overflowing_options(tmp_path, args, needle):
    seed = save_checkpoint(random_state(CFG), CFG, tmp_path / "seed.safetensors")
    code = save_checkpoint(random_state(CFG, 1), CFG, tmp_path / "code.safetensors")
    out = tmp_path / "mix"
    result = run("merge", "--seed", seed, "--experts", code, "--recipe", "btx", "--out", out, "--quiet", *args)
    if needle is None:  # huge but equal weights are just equal weights
        assert result.exit_code == 0, result.output
        return
    error_line(result, needle)
    assert not out.exists()


def test_float16_output_of_large_bfloat16_values_is_refused(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in random_state(CFG).items()}
    state["embed.weight"][0, 0] = 1e6  # fine in bfloat16, Inf in float16
    seed = save_checkpoint(state, CFG, tmp_path / "seed.safetensors")
    out = tmp_path / "mix.safetensors"
    error_line(run("merge", "--seed", seed, "--recipe", "upcycle", "--extra-ffn-experts", 1, "--dtype", "float16",
                 "--out", out, "--quiet"), "embed.weight", "non-finite")
    assert not out.exists()


# ---- safetensors headers: overflow is not truncation ----------------------------------------------
def _raw_safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_an_overflowing_offset_is_not_called_truncated(tmp_path):
    f = _raw_safetensors(tmp_path / "o.safetensors", {"t": {"dtype": "F32", "shape": [2**40, 2**40],
                                                            "data_offsets": [0, 2**82]}})
    line = error_line(run("inspect", f), "overflows 64-bit")
    assert "truncated" not in line.split("not a truncated")[0]
    f = _raw_safetensors(tmp_path / "t.safetensors", {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                         b"\x00" * 8)
    error_line(run("inspect", f), "truncated: tensor t ends at byte")


def test_a_tensor_name_cannot_forge_output_lines(tmp_path):
    state = random_state(CFG)
    evil = "layers.0.attn_norm.weight\nbam-surgery: error: forged\x1b[31m"
    state[evil] = state.pop("layers.0.attn_norm.weight")
    path = tmp_path / "evil.safetensors"
    save_file(state, str(path), metadata={"format": "bam-surgery/1", CONFIG_KEY: CFG.to_json()})
    result = run("inspect", path)
    assert result.exit_code == 1
    assert not any(line.startswith("bam-surgery: error: forged") for line in result.output.splitlines())
    assert "\\nbam-surgery: error: forged\\x1b[31m" in result.stdout and "\x1b" not in result.output
    line = error_line(run("count-params", path))
    assert "\\n" in line and "\x1b" not in line
    seed = save_checkpoint(random_state(CFG), CFG, tmp_path / "seed.safetensors")
    error_line(run("merge", "--seed", seed, "--experts", path, "--out", tmp_path / "m.safetensors"), "\\n")


# ---- reading outside the input ----------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors",
                                   "link/outside.safetensors"])
@pytest.mark.parametrize("kind", ["canonical", "hf"])
def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path, kind, entry):
    outside = save_checkpoint(random_state(CFG), CFG, tmp_path / "outside.safetensors")
    if kind == "canonical":
        ckpt = save_checkpoint(random_state(CFG), CFG, tmp_path / "m", max_shard_bytes=20_000)
    else:
        ckpt = _hf_dir(tmp_path)
        (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
        keys = list(llama_state(0))
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}))
    (ckpt / "link").symlink_to(tmp_path)  # a folder inside that resolves outside
    index = ckpt / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    first = next(iter(body["weight_map"]))
    body["weight_map"][first] = entry
    index.write_text(json.dumps(body))
    for cmd in ("inspect", "convert"):
        error_line(run(*command(cmd, ckpt, tmp_path)), str(index), repr(entry), "outside the model folder")
    assert outside.is_file()


# Side files and weights linked from elsewhere (issue 20, item 4): a model folder may link only to files
# inside itself, or, in the Hugging Face cache, from snapshots/<rev>/ to the blobs of the same repository.
SIDE_FILE_EXPORTS = {
    "convert-hf": lambda ckpt, out: ["convert", ckpt, "--format", "hf", "--out", out],
    "export-onnx": lambda ckpt, out: ["export-onnx", ckpt, "--out", out],
    "merge-hf": lambda ckpt, out: ["merge", "--seed", ckpt, "--recipe", "upcycle", "--extra-ffn-experts", 1,
                                   "--format", "hf", "--out", out],
}


def _outside_file(tmp_path: Path, target: str) -> Path:
    if target == "private":
        private = tmp_path / "private" / "secret.txt"
        private.parent.mkdir()
        private.write_text("a private file\n")
        return private
    if not Path(target).is_file():
        pytest.skip(f"{target} is absent here")
    return Path(target)


@pytest.mark.parametrize("name,target", [("tokenizer.json", "private"), ("merges.txt", "/etc/hostname"),
                                         ("generation_config.json", "private")])
@pytest.mark.parametrize("export", sorted(SIDE_FILE_EXPORTS))
def test_a_side_file_linking_outside_the_folder_is_refused(tmp_path, export, name, target):
    ckpt = _hf_dir(tmp_path)
    outside = _outside_file(tmp_path, target)
    link = ckpt / name
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    out = tmp_path / "out"
    error_line(run(*SIDE_FILE_EXPORTS[export](ckpt, out)), f"{link}: {name} is a symbolic link to {outside.resolve()}",
             "outside the model folder")
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["hf-single", "hf-shards", "hf-index", "canonical-index", "canonical-glob"])
def test_a_shard_linking_outside_the_folder_is_refused(tmp_path, kind):
    stash = tmp_path / "stash"
    stash.mkdir()
    if kind.startswith("hf"):
        ckpt = _hf_dir(tmp_path)
        name = {"hf-single": "model.safetensors"}.get(kind, "model-00001-of-00001.safetensors")
        (ckpt / "model.safetensors").rename(stash / name)
        if kind == "hf-index":
            (ckpt / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {k: name for k in llama_state(0)}}))
    else:
        ckpt = save_checkpoint(random_state(CFG), CFG, tmp_path / "m", max_shard_bytes=20_000)
        name = sorted(p.name for p in ckpt.glob("*.safetensors"))[0]
        (ckpt / name).rename(stash / name)
        if kind == "canonical-glob":
            (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / name).symlink_to(stash / name)
    for cmd in ("inspect", "convert"):
        error_line(run(*command(cmd, ckpt, tmp_path)), f"{ckpt / name}: a", f"symbolic link to {stash / name}",
                 "outside the model folder")
    assert not (tmp_path / "converted.safetensors").exists()


@pytest.mark.parametrize("export", sorted(SIDE_FILE_EXPORTS))
def test_links_inside_the_folder_are_followed(tmp_path, export):
    ckpt = _hf_dir(tmp_path)
    (ckpt / "other").mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (ckpt / name).rename(ckpt / "other" / name)
        (ckpt / name).symlink_to(Path("other") / name)
    (ckpt / "merges.txt").symlink_to(ckpt / "other" / "tokenizer.json")  # absolute, still inside
    out = tmp_path / "out"
    result = run(*SIDE_FILE_EXPORTS[export](ckpt, out))
    assert result.exit_code == 0, result.output
    for name in ("tokenizer.json", "merges.txt"):
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (ckpt / "other/tokenizer.json").read_bytes()


def _hub_cache(cache: Path, plain: Path, repo: str = "org/linked", sha: str = "c0ffee" * 6 + "c0ff") -> Path:
    """The huggingface_hub cache layout as the hub client writes it: refs/main, every file of
    snapshots/<sha>/ a relative link to ../../blobs/<sha256 of its bytes>."""
    import hashlib

    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    (repo_dir / "blobs").mkdir()
    snapshot = repo_dir / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for f in plain.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(repo_dir / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def test_the_hugging_face_cache_layout_is_allowed(tmp_path, monkeypatch):
    plain = _hf_dir(tmp_path)
    tokenizer = (plain / "tokenizer.json").read_bytes()
    cache = tmp_path / "hub"
    snapshot = _hub_cache(cache, plain)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in ("org/linked", snapshot):
        for export in ("convert-hf", "merge-hf"):  # side files and the weights, all links into blobs/
            out = tmp_path / f"out-{export}"
            result = run(*SIDE_FILE_EXPORTS[export](spec, out), "--force")
            assert result.exit_code == 0, result.output
            assert (out / "tokenizer.json").read_bytes() == tokenizer
            assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    # a snapshot's link to anything but its own repository's blobs is refused as anywhere else
    other = _hub_cache(cache, _hf_dir(tmp_path / "b"), repo="org/other")
    (snapshot / "merges.txt").symlink_to(other.parent.parent / "blobs" / (other / "tokenizer.json").resolve().name)
    error_line(run("convert", "org/linked", "--format", "hf", "--out", tmp_path / "refused"),
             "merges.txt is a symbolic link to", "outside the model folder")
    # and a blobs/ that is itself a link elsewhere is no cache's blobs
    crafted = _hub_cache(cache, _hf_dir(tmp_path / "c"), repo="org/crafted")
    blobs = crafted.parent.parent / "blobs"
    blobs.rename(tmp_path / "stolen")
    blobs.symlink_to(tmp_path / "stolen")
    error_line(run("convert", "org/crafted", "--format", "hf", "--out", tmp_path / "refused"),
             f"{crafted / 'model.safetensors'}: a weight file is a symbolic link to {tmp_path / 'stolen'}")
    assert not (tmp_path / "refused").exists()


def test_a_hub_revision_with_dotdot_never_touches_the_cache(tmp_path, monkeypatch):
    import huggingface_hub

    def no(*a, **k):
        raise AssertionError("the hub cache was consulted")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no)
    monkeypatch.chdir(tmp_path)
    for spec in ("org/name@../../x", "org/name@main/../../etc", "org/na..me"):
        for cmd in ("inspect", "count-params", "convert", "merge"):
            error_line(run(*command(cmd, spec, tmp_path)), "'..'")


# ---- pickles ------------------------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > PWNED",))


def test_pickles_need_allow_pickle_and_code_in_them_is_refused_plainly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _hf_dir(tmp_path)
    state = llama_state(0)
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    for cmd in ("inspect", "count-params"):
        error_line(run(cmd, ckpt), "--allow-pickle")
        assert run(cmd, ckpt, "--allow-pickle").exit_code == 0
    torch.save({**state, "evil": _Evil()}, ckpt / "pytorch_model.bin")
    for cmd in ("inspect", "count-params"):
        line = error_line(run(cmd, ckpt, "--allow-pickle"), "refused to load this pickle", "system", "never runs code")
        assert "weights_only" not in line and "False" not in line
    assert not (tmp_path / "PWNED").exists()


# ---- click's own errors and Ctrl-C ----------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["merge", "--seed", "x", "--ffn-top-k", "0"], "--ffn-top-k"),
    (["merge", "--seed", "x", "--dtype", "float8"], "--dtype"),
    (["merge"], "--seed"),
    (["inspect"], "CKPT"),
    (["count-params", "--convention", "nope"], "--convention"),
    (["no-such-command"], "no-such-command"),
])
def test_usage_errors_are_one_line(args, needle):
    line = error_line(run(*args), needle)
    assert "--help" in line


def test_bare_command_prints_the_help():
    """No command at all asks for the help: click's help text, line by line on stdout (not one escaped error
    line), and status 2 as for any usage without a command."""
    result = run_cli(code=2)  # CliRunner names the program "cli"
    lines = result.stdout.splitlines()
    assert lines[0] == "Usage: cli [OPTIONS] COMMAND [ARGS]..." and "Commands:" in lines
    listed = {line.split()[0] for line in lines[lines.index("Commands:") + 1:] if line.strip()}
    assert listed == set(cli.commands)
    assert "\\n" not in result.stdout and "error" not in result.stdout and not result.stderr


def test_ctrl_c_says_nothing_was_written(tmp_path, monkeypatch):
    import bam_surgery.converters as converters

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(converters, "open_checkpoint", interrupted)
    for args in (["merge", "--seed", "s", "--out", tmp_path / "m"], ["inspect", "s"], ["convert", "s", "--out", "o"]):
        result = run(*args)
        assert result.exit_code == 130 and result.stderr == "bam-surgery: interrupted; nothing was written\n"


# ---- an input rewritten while the merge reads it -------------------------------------------------
@pytest.mark.parametrize("out_name", ["mix.safetensors", "mix"])
def test_an_input_rewritten_in_place_during_the_merge_fails_it(tmp_path, monkeypatch, out_name):
    from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter

    seed = save_checkpoint(random_state(CFG), CFG, tmp_path / "seed.safetensors")
    code = save_checkpoint({k: v * 1.01 for k, v in random_state(CFG).items()}, CFG, tmp_path / "code.safetensors")
    real_write, done = SafetensorsStreamWriter.write, []

    def write_and_rewrite_input(self, name, tensor):
        if not done:  # same size, same mtime afterwards: only the bytes (and the ctime) change
            st = code.stat()
            time.sleep(0.02)
            with open(code, "r+b") as f:
                f.seek(st.st_size - 64)
                f.write(bytes(64))
            os.utime(code, ns=(st.st_atime_ns, st.st_mtime_ns))
            done.append(1)
        return real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", write_and_rewrite_input)
    out = tmp_path / out_name
    error_line(run("merge", "--seed", seed, "--experts", code, "--recipe", "btx", "--out", out, "--quiet"),
             str(code), "modified while it was being read")
    assert not out.exists()


# ---- convert checks the layout; commands added later get the contract for free -----------------
@pytest.mark.parametrize("damage", ["transposed", "renamed", "missing", "vocab"])
def test_convert_refuses_a_checkpoint_that_contradicts_its_own_config(tmp_path, damage):
    cfg = tiny_config(norm="rmsnorm", block="sequential")  # writable as llama too
    state = random_state(cfg)
    if damage == "transposed":
        state["layers.0.ffn.up.weight"] = state["layers.0.ffn.up.weight"].T.contiguous()
    elif damage == "renamed":
        state["layers.0.ffn.upper.weight"] = state.pop("layers.0.ffn.up.weight")
    elif damage == "missing":
        del state["layers.1.attn.o.weight"]
    else:
        cfg = cfg.replace(vocab_size=10**9)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path), metadata={"format": "bam-surgery/1", CONFIG_KEY: cfg.to_json()})
    for fmt in ("canonical", "hf"):
        out = tmp_path / f"out-{fmt}"
        error_line(run("convert", path, "--out", out, "--format", fmt, "--architecture", "llama"), "bad.safetensors")
        assert not out.exists()


def test_a_command_added_later_gets_the_error_contract(monkeypatch):
    import click

    from bam_surgery.surgery.errors import BamSurgeryError

    raised = {"user": BamSurgeryError("x.yaml: field: wrong"), "os": PermissionError(13, "Permission denied", "/d/x"),
              "ctrl-c": KeyboardInterrupt()}

    @click.command("later")
    @click.argument("what")
    def later(what):
        raise raised[what]

    monkeypatch.setitem(cli.commands, "later", later)
    assert error_line(run("later", "user")) == "bam-surgery: error: x.yaml: field: wrong"
    assert error_line(run("later", "os")) == "bam-surgery: error: /d/x: Permission denied"
    result = run("later", "ctrl-c")
    assert result.exit_code == 130 and result.stderr == "bam-surgery: interrupted; nothing was written\n"
    error_line(run("later"), "Missing argument")
