"""Parameter audit: the paper's Tables 5-7 in its convention, exact counts against hand-derived
arithmetic, a meta-device model, checkpoint headers, and the count-params / inspect commands."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from conftest import WrappedReader

from bam_surgery.cli.audit import count_params_cmd, inspect_cmd
from bam_surgery.runtime.checkpoint import save_checkpoint
from bam_surgery.runtime.config import ModelConfig, preset
from bam_surgery.runtime.layout import GROUPS, tensor_group, tensor_shapes
from bam_surgery.surgery.audit import PAPER_DEVIATIONS, audit, audit_checkpoint
from bam_surgery.surgery.inspect import inspect_checkpoint, key_config

SMALL = preset("paper-small")
LARGE = preset("paper-large")


def columns(dense: ModelConfig, e: int = 4) -> dict[str, ModelConfig]:
    """The paper's Table 5 models, built directly from the dense config (no recipe code)."""
    return {
        "dense": dense,
        "bam": dense.replace(ffn_experts=e, attn_experts=e),
        "bam-shared-kv": dense.replace(ffn_experts=e, attn_experts=e, kv_mode="shared"),
        "btx-top1": dense.replace(ffn_experts=e),
        "btx-top3": dense.replace(ffn_experts=e, ffn_top_k=3),
    }


# ---- Table 5, verbatim from the paper (row order as printed) -------------------------------------
TABLE5_LABELS = ("layernorm / Block", "attn_out / Block", "qkv_proj / Block", "ffn_exp / Block",
                 "ffn_red / Block", "router / Block", "input embedding", "output embedding", "layernorm",
                 "Active Params", "Total Params")
TABLE5 = {
    "dense": (1024, 1_048_576, 3_145_728, 4_194_304, 2_097_152, 0, 262_144_000, 262_144_000, 1024,
              587_209_728, 587_209_728),
    "bam": (1024, 4_194_304, 12_582_912, 4_194_304, 2_097_152, 4096, 262_144_000, 262_144_000, 1024,
            662_731_776, 776_002_560),
    "bam-shared-kv": (1024, 4_194_304, 4_194_304, 4_194_304, 2_097_152, 4096, 262_144_000, 262_144_000, 1024,
                      612_400_128, 738_253_824),
    "btx-top1": (1024, 1_048_576, 3_145_728, 4_194_304, 2_097_152, 4096, 262_144_000, 262_144_000, 1024,
                 587_234_304, 700_480_512),
    "btx-top3": (1024, 1_048_576, 3_145_728, 12_582_912, 6_291_456, 4096, 262_144_000, 262_144_000, 1024,
                 662_731_776, 700_480_512),
}


@pytest.mark.parametrize("model", list(TABLE5))
def test_table5_paper_convention_to_the_parameter(model):
    a = audit(columns(SMALL)[model], "paper")
    assert (a.active, a.total) == TABLE5[model][-2:]
    assert dict(a.table5()) == dict(zip(TABLE5_LABELS, TABLE5[model]))


def test_paper_deviations_are_named_and_sized():
    cols = columns(SMALL)
    adj = {m: {x.key: (x.group, x.total_delta, x.active_delta) for x in audit(c, "paper").adjustments}
           for m, c in cols.items()}
    assert adj["dense"] == adj["btx-top1"] == adj["btx-top3"] == {}
    # BAM: the attention router (E x D = 4,096 per block) is left out of active, 6 blocks
    assert adj["bam"] == {"attention_router_not_active": ("routers", 0, -6 * 4 * 1024)}
    # KV sharing: also the shared K and V projections (2 x 1024 x 1024 per block)
    assert adj["bam-shared-kv"] == {"attention_router_not_active": ("routers", 0, -6 * 4 * 1024),
                                    "shared_kv_not_active": ("attention", 0, -6 * 2 * 1024 * 1024)}
    # paper = exact + the listed adjustments, nothing else
    for m, c in cols.items():
        e, p = audit(c, "exact"), audit(c, "paper")
        assert p.total == e.total
        assert p.active == e.active + sum(x.active_delta for x in p.adjustments)
    assert {d.key for d in PAPER_DEVIATIONS} == {"attention_router_not_active", "shared_kv_not_active"}


