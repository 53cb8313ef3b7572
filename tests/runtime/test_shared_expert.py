"""The shared FFN expert (ffn_shared_hidden > 0; recipe btx-shared-expert): the runtime against the independent
float64 reference, its implementations and KV cache against each other, the identities a merge must keep, and the
parameter and FLOP counts."""
from __future__ import annotations

import pytest
import torch

from conftest import (build_model, dense_family, max_diff, merge_family, random_state, reference_forward,
                      tiny_config, tokens_for)
from bam_surgery.runtime import load_model, save_checkpoint
from bam_surgery.runtime.blocks import ForcedRouting
from bam_surgery.runtime.config import ConfigError
from bam_surgery.surgery.audit import audit
from bam_surgery.train.metrics import active_matmul_params

LLAMA = dict(block="sequential", norm="rmsnorm", activation="swiglu")


def shared_config(**overrides):
    return tiny_config(**{**LLAMA, "ffn_experts": 3, "ffn_top_k": 1, "ffn_shared_hidden": 40, **overrides})


@pytest.mark.parametrize("gate_norm,top_k", [("softmax", 1), ("topk_softmax", 2), ("softmax", 3)])
@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_runtime_matches_the_float64_reference(gate_norm, top_k, block):
    cfg = shared_config(gate_norm=gate_norm, ffn_top_k=top_k, block=block, norm="layernorm" if block == "parallel"
                        else "rmsnorm")
    state = random_state(cfg, seed=3)
    x = tokens_for(cfg)
    ref, _ = reference_forward(cfg, state, x)
    model = build_model(cfg, state)
    for impl in ("reference", "fused", "export"):
        model.impl = impl
        with torch.no_grad():
            assert max_diff(model(x).logits, ref) <= 1e-4, impl


def test_the_kv_cache_decodes_what_the_full_forward_computes():
    cfg = shared_config(ffn_top_k=2, gate_norm="topk_softmax")
    model = build_model(cfg, random_state(cfg, seed=5))
    x = tokens_for(cfg, batch=2, length=12)
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2, 16)
        parts = [model(x[:, :5], input_pos=torch.arange(5), cache=cache).logits]
        parts += [model(x[:, t:t + 1], input_pos=torch.tensor([t]), cache=cache).logits for t in range(5, 12)]
    assert max_diff(torch.cat(parts, 1), full) <= 1e-5


def test_forced_gates_turn_the_shared_expert_off_and_on():
    cfg = shared_config()
    state = random_state(cfg, seed=2)
    model = build_model(cfg, state)
    x = tokens_for(cfg)
    no_shared = {k: v for k, v in state.items() if "ffn_shared" not in k}
    plain = build_model(cfg.replace(ffn_shared_hidden=0), no_shared)
    with torch.no_grad():
        # gate 0: the routed experts alone (the same model without a shared expert)
        assert max_diff(model(x, routing=ForcedRouting(shared_gate=0.0)).logits, plain(x).logits) == 0
        # the learned gate is not 0 and not 1
        assert max_diff(model(x).logits, plain(x).logits) > 1e-3
        assert max_diff(model(x, routing=ForcedRouting(shared_gate=1.0)).logits, model(x).logits) > 1e-3


def test_config_rules():
    with pytest.raises(ConfigError, match="ffn_shared_hidden: a shared FFN expert sits beside routed FFN experts"):
        tiny_config(ffn_shared_hidden=16)
    with pytest.raises(ConfigError, match="ffn_shared_hidden: must be an integer from 0"):
        shared_config(ffn_shared_hidden=-1)
    cfg = shared_config()
    assert cfg.to_dict()["ffn_shared_hidden"] == 40 and "ffn_shared_hidden" not in shared_config(
        ffn_shared_hidden=0).to_dict()  # configs without one serialize as before
    assert cfg.dense().ffn_shared_hidden == 0


def test_counts():
    cfg = shared_config(ffn_top_k=1)
    a = audit(cfg)
    D, F, Fs, L = cfg.d_model, cfg.ffn_hidden, cfg.ffn_shared_hidden, cfg.n_layers
    assert a.groups["ffn"].total == a.groups["ffn"].active == L * 3 * D * Fs  # always on
    assert a.groups["ffn_experts"].active == L * 3 * D * F  # top-1 of 3
    assert a.groups["routers"].total == L * (3 * D + D)  # the routers and the shared expert's gate
    plain = shared_config(ffn_shared_hidden=0)
    assert active_matmul_params(cfg) - active_matmul_params(plain) == L * (3 * D * Fs + D)


def test_merge_identities(tmp_path):
    """btx-shared-expert from specialists that differ from the seed only in their FFNs: with the shared gate forced
    to 0 and the routing forced to expert i, the mixture is specialist i; with every routed gate 0 and the shared
    gate 1, it is the seed."""
    cfg = tiny_config(**LLAMA)
    family = dense_family(cfg, 3, seed=4, share_attention=True)
    paths = [save_checkpoint(s, cfg, tmp_path / f"m{i}.safetensors") for i, s in enumerate(family)]
    merge_family(paths, tmp_path / "mix.safetensors", "--recipe", "btx-shared-expert")
    mix = load_model(tmp_path / "mix.safetensors").eval()
    assert (mix.config.ffn_experts, mix.config.ffn_shared_hidden) == (2, cfg.ffn_hidden)
    x = tokens_for(cfg)
    with torch.no_grad():
        for i in (0, 1):
            dense = build_model(cfg, family[i + 1])
            got = mix(x, routing=ForcedRouting(ffn_gates=torch.eye(2)[i], shared_gate=0.0)).logits
            assert max_diff(got, dense(x).logits) <= 1e-5
        seed = build_model(cfg, family[0])
        got = mix(x, routing=ForcedRouting(ffn_gates=torch.zeros(2), shared_gate=1.0)).logits
        assert max_diff(got, seed(x).logits) <= 1e-5
        # as merged: the shared gate's weight is 0, so the shared expert counts 1/2 for every token
        state = mix.state_dict()
        assert all(float(state[f"layers.{i}.ffn_shared_gate.weight"].abs().max()) == 0 for i in range(cfg.n_layers))
        half = mix(x, routing=ForcedRouting(ffn_gates=torch.zeros(2))).logits
        assert max_diff(half, mix(x, routing=ForcedRouting(ffn_gates=torch.zeros(2), shared_gate=0.5)).logits) == 0
