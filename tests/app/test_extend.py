"""`bam-surgery extend` (app/extend.py, surgery/extend.py): specialists added to a trained mixture. The identities:
routing that never picks a new expert computes the trained mixture; routing forced to a new expert computes that
specialist's FFN and attention inside the trained trunk (BTX, BAM with expert and with shared K/V, a fine-grained
BTX); the mixture's trained tensors are kept, not re-averaged; the provenance keeps the merge and its training and
records the new specialists with their digests; the new router rows by each rule (random, prompts, domain data);
bad inputs in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (b3, branched_family, build_model, cli_error_line, max_diff, run_cli, save_family, tiny_config,
                      tokens_for)
from bam_surgery.app.extend import extend
from bam_surgery.app.merge import merge
from bam_surgery.runtime import load_model
from bam_surgery.runtime.blocks import ForcedRouting
from bam_surgery.runtime.checkpoint import PROVENANCE_KEY, CheckpointReader, save_checkpoint
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.surgery.options import ExtendOptions, MergeOptions
from bam_surgery.train.provenance import chain, expert_names, read_provenance

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
CFG = tiny_config(vocab_size=256, block="sequential", norm="rmsnorm", n_kv_heads=2, max_positions=64)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """seed, code, law (merged) and math (added later), branched from one seed; math's K/V are the seed's (what a
    shared-KV mixture keeps)."""
    root = tmp_path_factory.mktemp("family")
    states = branched_family(CFG, 4, spread=0.2)
    return save_family(root, CFG, states, names=("seed", "code", "law", "math"))


def trained_mixture(tmp_path: Path, family, recipe: str, **options) -> Path:
    """A merge of seed, code and law, then every tensor moved (as training would move it), with the merge's
    provenance and a training record chained to it."""
    merged = merge([(None, str(family[0])), ("code", str(family[1])), ("law", str(family[2]))],
                   tmp_path / "merged.safetensors", recipe=recipe, options=MergeOptions(**options)).path
    reader = CheckpointReader(merged)
    gen = torch.Generator().manual_seed(9)
    state = {n: reader.get(n) + 0.05 * reader.get(n).std() * torch.randn(reader.shape(n), generator=gen)
             for n in reader.names()}
    prov = read_provenance(reader.metadata)
    prov = chain(prov, {"steps": 10, "tokens": 1000}, expert_names(prov, reader.config))
    return save_checkpoint(state, reader.config, tmp_path / "trained.safetensors",
                           metadata={PROVENANCE_KEY: json.dumps(prov)})


def _random_state(cfg) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: 0.02 * torch.randn(shape, generator=gen) for n, shape in tensor_shapes(cfg).items()}


def _logits(model, x, routing=None):
    with torch.no_grad():
        return model(x, routing=routing).logits


def _never_new(model, old: dict[str, int]) -> None:
    """Every router's logits for the new experts -inf: they are never picked, their gates 0."""
    for name, router in model.routers().items():
        forward, n = router.forward, old[name]

        def masked(x, forward=forward, n=n):
            logits = forward(x).clone()
            logits[:, n:] = float("-inf")
            return logits
        router.forward = masked


def _specialist_in_trunk(trained: Path, specialist: Path, own_attention: str) -> torch.nn.Module:
    """The dense model of the trained mixture's trunk (norms, embeddings, head, dense or shared attention) with the
    specialist's FFN, and its attention projections `own_attention` (q,k,v,o for expert K/V; q,o for shared K/V)."""
    mix, spec = CheckpointReader(trained), CheckpointReader(specialist)
    state = {}
    for name in tensor_shapes(CFG):  # a BTX's attention and a shared-KV mixture's K/V: the mixture's own
        own = ".ffn." in name or any(f".attn.{p}." in name or f".attn.{p}_norm." in name for p in own_attention)
        state[name] = spec.get(name) if own else mix.get(name)
    return build_model(CFG, state)


@pytest.mark.parametrize("recipe, own_attention", [("btx", ""), ("bam", "qkvo"), ("bam-shared-kv", "qo")])
def test_both_identities_and_the_trained_tensors_kept(tmp_path, family, recipe, own_attention):
    trained = trained_mixture(tmp_path, family, recipe)
    out = extend(str(trained), [("math", str(family[3]))], tmp_path / "ext.safetensors").path
    before, after = load_model(trained).eval(), load_model(out).eval()
    cfg = after.config
    assert cfg.ffn_experts == 4 and cfg.attn_experts == (4 if recipe != "btx" else 0)
    x = tokens_for(CFG, length=12)
    trained_logits = _logits(before, x)
    _never_new(after, {n: r.weight.shape[0] if hasattr(r, "weight") else 0 for n, r in before.routers().items()})
    assert max_diff(_logits(after, x), trained_logits) <= TOL  # identity 1
    after = load_model(out).eval()
    forced = _logits(after, x, ForcedRouting(expert=3))
    expected = _logits(_specialist_in_trunk(trained, family[3], own_attention), x)
    assert max_diff(forced, expected) <= TOL  # identity 2
    mix, ext = CheckpointReader(trained), CheckpointReader(out)
    for name in mix.names():  # what the mixture had: kept as training left it
        t = ext.get(name)
        assert torch.equal(t[:mix.shape(name)[0]] if t.shape != mix.shape(name) else t, mix.get(name)), name