# ---- exact convention against per-block arithmetic written out here -----------------------------
V, D, L, F, E = 256_000, 1024, 6, 2048, 4
NORM = D  # one layernorm per parallel block, no bias
Q = K = VP = O = D * D  # 8 heads x 128 = 1024 = D, 8 KV heads
FFN = 2 * D * F + F * D  # gate + up + down
EMB = 2 * V * D  # untied input and output embedding
FINAL = D


def small(per_block: int) -> int:
    return L * per_block + EMB + FINAL


EXACT_SMALL = {  # (total, active)
    "dense": (small(NORM + Q + K + VP + O + FFN),) * 2,
    "bam": (small(NORM + E * (Q + K + VP + O) + E * FFN + 2 * E * D),
            small(NORM + E * (Q + K + VP + O) + 1 * FFN + 2 * E * D)),
    "bam-shared-kv": (small(NORM + E * (Q + O) + K + VP + E * FFN + 2 * E * D),
                      small(NORM + E * (Q + O) + K + VP + 1 * FFN + 2 * E * D)),
    "btx-top1": (small(NORM + Q + K + VP + O + E * FFN + E * D), small(NORM + Q + K + VP + O + FFN + E * D)),
    "btx-top3": (small(NORM + Q + K + VP + O + E * FFN + E * D), small(NORM + Q + K + VP + O + 3 * FFN + E * D)),
}


@pytest.mark.parametrize("model", list(EXACT_SMALL))
def test_exact_small_matches_hand_arithmetic(model):
    a = audit(columns(SMALL)[model])
    assert (a.total, a.active) == EXACT_SMALL[model]
    assert a.adjustments == []


def test_exact_groups_small_bam():
    g = audit(columns(SMALL)["bam"]).groups
    assert list(g) == list(GROUPS)
    assert (g["embeddings"].total, g["embeddings"].active) == (EMB, EMB)
    assert (g["attention"].total, g["attention_experts"].total) == (0, L * E * (Q + K + VP + O))
    assert g["attention_experts"].active == g["attention_experts"].total  # soft routing: all run
    assert (g["ffn_experts"].total, g["ffn_experts"].active) == (L * E * FFN, L * FFN)
    assert (g["routers"].total, g["routers"].active, g["routers"].tensors) == (L * 2 * E * D,) * 2 + (2 * L,)
    assert (g["norms"].total, g["norms"].tensors) == (L * NORM + FINAL, L + 1)


def test_attention_top_k_counts_k_experts():
    cfg = columns(SMALL)["bam"].replace(attn_top_k=2, ffn_top_k=2)
    assert audit(cfg).active == small(NORM + 2 * (Q + K + VP + O) + 2 * FFN + 2 * E * D)


# ---- Tables 6 and 7: BTX with more experts, and top-3 of 6 --------------------------------------
def shown_millions(x: int) -> set[int]:
    """The paper prints millions sometimes rounded, sometimes truncated (BAM's 662.73M is '663M' in
    Table 6 and '662M' in Table 7): accept either, nothing else."""
    return {math.floor(x / 1e6), round(x / 1e6)}


@pytest.mark.parametrize("experts,total_m", [(4, 700), (5, 738), (6, 776), (7, 813), (8, 851)])
def test_table6_btx_more_experts(experts, total_m):
    for convention in ("exact", "paper"):
        a = audit(SMALL.replace(ffn_experts=experts), convention)
        assert a.total == small(NORM + Q + K + VP + O + experts * FFN + experts * D)
        assert total_m in shown_millions(a.total)
        assert 587 in shown_millions(a.active)


