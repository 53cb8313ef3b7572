"""The key-store router (SoME): each update rule against numbers computed by hand (docs/routers.md, "key
store"), the forward (cosine logits over a temperature), the rules wired into training once per optimizer
step (buffers in the checkpoint, exact resume), frozen experts, and the SoME presets' parameter counts."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from conftest import train_interrupted_after

from bam_surgery.runtime import Model, load_checkpoint, load_model, preset
from bam_surgery.runtime.key_store import (KeyStoreCollector, attraction, dispersion, inactive_experts, move_keys,
                                           peer_pull, reseed, step_statistics, update_router, usage_ema, worst_served)
from bam_surgery.runtime.layout import buffer_names, tensor_shapes
from bam_surgery.runtime.routers import KeyStoreRouter
from bam_surgery.surgery.audit import audit
from bam_surgery.cli.commands import cli
from bam_surgery.train import TrainConfig, load_run_config, train
from bam_surgery.train.checkpoints import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"

# ---- the hand-sized case: E = 3 experts in D = 2, two tokens, top-2 ---------------------------------------
# keys k0 = (1, 0), k1 = (0, 1), k2 = (-1, 0); token a: q = (0.6, 0.8) selects {0, 1}; token b: q = (0.8, -0.6)
# selects {0, 2}. Best logits (temperature 1): a max(0.6, 0.8, -0.6) = 0.8, b max(0.8, -0.6, -0.8) = 0.8.
KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
TOPK = torch.tensor([[0, 1], [0, 2]])
QUERIES = torch.tensor([[0.6, 0.8], [0.8, -0.6]])
BEST = torch.tensor([0.8, 0.8])


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          atol=tol, rtol=0)


def test_step_statistics_by_hand():
    s = step_statistics(TOPK, QUERIES, BEST, 3, 1)
    assert close(s.counts, [2, 1, 1])
    # s0 = qa + qb = (1.4, 0.2); s1 = qa; s2 = qb
    assert close(s.query_sums, [[1.4, 0.2], [0.6, 0.8], [0.8, -0.6]])
    # pairs (0, 1) from token a, (0, 2) from token b, both orders; nothing on the diagonal
    assert close(s.co_counts, [[0, 1, 1], [1, 0, 0], [1, 0, 0]])
    assert float(s.tokens) == 2
    assert close(s.worst, [[0.8, 0.6, 0.8]])  # a tie: the token seen first
    assert close(step_statistics(TOPK, QUERIES, torch.tensor([0.9, 0.1]), 3, 2).worst,
                 [[0.1, 0.8, -0.6], [0.9, 0.6, 0.8]])  # lowest best logit first


def test_worst_served_merges_by_score_then_order():
    rows = torch.tensor([[0.5, 1.0], [0.2, 2.0], [0.5, 3.0], [0.9, 4.0], [0.2, 5.0]])
    assert worst_served(rows, 3)[:, 1].tolist() == [2.0, 5.0, 1.0]
    assert worst_served(rows, 0).shape == (0, 2)


def test_attraction_by_hand():
    s = step_statistics(TOPK, QUERIES, BEST, 3, 1)
    # A0 = (1.4, 0.2) / 2 - (1, 0) = (-0.3, 0.1); A1 = (0.6, 0.8) - (0, 1); A2 = (0.8, -0.6) - (-1, 0)
    assert close(attraction(KEYS, s.query_sums, s.counts), [[-0.3, 0.1], [0.6, -0.2], [1.8, -0.6]])
    # an expert nobody selected does not move
    assert close(attraction(KEYS, s.query_sums, torch.tensor([2.0, 0.0, 1.0]))[1], [0.0, 0.0])


def test_peer_pull_by_hand():
    co = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # P0 = (k1 + k2) / 2 - k0 = (-0.5, 0.5) - (1, 0); P1 = k0 - k1; P2 = k0 - k2
    assert close(peer_pull(KEYS, co), [[-1.5, 0.5], [1.0, -1.0], [2.0, 0.0]])
    # weights follow the co-selection counts: expert 0 with 1 twice and 2 once -> (2 k1 + k2) / 3 - k0
    co = torch.tensor([[0.0, 2.0, 1.0], [2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert close(peer_pull(KEYS, co)[0], [-1.0 / 3 - 1.0, 2.0 / 3])
    assert close(peer_pull(KEYS, torch.zeros(3, 3)), torch.zeros(3, 2))  # nobody co-selected: nobody pulled


def test_usage_ema_by_hand():
    u = torch.full((3,), 1.0 / 3)
    # shares 2/4, 1/4, 1/4; gamma 0.5: 0.5/3 + 0.5 * share
    assert close(usage_ema(u, torch.tensor([2.0, 1.0, 1.0]), 0.5), [5 / 12, 7 / 24, 7 / 24])
    assert close(usage_ema(u, torch.tensor([4.0, 0.0, 0.0]), 0.9), [0.3 + 0.1, 0.3, 0.3])  # 0.9 / 3 + 0.1 * share
    assert close(usage_ema(u, torch.zeros(3), 0.5), u)  # no routed token: unchanged


def test_inactive_experts_by_hand():
    u = torch.tensor([0.5, 0.3, 0.15, 0.05])  # fair share 1/4
    assert inactive_experts(u, 0.25).tolist() == [False, False, False, True]  # floor(1): expert 3
    assert inactive_experts(u, 0.5).tolist() == [False, False, True, True]  # floor(2): 3, 2 (both < 1/4)
    assert inactive_experts(u, 0.75).tolist() == [False, False, True, True]  # floor(3): 3, 2, 1; 0.3 >= 1/4
    assert inactive_experts(u, 0.2).tolist() == [False] * 4  # floor(0.8) = 0
    assert not inactive_experts(torch.full((64,), 1 / 64), 0.05).any()  # uniform usage: nobody
    # ties: the lower index goes first
    assert inactive_experts(torch.tensor([0.4, 0.2, 0.2, 0.2]), 0.25).tolist() == [False, True, False, False]
    # the SoME setting: 5% of 64 experts is 3
    u = torch.full((64,), 1.0 / 64)
    u[[7, 9, 40, 41]] = torch.tensor([0.001, 0.002, 0.003, 0.004])
    assert inactive_experts(u, 0.05).nonzero().flatten().tolist() == [7, 9, 40]


def test_dispersion_by_hand():
    # kbar = (0, 1/3): S0 = (1, -1/3), S1 = (0, 2/3), S2 = (-1, -1/3)
    assert close(dispersion(KEYS), [[1.0, -1 / 3], [0.0, 2 / 3], [-1.0, -1 / 3]])


def test_reseed_by_hand():
    usage = torch.tensor([0.5, 0.1, 0.3, 0.05, 0.05])  # fair share 0.2
    inactive = torch.tensor([False, True, False, True, True])
    keys = torch.eye(5)[:, :2].clone()  # any keys
    worst = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # two worst-served queries, worst first
    new_keys, new_usage = reseed(keys, usage, inactive, worst)
    # inactive by rising usage: 3 (0.05), 4 (0.05, higher index), 1 (0.1); two queries: 3 and 4 are re-seeded
    assert close(new_keys[3], [0.0, 1.0]) and close(new_keys[4], [1.0, 0.0]) and close(new_keys[1], keys[1])
    assert close(new_usage, [0.5, 0.1, 0.3, 0.2, 0.2])
    assert close(keys, torch.eye(5)[:, :2]) and close(usage, [0.5, 0.1, 0.3, 0.05, 0.05])  # inputs untouched


def test_one_whole_update_by_hand():
    """alpha 0.1, beta 0.05, delta 0.2, gamma 0.5, theta 0.34 (floor(1.02) = 1 inactive of 3): usage
    (5/12, 7/24, 7/24) makes expert 1 inactive (tie with 2: lower index); dispersion from kbar = (0, 1/3):
    k0 + 0.1 A0 + 0.05 P0 + 0.2 S0 = (1 - 0.03 - 0.075 + 0.2, 0.01 + 0.025 - 0.2/3)
    k2 + 0.1 A2 + 0.05 P2 + 0.2 S2 = (-1 + 0.18 + 0.1 - 0.2, -0.06 - 0.2/3)
    each divided by its norm; expert 1 is re-seeded to the worst-served query: token b (best logit 0.1 < 0.9),
    (0.8, -0.6), and its usage to 1/3."""
    router = KeyStoreRouter(SimpleNamespace(d_model=2, router_temperature=1.0), 3)
    router.keys.copy_(KEYS)
    cfg = preset("tiny").replace(key_store_alpha=0.1, key_store_beta=0.05, key_store_delta=0.2,
                                 key_store_theta_percentile=0.34, key_store_ema_decay=0.5)
    stats = step_statistics(TOPK, QUERIES, torch.tensor([0.9, 0.1]), 3, 1)
    inactive = update_router(router, stats, cfg)
    assert inactive.tolist() == [False, True, False]
    assert close(router.usage, [5 / 12, 1 / 3, 7 / 24])
    k0 = (1.0 - 0.03 - 0.075 + 0.2, 0.01 + 0.025 - 0.2 / 3)
    k2 = (-1.0 + 0.18 + 0.1 - 0.2, -0.06 - 0.2 / 3)
    expected = [[k0[0] / math.hypot(*k0), k0[1] / math.hypot(*k0)], [0.8, -0.6],
                [k2[0] / math.hypot(*k2), k2[1] / math.hypot(*k2)]]
    assert close(router.keys, expected)
    # move_keys alone: a row that would vanish keeps its key
    assert close(move_keys(KEYS, 1.0, -KEYS, 0.0, KEYS, 0.0, KEYS), KEYS)
    # delta 0 and nobody inactive: attraction and peer pull alone
    router.keys.copy_(KEYS)
    router.usage.fill_(1 / 3)
    update_router(router, stats, cfg.replace(key_store_delta=0.0, key_store_theta_percentile=0.0))
    k1 = (0.06 + 0.05, 1 - 0.02 - 0.05)  # k1 + 0.1 A1 + 0.05 P1
    assert close(router.keys[1], [k1[0] / math.hypot(*k1), k1[1] / math.hypot(*k1)])


def test_forward_is_cosine_over_temperature():
    router = KeyStoreRouter(SimpleNamespace(d_model=2, router_temperature=0.8), 3)
    router.keys.copy_(KEYS)
    with torch.no_grad():  # a query network that passes x through: W_out W_in = I, no biases
        router.query_in.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]) * 10)
        router.query_in.bias.zero_()
        router.query_out.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
        router.query_out.bias.zero_()
        x = torch.tensor([[3.0, 4.0]])  # gelu(30) = 30, gelu(40) = 40: query (30, 40), unit (0.6, 0.8)
        seen = []
        router.collector = SimpleNamespace(add=lambda logits, q: seen.append(q))
        logits = router.eval()(x)
        assert seen == []  # not training: nothing collected
        router.train()(x)
    assert close(seen[0], [[0.6, 0.8]], 1e-5)
    assert close(logits, [[0.6 / 0.8, 0.8 / 0.8, -0.6 / 0.8]], 1e-5)
    assert {n for n, _ in router.named_parameters()} == {"query_in.weight", "query_in.bias", "query_out.weight",
                                                        "query_out.bias"}
    assert {n for n, _ in router.named_buffers()} == {"keys", "usage"}


SMALL_SOME = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, ffn_hidden=64, max_positions=32,
                  ffn_experts=8, ffn_top_k=2)


def test_keys_take_no_gradient_and_the_state_dict_holds_them():
    cfg = preset("some-64", **SMALL_SOME)
    model = Model(cfg)
    model.reset_parameters(seed=0)
    assert set(model.state_dict()) == set(tensor_shapes(cfg))
    tokens = torch.randint(0, 256, (2, 16))
    out = model(tokens, targets=tokens)
    out.loss.backward()
    r = model.layers[0].ffn_router
    assert r.query_in.weight.grad is not None and not r.keys.requires_grad
    assert buffer_names(cfg) == {f"layers.{i}.ffn_router.{b}" for i in range(2) for b in ("keys", "usage")}
    # the same seed gives the same keys; reset gives unit keys and uniform usage
    other = Model(cfg)
    other.reset_parameters(seed=0)
    assert torch.equal(other.layers[1].ffn_router.keys, model.layers[1].ffn_router.keys)
    assert close(r.keys.norm(dim=-1), torch.ones(8)) and close(r.usage, torch.full((8,), 1 / 8))


def _collected(model, *batches) -> dict[str, KeyStoreCollector]:
    """Run training-mode forwards (no gradient needed) and return each key store's collector."""
    model.train()
    with torch.no_grad():
        for b in batches:
            model(b)
    return {n: r.collector for n, r in model.routers().items()}


