"""Byte identity of everything the tool writes, against recorded sha256 digests.

From tiny generated inputs (no downloads, no transformers), run every write path the CLI and the
Python API have: merges with every shipped recipe to a canonical file, a sharded canonical
directory, `--format mixtral` and `--format hf`; `convert` HF -> canonical -> HF for every HF
architecture table, canonical -> Mixtral / HF BAM and back; `save_checkpoint` and `save_hf` from a
state dict. The sha256 of every output file must equal tests/project/golden_outputs.json. Refactors that
claim "behaviour unchanged" are held to it; a change that means to alter an output re-records:

    .venv/bin/python tests/project/test_byte_identity.py --record

Paths inside outputs (input labels in provenance, the model card's load snippet) are relative:
everything runs inside one working directory. The remote-code files an HF BAM export ships
(`*.py`) are left out: they are the package's own files, copied (tests/converters/test_hf_bam_export.py loads
them with transformers), so editing the modeling code does not re-record the outputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest when run as a script
from conftest import llama_state, random_state, tiny_config, write_llama_dir  # noqa: E402
from bam_surgery.runtime.checkpoint import save_checkpoint  # noqa: E402
from bam_surgery.runtime.config import ModelConfig  # noqa: E402
from bam_surgery.cli.commands import cli  # noqa: E402

GOLDEN = Path(__file__).with_name("golden_outputs.json")

# ---- inputs -------------------------------------------------------------------------------------
# The Llama family in bf16 (a seed and branches): conftest.llama_state and write_llama_dir.

# Canonical configs that each HF architecture table can express exactly (float32, random_state).
ARCH_CONFIGS: dict[str, ModelConfig] = {
    "llama": tiny_config(norm="rmsnorm", block="sequential", n_kv_heads=2, qkv_bias=True, o_bias=True,
                         tie_embeddings=True),
    "mistral": tiny_config(norm="rmsnorm", block="sequential", n_kv_heads=2),
    "qwen2": tiny_config(norm="rmsnorm", block="sequential", n_kv_heads=1, qkv_bias=True, tie_embeddings=True),
    "gpt_neox": tiny_config(norm="layernorm", norm_bias=True, activation="gelu", block="parallel_two_norms",
                            rotary_fraction=0.25, qkv_bias=True, o_bias=True, ffn_bias=True),
    "gpt2": tiny_config(norm="layernorm", norm_bias=True, activation="gelu_tanh", position="learned",
                        qkv_bias=True, o_bias=True, ffn_bias=True, tie_embeddings=True),
    "cohere": tiny_config(norm="layernorm", block="parallel", rope_interleaved=True, n_kv_heads=2,
                          tie_embeddings=True, logit_scale=0.5),
    "phi": tiny_config(norm="layernorm", norm_bias=True, activation="gelu_tanh", block="parallel",
                       rotary_fraction=0.5, qkv_bias=True, o_bias=True, ffn_bias=True, lm_head_bias=True),
}


# ---- the runs -----------------------------------------------------------------------------------
def run(*args: str) -> None:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, f"{' '.join(map(str, args))}\n{result.output}{result.exception!r}"


def produce_outputs() -> list[str]:
    """Write every output under the current directory; return the output paths (relative)."""
    from bam_surgery.converters.hf.writer import save_hf

    seed = llama_state(0)
    write_llama_dir(Path("in/seed"), seed, "seed")
    write_llama_dir(Path("in/code"), llama_state(1, seed), "seed")
    write_llama_dir(Path("in/math"), llama_state(2, seed), "other")  # a differing tokenizer file: warns
    experts = "in/code,in/math"
    outs: list[str] = []

    def merge(out: str, *args: str) -> None:
        run("merge", "--seed", "in/seed", "--experts", experts, "--out", out, "--quiet", *args)
        outs.append(out)

    def convert(src: str, out: str, *args: str) -> None:
        run("convert", src, "--out", out, *args)
        outs.append(out)

    # merges: every recipe, every output kind
    merge("merge/bam.safetensors", "--recipe", "bam")
    merge("merge/bam-dir", "--recipe", "bam", "--max-shard-size", "40KB")
    merge("merge/bam-hf", "--recipe", "bam", "--format", "hf", "--max-shard-size", "40KB")
    merge("merge/bam-f32.safetensors", "--recipe", "bam", "--dtype", "float32", "--ffn-top-k", "2",
          "--attention-routing", "top2", "--weights", "0.5,0.25,0.25", "--router-seed", "3")
    merge("merge/shared-kv.safetensors", "--recipe", "bam-shared-kv")
    merge("merge/shared-kv-hf", "--recipe", "bam-shared-kv", "--format", "hf")
    merge("merge/btx.safetensors", "--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2")
    merge("merge/btx-dir", "--recipe", "btx", "--max-shard-size", "30KB", "--extra-ffn-experts", "1")
    merge("merge/btx-mixtral", "--recipe", "btx", "--gate-norm", "topk_softmax", "--ffn-top-k", "2",
          "--format", "mixtral")
    merge("merge/btx-mixtral-shards", "--recipe", "btx", "--gate-norm", "topk_softmax", "--format", "mixtral",
          "--max-shard-size", "30KB", "--dtype", "float16")
    merge("merge/btx-hf", "--recipe", "btx", "--format", "hf")
    run("merge", "--seed", "in/seed", "--recipe", "upcycle", "--out", "merge/upcycle.safetensors", "--quiet")
    outs.append("merge/upcycle.safetensors")
    run("merge", "--seed", "in/seed", "--recipe", "upcycle", "--gate-norm", "topk_softmax", "--format", "mixtral",
        "--out", "merge/upcycle-mixtral", "--quiet")
    outs.append("merge/upcycle-mixtral")

    # convert: HF -> canonical -> HF, and the exports read back
    convert("in/seed", "convert/seed.safetensors")
    convert("in/seed", "convert/seed-dir", "--max-shard-size", "20KB")
    convert("convert/seed.safetensors", "convert/seed-llama", "--format", "hf", "--architecture", "llama")
    convert("in/seed", "convert/seed-hf", "--format", "hf")
    convert("convert/seed-dir", "convert/seed-mistral", "--format", "hf", "--architecture", "mistral",
            "--max-shard-size", "20KB")
    convert("merge/bam.safetensors", "convert/bam-hf", "--format", "hf")
    convert("merge/bam-hf", "convert/bam-back.safetensors")
    convert("merge/btx.safetensors", "convert/btx-mixtral", "--format", "mixtral")
    convert("merge/btx-mixtral", "convert/btx-back.safetensors")
    convert("merge/btx-mixtral", "convert/btx-back-dir", "--max-shard-size", "30KB")
    convert("merge/upcycle.safetensors", "convert/upcycle-hf", "--format", "hf")
    convert("convert/seed-mistral", "convert/seed-mistral-back.safetensors")  # sharded HF input
    convert("in/code", "convert/code.safetensors")
    run("merge", "--seed", "convert/seed.safetensors", "--experts", "convert/code.safetensors", "--recipe", "bam",
        "--out", "merge/from-canonical.safetensors", "--quiet")  # canonical inputs: no tokenizer
    outs.append("merge/from-canonical.safetensors")

    # every HF architecture table, both directions, from the Python API
    for arch, cfg in ARCH_CONFIGS.items():
        state = random_state(cfg, seed=len(arch))
        save_checkpoint(state, cfg, f"api/{arch}.safetensors")
        save_hf(state, f"api/{arch}-hf", arch, config=cfg)
        outs += [f"api/{arch}.safetensors", f"api/{arch}-hf"]
        convert(f"api/{arch}-hf", f"api/{arch}-back.safetensors")
        convert(f"api/{arch}-back.safetensors", f"api/{arch}-again", "--format", "hf", "--architecture", arch)

    # mixed dtypes (norms float32, matrices bf16) through every writer
    cfg = ARCH_CONFIGS["mistral"]
    mixed = {n: t if "norm" in n else t.to(torch.bfloat16) for n, t in random_state(cfg, seed=5).items()}
    save_checkpoint(mixed, cfg, "api/mixed-dir", max_shard_bytes=20_000)
    outs.append("api/mixed-dir")
    convert("api/mixed-dir", "api/mixed-mistral", "--format", "hf", "--architecture", "mistral")
    convert("api/mixed-mistral", "api/mixed-back.safetensors")
    return outs


def digests(outputs: list[str]) -> dict[str, str]:
    """sha256 of every file under every output, by relative path (shipped remote code left out)."""
    found: dict[str, str] = {}
    for out in outputs:
        root = Path(out)
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_dir() or f.suffix == ".py":
                continue
            found[f.as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def test_every_output_is_byte_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = digests(produce_outputs())
    want = json.loads(GOLDEN.read_text())
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    changed = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    assert not (missing or extra or changed), (
        f"outputs differ from {GOLDEN.name}: changed {changed}, missing {missing}, new {extra} "
        f"(re-record with `python tests/project/test_byte_identity.py --record` only if the change is meant)")


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: {sys.argv[0]} --record   (writes {GOLDEN})")
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)
        table = digests(produce_outputs())
        os.chdir(here)
    GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{GOLDEN}: {len(table)} files")
