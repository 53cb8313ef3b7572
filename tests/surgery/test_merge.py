"""The merge engine end to end: recipe -> plan -> streamed execution, through the CLI.

Identities checked with the runtime (fp32, max abs diff <= 1e-4 on logits):
  * forced routing to expert i reproduces dense model i, for every recipe, when the inputs share
    what the recipe averages (norms and embeddings; K/V for shared-KV; attention for BTX);
  * N identical inputs with --ffn-top-k N reproduce the dense model with learned (random) routers;
  * upcycling reproduces its dense model under any routing.
Plus: tensor contents (stack order, weighted means, extra experts, the shared-KV rules), router
init, config options, determinism, provenance, sharded output, streaming memory, atomicity under
SIGTERM/SIGKILL, every bad input (exit 2, one line naming file and tensor, nothing at OUT), and
--dry-run reading no tensor data.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import (WrappedReader, is_norm_or_embedding, max_diff, merge, merge_family, random_state, tiny_config,
                      tokens_for)
from bam_surgery.runtime import ForcedRouting, load_model
from bam_surgery.runtime.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from bam_surgery.runtime.reader import Reader
from bam_surgery.cli.commands import cli
from bam_surgery.surgery.execute import execute_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.sizes import parse_size
from bam_surgery.surgery.plan import MergeOptions, compile_plan
from bam_surgery.surgery.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4

CONFIGS = {
    # the paper's block: parallel attention + FFN on one shared layernorm, SwiGLU, RoPE
    "parallel": tiny_config(block="parallel", norm="layernorm", activation="swiglu"),
    # Llama-like: sequential block, RMSNorm, SwiGLU, GQA
    "llama": tiny_config(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2),
    # GPT-2-like: biases everywhere, learned positions, GELU, tied embeddings
    "gpt2": tiny_config(block="sequential", norm="layernorm", norm_bias=True, activation="gelu",
                        position="learned", qkv_bias=True, o_bias=True, ffn_bias=True, tie_embeddings=True),
}


# ---- helpers --------------------------------------------------------------------------------------
def branched_family(cfg, n: int, seed: int = 0, share_kv: bool = False, share_attention: bool = False,
                    spread: float = 0.1) -> list[dict[str, torch.Tensor]]:
    """n dense states as after continued pre-training from one seed: state 0 is the seed; the others
    move every attention/FFN tensor by `spread` of its scale (relative distance ~0.1, a real branch).
    Norms and embeddings stay shared (what the recipes average), optionally K/V (shared-KV) or the
    whole attention (BTX), so that forcing expert i must reproduce dense model i."""
    base = random_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    family = [base]
    for _ in range(1, n):
        state = {}
        for name, t in base.items():
            shared = is_norm_or_embedding(name)
            shared |= share_kv and (".attn.k." in name or ".attn.v." in name)
            shared |= share_attention and ".attn." in name
            state[name] = t.clone() if shared else t + spread * t.std() * torch.randn(t.shape, generator=gen)
        family.append(state)
    return family


def save_family(tmp_path: Path, cfg, states, names=("seed", "code", "math", "law")) -> list[Path]:
    paths = []
    for name, state in zip(names, states):
        p = tmp_path / f"{name}.safetensors"
        save_checkpoint(state, cfg.replace(name=name), p)
        paths.append(p)
    return paths


def logits(model, tokens, routing=None):
    with torch.no_grad():
        return model(tokens, routing=routing).logits


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def b3(path: Path) -> str:
    """The provenance's digest of a file: BLAKE3 of its bytes, self-describing."""
    import blake3
    return "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".partial")]


# ---- identities -----------------------------------------------------------------------------------
FAMILIES = {"bam": {}, "bam-shared-kv": {"share_kv": True}, "btx": {"share_attention": True}}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("recipe", sorted(FAMILIES))
def test_forced_routing_reproduces_each_dense_model(tmp_path, recipe, arch):
    cfg = CONFIGS[arch]
    states = branched_family(cfg, 3, seed=1, **FAMILIES[recipe])
    paths = save_family(tmp_path, cfg, states)
    merge_family(paths, tmp_path / "mix.safetensors", "--recipe", recipe)
    mix = load_model(tmp_path / "mix.safetensors")
    assert mix.config.ffn_experts == 3
    assert mix.config.attn_experts == (0 if recipe == "btx" else 3)
    tokens = tokens_for(cfg)
    for i, p in enumerate(paths):
        dense = load_model(p)
        assert max_diff(logits(mix, tokens, ForcedRouting(expert=i)), logits(dense, tokens)) <= TOL, (recipe, i)
    # and the experts really differ: forcing expert 1 does not give dense model 0
    assert max_diff(logits(mix, tokens, ForcedRouting(expert=1)), logits(load_model(paths[0]), tokens)) > 1e-2