def test_table6_and_7_bam_and_btx_top3_of_6():
    bam = audit(columns(SMALL)["bam"], "paper")
    assert 776 in shown_millions(bam.total)
    assert {662, 663} == shown_millions(bam.active)  # Table 7 prints 662M, Table 6 663M
    btx = audit(SMALL.replace(ffn_experts=6, ffn_top_k=3), "paper")
    assert 776 in shown_millions(btx.total) and 662 in shown_millions(btx.active)


# ---- Table 4's large preset ------------------------------------------------------------------------
def test_large_preset():
    Dl, Ll, Fl, Vl, KV = 2304, 18, 9216, 256_000, 6 * 128  # 18 heads of 128, 6 KV heads, tied embeddings
    attn = 2 * Dl * Dl + 2 * KV * Dl
    ffn = 3 * Dl * Fl

    def large(per_block):
        return Ll * per_block + Vl * Dl + Dl

    assert large(Dl + attn + ffn) == 1_991_289_600
    dense = audit(LARGE)
    assert dense.total == dense.active == large(Dl + attn + ffn)
    assert round(dense.total / 1e7) / 100 == 1.99  # "2 Billion" (Table 4)
    assert dense.groups["embeddings"].tensors == 1  # tied: embed.weight is the output head
    bam = audit(columns(LARGE)["bam"])
    assert (bam.total, bam.active) == (large(Dl + 4 * attn + 4 * ffn + 8 * Dl), large(Dl + 4 * attn + ffn + 8 * Dl))
    btx = audit(columns(LARGE)["btx-top1"], "paper")
    assert (btx.total, btx.active) == (large(Dl + attn + 4 * ffn + 4 * Dl), large(Dl + attn + ffn + 4 * Dl))


def test_exact_with_biases_gqa_learned_positions():
    cfg = ModelConfig(vocab_size=100, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      activation="gelu", norm="layernorm", norm_bias=True, qkv_bias=True, o_bias=True,
                      ffn_bias=True, lm_head_bias=True, position="learned", max_positions=16,
                      block="sequential", ffn_experts=3, ffn_top_k=2, attn_experts=3, attn_top_k=1)
    d, kv, f, e = 32, 2 * 8, 48, 3
    norm = 2 * d
    attn = (d * d + d) + 2 * (kv * d + kv) + (d * d + d)
    ffn = (f * d + f) + (d * f + d)  # up, down (gelu: no gate)
    per_total = 2 * norm + e * attn + e * ffn + 2 * e * d
    per_active = 2 * norm + 1 * attn + 2 * ffn + 2 * e * d
    rest = 100 * d + 16 * d + norm + 100 * d + 100
    a = audit(cfg)
    assert (a.total, a.active) == (3 * per_total + rest, 3 * per_active + rest)


# ---- the meta-device model agrees -----------------------------------------------------------------
META_CONFIGS = {
    **{f"small-{k}": v for k, v in columns(SMALL).items()},
    "large-bam-shared-kv": columns(LARGE)["bam-shared-kv"],
    "tiny-variants": preset("tiny", n_kv_heads=2, norm_bias=True, qkv_bias=True, o_bias=True, ffn_bias=True,
                            lm_head_bias=True, tie_embeddings=True, position="learned",
                            block="parallel_two_norms", activation="gelu_tanh",
                            ffn_experts=3, ffn_top_k=2, attn_experts=2, attn_top_k=1),
}


@pytest.mark.parametrize("name", list(META_CONFIGS))
def test_meta_device_model_agrees(name):
    from bam_surgery.runtime.model import Model

    cfg = META_CONFIGS[name]
    with torch.device("meta"):
        model = Model(cfg)
    a = audit(cfg)
    assert sum(p.numel() for p in model.parameters()) == a.total
    by_group = {g: 0 for g in GROUPS}
    for n, t in model.state_dict().items():
        by_group[tensor_group(n)] += t.numel()
    assert by_group == {g: c.total for g, c in a.groups.items()}