def test_statistics_add_over_micro_batches():
    """Two micro-batches' statistics are the statistics of the whole step (what after_step applies)."""
    cfg = preset("some-64", **SMALL_SOME, key_store_theta_percentile=0.25)  # m = 2 of 8
    model = Model(cfg)
    model.reset_parameters(seed=1)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    whole = {n: (c.sums.clone(), c.worst.clone()) for n, c in _collected(model, tokens).items()}
    for c in _collected(model).values():
        c.sums = c.worst = None
    parts = _collected(model, tokens[:2], tokens[2:])
    for name, (sums, worst) in whole.items():
        assert torch.allclose(parts[name].sums, sums, atol=1e-4)
        assert torch.allclose(parts[name].worst, worst, atol=1e-5) and worst.shape == (2, 33)
        assert float(parts[name].statistics().counts.sum()) == 4 * 16 * 2
    # eval-mode forwards collect nothing
    for c in parts.values():
        c.sums = c.worst = None
    with torch.no_grad():
        model.eval()(tokens)
    assert all(c.sums is None for c in parts.values())
    assert model.after_step() is None and all(c.sums is None for c in parts.values())  # nothing routed: no-op


def test_statistics_reduce_across_processes():
    """Two processes with one micro-batch each, reduced through a summing stand-in for all_reduce, hold the
    statistics of the whole step: sums, and the worst-served tokens gathered and merged in rank order."""
    cfg = preset("some-64", **SMALL_SOME, key_store_theta_percentile=0.25)  # m = 2 of 8
    model = Model(cfg)
    model.reset_parameters(seed=1)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    name = "layers.1.ffn_router"

    def take():
        c = model.routers()[name].collector
        out = (c.sums, c.worst)
        c.sums = c.worst = None
        return out

    _collected(model, tokens)
    whole = take()
    ranks = []
    for r in range(2):
        _collected(model, tokens[2 * r:2 * r + 2])
        ranks.append(take())
    sent = []
    for r, (sums, worst) in enumerate(ranks):  # what each rank contributes (all_sum returns its input)
        c = KeyStoreCollector(cfg, 8)
        c.sums, c.worst = sums, worst
        c.reduce(lambda t: sent.append(t.clone()) or t, r, 2)
    total = sent[0] + sent[1]
    for r, (sums, worst) in enumerate(ranks):
        c = KeyStoreCollector(cfg, 8)
        c.sums, c.worst = sums, worst
        c.reduce(lambda t: total, r, 2)
        assert torch.allclose(c.sums, whole[0], atol=1e-4)
        assert c.worst.shape == (2, 33) and torch.allclose(c.worst, whole[1], atol=1e-5)
    # a process that routed nothing joins with zeros
    idle = KeyStoreCollector(cfg, 8)
    idle.reduce(lambda t: t, 1, 2)
    assert float(idle.statistics().tokens) == 0 and idle.worst.shape == (0, 33)