@pytest.mark.parametrize("recipe", ["bam", "bam-shared-kv", "btx"])
def test_identical_inputs_with_top_k_all_reproduce_the_dense_model(tmp_path, recipe):
    cfg = CONFIGS["parallel"]
    (seed,) = save_family(tmp_path, cfg, [random_state(cfg, 3)])
    out = tmp_path / "mix.safetensors"
    result = merge_family([seed, seed, seed], out, "--recipe", recipe, "--ffn-top-k", "3")
    assert "identical to the seed" in result.output  # the branch check notices
    mix = load_model(out)
    tokens = tokens_for(cfg)
    assert max_diff(logits(mix, tokens), logits(load_model(seed), tokens)) <= TOL
    # the recipe's defaults (top-2, gates renormalized to sum to 1) keep the dense model too
    merge_family([seed, seed, seed], tmp_path / "default.safetensors", "--recipe", recipe)
    assert max_diff(logits(load_model(tmp_path / "default.safetensors"), tokens), logits(load_model(seed), tokens)) <= TOL
    # the paper's top-1 with full-softmax gates scales the FFN by p_max < 1: not the dense model
    merge_family([seed, seed, seed], tmp_path / "top1.safetensors", "--recipe", recipe, "--ffn-top-k", "1",
                 "--gate-norm", "softmax")
    assert max_diff(logits(load_model(tmp_path / "top1.safetensors"), tokens), logits(load_model(seed), tokens)) > 1e-3


@pytest.mark.parametrize("arch", ["parallel", "llama"])
def test_upcycle_reproduces_its_dense_model(tmp_path, arch):
    cfg = CONFIGS[arch]
    (seed,) = save_family(tmp_path, cfg, [random_state(cfg, 4)])
    out = tmp_path / "up.safetensors"
    merge("--recipe", "upcycle", "--seed", seed, "--out", out)
    mix = load_model(out)
    assert (mix.config.ffn_experts, mix.config.attn_experts) == (4, 0)
    tokens, dense = tokens_for(cfg), logits(load_model(seed), tokens_for(cfg))
    for i in range(4):
        assert max_diff(logits(mix, tokens, ForcedRouting(expert=i)), dense) <= TOL
    # the recipe's renormalized top-2 gates sum to 1 over identical experts: the dense model
    assert max_diff(logits(mix, tokens), dense) <= TOL
    # the paper's learned top-1 routing with full-softmax gates scales the FFN by p_max: close, not equal
    merge("--recipe", "upcycle", "--seed", seed, "--out", tmp_path / "up1.safetensors", "--ffn-top-k", "1",
          "--gate-norm", "softmax")
    assert max_diff(logits(load_model(tmp_path / "up1.safetensors"), tokens), dense) > 1e-4
    merge("--recipe", "upcycle", "--seed", seed, "--out", tmp_path / "up8.safetensors", "--extra-ffn-experts", "7")
    mix8 = load_model(tmp_path / "up8.safetensors")
    assert mix8.config.ffn_experts == 8
    assert max_diff(logits(mix8, tokens), dense) <= TOL


def test_shared_kv_rules(tmp_path):
    cfg = CONFIGS["llama"]
    states = branched_family(cfg, 3, seed=5)  # K/V differ between inputs
    paths = save_family(tmp_path, cfg, states)
    merge_family(paths, tmp_path / "mean.safetensors", "--recipe", "bam-shared-kv")
    merge_family(paths, tmp_path / "seedkv.safetensors", "--recipe", "bam-shared-kv", "--shared-kv-rule", "seed")
    _, mean_state = load_checkpoint(tmp_path / "mean.safetensors")
    _, seed_state = load_checkpoint(tmp_path / "seedkv.safetensors")
    for i in range(cfg.n_layers):
        for kv in "kv":
            name = f"layers.{i}.attn.{kv}.weight"
            assert f"layers.{i}.attn_experts.{kv}.weight" not in mean_state
            expected = sum(s[name] for s in states) / 3
            assert torch.allclose(mean_state[name], expected, atol=1e-6)
            assert torch.equal(seed_state[name], states[0][name])
    # with the seed's K/V, forcing expert 0 (the seed) gives back the seed model exactly
    tokens = tokens_for(cfg)
    mix = load_model(tmp_path / "seedkv.safetensors")
    assert max_diff(logits(mix, tokens, ForcedRouting(expert=0)), logits(load_model(paths[0]), tokens)) <= TOL