# ---- checkpoints: header only ------------------------------------------------------------------------
TINY_BAM = preset("tiny").replace(ffn_experts=4, attn_experts=4, kv_mode="shared")
PROVENANCE = {"recipe": "bam-shared-kv", "tool": {"name": "bam-surgery", "version": "0.1.0"},
              "inputs": [{"role": "seed", "path": "seed.safetensors", "sha256": "ab" * 32},
                         {"role": "expert", "path": "code.safetensors", "sha256": "cd" * 32}]}


def random_state(cfg: ModelConfig, dtype_of=lambda name: torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen).to(dtype_of(n)) for n, s in tensor_shapes(cfg).items()}


@pytest.fixture
def tiny_ckpt(tmp_path):
    state = random_state(TINY_BAM, lambda n: torch.bfloat16 if "_experts." in n else torch.float32)
    return save_checkpoint(state, TINY_BAM, tmp_path / "mix.safetensors",
                           metadata={"bam_provenance": json.dumps(PROVENANCE)})


class HeaderOnly(WrappedReader):
    """Fails the test if tensor data is read."""

    def get(self, n):
        raise AssertionError(f"tensor data of {n} was read")


def test_audit_checkpoint_from_header(tiny_ckpt):
    from bam_surgery.converters import open_checkpoint

    reader = HeaderOnly(open_checkpoint(str(tiny_ckpt)))
    for conv in ("exact", "paper"):
        from_file, from_cfg = audit_checkpoint(reader, conv), audit(TINY_BAM, conv)
        assert from_file.mismatches == []
        assert (from_file.total, from_file.active) == (from_cfg.total, from_cfg.active)
        assert from_file.groups == from_cfg.groups
    ins = inspect_checkpoint(reader)
    assert ins.groups["ffn_experts"].dtypes == ("bfloat16",) and ins.groups["norms"].dtypes == ("float32",)
    assert ins.groups["ffn_experts"].bytes == 2 * ins.groups["ffn_experts"].params
    assert ins.groups["attention"].bytes == 4 * ins.groups["attention"].params  # shared K, V in float32
    assert ins.provenance.recipe == "bam-shared-kv" and ins.provenance.tool_version == "bam-surgery 0.1.0"


@pytest.fixture
def broken_ckpt(tmp_path):
    state = random_state(TINY_BAM)
    del state["layers.1.ffn_router.weight"]
    state["layers.0.attn_experts.q.weight"] = torch.zeros(3, 64, 64)  # 3 experts where the config says 4
    state["layers.0.extra.weight"] = torch.zeros(2)
    return save_checkpoint(state, TINY_BAM, tmp_path / "broken.safetensors")


def test_audit_checkpoint_reports_mismatches(broken_ckpt):
    from bam_surgery.converters import open_checkpoint

    a = audit_checkpoint(open_checkpoint(str(broken_ckpt)))
    assert {(m.kind, m.name) for m in a.mismatches} == {
        ("missing", "layers.1.ffn_router.weight"), ("shape", "layers.0.attn_experts.q.weight"),
        ("unexpected", "layers.0.extra.weight")}
    assert "has shape [3, 64, 64], config expects [4, 64, 64]" in " ".join(m.message() for m in a.mismatches)


# ---- CLI -------------------------------------------------------------------------------------------------
def invoke(cmd, args):
    """Run a command through the CLI group (its error contract: one line, exit status 2)."""
    from bam_surgery.cli.commands import cli
    return CliRunner().invoke(cli, [cmd.name, *[str(a) for a in args]])


