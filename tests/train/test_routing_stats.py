"""Routing metrics (train/metrics.py, train/routing_report.py) and `bam-surgery routing-stats`: Gini and
entropy against hand-computed values, stability against constructed checkpoint pairs whose answer is
known, the command on a tiny merged model (tables, --json schema, --plot), and bad input."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import cli_error_line, dense_family, run_cli

from bam_surgery.runtime import Model, preset, save_model
from bam_surgery.runtime.blocks import Routing
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.train.data import DOC_SEPARATOR
from bam_surgery.train.metrics import entropy_bits, experts_used, gini, top1_expert
from bam_surgery.train.routing_report import routing_stats, top1_changes

SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=32)
TEXTS = {"code": ["def f(x):\n    return x * 2", "for i in range(10): print(i)", "x = [a + b for a, b in z]"],
         "law": ["The party of the first part shall", "pursuant to section 12(b) of the act", "hereinafter"]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("text")
    for name, docs in TEXTS.items():
        (folder / f"{name}.txt").write_text(DOC_SEPARATOR.join(docs))
    return ",".join(f"{name}={folder}/{name}.txt" for name in TEXTS)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokens")


run, error_line = run_cli, cli_error_line


# ---- the definitions -------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [2, 4, 8, 64])
def test_uniform_and_one_expert(E):
    assert gini(torch.full((E,), 1.0 / E)) == pytest.approx(0.0, abs=1e-12)
    assert entropy_bits(torch.full((E,), 1.0 / E)) == pytest.approx(math.log2(E))
    one = torch.zeros(E)
    one[E // 2] = 1.0
    assert gini(one) == pytest.approx((E - 1) / E)
    assert entropy_bits(one) == 0.0
    assert experts_used(one) == 1 and experts_used(torch.full((E,), 1.0 / E)) == E


def test_uneven_usage_by_hand():
    u = torch.tensor([0.3, 0.1, 0.4, 0.2])
    # sorted .1 .2 .3 .4, weights 2i - E - 1 = -3 -1 1 3: (-.3 - .2 + .3 + 1.2) / (4 * 1) = 0.25
    assert gini(u) == pytest.approx(0.25)
    # -(.1 log2 .1 + .2 log2 .2 + .3 log2 .3 + .4 log2 .4)
    assert entropy_bits(u) == pytest.approx(0.33219281 + 0.46438562 + 0.52108968 + 0.52877124, abs=1e-7)
    assert gini(u * 40) == pytest.approx(0.25) and entropy_bits(u * 40) == pytest.approx(entropy_bits(u))
    # two of three experts, equal shares: G = (-2*0 + 0*.5 + 2*.5) / 3 = 1/3; 1 bit; 2 used
    assert gini(torch.tensor([0.5, 0.0, 0.5])) == pytest.approx(1 / 3)
    assert entropy_bits(torch.tensor([0.5, 0.0, 0.5])) == pytest.approx(1.0)
    assert experts_used(torch.tensor([0.5, 0.0, 0.5])) == 2
    assert gini(torch.zeros(4)) == 0.0


def test_sorted_gini_equals_the_mean_absolute_difference():
    u = torch.rand(37, generator=torch.Generator().manual_seed(0)).double()
    pairwise = float((u[:, None] - u[None, :]).abs().sum() / (2 * 37 * u.sum()))
    assert gini(u) == pytest.approx(pairwise, rel=1e-12)


def test_top1_and_changes_by_hand():
    gates = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0]])
    assert top1_expert(Routing(gates=gates)).tolist() == [1, 0]  # ties: the lowest index
    topk = torch.tensor([[2, 0], [1, 2]])
    assert top1_expert(Routing(gates=gates, topk=topk)).tolist() == [2, 1]
    a = {"d": {"r": torch.tensor([0, 1, 2, 3], dtype=torch.int16)}}
    b = {"d": {"r": torch.tensor([0, 2, 2, 0], dtype=torch.int16)}}
    assert top1_changes(a, b) == {"d": {"r": 0.5}} and top1_changes(a, a) == {"d": {"r": 0.0}}


# ---- stability against constructed checkpoint pairs ---------------------------------------------------
def _mixture(tmp_path: Path, **overrides) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    model = Model(preset("tiny", **{**SMALL, "ffn_experts": 4, "attn_experts": 3, **overrides}))
    model.reset_parameters(std=0.3, seed=3)
    return model.config, model.state_dict(), save_model(model, tmp_path / "a.safetensors")


def _permuted(state: dict[str, torch.Tensor], kind: str, perm: list[int]) -> dict[str, torch.Tensor]:
    """New expert j (and router row j) = old expert perm[j]: the same function, relabelled experts."""
    out = dict(state)
    for name, t in state.items():
        if f".{kind}_experts." in name or f".{kind}_router." in name:
            out[name] = t[perm].clone()
    return out


def test_stability_identical_is_zero_and_relabelled_experts_give_the_known_share(tmp_path, data, cache):
    cfg, state, a = _mixture(tmp_path)
    perm_ffn, perm_attn = [1, 0, 2, 3], [1, 2, 0]  # swap FFN experts 0 and 1; rotate the attention experts
    b = save_checkpoint(_permuted(_permuted(state, "ffn", perm_ffn), "attn", perm_attn), cfg,
                        tmp_path / "b.safetensors")
    same = routing_stats(str(a), data, compare=str(a), seq_len=16, token_cache=cache)
    for r in same.domains.values():
        assert {s["changed"] for s in r.routing.values()} == {0.0}
        assert r.routing_summary["ffn"]["changed"] == 0.0 and r.routing_summary["attn"]["changed"] == 0.0

    tokens = torch.arange(1, 40)[None]
    with torch.no_grad():  # the relabelled model is the same function
        ma, mb = Model(cfg), Model(cfg)
        ma.load_state_dict(state)
        mb.load_state_dict(_permuted(_permuted(state, "ffn", perm_ffn), "attn", perm_attn))
        assert torch.allclose(ma(tokens).logits, mb(tokens).logits, atol=1e-5)

    report = routing_stats(str(a), data, compare=str(b), seq_len=16, token_cache=cache)
    alone = routing_stats(str(b), data, seq_len=16, token_cache=cache)
    assert report.compare == str(b)
    for domain, r in report.domains.items():
        for router, s in r.routing.items():
            if router.endswith("ffn_router"):  # top-1: a token changes label iff its expert was 0 or 1
                assert s["changed"] == pytest.approx(s["usage"][0] + s["usage"][1], abs=2e-6)
                assert 0 < s["changed"] < 1
                relabelled = alone.domains[domain].routing[router]["usage"]
                assert relabelled == pytest.approx([s["usage"][p] for p in perm_ffn], abs=2e-6)
            else:  # every attention expert moved: every token's top-1 label changes
                assert s["changed"] == 1.0
        assert r.routing_summary["attn"]["changed"] == 1.0


# ---- the command ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """A tiny BAM merge of a seed and two specialists, through `bam-surgery merge`."""
    root = tmp_path_factory.mktemp("merged")
    cfg = ModelConfig(vocab_size=256, **SMALL)
    paths = []
    for name, state in zip(("seed", "code", "law"), dense_family(cfg, 3, seed=5)):
        paths.append(save_checkpoint(state, cfg, root / f"{name}.safetensors"))
    run("merge", "--seed", paths[0], "--experts", f"code={paths[1]},law={paths[2]}", "--out",
        root / "mix.safetensors", "--quiet")
    return root / "mix.safetensors"


def test_tables_json_and_plots(tmp_path, merged, data, cache):
    args = ["routing-stats", merged, "--data", data, "--seq-len", 16, "--token-cache", cache]
    text = run(*args).output
    assert f"checkpoint  {merged}" in text and "== code: " in text and "== law: " in text
    assert "FFN routers: share of top-k assignments" in text and "attention routers: mean gate" in text
    header = next(ln for ln in text.splitlines() if ln.startswith("layer"))
    assert header.split() == ["layer", "seed", "code", "law", "used", "entropy", "gini"]
    assert [ln.split()[0] for ln in text.splitlines() if ln[:1].isdigit() or ln.startswith("mean")][:3] == \
        ["0", "1", "mean"]

    body = json.loads(run(*args, "--json").output)
    assert set(body) == {"checkpoint", "compare", "tokenizer", "separator", "seq_len", "experts", "domains"}
    assert body["experts"] == {"ffn": ["seed", "code", "law"], "attn": ["seed", "code", "law"]}
    assert body["compare"] is None and set(body["domains"]) == {"code", "law"}
    code = body["domains"]["code"]
    assert set(code) == {"tokens", "loss", "perplexity", "routing", "routers"}
    assert set(code["routers"]) == {f"layers.{i}.{k}_router" for i in range(2) for k in ("ffn", "attn")}
    for router, s in code["routers"].items():
        assert set(s) == {"experts", "usage", "mean_gate", "used", "used_percent", "entropy", "entropy_max",
                          "token_entropy", "gini", "tokens", "changed"}
        assert sum(s["usage"]) == pytest.approx(1.0, abs=1e-5) and s["tokens"] == code["tokens"]
        assert s["entropy"] == pytest.approx(entropy_bits(torch.tensor(s["usage"])), abs=1e-5)
        assert s["gini"] == pytest.approx(gini(torch.tensor(s["usage"])), abs=1e-5)
        assert s["used"] == sum(u > 0 for u in s["usage"]) and s["entropy_max"] == pytest.approx(math.log2(3))
        assert s["changed"] is None
    assert set(code["routing"]) == {"ffn", "attn"} and code["routing"]["ffn"]["changed"] is None

    compared = run(*args, "--compare", merged, "--plot", tmp_path / "png")
    assert "changed" in compared.output and f"compare     {merged}" in compared.output
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs == ["routing-attn-code.png", "routing-attn-law.png", "routing-ffn-code.png", "routing-ffn-law.png",
                    "routing-usage-histogram.png"]
    assert all((tmp_path / "png" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    run(*args, "--plot", tmp_path / "png")  # our own PNGs are replaced
    (tmp_path / "png" / "routing-ffn-law.png").write_bytes(b"a user's file")
    line = error_line(*args, "--plot", tmp_path / "png")
    assert "routing-ffn-law.png exists and was not written by bam-surgery" in line
    assert (tmp_path / "png" / "routing-ffn-law.png").read_bytes() == b"a user's file"


def test_many_experts_get_a_summary_per_layer(tmp_path, data, cache):
    model = Model(preset("tiny", **{**SMALL, "n_layers": 1}, ffn_experts=16, ffn_top_k=2))
    model.reset_parameters(seed=2)
    path = save_model(model, tmp_path / "wide.safetensors")
    text = run("routing-stats", path, "--data", data, "--seq-len", 16, "--token-cache", cache).output
    header = next(ln for ln in text.splitlines() if ln.startswith("layer"))
    assert header.split() == ["layer", "max", "(expert)", "min", "(expert)", "used", "entropy", "gini"]
    assert "(entropy in bits, max 4.000)" in text and "attention routers" not in text


def test_bad_input(tmp_path, merged, data, cache):
    common = ["--seq-len", 16, "--token-cache", cache]
    assert "nope.txt: no such file or folder" in error_line("routing-stats", merged, "--data",
                                                             f"x={tmp_path}/nope.txt", *common)
    dense = save_model(Model(preset("tiny", **SMALL)), tmp_path / "dense.safetensors")
    assert f"{dense}: has no routers" in error_line("routing-stats", dense, "--data", data, *common)
    other = Model(preset("tiny", **SMALL, ffn_experts=4, attn_experts=3))
    four = save_model(other, tmp_path / "four.safetensors")
    line = error_line("routing-stats", merged, "--data", data, "--compare", four, *common)
    assert "FFN expert count (ffn_experts 4) differs" in line and str(four) in line
    small_vocab = Model(preset("tiny", **{**SMALL, "vocab_size": 300}, ffn_experts=3, attn_experts=3))
    v300 = save_model(small_vocab, tmp_path / "v300.safetensors")
    line = error_line("routing-stats", merged, "--data", data, "--compare", v300, *common)
    assert "vocabulary (vocab_size 300) differs" in line
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in error_line("routing-stats", merged, "--data", data, *common, "--plot",
                                                      tmp_path / "file")


def test_python_api_names():
    import bam_surgery.train as train_api

    assert train_api.routing_stats is routing_stats and callable(train_api.plot_routing)


def test_plot_dir_rule_is_the_one_of_plot(tmp_path):
    """routing-stats --plot and plot --out share train.plot.plot_files: a symbolic link under a PNG's name is
    refused as a user's file is, in a DIR that is itself a link too."""
    from bam_surgery.train.errors import TrainError
    from bam_surgery.train.plot import routing_plot_files

    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    (tmp_path / "dir" / "routing-usage-histogram.png").symlink_to(tmp_path / "elsewhere.png")
    for out in (tmp_path / "dir", tmp_path / "link"):
        with pytest.raises(TrainError, match="routing-usage-histogram.png exists and was not written"):
            routing_plot_files(out, ["code"])
    assert set(routing_plot_files(tmp_path / "new", ["code"])) == {("code", "ffn"), ("code", "attn"), None}