def test_expert_order_no_seed_expert_and_extra_ffn_experts(tmp_path):
    cfg = CONFIGS["parallel"]
    states = branched_family(cfg, 3, seed=6)
    paths = save_family(tmp_path, cfg, states)
    out = tmp_path / "mix.safetensors"
    merge_family(paths, out, "--recipe", "bam", "--no-seed-expert", "--extra-ffn-experts", "2")
    mcfg, mixed = load_checkpoint(out)
    assert (mcfg.ffn_experts, mcfg.attn_experts) == (4, 2)
    for i in range(cfg.n_layers):
        q = mixed[f"layers.{i}.attn_experts.q.weight"]
        assert torch.equal(q[0], states[1][f"layers.{i}.attn.q.weight"])  # --experts order
        assert torch.equal(q[1], states[2][f"layers.{i}.attn.q.weight"])
        up = mixed[f"layers.{i}.ffn_experts.up.weight"]
        for e, src in enumerate([1, 2, 0, 0]):  # members, then copies of the seed's FFN
            assert torch.equal(up[e], states[src][f"layers.{i}.ffn.up.weight"])
    # the seed is not a member: means run over the two experts only
    different = {k: v + 0.1 for k, v in states[2].items()}
    save_checkpoint(different, cfg, paths[2])
    merge_family(paths, tmp_path / "mix2.safetensors", "--recipe", "btx", "--no-seed-expert")
    _, mixed2 = load_checkpoint(tmp_path / "mix2.safetensors")
    assert torch.allclose(mixed2["embed.weight"], (states[1]["embed.weight"] + different["embed.weight"]) / 2,
                          atol=1e-6)
    tokens = tokens_for(cfg)
    mix = load_model(out)
    assert max_diff(logits(mix, tokens, ForcedRouting(expert=1)), logits(load_model(paths[2]), tokens)) > 0  # changed
    assert max_diff(logits(load_model(out), tokens, ForcedRouting(expert=0)),
                    logits(load_model(paths[1]), tokens)) <= TOL


def test_weighted_means(tmp_path):
    cfg = CONFIGS["parallel"]
    states = [random_state(cfg, s) for s in (10, 11, 12)]
    paths = save_family(tmp_path, cfg, states)
    merge_family(paths, tmp_path / "w.safetensors", "--recipe", "btx", "--weights", "2,1,1")
    _, mixed = load_checkpoint(tmp_path / "w.safetensors")
    for name in ("embed.weight", "layers.1.attn.o.weight", "layers.0.attn_norm.weight", "lm_head.weight"):
        expected = 0.5 * states[0][name] + 0.25 * states[1][name] + 0.25 * states[2][name]
        assert torch.allclose(mixed[name], expected, atol=1e-6), name


def test_routers_are_seeded_per_tensor(tmp_path):
    cfg = CONFIGS["parallel"].replace(d_model=64, n_heads=4)
    paths = save_family(tmp_path, cfg, branched_family(cfg, 4, seed=2))
    runs = {}
    for tag, args in {"bam": ["--recipe", "bam"], "shared": ["--recipe", "bam-shared-kv"],
                      "seed9": ["--recipe", "bam", "--router-seed", "9"],
                      "std": ["--recipe", "bam", "--router-std", "0.5"]}.items():
        merge_family(paths, tmp_path / f"{tag}.safetensors", *args)
        runs[tag] = load_checkpoint(tmp_path / f"{tag}.safetensors")[1]
    r = "layers.1.ffn_router.weight"
    assert torch.equal(runs["bam"][r], runs["shared"][r])  # a router depends on its name and the seed only
    assert not torch.equal(runs["bam"][r], runs["seed9"][r])
    assert not torch.equal(runs["bam"][r], runs["bam"]["layers.0.ffn_router.weight"])
    routers = torch.cat([runs["bam"][f"layers.{i}.{k}_router.weight"].flatten()
                         for i in range(cfg.n_layers) for k in ("ffn", "attn")])
    assert abs(routers.std().item() - 0.02) < 0.004 and abs(routers.mean().item()) < 0.004
    assert torch.allclose(runs["std"][r], runs["bam"][r] * 25, rtol=1e-5)