def _train_cfg(tmp_path, out, **kw) -> TrainConfig:
    model_cfg = tmp_path / "some.json"
    model_cfg.write_text(preset("some-64", **SMALL_SOME).to_json())
    base = dict(model_config=str(model_cfg), data=f"code={CORPUS}/code,law={CORPUS}/law", out=str(tmp_path / out),
                steps=5, warmup_steps=1, lr=3e-3, seq_len=32, micro_batch=2, batch_tokens=4 * 32, save_every=2,
                eval_every=-1, token_cache=str(tmp_path / "tokens"), progress=False, plot=False,
                trainable=["*", "!ffn_experts"])
    return TrainConfig(**{**base, **kw})


def test_training_moves_keys_once_per_step_and_resumes_exactly(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    full = train(_train_cfg(tmp_path, "full"))
    init_model = Model(preset("some-64", **SMALL_SOME))
    init_model.reset_parameters(seed=0)  # the run's init (seed 0)
    _, end = load_checkpoint(full.checkpoint)
    keys = end["layers.0.ffn_router.keys"]
    assert not torch.equal(keys, init_model.layers[0].ffn_router.keys)  # the rules moved them
    assert close(keys.norm(dim=-1), torch.ones(8), 1e-5)
    usage = end["layers.0.ffn_router.usage"]
    assert close(usage.sum(), 1.0, 1e-5) and not close(usage, torch.full((8,), 1 / 8))
    # frozen experts: bit-identical to the init
    assert torch.equal(end["layers.1.ffn_experts.up.weight"], init_model.state_dict()["layers.1.ffn_experts.up.weight"])

    train_interrupted_after(monkeypatch, 3, _train_cfg(tmp_path, "cut"))
    assert [p.name for _, p in list_checkpoints(tmp_path / "cut")] == ["step-00000002"]
    resumed = train(load_run_config(tmp_path / "cut"), resume=True)
    _, again = load_checkpoint(resumed.checkpoint)
    assert set(again) == set(end)
    assert all(torch.equal(end[k], again[k]) for k in end)  # keys and usage included, bit for bit


def test_key_store_rules_run_once_per_step(tmp_path, monkeypatch):
    calls = []
    original = KeyStoreCollector.apply

    def counting(self, router):
        calls.append(float(self.statistics().tokens))
        return original(self, router)

    monkeypatch.setattr(KeyStoreCollector, "apply", counting)
    train(_train_cfg(tmp_path, "once", steps=3, save_every=0))
    # 3 steps x 2 routers; each step's statistics cover all of its 4 sequences x 32 tokens (2 micro-batches of 2)
    assert calls == [128.0] * 6


# ---- the SoME presets: counts of the ablation logs -----------------------------------------------------------
SOME_TOTALS = {64: 701_496_320, 128: 1_373_568_000, 256: 2_717_711_360, 512: 5_405_998_080}


@pytest.mark.parametrize("experts", sorted(SOME_TOTALS))
def test_some_presets_count_as_in_the_logs(experts):
    a = audit(preset(f"some-{experts}"), trainable=["*", "!ffn_experts"])
    # per layer: attention 4 (512^2 + 512) = 1,050,624; two layernorms 2,048; query network
    # 512 x 1024 + 1024 + 1024 x 512 + 512 = 1,050,112; embeddings 8192 x 512 twice plus the head's bias 8192;
    # no final norm (docs/param-counting.md)
    trainable = 10 * (1_050_624 + 2_048 + 1_050_112) + 2 * 8192 * 512 + 8192
    assert a.trainable == trainable == 29_424_640
    expert = 512 * 1024 + 1024 + 1024 * 512 + 512  # one non-gated FFN expert, biases: 1,050,112
    assert a.total == trainable + 10 * experts * expert == SOME_TOTALS[experts]
    assert a.buffers.total == 10 * (experts * 512 + experts) and a.buffers.tensors == 20  # keys [E, D] and usage [E] per layer
    logs = {64: "701.50", 128: "1373.57", 256: "2717.71", 512: "5406.00"}
    assert f"{a.total / 1e6:.2f}" == logs[experts] and f"{a.trainable / 1e6:.2f}" == "29.42"
    # with a final layernorm (weight and bias, 1,024) the trainable count would round to 29.43M
    with_norm = audit(preset(f"some-{experts}", final_norm=True), trainable=["*", "!ffn_experts"])
    assert with_norm.trainable - a.trainable == 1024 and f"{with_norm.trainable / 1e6:.2f}" == "29.43"


def test_count_params_shows_trainable_and_buffers():
    res = CliRunner().invoke(cli, ["count-params", "--preset", "some-128"])
    assert res.exit_code == 0, res.output
    assert "total       1,373,568,000 = 1373.57M" in res.output
    assert "trainable   29,424,640 = 29.42M (2.14% of total; --trainable *,!ffn_experts)" in res.output
    assert "buffers     656,640 = 0.66M in 20 tensors" in res.output  # 10 x (128 x 512 + 128)
    res = CliRunner().invoke(cli, ["count-params", "--preset", "some-64", "--trainable", "*", "--json"])
    body = json.loads(res.output)
    assert body["trainable"] == body["total"] == 701_496_320 and body["buffers"] == {"tensors": 20, "total": 10 * 64 * (512 + 1)}
    res = CliRunner().invoke(cli, ["count-params", "--preset", "some-64", "--trainable", "layers.*.nothing"])
    assert res.exit_code == 2 and res.output.startswith("bam-surgery: error: trainable: pattern 'layers.*.nothing'")


def test_bad_key_store_configs_name_their_field():
    from bam_surgery.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="^router: key_store routes FFN experts"):
        preset("tiny", router="key_store")
    with pytest.raises(ConfigError, match="^router_temperature: must be a finite number > 0"):
        preset("some-64", router_temperature=0.0)
    with pytest.raises(ConfigError, match="^key_store_ema_decay: must be in"):
        preset("some-64", key_store_ema_decay=1.0)
    with pytest.raises(ConfigError, match="^key_store_alpha: must be in"):
        preset("some-64", key_store_alpha=-0.1)
    with pytest.raises(ConfigError, match="^attn_router: key_store routes FFN experts only"):
        preset("tiny", ffn_experts=2, attn_experts=2, router="key_store")
    assert preset("tiny", ffn_experts=2, attn_experts=2, router="key_store", attn_router="linear").attn_router_kind \
        == "linear"


