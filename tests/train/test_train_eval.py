"""Evaluation: per-domain numbers against a token-by-token hand computation, and routing statistics
against forced routing whose answer is known (bam_surgery.train.evaluation / metrics)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bam_surgery.runtime import ForcedRouting, Model, preset, save_model
from bam_surgery.train import evaluate
from bam_surgery.train.data import DOC_SEPARATOR
from bam_surgery.train.evaluation import evaluate_streams
from bam_surgery.train.metrics import entropy_bits, gini

TINY = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (conftest.one_thread)


def _model(seed: int = 0, **mixture) -> Model:
    model = Model(preset("tiny", **TINY, **mixture))
    model.reset_parameters(std=0.2, seed=seed)
    return model.eval()


def test_per_domain_loss_equals_a_token_by_token_hand_computation(tmp_path):
    model = _model()
    path = save_model(model, tmp_path / "m.safetensors")
    texts = {"alpha": ["the cat sat", "on the mat"], "beta": ["x=1+2", "y = x * 3; z"]}
    for name, docs in texts.items():
        (tmp_path / f"{name}.txt").write_text(DOC_SEPARATOR.join(docs))
    T = 8
    report = evaluate(str(path), f"alpha={tmp_path}/alpha.txt,beta={tmp_path}/beta.txt", seq_len=T,
                      batch_size=3, token_cache=tmp_path / "cache")
    for name, docs in texts.items():
        stream = [b for d in docs for b in [*d.encode(), 0]]  # byte-level: UTF-8 bytes, EOS 0 after each
        nll = 0.0
        with torch.no_grad():
            for p in range(1, len(stream)):  # token p is predicted from its window's start up to p
                start = (p - 1) // T * T
                logits = model(torch.tensor([stream[start:p]])).logits[0, -1].double()
                nll -= float(logits.log_softmax(-1)[stream[p]])
        got = report.domains[name]
        assert got.tokens == len(stream) - 1
        assert got.loss == pytest.approx(nll / (len(stream) - 1), rel=1e-6)
        assert got.perplexity == pytest.approx(math.exp(nll / (len(stream) - 1)), rel=1e-6)
    assert report.tokenizer == "bytes" and report.seq_len == T


def test_max_tokens_and_batching_do_not_change_the_numbers(tmp_path):
    model = _model(seed=1)
    stream = np.random.default_rng(0).integers(1, 256, 200).astype(np.uint16)
    a = evaluate_streams(model, {"d": stream}, seq_len=16, batch_size=1)["d"]
    b = evaluate_streams(model, {"d": stream}, seq_len=16, batch_size=7)["d"]
    assert a.tokens == b.tokens == 199 and a.loss == pytest.approx(b.loss, rel=1e-6)
    c = evaluate_streams(model, {"d": stream}, seq_len=16, max_tokens=50)["d"]
    assert c.tokens == 50


def test_entropy_and_gini_known_values():
    assert entropy_bits(torch.tensor([1.0, 1, 1, 1])) == pytest.approx(2.0)
    assert entropy_bits(torch.tensor([0.0, 3, 0, 0])) == 0.0
    assert gini(torch.tensor([0.25] * 4)) == pytest.approx(0.0)
    assert gini(torch.tensor([0.0, 1, 0, 0])) == pytest.approx(0.75)
    assert gini(torch.tensor([0.5, 0.5, 0, 0])) == pytest.approx(0.5)


def test_routing_statistics_under_forced_routing():
    """FFN gates (.5, .5, 0, 0) for every token: shares .5/.5/0/0, 1 bit, Gini .5; attention gates
    (0, 0, 1, 0): mean gate one-hot, 0 bits, Gini .75; in every layer and domain."""
    model = _model(ffn_experts=4, attn_experts=4)
    streams = {"a": np.arange(1, 60, dtype=np.uint16), "b": np.arange(100, 141, dtype=np.uint16)}
    forced = ForcedRouting(ffn_gates=torch.tensor([0.5, 0.5, 0, 0]), attn_gates=torch.tensor([0.0, 0, 1, 0]))
    names = {"ffn": ["seed", "code", "law", "math"], "attn": ["seed", "code", "law", "math"]}
    res = evaluate_streams(model, streams, seq_len=16, routing=forced, expert_names=names)
    for dom, r in res.items():
        assert set(r.routing) == {f"layers.{i}.{k}_router" for i in range(2) for k in ("attn", "ffn")}
        for router, s in r.routing.items():
            if router.endswith("ffn_router"):
                assert s["usage"] == [0.5, 0.5, 0.0, 0.0] and s["mean_gate"] == [0.5, 0.5, 0.0, 0.0]
                assert (s["entropy"], s["gini"]) == (pytest.approx(1.0), pytest.approx(0.5))
                assert (s["used"], s["used_percent"]) == (2, 50.0)
            else:
                assert s["mean_gate"] == [0.0, 0.0, 1.0, 0.0]
                assert (s["entropy"], s["gini"]) == (0.0, pytest.approx(0.75))
                assert (s["used"], s["used_percent"]) == (1, 25.0)
            assert s["entropy_max"] == 2.0
            assert s["tokens"] == r.tokens and s["token_entropy"] is None  # forced: no router softmax
        assert r.routing_summary["ffn"] == {"experts": names["ffn"], "share": [0.5, 0.5, 0.0, 0.0], "used": 2,
                                            "entropy_bits": 1.0, "entropy_max_bits": 2.0, "gini": 0.5}
        assert r.routing_summary["attn"]["mean_gate"] == [0.0, 0.0, 1.0, 0.0]
    one = evaluate_streams(model, streams, seq_len=16, routing=ForcedRouting(expert=3))["a"]
    assert one.routing_summary["ffn"]["share"] == [0.0, 0.0, 0.0, 1.0]


def test_learned_top1_routing_counts_every_token_once():
    model = _model(ffn_experts=4, attn_experts=2)
    res = evaluate_streams(model, {"a": np.arange(1, 80, dtype=np.uint16)}, seq_len=16)["a"]
    for router, s in res.routing.items():
        assert sum(s["usage"]) == pytest.approx(1.0)
        assert 0 <= s["entropy"] <= math.log2(len(s["usage"])) + 1e-9
        assert s["token_entropy"] is not None and 0 < s["token_entropy"] <= math.log2(len(s["usage"])) + 1e-9
    with torch.no_grad():  # the FFN shares are the top-1 choices of the routers, counted by hand
        tokens = torch.arange(1, 80)
        chosen = torch.zeros(4)
        for s in range(0, 78, 16):
            seq = tokens[s:min(s + 17, 79)]
            out = model(seq[None, :-1])
            chosen += torch.bincount(out.routing["layers.0.ffn_router"].topk.reshape(-1), minlength=4)
    assert res.routing["layers.0.ffn_router"]["usage"] == [round(float(c), 6) for c in chosen / chosen.sum()]
