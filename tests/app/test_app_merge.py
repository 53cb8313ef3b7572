"""The merge use case (app.merge.merge) end to end, called as a library: recipe -> plan -> streamed execution.

Identities checked with the runtime (fp32, max abs diff <= 1e-4 on logits):
  * forced routing to expert i reproduces dense model i, for every recipe, when the inputs share
    what the recipe averages (norms and embeddings; K/V for shared-KV; attention for BTX);
  * N identical inputs with ffn_top_k=N reproduce the dense model with learned (random) routers;
  * upcycling reproduces its dense model under any routing.
Plus: tensor contents (stack order, weighted means, extra experts, the shared-KV rules), router
init, config options, determinism, provenance, sharded output, streaming memory, HF inputs. The command's
contract (flags, messages, exit codes, atomicity under signals) is tests/surgery/test_merge.py's.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import MERGE_CONFIGS as CONFIGS
from conftest import WrappedReader, b3, branched_family, logits, max_diff, random_state, save_family, sha256, tokens_for
from bam_surgery.app.merge import MergeResult, merge
from bam_surgery.app.reporter import Quiet
from bam_surgery.runtime import ForcedRouting, load_model
from bam_surgery.runtime.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from bam_surgery.runtime.reader import Reader
from bam_surgery.surgery.execute import execute_plan
from bam_surgery.surgery.options import MergeOptions
from bam_surgery.surgery.plan import compile_plan
from bam_surgery.surgery.plan_reader import PlanReader
from bam_surgery.surgery.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


@dataclass
class Merged:
    result: MergeResult
    warnings: list[str]


def merged(paths, out, recipe: str = "bam", max_shard_size: str | None = None, **options) -> Merged:
    """app.merge.merge of paths[0] (the seed) and paths[1:] (the experts) into OUT, its warnings kept."""
    reporter = Kept()
    result = merge([(None, str(p)) for p in paths], out, recipe=recipe, options=MergeOptions(**options),
                   max_shard_size=max_shard_size, reporter=reporter)
    return Merged(result, reporter.warnings)


class Kept(Quiet):
    """A reporter that keeps the warnings."""

    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, message: str) -> None:
        self.warnings.append(message)


# ---- identities -----------------------------------------------------------------------------------
FAMILIES = {"bam": {}, "bam-shared-kv": {"share_kv": True}, "btx": {"share_attention": True}}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("recipe", sorted(FAMILIES))
def test_forced_routing_reproduces_each_dense_model(tmp_path, recipe, arch):
    cfg = CONFIGS[arch]
    states = branched_family(cfg, 3, seed=1, **FAMILIES[recipe])
    paths = save_family(tmp_path, cfg, states)
    merged(paths, tmp_path / "mix.safetensors", recipe=recipe)
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
    result = merged([seed, seed, seed], out, recipe=recipe, ffn_top_k=3)
    assert any("identical to the seed" in w for w in result.warnings)  # the branch check notices
    mix = load_model(out)
    tokens = tokens_for(cfg)
    assert max_diff(logits(mix, tokens), logits(load_model(seed), tokens)) <= TOL
    # the recipe's defaults (top-2, gates renormalized to sum to 1) keep the dense model too
    merged([seed, seed, seed], tmp_path / "default.safetensors", recipe=recipe)
    assert max_diff(logits(load_model(tmp_path / "default.safetensors"), tokens), logits(load_model(seed), tokens)) <= TOL
    # the paper's top-1 with full-softmax gates scales the FFN by p_max < 1: not the dense model
    merged([seed, seed, seed], tmp_path / "top1.safetensors", recipe=recipe, ffn_top_k=1, gate_norm="softmax")
    assert max_diff(logits(load_model(tmp_path / "top1.safetensors"), tokens), logits(load_model(seed), tokens)) > 1e-3


@pytest.mark.parametrize("arch", ["parallel", "llama"])
def test_upcycle_reproduces_its_dense_model(tmp_path, arch):
    cfg = CONFIGS[arch]
    (seed,) = save_family(tmp_path, cfg, [random_state(cfg, 4)])
    out = tmp_path / "up.safetensors"
    merged([seed], out, recipe="upcycle")
    mix = load_model(out)
    assert (mix.config.ffn_experts, mix.config.attn_experts) == (4, 0)
    tokens, dense = tokens_for(cfg), logits(load_model(seed), tokens_for(cfg))
    for i in range(4):
        assert max_diff(logits(mix, tokens, ForcedRouting(expert=i)), dense) <= TOL
    # the recipe's renormalized top-2 gates sum to 1 over identical experts: the dense model
    assert max_diff(logits(mix, tokens), dense) <= TOL
    # the paper's learned top-1 routing with full-softmax gates scales the FFN by p_max: close, not equal
    merged([seed], tmp_path / "up1.safetensors", recipe="upcycle", ffn_top_k=1, gate_norm="softmax")
    assert max_diff(logits(load_model(tmp_path / "up1.safetensors"), tokens), dense) > 1e-4
    merged([seed], tmp_path / "up8.safetensors", recipe="upcycle", extra_ffn_experts=7)
    mix8 = load_model(tmp_path / "up8.safetensors")
    assert mix8.config.ffn_experts == 8
    assert max_diff(logits(mix8, tokens), dense) <= TOL


def test_shared_kv_rules(tmp_path):
    cfg = CONFIGS["llama"]
    states = branched_family(cfg, 3, seed=5)  # K/V differ between inputs
    paths = save_family(tmp_path, cfg, states)
    merged(paths, tmp_path / "mean.safetensors", recipe="bam-shared-kv")
    merged(paths, tmp_path / "seedkv.safetensors", recipe="bam-shared-kv", shared_kv_rule="seed")
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
    merged(paths, out, recipe="bam", seed_expert=False, extra_ffn_experts=2)
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
    merged(paths, tmp_path / "mix2.safetensors", recipe="btx", seed_expert=False)
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
    merged(paths, tmp_path / "w.safetensors", recipe="btx", weights=(2.0, 1.0, 1.0))
    _, mixed = load_checkpoint(tmp_path / "w.safetensors")
    for name in ("embed.weight", "layers.1.attn.o.weight", "layers.0.attn_norm.weight", "lm_head.weight"):
        expected = 0.5 * states[0][name] + 0.25 * states[1][name] + 0.25 * states[2][name]
        assert torch.allclose(mixed[name], expected, atol=1e-6), name


def test_routers_are_seeded_per_tensor(tmp_path):
    cfg = CONFIGS["parallel"].replace(d_model=64, n_heads=4)
    paths = save_family(tmp_path, cfg, branched_family(cfg, 4, seed=2))
    runs = {}
    for tag, args in {"bam": dict(recipe="bam"), "shared": dict(recipe="bam-shared-kv"),
                      "seed9": dict(recipe="bam", router_seed=9), "std": dict(recipe="bam", router_std=0.5)}.items():
        merged(paths, tmp_path / f"{tag}.safetensors", **args)
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
    merged(paths, out, attention_routing="top2", ffn_top_k=2, gate_norm="topk_softmax", lb_coef=0.05, z_coef=0.002,
           dtype="bfloat16")
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
    merged(paths, a)
    merged(paths, b)
    merged(paths, c, router_seed=1)
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
    merged(paths, tmp_path / "one.safetensors")
    merged(paths, tmp_path / "dir", max_shard_size="40KB")
    merged(paths, tmp_path / "dir2", max_shard_size="40KB")
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
    merged([seed_dir, *paths[1:]], tmp_path / "from-dir.safetensors")
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
    merged(paths, out, recipe="bam-shared-kv", extra_ffn_experts=1)
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
    result = merged(dirs, out)
    assert result.warnings == []
    mix = load_model(out)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for i, m in enumerate(models):
        with torch.no_grad():
            assert max_diff(logits(mix, tokens, ForcedRouting(expert=i)), m(tokens).logits) <= TOL



# ---- the use case's own steps ------------------------------------------------------------------------
def test_a_dry_run_returns_the_plan_and_writes_nothing(tmp_path):
    cfg = CONFIGS["parallel"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=21))
    out = tmp_path / "mix.safetensors"
    result = merge([(None, str(p)) for p in paths], out, options=MergeOptions(ffn_top_k=2), dry_run=True)
    assert result.path is None and not out.exists()
    assert result.plan.config.ffn_top_k == 2 and [i.name for i in result.plan.inputs] == ["seed", "code", "math"]


@pytest.mark.parametrize("fmt,out", [("canonical", "mix.safetensors"), ("hf", "mix-hf")])
def test_out_is_checked_once_before_any_tensor_is_read(tmp_path, monkeypatch, fmt, out):
    """The OUT policy runs once per merge, whatever the format (the command, execute_plan and the export each ran
    it before issue 30), and refuses before a tensor is read."""
    import bam_surgery.app.exports as app_exports
    import bam_surgery.app.merge as app_merge
    from bam_surgery.runtime.errors import UserError
    from bam_surgery.runtime.output_path import check_output_path

    cfg = CONFIGS["llama"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=22))
    calls = []
    counted = lambda *args, **kwargs: (calls.append(args[0]), check_output_path(*args, **kwargs))[1]  # noqa: E731
    monkeypatch.setattr(app_merge, "check_output_path", counted)
    monkeypatch.setattr(app_exports, "check_output_path", counted)
    merge([(None, str(p)) for p in paths], tmp_path / out, fmt=fmt)
    assert calls == [tmp_path / out]
    reads = []
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: reads.append(name))
    with pytest.raises(UserError, match="already exists; pass --force"):
        merge([(None, str(p)) for p in paths], tmp_path / out, fmt=fmt)
    with pytest.raises(UserError, match="is input"):  # a folder holding an input, for the directory formats
        merge([(None, str(p)) for p in paths], paths[1] if fmt == "canonical" else tmp_path, fmt=fmt, force=True)
    assert reads == []
