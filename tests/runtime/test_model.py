"""The reference runtime (runtime/model.py) against an independent float64 reference and mixture identities.

Tolerances. The runtime computes in fp32, the reference in fp64. With tiny dims (D 32, 2 layers) and
O(1) activations, fp32 rounding contributes ~1e-6 to logits of magnitude ~1-5, so 1e-5 leaves a
margin of ~10x while any semantic slip (a wrong RoPE pairing, a missing bias, a wrong kv head, a
dropped gate) moves logits by 1e-2 or more. The identity tests compare fp32 with fp32: the expert
outputs are bit-identical to the dense ones, and the only rounding is in the gates (softmax, the
top-k renormalization and the gate-weighted sum, ~1e-7 relative), so 1e-5 is generous there too.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import (T_TINY, build_model, dense_family, max_diff, mixture_state, random_state,
                      reference_forward, ref_attention, ref_ffn, ref_norm, sub, tiny_config, tokens_for)
from bam_surgery.runtime.config import preset
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.model import ForcedRouting, Model, load_balancing_loss, z_loss

TOL = 1e-5

BLOCKS = ("sequential", "parallel", "parallel_two_norms")
POSITIONS = {
    "rope_half": dict(position="rope"),
    "rope_interleaved": dict(position="rope", rope_interleaved=True),
    "rope_partial": dict(position="rope", rotary_fraction=0.5),
    "rope_partial_interleaved": dict(position="rope", rotary_fraction=0.5, rope_interleaved=True),
    "learned": dict(position="learned"),
    "none": dict(position="none"),
}
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh", "relu", "silu")
NORMS = (dict(norm="rmsnorm"), dict(norm="layernorm"), dict(norm="layernorm", norm_bias=True))
KV_HEADS = (4, 2, 1)  # MHA, GQA, MQA (4 query heads)
EXTRAS = (dict(), dict(qkv_bias=True, o_bias=True), dict(ffn_bias=True, tie_embeddings=True),
          dict(lm_head_bias=True, logit_scale=0.5, rope_theta=500.0))


def dense_variant(i: int, block: str, pos: dict) -> dict:
    """Cycle the remaining axes so that every activation, norm kind, kv-head count and bias flag
    meets several block/position combinations."""
    return dict(block=block, **pos, activation=ACTIVATIONS[i % 5], **NORMS[i % 3],
                n_kv_heads=KV_HEADS[(i // 3) % 3], **EXTRAS[i % 4])


DENSE_CASES = [(f"{b}-{p}", dense_variant(i, b, pos))
               for i, (b, (p, pos)) in enumerate((b, pp) for b in BLOCKS for pp in POSITIONS.items())]
# the newer families' features: QK-norm per head (Qwen3) or full width with post-norms (OLMo 2), layers
# without RoPE (SmolLM3); each with GQA and a norm kind of its own
FAMILY_FEATURES = {
    "qk_head": dict(qk_norm="head", n_kv_heads=2, head_dim=16),
    "qk_full_post": dict(qk_norm="full", norm_position="post", n_kv_heads=2),
    "qk_head_layernorm_bias": dict(qk_norm="head", norm="layernorm", norm_bias=True, n_kv_heads=2, n_heads=2),
    "nope_layer": dict(nope_layers=[1], n_kv_heads=2),
    # sliding windows of 3 slots (sequences of 8): every layer (Mistral), or Gemma 3's local layers with their own
    # RoPE base beside sandwich norms, (1 + w) norms, scaled embeddings, GeGLU and query_pre_attn_scalar; Gemma 2's
    # soft-capping
    "window_all": dict(attn_window=3, n_kv_heads=2),
    "gemma3": dict(attn_window=3, attn_window_layers=[0], window_rope_theta=10.0, rope_theta=1000.0,
                   norm_position="sandwich", norm_unit_offset=True, scale_embeddings=True, activation="geglu_tanh",
                   qk_norm="head", head_dim=16, attn_scale_dim=24, n_kv_heads=2),
    "gemma2": dict(attn_window=3, attn_window_layers=[0], norm_position="sandwich", norm_unit_offset=True,
                   scale_embeddings=True, activation="geglu_tanh", attn_softcap=5.0, final_softcap=3.0,
                   n_kv_heads=2),
    # the residual stream's multipliers and an attention scale of its own (Granite) with queries scaled by position
    # (Ministral 3; the scale changes every other position of the 8); a per-head QK-norm with post-norms, RoPE in
    # the sliding layer only (EXAONE 4)
    "granite_ministral3": dict(embedding_multiplier=3.0, residual_multiplier=0.25, attn_scale=0.0625,
                               logit_scale=0.125, attn_temperature=0.5, attn_temperature_length=2, n_kv_heads=2),
    "exaone4": dict(qk_norm="head", norm_position="post", attn_window=3, attn_window_layers=[0], nope_layers=[1],
                    n_kv_heads=2, head_dim=16),
}
DENSE_CASES += [(f"family-{n}", f) for n, f in FAMILY_FEATURES.items()]

MIXTURES = {
    "soft_moa_expert_kv": dict(attn_experts=3),
    "soft_moa_shared_kv": dict(attn_experts=3, kv_mode="shared"),
    "topk_moa": dict(attn_experts=3, attn_top_k=2, gate_norm="topk_softmax"),
    "moe_ffn": dict(ffn_experts=4, ffn_top_k=2),
    "bam": dict(ffn_experts=3, ffn_top_k=1, attn_experts=3, gate_norm="topk_softmax"),
}
MIXTURE_CASES = [(f"{m}-{b}", dict(mix, **dense_variant(3 * j + k, b, list(POSITIONS.values())[(j + k) % 6])))
                 for j, (m, mix) in enumerate(MIXTURES.items()) for k, b in enumerate(BLOCKS)]
# every router kind (runtime/routers.py), on FFN and attention routers, with each block style once
ROUTER_KIND_MIXTURES = {
    "mlp": dict(ffn_experts=3, ffn_top_k=2, attn_experts=3, router="mlp"),
    "attention": dict(ffn_experts=3, ffn_top_k=2, attn_experts=3, attn_top_k=2, router="attention"),
    "expert_embedding": dict(ffn_experts=3, ffn_top_k=1, attn_experts=3, kv_mode="shared",
                             router="expert_embedding", router_temperature=0.5),
    "mixed": dict(ffn_experts=3, ffn_top_k=2, attn_experts=3, router="mlp", attn_router="expert_embedding",
                  router_hidden=16, gate_norm="topk_softmax"),
}
MIXTURE_CASES += [(f"{m}-family-{n}", dict(mix, **f)) for n, f in FAMILY_FEATURES.items()
                  for m, mix in MIXTURES.items() if m in ("soft_moa_shared_kv", "bam")]
MIXTURE_CASES += [(f"router_{m}-{b}", dict(mix, **dense_variant(j, b, list(POSITIONS.values())[j % 6])))
                  for j, ((m, mix), b) in enumerate(zip(ROUTER_KIND_MIXTURES.items(), BLOCKS * 2))]


def test_dense_cases_cover_every_axis():
    variants = [(n, c) for n, c in DENSE_CASES if not n.startswith("family-")]
    seen = {k: {str(c.get(k)) for _, c in variants} for k in ("activation", "norm", "n_kv_heads", "block")}
    assert seen["activation"] == set(ACTIVATIONS)
    assert seen["norm"] == {"rmsnorm", "layernorm"}
    assert seen["n_kv_heads"] == {"4", "2", "1"}
    assert seen["block"] == set(BLOCKS)
    assert any(c.get("norm_bias") for _, c in DENSE_CASES)
    mixed_pos = {(c["block"], c["position"]) for _, c in MIXTURE_CASES if "block" in c}
    assert len(mixed_pos) >= 6


def expert_usage(probs: torch.Tensor, k: int | None) -> torch.Tensor:
    """Which experts received at least one token: [E] bool (soft routing: all)."""
    if k is None:
        return torch.ones(probs.shape[-1], dtype=torch.bool)
    used = torch.zeros(probs.shape[-1], dtype=torch.bool)
    used[probs.topk(k, dim=-1).indices.reshape(-1)] = True
    return used


def check_forward_backward(cfg, seed):
    state = random_state(cfg, seed)
    model = build_model(cfg, state)
    tokens = tokens_for(cfg, seed)
    targets = tokens_for(cfg, seed + 1)
    out = model(tokens, targets=targets)
    ref, _ = reference_forward(cfg, state, tokens)
    assert out.logits.shape == (2, T_TINY, cfg.vocab_size)
    assert max_diff(out.logits, ref) < TOL, max_diff(out.logits, ref)

    out.loss.backward()
    params = dict(model.named_parameters())
    assert set(params) == {"lm_head_bias" if k == "lm_head.bias" else k for k in state}
    for name, p in params.items():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    # Stacked experts: the slice of expert e has a gradient iff some token was routed to it.
    usage = {name: expert_usage(probs, cfg.ffn_top_k if "ffn" in name else cfg.attn_top_k)
             for name, probs in ((n, r.probs) for n, r in out.routing.items())}
    for name, p in params.items():
        if ".ffn_experts." in name or ".attn_experts." in name:
            router = name.split(".ffn_experts.")[0] + ".ffn_router" if ".ffn_experts." in name \
                else name.split(".attn_experts.")[0] + ".attn_router"
            got = p.grad.flatten(1).abs().sum(1) > 0
            assert torch.equal(got, usage[router]), (name, got, usage[router])
    return model, tokens


def check_causal(model, tokens):
    # Not bit-exact on purpose: sparse FFN dispatch batches a different set of tokens per expert when
    # a later token's routing changes, which moves fp32 rounding by an ulp or two (logits up to ~10).
    # A real leak moves earlier logits by far more than 1e-5.
    with torch.no_grad():
        base = model(tokens).logits
        for t in (3, T_TINY - 1):
            changed = tokens.clone()
            changed[:, t] = (changed[:, t] + 1) % model.config.vocab_size
            new = model(changed).logits
            assert max_diff(new[:, :t], base[:, :t]) < 1e-5, f"position {t} leaked into earlier logits"
            assert max_diff(new[:, t:], base[:, t:]) > 1e-4, "changing a token changed nothing (test is void)"


@pytest.mark.parametrize("case", [c for _, c in DENSE_CASES], ids=[n for n, _ in DENSE_CASES])
def test_dense_forward_backward_causal(case):
    model, tokens = check_forward_backward(tiny_config(**case), seed=len(str(case)))
    check_causal(model, tokens)


@pytest.mark.parametrize("case", [c for _, c in MIXTURE_CASES], ids=[n for n, _ in MIXTURE_CASES])
def test_mixture_forward_backward_causal(case):
    model, tokens = check_forward_backward(tiny_config(**case), seed=3 + len(str(case)))
    check_causal(model, tokens)


def test_reference_sees_a_wrong_rope_pairing():
    """Guard for the reference itself: half-split and interleaved RoPE give different logits."""
    cfg = tiny_config()
    state = random_state(cfg, 1)
    tokens = tokens_for(cfg)
    a, _ = reference_forward(cfg, state, tokens)
    b, _ = reference_forward(cfg.replace(rope_interleaved=True), state, tokens)
    assert max_diff(a, b) > 1e-3


# ---- N identical copies of a dense model == the dense model ---------------------------------
IDENTITY_MIXTURES = {
    "soft_moa_expert_kv": dict(attn_experts=3),
    "soft_moa_shared_kv": dict(attn_experts=3, kv_mode="shared"),
    "ffn_top1_topk_softmax": dict(ffn_experts=3, ffn_top_k=1, gate_norm="topk_softmax"),
    "ffn_top2_topk_softmax": dict(ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
    "ffn_topN_softmax": dict(ffn_experts=3, ffn_top_k=3, gate_norm="softmax"),
    "ffn_topN_topk_softmax": dict(ffn_experts=3, ffn_top_k=3, gate_norm="topk_softmax"),
    "attn_top1_topk_softmax": dict(attn_experts=3, attn_top_k=1, gate_norm="topk_softmax"),
    "attn_top2_topk_softmax": dict(attn_experts=3, attn_top_k=2, gate_norm="topk_softmax"),
    "bam_soft_moa_ffn_top2": dict(attn_experts=3, ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"),
}


BLOCK_TRUNK = dict(n_kv_heads=2, qkv_bias=True, ffn_bias=True, norm="layernorm", norm_bias=True)
# (trunk, mixture): every block style with every identity mixture; each newer family's features with the
# attention-expert mixtures (their features live in the attention and the norms)
IDENTITY_CASES = [(f"{b}-{m}", dict(BLOCK_TRUNK, block=b), m) for b in BLOCKS for m in IDENTITY_MIXTURES] + [
    (f"family-{f}-{m}", FAMILY_FEATURES[f], m) for f in FAMILY_FEATURES
    for m in ("soft_moa_expert_kv", "soft_moa_shared_kv", "bam_soft_moa_ffn_top2")]


@pytest.mark.parametrize("trunk, name", [c[1:] for c in IDENTITY_CASES], ids=[c[0] for c in IDENTITY_CASES])
def test_identical_copies_equal_dense(trunk, name):
    dense_cfg = tiny_config(**trunk)
    mix_cfg = dense_cfg.replace(**IDENTITY_MIXTURES[name])
    dense = random_state(dense_cfg, 5)
    tokens = tokens_for(dense_cfg, 5)
    with torch.no_grad():
        want = build_model(dense_cfg, dense)(tokens).logits
        got = build_model(mix_cfg, mixture_state(mix_cfg, [dense] * 3, router_seed=11))(tokens).logits
    assert max_diff(got, want) < TOL


def test_identical_copies_top1_plain_softmax_is_not_dense():
    """Control: with gate_norm="softmax" and k < N the gates sum to < 1, so the identity must fail."""
    dense_cfg = tiny_config()
    mix_cfg = dense_cfg.replace(ffn_experts=3, ffn_top_k=1, gate_norm="softmax")
    dense = random_state(dense_cfg, 5)
    tokens = tokens_for(dense_cfg, 5)
    with torch.no_grad():
        want = build_model(dense_cfg, dense)(tokens).logits
        got = build_model(mix_cfg, mixture_state(mix_cfg, [dense] * 3))(tokens).logits
    assert max_diff(got, want) > 1e-3


# ---- forced routing --------------------------------------------------------------------------
FORCED_MIXTURES = {
    "bam_expert_kv": (dict(attn_experts=3, ffn_experts=3, ffn_top_k=2), dict()),
    "bam_shared_kv": (dict(attn_experts=3, kv_mode="shared", ffn_experts=3, ffn_top_k=1), dict(share_kv=True)),
    "topk_moa_expert_kv": (dict(attn_experts=3, attn_top_k=1, ffn_experts=3, gate_norm="topk_softmax"), dict()),
    "btx_ffn_only": (dict(ffn_experts=3, ffn_top_k=2, gate_norm="topk_softmax"), dict(share_attention=True)),
    **{f"router_{kind}": (dict(mix, n_kv_heads=2), dict(share_kv=mix.get("kv_mode") == "shared"))
       for kind, mix in ROUTER_KIND_MIXTURES.items()},
}


@pytest.mark.parametrize("block", BLOCKS + tuple(f"family-{n}" for n in FAMILY_FEATURES))
@pytest.mark.parametrize("name", list(FORCED_MIXTURES))
def test_forced_expert_reproduces_dense_model(name, block):
    mix, share = FORCED_MIXTURES[name]
    trunk = FAMILY_FEATURES[block[7:]] if block.startswith("family-") else dict(block=block)
    dense_cfg = tiny_config(**{**dict(n_kv_heads=2, qkv_bias=True, o_bias=True), **trunk})
    mix_cfg = dense_cfg.replace(**mix)
    family = dense_family(dense_cfg, 3, seed=21, **share)
    tokens = tokens_for(dense_cfg, 2)
    mixture = build_model(mix_cfg, mixture_state(mix_cfg, family))
    with torch.no_grad():
        dense_logits = [build_model(dense_cfg, s)(tokens).logits for s in family]
        for i in range(3):
            got = mixture(tokens, routing=ForcedRouting(expert=i)).logits
            assert max_diff(got, dense_logits[i]) < TOL, f"expert {i}"
            for j in range(3):  # the dense models really differ, so the check picks out expert i
                if j != i:
                    assert max_diff(got, dense_logits[j]) > 1e-3


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kv_mode", ["expert", "shared"])
def test_forced_gates_equal_hand_mixed_dense_models(block, kv_mode):
    """1-layer mixture with given gates == the mix written out by hand from the 3 dense models."""
    dense_cfg = tiny_config(block=block, n_layers=1, norm="layernorm", norm_bias=True, qkv_bias=True)
    mix_cfg = dense_cfg.replace(attn_experts=3, ffn_experts=3, ffn_top_k=1, kv_mode=kv_mode)
    family = dense_family(dense_cfg, 3, seed=31, share_kv=kv_mode == "shared")
    ga = torch.tensor([0.5, 0.3, 0.2])
    gf = torch.tensor([0.25, 0.0, 1.25])  # a zero gate (expert skipped) and a sum != 1 (no renormalization)
    tokens = tokens_for(dense_cfg, 4)
    with torch.no_grad():
        got = build_model(mix_cfg, mixture_state(mix_cfg, family))(
            tokens, routing=ForcedRouting(ffn_gates=gf, attn_gates=ga)).logits

    s = {k: v.double() for k, v in family[0].items()}  # norms and embeddings (shared by the family)
    attn = [sub({k: v.double() for k, v in d.items()}, "layers.0.attn") for d in family]
    ffn = [sub({k: v.double() for k, v in d.items()}, "layers.0.ffn") for d in family]

    def norm(prefix, h):
        return ref_norm(dense_cfg, h, s[f"{prefix}.weight"], s[f"{prefix}.bias"])

    def A(h):
        return sum(float(ga[j]) * ref_attention(dense_cfg, attn[j], h) for j in range(3))

    def Fn(h):
        return sum(float(gf[j]) * ref_ffn(dense_cfg, ffn[j], h) for j in range(3))

    x = s["embed.weight"][tokens]
    if block == "sequential":  # h = x + A(n1(x)); y = h + F(n2(h))
        h = x + A(norm("layers.0.attn_norm", x))
        y = h + Fn(norm("layers.0.ffn_norm", h))
    elif block == "parallel":  # y = x + A(n(x)) + F(n(x))
        n = norm("layers.0.attn_norm", x)
        y = x + A(n) + Fn(n)
    else:  # y = x + A(n1(x)) + F(n2(x))
        y = x + A(norm("layers.0.attn_norm", x)) + Fn(norm("layers.0.ffn_norm", x))
    want = norm("final_norm", y) @ s["lm_head.weight"].T
    assert max_diff(got, want) < TOL
    # and the mix is not trivially one of the dense models
    with torch.no_grad():
        assert max_diff(got, build_model(dense_cfg, family[2])(tokens).logits) > 1e-3


def test_forced_routing_rejects_bad_input():
    cfg = tiny_config(ffn_experts=3, attn_experts=3)
    model = build_model(cfg, random_state(cfg))
    tokens = tokens_for(cfg)
    with pytest.raises(ValueError, match="expert=3"):
        model(tokens, routing=ForcedRouting(expert=3))
    with pytest.raises(ValueError, match="ffn_gates"):
        model(tokens, routing=ForcedRouting(ffn_gates=torch.ones(2)))


# ---- auxiliary losses -----------------------------------------------------------------------
def lse(row):
    m = max(row)
    return m + math.log(sum(math.exp(v - m) for v in row))


def hand_lb(probs_rows, topk_rows, n):
    """N * sum_i f_i P_i in plain python."""
    assignments = [i for row in topk_rows for i in row]
    f = [assignments.count(i) / len(assignments) for i in range(n)]
    P = [sum(r[i] for r in probs_rows) / len(probs_rows) for i in range(n)]
    return n * sum(fi * pi for fi, pi in zip(f, P))


def test_load_balancing_loss_hand_example():
    probs = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]]
    # top-1: f = (2/4, 1/4, 1/4); P = (0.375, 0.3125, 0.3125); L = 3 * (0.1875 + 0.078125 * 2) = 1.03125
    got = load_balancing_loss(torch.tensor(probs), torch.tensor([[0], [1], [2], [0]]), 3)
    assert got.item() == pytest.approx(1.03125, abs=1e-6)
    # top-2: assignments 0,1 | 1,2 | 2,0 | 0,1 -> f = (3/8, 3/8, 2/8)
    top2 = [[0, 1], [1, 2], [2, 0], [0, 1]]
    want = 3 * (3 / 8 * 0.375 + 3 / 8 * 0.3125 + 2 / 8 * 0.3125)
    assert want == pytest.approx(hand_lb(probs, top2, 3))
    assert load_balancing_loss(torch.tensor(probs), torch.tensor(top2), 3).item() == pytest.approx(want, abs=1e-6)


def test_load_balancing_loss_is_one_when_uniform():
    n = 4
    probs = torch.full((8, n), 1.0 / n)
    topk = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3], [0, 3], [1, 2]])  # each expert 4 times
    assert load_balancing_loss(probs, topk, n).item() == pytest.approx(1.0, abs=1e-6)
    # all load on one expert with a matching P is the worst case, N
    probs_one = torch.zeros(8, n)
    probs_one[:, 0] = 1.0
    assert load_balancing_loss(probs_one, torch.zeros(8, 1, dtype=torch.long), n).item() == pytest.approx(n)


def test_z_loss_hand_example():
    logits = [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]]
    want = sum(lse(r) ** 2 for r in logits) / 3  # lse([0,0,0]) = ln 3
    assert z_loss(torch.tensor(logits)).item() == pytest.approx(want, abs=1e-5)


def capture_router_logits(model):
    """Forward hooks on every router: name -> list of python rows of logits."""
    seen: dict[str, list[list[float]]] = {}

    def hook(name):
        def fn(_mod, _inp, out):
            seen[name] = out.detach().double().reshape(-1, out.shape[-1]).tolist()
        return fn

    for name, mod in model.named_modules():
        if name.endswith(("attn_router", "ffn_router")):
            mod.register_forward_hook(hook(name))
    return seen


@pytest.mark.parametrize("attn_top_k", [None, 2])
def test_model_losses_equal_hand_computation(attn_top_k):
    cfg = tiny_config(ffn_experts=4, ffn_top_k=2, attn_experts=3, attn_top_k=attn_top_k,
                      gate_norm="topk_softmax", lb_coef=0.3, z_coef=0.07)
    model = build_model(cfg, random_state(cfg, 9))
    seen = capture_router_logits(model)
    tokens, targets = tokens_for(cfg, 9), tokens_for(cfg, 10)
    targets[0, 2] = -100  # ignored position
    out = model(tokens, targets=targets)
    assert sorted(seen) == [f"layers.{i}.{r}" for i in range(2) for r in ("attn_router", "ffn_router")]

    lb = z = 0.0
    for name, logits in seen.items():
        probs = [[math.exp(v - lse(r)) for v in r] for r in logits]
        z += sum(lse(r) ** 2 for r in logits) / len(logits)
        k = cfg.ffn_top_k if name.endswith("ffn_router") else attn_top_k
        if k is not None:  # soft attention routers: z-loss only
            topk = [sorted(range(len(p)), key=lambda i: -p[i])[:k] for p in probs]
            lb += hand_lb(probs, topk, len(probs[0]))
    assert out.z_loss.item() == pytest.approx(z, rel=1e-5)
    assert out.lb_loss.item() == pytest.approx(lb, rel=1e-5)
    assert lb > 0 and z > 0

    rows = out.logits.detach().double().reshape(-1, cfg.vocab_size).tolist()
    tgt = targets.reshape(-1).tolist()
    nll = [lse(r) - r[t] for r, t in zip(rows, tgt) if t != -100]
    assert out.nll.item() == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert out.loss.item() == pytest.approx(out.nll.item() + 0.3 * lb + 0.07 * z, rel=1e-5)


def test_soft_attention_routers_give_z_loss_but_no_lb():
    cfg = tiny_config(attn_experts=3)  # soft MoA, dense FFN
    model = build_model(cfg, random_state(cfg, 2))
    tokens = tokens_for(cfg)
    out = model(tokens, targets=tokens)
    assert out.lb_loss.item() == 0.0
    assert out.z_loss.item() > 0
    assert out.loss.item() == pytest.approx(out.nll.item() + cfg.z_coef * out.z_loss.item(), rel=1e-6)
    top = cfg.replace(attn_top_k=1, gate_norm="topk_softmax")
    assert build_model(top, random_state(top, 2))(tokens).lb_loss.item() > 0


def test_zero_routers_give_uniform_probabilities():
    """Router weights 0 -> p = 1/E for every token: P uniform, so L_LB = E * sum_i f_i / E = 1 per
    balancing router whatever top-k picked; L_z = (ln E)^2 per router."""
    cfg = tiny_config(ffn_experts=4, ffn_top_k=2, attn_experts=3)
    state = random_state(cfg, 3)
    for name in state:
        if name.endswith("router.weight"):
            state[name] = torch.zeros_like(state[name])
    out = build_model(cfg, state)(tokens_for(cfg))
    assert out.lb_loss.item() == pytest.approx(2 * 1.0, abs=1e-6)  # two FFN routers; soft attention: none
    assert out.z_loss.item() == pytest.approx(2 * math.log(4) ** 2 + 2 * math.log(3) ** 2, abs=1e-5)
    for p in (r.probs for r in out.routing.values()):
        assert torch.allclose(p, torch.full_like(p, 1.0 / p.shape[-1]))


def test_forced_routing_has_no_router_losses():
    cfg = tiny_config(ffn_experts=3, attn_experts=3)
    model = build_model(cfg, random_state(cfg, 3))
    tokens = tokens_for(cfg)
    out = model(tokens, targets=tokens, routing=ForcedRouting(expert=1))
    assert out.lb_loss.item() == 0.0 and out.z_loss.item() == 0.0
    assert out.loss.item() == pytest.approx(out.nll.item())


# ---- structure ------------------------------------------------------------------------------
STRUCTURE_CASES = [
    dict(), dict(position="learned", norm="layernorm", norm_bias=True), dict(tie_embeddings=True, lm_head_bias=True),
    dict(block="parallel", activation="gelu", qkv_bias=True, o_bias=True, ffn_bias=True),
    dict(attn_experts=3), dict(attn_experts=3, kv_mode="shared", qkv_bias=True, o_bias=True),
    dict(ffn_experts=4, ffn_top_k=2, ffn_bias=True, activation="relu"),
    dict(ffn_experts=2, attn_experts=4, attn_top_k=2, block="parallel_two_norms", n_kv_heads=1),
    *ROUTER_KIND_MIXTURES.values(),
]


@pytest.mark.parametrize("case", STRUCTURE_CASES, ids=[str(i) for i in range(len(STRUCTURE_CASES))])
def test_state_dict_matches_layout(case):
    cfg = tiny_config(**case)
    sd = Model(cfg).state_dict()
    shapes = tensor_shapes(cfg)
    assert list(sd) == list(shapes)  # same names, in file order
    assert {k: tuple(v.shape) for k, v in sd.items()} == shapes
    assert sum(p.numel() for p in Model(cfg).parameters()) == sum(math.prod(s) for s in shapes.values())


def test_learned_positions_refuse_long_sequences():
    cfg = tiny_config(position="learned", max_positions=8)
    model = build_model(cfg, random_state(cfg))
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


def n_params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Model(cfg).parameters())


def test_paper_small_parameter_count():
    # Table 5 (dense 590M): embedding + unembedding 2 * 256000 * 1024; per block attention 4 * 1024^2,
    # FFN (SwiGLU, F 2048) 3 * 2048 * 1024, one layernorm 1024 (no bias); 6 blocks; final norm 1024.
    per_block = 4 * 1024 * 1024 + 3 * 2048 * 1024 + 1024
    hand = 2 * 256000 * 1024 + 6 * per_block + 1024
    assert hand == 587_209_728
    assert n_params(preset("paper-small")) == hand
    # BAM (Table 5): 4 attention experts (expert KV), 4 FFN experts, two [4, 1024] routers per block.
    bam_block = 4 * 4 * 1024 * 1024 + 4 * 3 * 2048 * 1024 + 2 * 4 * 1024 + 1024
    assert n_params(preset("paper-small", ffn_experts=4, attn_experts=4)) == 2 * 256000 * 1024 + 6 * bam_block + 1024 \
        == 776_002_560


def test_paper_large_parameter_count():
    # 2B (Table 4): D 2304, 18 layers, 18 heads of 128, 6 kv heads (GQA), F 9216, tied embeddings.
    D, Dh = 2304, 128
    attention = D * 18 * Dh * 2 + D * 6 * Dh * 2  # q, o [2304, 2304]; k, v [768, 2304]
    per_block = attention + 3 * 9216 * D + D
    hand = 256000 * D + 18 * per_block + D
    assert hand == 1_991_289_600
    assert n_params(preset("paper-large")) == hand


def test_routing_trace_exposes_applied_gates_and_topk_choices():
    """ModelOutput.routing: every router by name, with the gates actually applied and the top-k choices."""
    cfg = tiny_config(ffn_experts=4, ffn_top_k=2, attn_experts=3, attn_top_k=None)
    model = build_model(cfg, random_state(cfg))
    out = model(tokens_for(cfg))
    n_tok = tokens_for(cfg).numel()
    assert list(out.routing) == [f"layers.{i}.{r}" for i in range(cfg.n_layers) for r in ("attn_router", "ffn_router")]
    for name, r in out.routing.items():
        E = 4 if "ffn" in name else 3
        assert r.gates.shape == r.probs.shape == r.logits.shape == (n_tok, E)
        if "ffn" in name:  # top-2 of the full softmax: the gates are p_i on the chosen experts, 0 elsewhere
            assert r.topk.shape == (n_tok, 2)
            assert ((r.gates > 0).sum(-1) == 2).all()
            assert torch.equal(r.gates.gather(-1, r.topk), r.probs.gather(-1, r.topk))
        else:  # soft: every expert, the full softmax
            assert r.topk is None and torch.equal(r.gates, r.probs)
    forced = model(tokens_for(cfg), routing=ForcedRouting(expert=1)).routing
    assert all(r.logits is None and (r.gates.argmax(-1) == 1).all() for r in forced.values())