def test_options_are_written_into_the_output_config(tmp_path):
    cfg = CONFIGS["parallel"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 4, seed=8))
    out = tmp_path / "mix.safetensors"
    merge_family(paths, out, "--attention-routing", "top2", "--ffn-top-k", "2", "--gate-norm", "topk_softmax",
                 "--lb-coef", "0.05", "--z-coef", "0.002", "--dtype", "bfloat16")
    reader = CheckpointReader(out)
    c = reader.config
    assert (c.attn_top_k, c.ffn_top_k, c.gate_norm, c.lb_coef, c.z_coef) == (2, 2, "topk_softmax", 0.05, 0.002)
    assert {reader.dtype(n) for n in reader.names()} == {torch.bfloat16}
    _, mixed = load_checkpoint(out)
    _, seed = load_checkpoint(paths[0])
    q = "layers.0.attn_experts.q.weight"
    assert torch.equal(mixed[q][0], seed["layers.0.attn.q.weight"].to(torch.bfloat16))
    out_logits = logits(load_model(out), tokens_for(cfg))
    assert out_logits.dtype == torch.bfloat16 and torch.isfinite(out_logits.float()).all()


# ---- output: determinism, provenance, shards, PlanReader ------------------------------------------
def test_deterministic_output_and_provenance(tmp_path):
    cfg = CONFIGS["llama"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=9))
    a, b, c = (tmp_path / f"{n}.safetensors" for n in ("a", "b", "c"))
    merge_family(paths, a)
    merge_family(paths, b)
    merge_family(paths, c, "--router-seed", "1")
    assert sha256(a) == sha256(b) != sha256(c)

    meta = CheckpointReader(a).metadata
    prov = json.loads(meta["bam_provenance"])
    assert prov["recipe"]["name"] == "bam"
    assert prov["recipe"]["text"] == (ROOT / "recipes" / "bam.yaml").read_text()
    assert [i["role"] for i in prov["inputs"]] == ["seed", "expert", "expert"]
    for entry, p in zip(prov["inputs"], paths):
        assert entry["files"] == [{"name": p.name, "bytes": p.stat().st_size, "digest": b3(p), "how": "bytes"}]
        assert entry["digest"] == b3(p) and entry["path"] == str(p)
    assert prov["tool"]["name"] == "bam-surgery"
    t = prov["tensors"]
    assert t["layers.0.attn_experts.k.weight"] == {"op": "stack", "from": "layers.0.attn.k.weight",
                                                    "inputs": [0, 1, 2]}
    assert t["embed.weight"]["op"] == "mean" and t["embed.weight"]["inputs"] == [0, 1, 2]
    assert t["layers.1.ffn_router.weight"]["op"] == "normal" and t["layers.1.ffn_router.weight"]["std"] == 0.02
    assert prov["options"]["router_seed"] == 0 and prov["options"]["seed_expert"] is True
    assert set(t) == set(CheckpointReader(a).names())


def test_directory_output_with_shards(tmp_path):
    cfg = CONFIGS["parallel"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=12))
    merge_family(paths, tmp_path / "one.safetensors")
    merge_family(paths, tmp_path / "dir", "--max-shard-size", "40KB")
    merge_family(paths, tmp_path / "dir2", "--max-shard-size", "40KB")
    shards = sorted((tmp_path / "dir").glob("model-*.safetensors"))
    assert len(shards) > 2 and all(s.stat().st_size < 40_000 + 8_192 for s in shards)
    assert (tmp_path / "dir" / "config.json").is_file()
    for f in (tmp_path / "dir").iterdir():  # deterministic, index and config included
        assert f.read_bytes() == (tmp_path / "dir2" / f.name).read_bytes(), f.name
    cfg1, one = load_checkpoint(tmp_path / "one.safetensors")
    cfg2, many = load_checkpoint(tmp_path / "dir")
    assert cfg1 == cfg2 and one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    prov = json.loads(CheckpointReader(tmp_path / "dir").metadata["bam_provenance"])
    assert prov["inputs"][0]["files"][0]["digest"] == prov["inputs"][0]["digest"] == b3(paths[0])

    # a sharded input: one digest per shard, and the input's digest is the BLAKE3 of its manifest
    seed_dir = tmp_path / "seed-dir"
    save_checkpoint(load_checkpoint(paths[0])[1], cfg, seed_dir, max_shard_bytes=30_000)
    merge_family([seed_dir, *paths[1:]], tmp_path / "from-dir.safetensors")
    assert torch.equal(load_checkpoint(tmp_path / "from-dir.safetensors")[1]["embed.weight"], one["embed.weight"])
    entry = json.loads(CheckpointReader(tmp_path / "from-dir.safetensors").metadata["bam_provenance"])["inputs"][0]
    shards = sorted(seed_dir.glob("*.safetensors"))
    assert len(shards) > 1 and entry["path"] == str(seed_dir)
    assert entry["files"] == [{"name": f.name, "bytes": f.stat().st_size, "digest": b3(f), "how": "bytes"}
                              for f in shards]
    import blake3
    manifest = "".join(f"{b3(f)}  {f.name}\n" for f in shards)
    assert entry["digest"] == "blake3:" + blake3.blake3(manifest.encode()).hexdigest()


