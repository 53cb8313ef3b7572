"""Learning-rate schedule, weight-decay groups and trainable patterns (bam_surgery.train.optim),
and the TrainConfig knobs (YAML, validation, docs)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from bam_surgery.runtime import Model, preset
from bam_surgery.train.config import TrainConfig
from bam_surgery.train.errors import TrainError
from bam_surgery.train.optim import apply_trainable, build_optimizer, lr_at

ROOT = Path(__file__).resolve().parents[2]


def test_paper_schedule_at_chosen_steps():
    """Appendix B.2: warm-up from 0 to 1.2e-4 over 1500 steps, then cosine to a tenth of the peak."""
    cfg = TrainConfig(steps=11500)
    assert (cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, cfg.weight_decay) == (1.2e-4, 1500, 0.1, 0.1)
    assert lr_at(1, cfg) == pytest.approx(1.2e-4 / 1500)
    assert lr_at(750, cfg) == pytest.approx(0.6e-4)
    assert lr_at(1500, cfg) == pytest.approx(1.2e-4)
    assert lr_at(6500, cfg) == pytest.approx(1.2e-5 + (1.2e-4 - 1.2e-5) * 0.5)  # half-way down the cosine
    assert lr_at(1500 + 2500, cfg) == pytest.approx(1.2e-5 + 1.08e-4 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(11500, cfg) == pytest.approx(1.2e-5)
    values = [lr_at(n, cfg) for n in range(1, 11501)]
    assert all(a < b for a, b in zip(values[:1499], values[1:1500]))  # rising
    assert all(a >= b for a, b in zip(values[1499:], values[1500:]))  # then falling


def test_constant_and_no_warmup():
    cfg = TrainConfig(steps=10, warmup_steps=0, schedule="constant", lr=1e-3)
    assert [lr_at(n, cfg) for n in (1, 5, 10)] == [1e-3] * 3
    cfg = TrainConfig(steps=10, warmup_steps=0, lr=1e-3, min_lr_ratio=0.0)
    assert lr_at(1, cfg) == pytest.approx(1e-3 * (1 + math.cos(math.pi / 10)) / 2)
    assert lr_at(10, cfg) == pytest.approx(0.0)


def _groups(model, cfg):
    opt, names = build_optimizer(model, cfg)
    by_name = dict(zip(names, [g["weight_decay"] for g in opt.param_groups for _ in g["params"]]))
    return by_name


def test_weight_decay_skips_norms_biases_and_embeddings():
    model = Model(preset("tiny", ffn_experts=2, attn_experts=2, norm_bias=True, qkv_bias=True))
    wd = _groups(model, TrainConfig())
    assert wd["layers.0.ffn_experts.up.weight"] == wd["layers.0.ffn_router.weight"] == wd["lm_head.weight"] == 0.1
    assert wd["embed.weight"] == wd["layers.0.attn_norm.weight"] == wd["layers.0.attn_norm.bias"] == 0.0
    assert wd["layers.0.attn_experts.q.bias"] == wd["final_norm.weight"] == 0.0
    wd = _groups(model, TrainConfig(decay_embeddings=True, decay_norms_and_biases=True))
    assert set(wd.values()) == {0.1}
    tied = Model(preset("tiny", tie_embeddings=True))
    assert _groups(tied, TrainConfig())["embed.weight"] == 0.0


def test_trainable_patterns():
    model = Model(preset("tiny", ffn_experts=2, attn_experts=2))
    routers = apply_trainable(model, ["routers"])
    assert routers == ["layers.0.attn_router.weight", "layers.0.ffn_router.weight", "layers.1.attn_router.weight",
                       "layers.1.ffn_router.weight"]
    assert sum(p.requires_grad for p in model.parameters()) == 4
    rest = apply_trainable(model, ["*", "!ffn_experts"])
    assert not any(".ffn_experts." in n for n in rest) and "embed.weight" in rest
    assert apply_trainable(model, ["layers.1.*.weight", "!norms"])[0] == "layers.1.attn_router.weight"
    with pytest.raises(TrainError, match="pattern 'experts' matches no parameter"):
        apply_trainable(model, ["experts"])
    with pytest.raises(TrainError, match="leaves no parameter to train"):
        apply_trainable(model, ["routers", "!routers"])


def test_a_preset_trains_with_its_own_patterns_unless_told_otherwise():
    """train --preset some-64 freezes its experts as the preset says (count-params counts the same), unless
    --trainable is given; presets without patterns train every parameter."""
    from bam_surgery.runtime.config import preset_trainable

    base = {"data": "x=y", "out": "x"}
    assert preset_trainable("some-64") != ["*"]
    assert TrainConfig.from_dict({**base, "preset": "some-64"}).trainable == preset_trainable("some-64")
    assert TrainConfig.from_dict({**base, "preset": "some-64", "trainable": "*"}).trainable == ["*"]
    assert TrainConfig.from_dict({**base, "preset": "tiny"}).trainable == ["*"]
    assert TrainConfig.from_dict({**base, "init": "mix.safetensors"}).trainable == ["*"]
    with pytest.raises(TrainError, match="preset: expected str"):  # a YAML list is refused, not hashed
        TrainConfig.from_dict({**base, "preset": ["some-64"]})


def test_yaml_config_and_errors(tmp_path):
    (tmp_path / "t.yaml").write_text("steps: 50\nlr: 3e-4\ntrainable: routers, norms\nwarmup_steps: 5\n")
    cfg = TrainConfig.from_yaml(tmp_path / "t.yaml", overrides={"steps": 60})
    assert (cfg.steps, cfg.lr, cfg.trainable, cfg.warmup_steps) == (60, 3e-4, ["routers", "norms"], 5)
    assert TrainConfig.from_dict(yaml_roundtrip(cfg)) == cfg
    (tmp_path / "bad.yaml").write_text("stepz: 5\n")
    with pytest.raises(TrainError, match=r"bad.yaml: stepz: unknown training knob \(did you mean steps\?\)"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("steps: many\n")
    with pytest.raises(TrainError, match=r"bad.yaml: steps: expected int, got 'many'"):
        TrainConfig.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(TrainError, match="schedule: 'linear' is not one of cosine, constant"):
        TrainConfig(schedule="linear")
    with pytest.raises(TrainError, match="give exactly one of --init CKPT, --preset NAME, --model-config FILE"):
        TrainConfig(data="x", out="y").validate()
    with pytest.raises(TrainError, match="min_lr_ratio: must be in"):
        TrainConfig(preset="tiny", data="x", out="y", min_lr_ratio=2.0).validate()


def yaml_roundtrip(cfg: TrainConfig) -> dict:
    import yaml
    return yaml.safe_load(cfg.to_yaml())


def test_every_knob_is_documented():
    doc = (ROOT / "docs" / "training.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f"`{f.name}`" not in doc]
    assert not missing, f"docs/training.md does not document {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("kind, bf16", [(dict(), False), (dict(ffn_experts=3, attn_experts=2, ffn_top_k=1), True)])
def test_compile_blocks_compiles_one_graph_for_every_layer(kind, bf16):
    """compile_blocks (train --compile): one dynamo graph serves every block (the trunk hands each block an empty
    routing record and names its routers itself), and the compiled step gives eager's loss and gradients (aot_eager:
    fp32 to 1e-5; bf16 autocast, where the MoE's grouped matmul traces, to 1% in relative L2: the traced graph
    rounds some intermediates differently)."""
    import torch
    from torch._dynamo.utils import counters

    from bam_surgery.train.optim import compile_blocks

    cfg = preset("tiny", d_model=32, n_layers=3, n_heads=4, ffn_hidden=48, max_positions=16, **kind)
    model = Model(cfg).train()
    model.reset_parameters(seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    results = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_blocks(model, backend="aot_eager")
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    (eager, eager_grads), (comp, comp_grads) = results
    assert abs(eager.loss.item() - comp.loss.item()) < (1e-3 if bf16 else 1e-5) and list(eager.routing) == list(comp.routing)
    for name, g in eager_grads.items():
        if bf16:
            assert (comp_grads[name] - g).norm() <= 1e-2 * g.norm() + 1e-6, name
        else:
            assert (comp_grads[name] - g).abs().max() < 1e-5, name
    torch._dynamo.reset()