def test_a_fine_grained_mixture_gets_the_specialist_in_virtual_groups(tmp_path, family):
    trained = trained_mixture(tmp_path, family, "btx", ffn_granularity=2)
    out = extend(str(trained), [("math", str(family[3]))], tmp_path / "ext.safetensors").path
    ext = load_model(out).eval()
    assert (ext.config.ffn_experts, ext.config.ffn_top_k, ext.config.ffn_hidden) == (8, 4, CFG.ffn_hidden // 2)
    w = CheckpointReader(out).get("layers.0.ffn_router.weight")
    assert torch.equal(w[6], w[7])  # the new row repeated over its two experts
    gates = torch.zeros(8)
    gates[6:] = 0.5
    x = tokens_for(CFG, length=12)
    assert max_diff(_logits(ext, x, ForcedRouting(ffn_gates=gates)),
                    _logits(_specialist_in_trunk(trained, family[3], ""), x)) <= TOL
    names = json.loads(CheckpointReader(out).metadata[PROVENANCE_KEY])["experts"]["ffn"]
    assert names == ["seed.0", "seed.1", "code.0", "code.1", "law.0", "law.1", "math.0", "math.1"]


def test_the_provenance_keeps_both_origins(tmp_path, family):
    trained = trained_mixture(tmp_path, family, "bam")
    out = extend(str(trained), [("math", str(family[3]))], tmp_path / "ext.safetensors",
                 options=ExtendOptions(router_seed=4)).path
    prov = json.loads(CheckpointReader(out).metadata[PROVENANCE_KEY])
    assert prov["recipe"]["name"] == "bam" and [i["name"] for i in prov["inputs"]] == ["seed", "code", "law"]
    assert prov["training"] == [{"steps": 10, "tokens": 1000}]  # the mixture's own history, kept whole
    (rec,) = prov["extensions"]
    assert rec["mixture"]["digest"] == b3(trained) and rec["mixture"]["role"] == "mixture"
    (new,) = rec["experts"]
    assert (new["name"], new["digest"], new["ffn_experts"], new["attn_expert"]) == ("math", b3(family[3]), [3, 4], 3)
    assert rec["router_rows"] == {"rule": "random", "std": 0.02, "seed": 4} and rec["after_training_runs"] == 1
    assert rec["before"] == {"ffn_experts": 3, "attn_experts": 3}
    assert prov["experts"] == {"ffn": ["seed", "code", "law", "math"], "attn": ["seed", "code", "law", "math"]}


def _layer0_ffn_inputs(model, windows: list[list[int]]) -> torch.Tensor:
    """Layer 0's FFN router input for every position of the windows (BTX: no router before it)."""
    seen = []
    hook = model.routers()["layers.0.ffn_router"].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    hook.remove()
    return torch.cat(seen).double()


def _new_row(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    w = CheckpointReader(path).get("layers.0.ffn_router.weight").double()
    return w[3], w[:3].norm(dim=1).mean()


def test_rows_from_prompts_and_from_domain_data(tmp_path, family):
    trained = trained_mixture(tmp_path, family, "btx")
    model = load_model(trained).eval()
    doc = {"gate_mode": "hidden_avg", "experts": [{"source_model": "math", "positive_prompts": [
        "Let x = 3. Then 2x + 1 = 7.", "The integral of x^2 is x^3 / 3."], "negative_prompts": ["The court held"]}]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    out = extend(str(trained), [("math", str(family[3]))], tmp_path / "prompts.safetensors",
                 options=ExtendOptions(router_init="prompts", router_prompts=str(tmp_path / "p.yaml"))).path
    row, norm = _new_row(out)

    def mean_state(texts):  # every token of the prompts but each one's start token (EOS 0 for bytes)
        return torch.cat([_layer0_ffn_inputs(model, [[0, *t.encode()]])[1:] for t in texts]).mean(0)
    entry = doc["experts"][0]
    v = mean_state(entry["positive_prompts"]) - mean_state(entry["negative_prompts"])
    assert torch.allclose(row, v / v.norm() * norm, atol=1e-5)

    data = {d: str(ROOT / "data" / "domains" / d) for d in ("math", "general", "code")}
    out = extend(str(trained), [("math", str(family[3]))], tmp_path / "domain.safetensors",
                 options=ExtendOptions(router_init="domain", calibration=",".join(f"{k}={v}" for k, v in data.items()),
                                       calibration_tokens=100)).path
    row, norm = _new_row(out)
    from bam_surgery.train.data import open_source, parse_data_spec
    means = {}
    for dom in parse_data_spec(",".join(f"{k}={v}" for k, v in data.items())):
        ids: list[int] = []  # the first 101 tokens of the train split: documents in bytes, each ended by EOS 0
        for text in open_source(dom, "train", "text").documents():
            ids += [*text.encode(), 0]
            if len(ids) > 100:
                break
        windows = [ids[s:min(s + 64, 100)] for s in range(0, 100, 64)]  # max_positions 64: windows of 64 and 36
        means[dom.name] = _layer0_ffn_inputs(model, windows).mean(0)
    v = means["math"] - (means["general"] + means["code"]) / 2
    assert torch.allclose(row, v / v.norm() * norm, atol=1e-5)
    rows = json.loads(CheckpointReader(out).metadata[PROVENANCE_KEY])["extensions"][0]["router_rows"]
    assert rows["rule"] == "domain" and rows["tokens"] == 300


def test_random_rows_are_seeded_normal(tmp_path, family):
    trained = trained_mixture(tmp_path, family, "btx")
    a = extend(str(trained), [("math", str(family[3]))], tmp_path / "a.safetensors").path
    b = extend(str(trained), [("math", str(family[3]))], tmp_path / "b.safetensors").path
    c = extend(str(trained), [("math", str(family[3]))], tmp_path / "c.safetensors",
               options=ExtendOptions(router_std=0.001, router_seed=1)).path
    assert a.read_bytes() == b.read_bytes()
    # the Python API and the command: the same function, the same bytes
    import bam_surgery as bs

    api = bs.extend(trained, {"math": family[3]}, tmp_path / "api.safetensors", router_std=0.001, router_seed=1)
    assert api.path.read_bytes() == c.read_bytes() and api.extension.config.ffn_experts == 4
    run_cli("extend", trained, "--experts", f"math={family[3]}", "--router-std", "0.001", "--router-seed", "1",
            "--out", tmp_path / "cli.safetensors", "--quiet")
    assert (tmp_path / "cli.safetensors").read_bytes() == c.read_bytes()
    with pytest.raises(bs.UserError, match="extend takes no option 'drop_ratio'"):
        bs.extend(trained, [f"math={family[3]}"], tmp_path / "x.safetensors", drop_ratio=0.5)
    (row, _), (small, _) = _new_row(a), _new_row(c)
    assert abs(row.std() - 0.02) < 0.01 and abs(small.std() - 0.001) < 0.0005


def test_bad_inputs_are_one_line(tmp_path, family):
    trained = trained_mixture(tmp_path, family, "btx")
    out = tmp_path / "ext.safetensors"
    assert "a dense model" in cli_error_line("extend", family[0], "--experts", family[3], "--out", out)
    other = save_family(tmp_path, CFG.replace(rope_theta=500.0), branched_family(CFG, 1), names=("odd",))[0]
    assert "rope_theta" in cli_error_line("extend", trained, "--experts", other, "--out", out)
    line = cli_error_line("extend", trained, "--experts", family[3], "--router-init", "domain",
                          "--calibration", f"general={ROOT / 'data/domains/general'}", "--out", out)
    assert "no domain named 'math'" in line
    line = cli_error_line("extend", trained, "--experts", family[3], "--router-init", "prompts", "--out", out)
    assert "--router-prompts" in line
    hybrid = CFG.replace(head_dim=16, linear_layers=[0], linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                         linear_value_dim=8, linear_conv=4, attn_experts=2, linear_experts=2, ffn_experts=2)
    hybrid_mix = save_checkpoint(_random_state(hybrid), hybrid, tmp_path / "hybrid.safetensors")  # a Qwen3.5 BAM
    assert "Gated DeltaNet" in cli_error_line("extend", hybrid_mix, "--experts", family[3], "--out", out)
    (tmp_path / "mlp").mkdir()
    mlp = trained_mixture(tmp_path / "mlp", family, "btx", router="mlp")
    assert "linear routers" in cli_error_line("extend", mlp, "--experts", family[3], "--router-init", "prompts",
                                              "--router-prompts", tmp_path / "none.yaml", "--out", out)
    assert not out.exists()
    run_cli("extend", trained, "--experts", f"math={family[3]}", "--out", out, "--quiet")
    assert "exists" in cli_error_line("extend", trained, "--experts", f"math={family[3]}", "--out", out)