def test_plan_reader_matches_the_written_file(tmp_path):
    cfg = CONFIGS["gpt2"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=13))
    out = tmp_path / "mix.safetensors"
    merge_family(paths, out, "--recipe", "bam-shared-kv", "--extra-ffn-experts", "1")
    readers = [CheckpointReader(p) for p in paths]
    plan = compile_plan(load_recipe("bam-shared-kv"), readers, MergeOptions(extra_ffn_experts=1))
    pr, written = PlanReader(plan), CheckpointReader(out)
    assert sorted(pr.names()) == sorted(written.names())
    assert pr.config == written.config
    for n in pr.names():
        assert pr.shape(n) == written.shape(n) and pr.dtype(n) == written.dtype(n)
        assert torch.equal(pr.get(n), written.get(n)), n
    assert pr.metadata == {k: v for k, v in written.metadata.items()}  # same provenance, same digests


def test_execution_streams_one_tensor_at_a_time(tmp_path):
    """Each input tensor is read once, and at most two input tensors are alive at any time (a stack
    holds the seed's tensor while it fills the extra FFN slots)."""
    cfg = CONFIGS["llama"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=14))
    live, peak, reads = [0], [0], []

    class Counting(WrappedReader, Reader):  # read_into from the base class: through get
        def __init__(self, path):
            super().__init__(CheckpointReader(path))

        def get(self, name):
            t = self._r.get(name)
            reads.append((str(self.path), name))
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
            return t

    plan = compile_plan(load_recipe("bam"), [Counting(p) for p in paths], MergeOptions(extra_ffn_experts=2))
    execute_plan(plan, tmp_path / "mix.safetensors", check_branch=False)
    assert len(reads) == len(set(reads)) == 3 * len(CheckpointReader(paths[0]).names())
    assert peak[0] <= 2
    assert live[0] == 0


def test_hugging_face_inputs_merge_by_name(tmp_path):
    """Inputs in another format plug in through converters.open_checkpoint: three Llama directories
    (transformers' own save_pretrained) merge into a mixture whose forced experts reproduce each
    transformers model."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    models, dirs = [], []
    for i in range(3):
        m = transformers.LlamaForCausalLM(hf_cfg).eval()
        if i:  # a branch: the seed's weights, attention and MLP moved by 10%
            m.load_state_dict(models[0].state_dict())
            with torch.no_grad():
                for n, p in m.named_parameters():
                    if ".self_attn." in n or ".mlp." in n:
                        p.add_(0.1 * p.std() * torch.randn_like(p))
        m.save_pretrained(tmp_path / f"hf{i}")
        models.append(m)
        dirs.append(tmp_path / f"hf{i}")
    out = tmp_path / "mix.safetensors"
    result = merge_family(dirs, out)
    assert "warning" not in result.stderr
    mix = load_model(out)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for i, m in enumerate(models):
        with torch.no_grad():
            assert max_diff(logits(mix, tokens, ForcedRouting(expert=i)), m(tokens).logits) <= TOL


# ---- atomicity --------------------------------------------------------------------------------------
SLOW_MERGE = """
import sys, time
import bam_surgery.runtime.safetensors_file as sf
write = sf.SafetensorsStreamWriter.write
def slow_write(self, name, tensor):
    n = write(self, name, tensor)
    print("wrote", name, flush=True)
    time.sleep(0.5)
    return n