def test_count_params_table_and_json(tiny_ckpt):
    exact = audit(TINY_BAM)
    res = invoke(count_params_cmd, [tiny_ckpt])
    assert res.exit_code == 0, res.output
    total_line = next(line for line in res.output.splitlines() if line.startswith("total "))
    assert total_line.split()[-2:] == [f"{exact.total:,}", f"{exact.active:,}"]
    ffn_line = next(line for line in res.output.splitlines() if line.startswith("ffn_experts "))
    assert ffn_line.split()[1:] == ["6", f"{4 * 3 * 64 * 128 * 2:,}", f"{3 * 64 * 128 * 2:,}"]

    res = invoke(count_params_cmd, [tiny_ckpt, "--convention", "paper", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    paper = audit(TINY_BAM, "paper")
    assert (out["total"], out["active"]) == (paper.total, paper.active)
    assert out["active"] == exact.active - 2 * 4 * 64 - 2 * 2 * 64 * 64  # attention routers, shared K/V
    assert {a["key"] for a in out["adjustments"]} == {"attention_router_not_active", "shared_kv_not_active"}
    assert out["groups"]["attention"] == {"tensors": 4, "total": 2 * 2 * 64 * 64, "active": 0}

    res = invoke(count_params_cmd, [tiny_ckpt, "--ffn-top-k", "2", "--attention-routing", "top1", "--json"])
    assert json.loads(res.output)["groups"]["ffn_experts"]["active"] == 2 * 2 * 3 * 64 * 128


# count-params from the paper's preset and convention alone: each column's recipe and experts, and the routing the
# column names (BTX top-3's --ffn-top-k 3); the paper's top-1 routing comes with --convention paper
PAPER_COLUMNS = {"dense": [], "bam": ["--recipe", "bam", "--experts", 4],
                 "bam-shared-kv": ["--recipe", "bam-shared-kv", "--experts", 4],
                 "btx-top1": ["--recipe", "btx", "--experts", 4],
                 "btx-top3": ["--recipe", "btx", "--experts", 4, "--ffn-top-k", 3]}


def paper_count(*args) -> dict:
    res = invoke(count_params_cmd, ["--preset", "paper-small", *args, "--convention", "paper", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.parametrize("model", list(PAPER_COLUMNS))
def test_count_params_reproduces_every_table5_figure_from_the_preset_and_convention(model):
    out = paper_count(*PAPER_COLUMNS[model])
    assert (out["active"], out["total"]) == TABLE5[model][-2:]
    assert list(out["table5"].items()) == list(zip(TABLE5_LABELS, TABLE5[model]))


def test_count_params_prints_table5_under_its_heading():
    """The issue's command, as a user types it: 662,731,776 active under "as in the paper's Table 5"."""
    res = invoke(count_params_cmd, ["--preset", "paper-small", "--recipe", "bam", "--experts", 4, "--convention", "paper"])
    section = res.output.split("as in the paper's Table 5 (per-block rows: one transformer block, active)\n", 1)
    assert len(section) == 2, res.output
    assert "Active Params      662,731,776" in section[1] and "Total Params       776,002,560" in section[1]
    assert res.output.splitlines()[0].endswith("4 experts, the paper's top-1 FFN routing and softmax gates")


@pytest.mark.parametrize("experts,total,active", [(4, 700_480_512, 587_234_304), (5, 738_235_392, 587_240_448),
                                                  (6, 775_990_272, 587_246_592), (7, 813_745_152, 587_252_736),
                                                  (8, 851_500_032, 587_258_880)])
def test_count_params_reproduces_every_table6_figure(experts, total, active):
    """Table 6: BTX with 4 to 8 experts (the extra ones copies of the seed's FFN; --experts counts them), totals
    700M to 851M and 587M active; docs/param-counting.md has the exact figures."""
    out = paper_count("--recipe", "btx", "--experts", experts)
    assert (out["total"], out["active"]) == (total, active)
    assert {700: 4, 738: 5, 776: 6, 813: 7, 851: 8}[next(m for m in (700, 738, 776, 813, 851)
                                                         if m in shown_millions(total))] == experts
    assert 587 in shown_millions(active)
    bam = paper_count(*PAPER_COLUMNS["bam"])  # Table 6's first row: BAM, 776M / 663M
    assert 776 in shown_millions(bam["total"]) and 663 in shown_millions(bam["active"])


def test_count_params_reproduces_table7():
    """Table 7: BTX top-3 of 6 experts, 776M / 662M, beside BAM's 776M / 662M."""
    out = paper_count("--recipe", "btx", "--experts", 6, "--ffn-top-k", 3)
    assert (out["total"], out["active"]) == (775_990_272, 662_744_064)
    assert 776 in shown_millions(out["total"]) and 662 in shown_millions(out["active"])


def test_count_params_labels_any_other_routing():
    """Another routing than the paper's is counted, and said, in the Table 5 heading; exact counts the recipe's
    own routing (top-2), as a merge with the same flags writes it."""
    base = ["--preset", "paper-small", "--recipe", "bam", "--experts", 4]
    res = invoke(count_params_cmd, [*base, "--convention", "paper", "--ffn-top-k", 2])
    assert ("as in the paper's Table 5, routed top-2 of 4 FFN experts (not the paper's: 1 FFN expert per token, "
            "every attention expert)") in res.output
    assert "Active Params      700,480,512" in res.output
    assert res.output.splitlines()[0].endswith("4 experts, the paper's softmax gates")  # what it took, said
    res = invoke(count_params_cmd, [*base, "--convention", "paper", "--attention-routing", "top2", "--json"])
    assert json.loads(res.output)["config"]["attn_top_k"] == 2
    res = invoke(count_params_cmd, ["--preset", "paper-small", *PAPER_COLUMNS["btx-top3"], "--convention", "paper"])
    assert "routed top-3 of 4 FFN experts, as the paper's BTX top-3 column" in res.output
    exact = json.loads(invoke(count_params_cmd, [*base, "--json"]).output)
    assert exact["config"]["ffn_top_k"] == 2 and exact["config"]["gate_norm"] == "topk_softmax"


def test_count_params_takes_the_merge_options():
    """count-params reads the merge's own flags (MergeOptions' `counts` fields): the same mixture as a merge."""
    out = paper_count("--recipe", "btx", "--experts", 4, "--extra-ffn-experts", 2)
    assert out["total"] == 775_990_272  # 6 FFN experts, as Table 6's BTX 6 experts
    out = json.loads(invoke(count_params_cmd, ["--preset", "tiny", "--recipe", "bam", "--experts", 3, "--router", "mlp",
                                               "--router-hidden", 16, "--json"]).output)
    assert out["config"]["router"] == "mlp" and out["config"]["router_hidden"] == 16
    res = invoke(count_params_cmd, ["--preset", "paper-small", "--recipe", "upcycle", "--experts", 4, "--json"])
    assert json.loads(res.output)["total"] == TABLE5["btx-top1"][-1]  # same shapes as BTX
    res = invoke(count_params_cmd, ["--preset", "tiny", "--recipe", "upcycle", "--experts", 4,
                                    "--extra-ffn-experts", 2])
    assert res.exit_code == 2 and "--extra-ffn-experts: recipe upcycle counts its copies" in res.stderr
    res = invoke(count_params_cmd, ["--preset", "tiny", "--router", "mlp"])
    assert res.exit_code == 2 and "--router needs --recipe" in res.stderr


@pytest.mark.parametrize("args,message", [
    ([], "give a checkpoint CKPT or --preset"),
    (["--preset", "tiny", "--experts", 4], "--experts needs --recipe"),
    (["--preset", "tiny", "--recipe", "bam"], "--recipe needs --experts"),
    (["--preset", "tiny", "--ffn-top-k", 2], "--ffn-top-k: this model has no FFN experts"),
    (["--preset", "tiny", "--recipe", "btx", "--experts", 4, "--attention-routing", "top2"], "no attention experts"),
    (["--preset", "tiny", "--recipe", "bam", "--experts", 4, "--attention-routing", "hard"], "--attention-routing"),
    (["--preset", "tiny", "--recipe", "nope", "--experts", 4], "no such recipe"),
    (["missing.safetensors"], "missing.safetensors: no such file"),
])
def test_count_params_errors(args, message):
    res = invoke(count_params_cmd, args)
    assert res.exit_code == 2 and message in res.stderr
    assert res.stderr.startswith("bam-surgery: error: ") and res.stderr.count("\n") == 1, res.stderr


def test_count_params_lists_presets_in_natural_order():
    order = "paper-large|paper-small|some-64|some-128|some-256|some-512|tiny"
    assert f"--preset [{order}]" in invoke(count_params_cmd, ["--help"]).stdout
    res = invoke(count_params_cmd, ["--preset", "some-32"])
    assert res.exit_code == 2 and "'some-32' is not one of " + ", ".join(f"'{p}'" for p in order.split("|")) in res.stderr


def test_count_params_refuses_mismatched_checkpoint(broken_ckpt):
    res = invoke(count_params_cmd, [broken_ckpt])
    assert res.exit_code == 2
    error = res.stderr.splitlines()
    assert len(error) == 1 and error[0].startswith("bam-surgery: error: ")
    assert str(broken_ckpt) in error[0] and "(and 2 more" in error[0]


def test_inspect_table_and_json(tiny_ckpt):
    res = invoke(inspect_cmd, [tiny_ckpt])
    assert res.exit_code == 0, res.output
    text = res.output
    assert "4 attention experts, soft routing, shared K/V" in text
    assert "ab" * 32 in text and "code.safetensors" in text and "bam-surgery 0.1.0" in text
    tensors_section = text.split("\ntensors\n")[1]
    line = next(x for x in tensors_section.splitlines() if x.strip().startswith("ffn_experts "))
    assert line.split()[1:] == ["6", "196,608", "49,152", "393,216", "bfloat16"]
    assert "ok: every tensor name and shape matches" in text
    config = {ln.split()[0]: ln.split()[1:] for ln in text.split("\nconfig\n")[1].split("\n\n")[0].splitlines()[2:]}
    for field in ("rope_theta", "norm_eps", "qkv_bias", "o_bias", "max_positions", "qk_norm", "scaled_rope", "lb_coef"):
        shown = " ".join(config[field])
        value = getattr(TINY_BAM, field)
        assert shown == ("-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)), field

    res = invoke(inspect_cmd, [tiny_ckpt, "--json"])
    out = json.loads(res.output)
    assert out["config"] == TINY_BAM.to_dict()
    assert out["provenance"] == PROVENANCE
    assert out["params"] == audit(TINY_BAM).total and out["mismatches"] == []
    expert_params = sum(math.prod(s) for n, s in tensor_shapes(TINY_BAM).items() if "_experts." in n)
    assert out["bytes"] == 2 * expert_params + 4 * (out["params"] - expert_params)  # bf16 experts, f32 rest
    assert out["groups"]["embeddings"] == {"tensors": 2, "params": 2 * 256 * 64, "active": 2 * 256 * 64,
                                           "bytes": 4 * 2 * 256 * 64, "dtypes": ["float32"]}


def test_inspect_shows_a_familys_own_numbers_where_they_are_not_the_default():
    """Granite's multipliers and attention scale, Ministral 3's attention temperature: in the table where the model
    has them, absent where it has not."""
    plain = TINY_BAM.replace(attn_experts=0, kv_mode="expert", attn_top_k=None)
    granite = plain.replace(embedding_multiplier=12.0, residual_multiplier=0.22, attn_scale=0.0625)
    shown = key_config(granite)
    assert (shown["embedding_multiplier"], shown["residual_multiplier"], shown["attn_scale"]) == (12.0, 0.22, 0.0625)
    assert "attn_temperature" not in shown and "embedding_multiplier" not in key_config(plain)
    tempered = key_config(plain.replace(attn_temperature=0.1, attn_temperature_length=512))
    assert (tempered["attn_temperature"], tempered["attn_temperature_length"]) == (0.1, 512)


def test_inspect_sharded_directory_without_provenance(tmp_path):
    cfg = preset("tiny")
    path = save_checkpoint(random_state(cfg), cfg, tmp_path / "dense", max_shard_bytes=100_000)
    res = invoke(inspect_cmd, [path, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["files"]) > 1 and out["provenance"] is None and out["kind"] == "dense"
    assert out["params"] == audit(cfg).total
    assert "none (no 'bam_provenance'" in invoke(inspect_cmd, [path]).output


def test_inspect_lists_mismatches_and_fails(broken_ckpt):
    res = invoke(inspect_cmd, [broken_ckpt])
    assert res.exit_code == 1
    assert "3 mismatches" in res.output and "tensor layers.1.ffn_router.weight is missing" in res.output


def test_docs_large_table_matches_the_code():
    """docs/param-counting.md states paper-large figures computed by this code; keep them true."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "param-counting.md").read_text()
    section = doc.split("## paper-large")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): [int(c.strip().replace(",", "")) for c in line.split("|")[2:5]]
            for line in section.splitlines() if line.startswith("| ") and line[2].isalpha() and "model" not in line}
    cols = columns(LARGE)
    names = {"dense": "dense", "BAM (KV experts)": "bam", "BAM (KV sharing)": "bam-shared-kv",
             "BTX top-1": "btx-top1", "BTX top-3": "btx-top3"}
    assert set(rows) == set(names)
    for label, model in names.items():
        exact, paper = audit(cols[model]), audit(cols[model], "paper")
        assert rows[label] == [exact.total, exact.active, paper.active], label


def test_count_params_of_a_hugging_face_directory_matches_transformers(tmp_path):
    """An independent reference: transformers' own parameter count of the same checkpoint."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_cfg)
    model.save_pretrained(tmp_path / "llama")
    res = invoke(count_params_cmd, [tmp_path / "llama", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["total"] == out["active"] == sum(p.numel() for p in model.parameters())
    assert out["groups"]["attention"]["total"] == 2 * (2 * 32 * 32 + 2 * 16 * 32)  # q, o [32,32]; k, v [16,32]


def test_count_params_recipe_from_a_dense_checkpoint(tmp_path, tiny_ckpt):
    cfg = preset("tiny")
    dense = save_checkpoint(random_state(cfg), cfg, tmp_path / "seed.safetensors")
    res = invoke(count_params_cmd, [dense, "--recipe", "bam", "--experts", 3, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["total"] == audit(cfg.replace(ffn_experts=3, attn_experts=3)).total
    res = invoke(count_params_cmd, [tiny_ckpt, "--recipe", "bam", "--experts", 3])
    assert res.exit_code == 2 and "already a mixture" in res.output
    res = invoke(count_params_cmd, [dense, "--preset", "tiny"])
    assert res.exit_code == 2 and "not both" in res.output


def test_qk_and_post_norms_count_as_norms():
    """QK-norms (per expert too) and post-norms are in the norms group; the paper's Table 5 rows count them with the
    block's layernorms, and a model without them counts as before."""
    from bam_surgery.runtime.config import ModelConfig
    from bam_surgery.surgery.audit import audit

    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    qwen3 = ModelConfig(**base, qk_norm="head", head_dim=16)
    olmo2 = ModelConfig(**base, qk_norm="full", norm_position="post")
    bam = qwen3.replace(attn_experts=3, ffn_experts=3)
    norms = {name: audit(cfg).groups["norms"].total for name, cfg in
             (("qwen3", qwen3), ("olmo2", olmo2), ("bam", bam))}
    # per layer: 2 pre-norms of D, q and k norms of Dh (+ final norm D)
    assert norms["qwen3"] == 2 * (2 * 32 + 2 * 16) + 32
    # per layer: 2 post-norms of D, q norm of H*Dh = 32, k norm of G*Dh = 16
    assert norms["olmo2"] == 2 * (2 * 32 + 32 + 16) + 32
    # every attention expert has its own q and k norms
    assert norms["bam"] == 2 * (2 * 32 + 3 * (16 + 16)) + 32