def test_a_checkpoint_round_trips_with_its_store(tmp_path):
    from bam_surgery.runtime import save_model

    model = Model(preset("some-64", **SMALL_SOME))
    model.reset_parameters(seed=3)
    model.layers[0].ffn_router.usage.copy_(torch.arange(8.0) / 28)
    path = save_model(model, tmp_path / "some.safetensors")
    loaded = load_model(path)
    assert torch.equal(loaded.layers[0].ffn_router.usage, torch.arange(8.0) / 28)
    tokens = torch.randint(0, 256, (1, 12))
    assert torch.equal(loaded(tokens).logits, model.eval()(tokens).logits)
    res = CliRunner().invoke(cli, ["count-params", str(path)])
    assert res.exit_code == 0, res.output
    assert "buffers     528 = 0.00M in 4 tensors" in res.output  # 2 layers x (8 x 32 + 8)


def test_exports_without_a_final_norm_are_refused_where_the_format_has_one():
    from bam_surgery.converters.export import CapabilityError
    from bam_surgery.converters.hf.architectures import ARCHITECTURES

    mixtral_problems = ARCHITECTURES["mixtral"].config.problems
    dense = preset("tiny", block="sequential", final_norm=False)
    with pytest.raises(CapabilityError, match="needs final_norm=True"):
        ARCHITECTURES["llama"].config.write(dense.replace(norm="rmsnorm"), "llama")
    mix = preset("tiny", block="sequential", norm="rmsnorm", final_norm=False, ffn_experts=2, gate_norm="topk_softmax")
    assert ("a final norm", "no final norm") in mixtral_problems(mix)
    assert ("linear routers", "router key_store") in mixtral_problems(mix.replace(router="key_store"))