sf.SafetensorsStreamWriter.write = slow_write
from bam_surgery.cli.commands import main
main(sys.argv[1:])
"""


def _foreground_signals() -> None:
    """In the child before exec: Ctrl-C as in a terminal. A shell that starts the test run in the background
    (`cmd &` without job control) leaves SIGINT ignored, the child inherits that, and Python then installs no
    KeyboardInterrupt handler: the merge would not see the SIGINT this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_merge_leaves_nothing_at_out(tmp_path, sig):
    cfg = CONFIGS["parallel"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=15))
    out = tmp_path / "out" / "mix.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_MERGE, "merge", "--quiet", "--seed", str(paths[0]),
                             "--experts", f"{paths[1]},{paths[2]}", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_foreground_signals)
    try:
        first = proc.stdout.readline()
        assert first.startswith("wrote "), proc.stderr.read()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0, f"exit 0 after {sig.name}; stderr: {proc.stderr.read()!r}"
    assert not out.exists()
    if sig == signal.SIGINT:  # Ctrl-C: one line, exit status 130
        assert proc.returncode == 130 and proc.stderr.read() == "bam-surgery: interrupted; nothing was written\n"
    if sig != signal.SIGKILL:  # unwinds: the work folder is removed too, and the folder the run created for OUT
        assert not out.parent.exists()
    else:  # kill -9 leaves the work folder; the next run on the same OUT removes it
        assert leftovers(out.parent) == [f".{out.name}.bam-surgery.partial"]
        result = merge("--seed", paths[0], "--experts", f"{paths[1]},{paths[2]}", "--out", out)
        assert "removed" in result.stderr and "interrupted run" in result.stderr
        assert out.is_file() and leftovers(out.parent) == []


# ---- bad input --------------------------------------------------------------------------------------
def _family(tmp_path, cfg=None, n=3, seed=20):
    cfg = cfg or CONFIGS["parallel"]
    states = branched_family(cfg, n, seed=seed)
    return cfg, states, save_family(tmp_path, cfg, states)


def _broken(tmp_path, case):
    """(paths, file the error must name, text the error must contain)."""
    cfg, states, paths = _family(tmp_path)
    bad = paths[2]
    state = dict(states[2])
    if case in ("d_model", "vocab_size", "n_layers", "n_heads"):
        other = cfg.replace(**{case: {"d_model": 48, "vocab_size": 80, "n_layers": 3, "n_heads": 8}[case]})
        save_checkpoint(random_state(other, 1), other, bad)
        return paths, bad, case
    if case == "missing":
        del state["layers.1.ffn.down.weight"]
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.1.ffn.down.weight"
    if case == "shape":
        state["layers.0.attn.q.weight"] = state["layers.0.attn.q.weight"][:, :16].contiguous()
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.attn.q.weight"
    if case == "unexpected":
        state["layers.0.attn.rotary.inv_freq"] = torch.ones(4)
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.attn.rotary.inv_freq"
    if case in ("nan", "inf"):
        state["lm_head.weight"] = state["lm_head.weight"].clone()
        state["lm_head.weight"][3, 5] = float(case)
        save_checkpoint(state, cfg, bad)
        return paths, bad, "lm_head.weight has 1 non-finite value"
    if case == "-inf_bf16":
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
        state["layers.0.ffn.up.weight"][7, 1] = float("-inf")
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.ffn.up.weight has 1 non-finite value"
    if case == "truncated":
        data = bad.read_bytes()
        bad.write_bytes(data[: len(data) * 2 // 3])
        return paths, bad, "truncated: tensor "
    if case == "garbage":
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + bytes(64))
        return paths, bad, "unreadable"
    if case == "mixture_seed":
        merge_family(paths[1:], tmp_path / "premixed.safetensors")
        return [tmp_path / "premixed.safetensors", *paths[1:]], tmp_path / "premixed.safetensors", "mixture"
    raise AssertionError(case)


BAD_CASES = ["d_model", "vocab_size", "n_layers", "n_heads", "missing", "shape", "unexpected", "nan", "inf", "-inf_bf16",
             "truncated", "garbage", "mixture_seed"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_naming_file_and_tensor(tmp_path, case):
    paths, bad, needle = _broken(tmp_path, case)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, code=None)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("bam-surgery: error: ") and "Traceback" not in result.output
    assert result.stderr.count("error") == 1 and "warning" not in result.stderr
    assert str(bad) in err and needle in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_allow_nonfinite_merges_with_a_warning(tmp_path):
    paths, bad, _ = _broken(tmp_path, "nan")
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, "--allow-nonfinite")
    assert "warning" in result.stderr and str(bad) in result.stderr and "lm_head.weight" in result.stderr
    assert torch.isnan(load_checkpoint(out)[1]["lm_head.weight"]).any()


def test_existing_out_is_refused_without_force(tmp_path):
    _, _, paths = _family(tmp_path)
    out = tmp_path / "mix.safetensors"
    out.write_bytes(b"precious")
    result = merge_family(paths, out, code=None)
    assert result.exit_code == 2 and str(out) in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"precious"
    result = merge_family(paths, out, "--force", code=None)  # not ours: --force does not replace it either
    assert result.exit_code == 2 and "did not write" in result.stderr and out.read_bytes() == b"precious"
    out.unlink()
    merge_family(paths, out)
    merge_family(paths, out, "--force", "--router-seed", "9")  # ours: replaced
    assert load_checkpoint(out)[0].attn_experts == 3
    result = merge_family(paths, paths[1], "--force", code=None)  # never over an input
    assert result.exit_code == 2 and "is input" in result.stderr
    result = merge_family(paths, tmp_path, "--force", code=None)  # nor over the directory holding them
    assert result.exit_code == 2 and "is input" in result.stderr
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    result = merge_family(paths, home, "--force", code=None)  # nor over a directory that is not a checkpoint
    assert result.exit_code == 2 and "notes" in result.stderr and (home / "notes").is_dir()
    merge_family(paths, tmp_path / "dir")
    merge_family(paths, tmp_path / "dir", "--force", "--max-shard-size", "50KB")  # a checkpoint dir is replaced
    assert len(list((tmp_path / "dir").glob("model-*.safetensors"))) > 1


def test_expert_not_branched_from_the_seed_is_reported(tmp_path):
    cfg, states, paths = _family(tmp_path)
    stranger = random_state(cfg, 999)  # an independent model: distance ~ sqrt(2)
    save_checkpoint(stranger, cfg, paths[2])
    result = merge_family(paths, tmp_path / "mix.safetensors")
    line = next(l for l in result.stderr.splitlines() if str(paths[2]) in l)
    assert "warning" in line and "relative distance" in line
    figure = float(line.split("is ")[1].split()[0])
    assert 1.0 < figure < 2.0
    assert str(paths[1]) not in result.stderr  # a real branch (distance ~0.?) is not reported


OPTION_ERRORS = [
    (["--recipe", "upcycle"], "takes no --experts"),
    (["--recipe", "bam", "--shared-kv-rule", "seed"], "--shared-kv-rule"),
    (["--recipe", "btx", "--attention-routing", "top2"], "no attention experts"),
    (["--attention-routing", "sideways"], "neither 'soft' nor 'topK'"),
    (["--ffn-top-k", "5"], "ffn_top_k"),
    (["--weights", "1,2"], "--weights"),
    (["--weights", "1,x,2"], "--weights"),
    (["--max-shard-size", "2GB"], "--max-shard-size"),
    (["--recipe", "no-such-recipe"], "choose one of bam, bam-shared-kv, btx, btx-shared-expert, upcycle"),
    (["--recipe", "bam-shared-kv", "--extra-ffn-experts", "1", "--no-seed-expert", "--ffn-top-k", "9"], "ffn_top_k"),
]


@pytest.mark.parametrize("args,needle", OPTION_ERRORS)
def test_bad_options_are_one_line_errors(tmp_path, args, needle):
    _, _, paths = _family(tmp_path)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, *args, code=None)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("bam-surgery: error: ") and needle in result.stderr, result.stderr
    assert not out.exists()


def test_upcycle_without_seed_expert_is_refused(tmp_path):
    _, _, paths = _family(tmp_path, n=1)
    result = merge("--recipe", "upcycle", "--seed", paths[0], "--out", tmp_path / "x.safetensors",
                   "--no-seed-expert", code=None)
    assert result.exit_code == 2 and "--no-seed-expert" in result.stderr


# ---- dry run ----------------------------------------------------------------------------------------
def test_dry_run_reads_no_tensor_data(tmp_path, monkeypatch):
    _, _, paths = _family(tmp_path)

    def no_data(self, name):
        raise AssertionError(f"dry run read tensor {name}")
    monkeypatch.setattr(CheckpointReader, "get", no_data)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, "--dry-run", "--recipe", "bam-shared-kv", "--extra-ffn-experts", "2")
    text = result.stdout
    assert "layers.{i}.attn_experts.q.weight" in text and "i=0-1" in text
    assert "stack inputs 0,1,2,0,0 <- layers.{i}.ffn.up.weight" in text
    assert "layers.{i}.attn.k.weight" in text and "mean inputs 0,1,2" in text
    assert "ffn_experts" in text and re.search(r"^total +23 ", text, re.M)  # the parameter audit
    assert not out.exists()


# ---- small pieces -----------------------------------------------------------------------------------
def test_every_merge_option_has_help():
    merge_cmd = cli.commands["merge"]
    for p in merge_cmd.params:
        assert getattr(p, "help", None), p.name


@pytest.mark.parametrize("text,size", [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30),
                                       ("1000", 1000), ("1.5kb", 1500)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_plan_compiles_from_headers_for_a_paper_sized_model(tmp_path):
    """The paper's 590M model (Table 4) planned from shapes alone: expert shapes as in Table 5."""
    from bam_surgery.runtime.config import preset

    class Header:  # a reader with headers only: no data at all
        def __init__(self, cfg, path):
            from bam_surgery.runtime.layout import tensor_shapes
            self.config, self.path, self.metadata = cfg, path, {}
            self._shapes = tensor_shapes(cfg)

        def names(self):
            return list(self._shapes)

        def shape(self, n):
            return self._shapes[n]

        def dtype(self, n):
            return torch.bfloat16

        def get(self, n):
            raise AssertionError("no data")

    cfg = preset("paper-small")
    plan = compile_plan(load_recipe("bam"), [Header(cfg, f"m{i}") for i in range(4)])
    assert plan["layers.0.attn_experts.q.weight"].shape == (4, 1024, 1024)
    assert plan["layers.0.ffn_experts.gate.weight"].shape == (4, 2048, 1024)
    assert plan.config.ffn_experts == plan.config.attn_experts == 4
    total = sum(math.prod(t.shape) for t in plan.tensors)
    assert total == 776_002_560  # Table 5, BAM total


# ---- expert names ---------------------------------------------------------------------------------
def test_experts_carry_names_into_provenance_inspect_and_the_plan(tmp_path):
    cfg, states, paths = _family(tmp_path)
    odd = tmp_path / "with,comma"
    odd.mkdir()
    comma_path = save_checkpoint(states[2], cfg, odd / "math.safetensors")
    out = tmp_path / "mix.safetensors"
    result = merge("--seed", f"base={paths[0]}", "--experts", f"code={paths[1]}", "--experts", comma_path,
                   "--out", out)
    prov = json.loads(CheckpointReader(out).metadata["bam_provenance"])
    assert [(i["name"], i["role"]) for i in prov["inputs"]] == [("base", "seed"), ("code", "expert"),
                                                               ("math", "expert")]
    assert prov["inputs"][2]["path"] == str(comma_path)
    text = CliRunner().invoke(cli, ["inspect", str(out)]).stdout
    assert re.search(r"^\s+code\s+expert\s+\S*code\.safetensors", text, re.M)
    dry = merge("--seed", paths[0], "--experts", ",".join(map(str, paths[1:])), "--dry-run").stdout
    assert f"input 1  expert code={paths[1]}" in dry and f"input 0  seed   seed={paths[0]}" in dry
    assert result.exit_code == 0


@pytest.mark.parametrize("experts,needle", [
    (["code=A", "code=B"], "expert name 'code' is given twice"),
    (["1st=A"], "no such file"),  # not a name: the whole value is a path
    (["seed=A"], "expert name 'seed' is given twice"),
])
def test_bad_expert_names_are_one_line(tmp_path, experts, needle):
    _, _, paths = _family(tmp_path)
    args = [e.replace("=A", f"={paths[1]}").replace("=B", f"={paths[2]}") for e in experts]
    result = merge("--seed", f"seed={paths[0]}", *[x for a in args for x in ("--experts", a)], "--dry-run", code=None)
    assert result.exit_code == 2 and needle in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_the_same_expert_twice_is_warned_about(tmp_path):
    _, _, paths = _family(tmp_path)
    result = merge("--seed", paths[0], "--experts", paths[1], "--experts", paths[1], "--experts", paths[2],
                   "--out", tmp_path / "mix.safetensors")
    assert "(expert code_2): identical to" in result.stderr and "the same expert given twice" in result.stderr


def test_untrained_softmax_top1_mixture_gets_a_note(tmp_path):
    _, _, paths = _family(tmp_path)
    args = ("--seed", paths[0], "--experts", ",".join(map(str, paths[1:])))
    note = "bam-surgery: note: until the routers are trained each FFN output is scaled by its gate, about 1/3"
    paper = ["--ffn-top-k", "1", "--gate-norm", "softmax"]  # the paper's gates (the recipes' are renormalized)
    result = CliRunner().invoke(cli, ["merge", *map(str, args), *paper, "--out", str(tmp_path / "a.safetensors")])
    assert note in result.stderr and "perplexity before training is not representative" in result.stderr
    for i, extra in enumerate(([], ["--ffn-top-k", "1", "--gate-norm", "topk_softmax"],
                               ["--ffn-top-k", "3", "--gate-norm", "softmax"])):  # gates sum to 1: no note
        result = CliRunner().invoke(cli, ["merge", *map(str, args), *extra, "--out", str(tmp_path / f"b{i}")])
        assert result.exit_code == 0 and "note:" not in result.stderr
