"""Training runs end to end on tiny models (bam_surgery.train.loop): loss falls on the repository's
corpus, exact resume, frozen parameters, checkpoints and their provenance chain."""
from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import train_interrupted_after

from bam_surgery.runtime import CheckpointReader, Model, load_checkpoint, load_model, preset, save_model
from bam_surgery.train import TrainConfig, load_run_config, train
from bam_surgery.train.checkpoints import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"
DATA = f"code={CORPUS}/code:0.5,law={CORPUS}/law:0.3,math={CORPUS}/math:0.2"
SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (conftest.one_thread)


@pytest.fixture(scope="module", autouse=True)
def token_cache(tmp_path_factory):
    """One token cache for the module: the corpus is tokenized once."""
    global CACHE
    CACHE = tmp_path_factory.mktemp("tokens")


def _cfg(tmp_path, out="run", **kw) -> TrainConfig:
    base = dict(data=DATA, out=str(tmp_path / out), steps=6, warmup_steps=2, lr=3e-3, seq_len=32, micro_batch=4,
                save_every=3, eval_tokens=256, token_cache=str(CACHE), progress=False, plot=False)
    return TrainConfig(**{**base, **kw})


def _losses(run: Path, kind="train", key="loss") -> list:
    return [r[key] for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == kind]


@pytest.fixture
def mixture(tmp_path) -> Path:
    """A tiny BAM-shaped mixture with a merge-style provenance record naming its experts."""
    cfg = preset("tiny", **SMALL, ffn_experts=3, attn_experts=3)
    model = Model(cfg)
    model.reset_parameters(seed=5)
    prov = {"tool": {"name": "bam-surgery", "version": "0.1.0"}, "recipe": {"name": "bam"},
            "inputs": [{"index": 0, "role": "seed", "path": "ckpts/seed.safetensors", "expert": 0},
                       {"index": 1, "role": "expert", "path": "ckpts/code.safetensors", "expert": 1},
                       {"index": 2, "role": "expert", "path": "ckpts/law", "expert": 2, "name": "legal"}]}
    return save_model(model, tmp_path / "mix.safetensors", metadata={"bam_provenance": json.dumps(prov)})


def test_loss_falls_on_the_repository_corpus(tmp_path):
    res = train(_cfg(tmp_path, preset="tiny", steps=40, warmup_steps=5, micro_batch=8, save_every=0,
                     eval_every=20, eval_tokens=2048))
    losses = _losses(res.run)
    assert len(losses) == 40 and losses[0] > 5.0  # ~ln(256) at random init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    evals = [r for r in map(json.loads, open(res.run / "metrics.jsonl")) if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    for dom in ("code", "law", "math"):
        assert evals[1]["domains"][dom]["loss"] < evals[0]["domains"][dom]["loss"] < 5.0
    rec = json.loads(open(res.run / "metrics.jsonl").readline())
    assert {"loss", "nll", "lb_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "router_entropy",
            "tokens"} <= set(rec)
    assert rec["tokens"] == 8 * 32 and rec["lr"] == pytest.approx(3e-3 / 5)
    model = load_model(res.checkpoint)  # the final checkpoint is a canonical checkpoint
    assert model.config.name == "tiny" and [p.name for _, p in list_checkpoints(res.run)] == ["step-00000040"]


def test_interrupted_and_resumed_run_is_identical(tmp_path, mixture, monkeypatch):
    kw = dict(init=str(mixture), micro_batch=2, batch_tokens=4 * 32, steps=7, save_every=3, keep_last=2)
    full = train(_cfg(tmp_path, "full", **kw))
    train_interrupted_after(monkeypatch, 5, _cfg(tmp_path, "cut", **kw))
    cut = tmp_path / "cut"
    assert [p.name for _, p in list_checkpoints(cut)] == ["step-00000003"]
    assert len(_losses(cut)) == 5
    resumed = train(load_run_config(cut), resume=True)
    assert _losses(cut) == _losses(full.run)  # steps 4, 5 re-run from the step-3 checkpoint, bit for bit
    assert _losses(cut, key="router_entropy") == _losses(full.run, key="router_entropy")
    _, a = load_checkpoint(full.checkpoint)
    _, b = load_checkpoint(resumed.checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [p.name for _, p in list_checkpoints(cut)] == ["step-00000006", "step-00000007"]  # keep_last 2


def test_frozen_parameters_stay_bit_identical(tmp_path, mixture):
    res = train(_cfg(tmp_path, init=str(mixture), trainable=["routers"], steps=3, lr=1e-2, warmup_steps=0))
    _, before = load_checkpoint(mixture)
    _, after = load_checkpoint(res.checkpoint)
    for name in before:
        if "router" in name:
            assert not torch.equal(before[name], after[name]), name
        else:
            assert torch.equal(before[name], after[name]), name
    res = train(_cfg(tmp_path, "b", init=str(mixture), trainable=["*", "!ffn_experts"], steps=2, warmup_steps=0))
    _, after = load_checkpoint(res.checkpoint)
    assert all(torch.equal(before[n], after[n]) == (".ffn_experts." in n) for n in before)


def test_provenance_chain_and_expert_names(tmp_path, mixture):
    first = train(_cfg(tmp_path, "one", init=str(mixture), steps=2, save_every=0))
    second = train(_cfg(tmp_path, "two", init=str(first.run), steps=1, save_every=0, data=f"law={CORPUS}/law"))
    with CheckpointReader(second.checkpoint) as r:
        prov = json.loads(r.metadata["bam_provenance"])
        assert r.metadata["bam_tokenizer"] == "bytes"
    assert prov["recipe"] == {"name": "bam"} and len(prov["inputs"]) == 3  # the merge's record, kept
    assert prov["experts"] == {"ffn": ["seed", "code", "legal"], "attn": ["seed", "code", "legal"]}
    one, two = prov["training"]
    assert (one["steps"], two["steps"]) == (2, 1)
    assert one["init"]["spec"] == str(mixture) and two["init"]["resolved"] == str(first.checkpoint)
    assert [d["domain"] for d in one["data"]] == ["code", "law", "math"]
    law = one["data"][1]["files"][0]
    assert law["file"].endswith("law/train.txt.gz") and len(law["sha256"]) == 64
    assert one["config"]["seq_len"] == 32 and one["tokens"] == 2 * 4 * 32
    card = (second.checkpoint / "README.md").read_text()
    assert "FFN experts: 0 `seed`, 1 `code`, 2 `legal`" in card and "| law |" in card
    evals = [r for r in map(json.loads, open(second.run / "metrics.jsonl")) if r["kind"] == "eval"]
    assert evals[-1]["domains"]["law"]["routing"]["ffn"]["experts"] == ["seed", "code", "legal"]


def test_random_init_from_a_model_config_file(tmp_path):
    cfg = preset("tiny", **SMALL).to_dict()
    (tmp_path / "model.json").write_text(json.dumps(cfg))
    res = train(_cfg(tmp_path, model_config=str(tmp_path / "model.json"), steps=2, save_every=0))
    assert load_model(res.checkpoint).config.to_dict() == cfg
    saved = load_run_config(res.run)
    assert (saved.seq_len, saved.batch_tokens, saved.lb_coef) == (32, 4 * 32, 0.01)


def test_every_router_kind_trains_and_gets_after_step(tmp_path, monkeypatch):
    """Routers of the other kinds train like linear ones (every tensor moves), and the loop calls each
    router's after_step() once per optimizer step (the hook of rule-based kinds)."""
    from bam_surgery.runtime.routers import Router

    calls: list[str] = []
    monkeypatch.setattr(Router, "after_step", lambda self: calls.append(self.kind))
    cfg = preset("tiny", **SMALL, ffn_experts=3, attn_experts=2, router="expert_embedding", attn_router="mlp")
    model = Model(cfg)
    model.reset_parameters(seed=6)
    init = save_model(model, tmp_path / "mix.safetensors")
    res = train(_cfg(tmp_path, init=str(init), trainable=["routers"], steps=3, lr=1e-2, warmup_steps=0))
    _, before = load_checkpoint(init)
    _, after = load_checkpoint(res.checkpoint)
    routers = [n for n in before if "_router." in n]
    assert any(n.endswith("log_temperature") for n in routers) and any(".hidden." in n for n in routers)
    assert all(not torch.equal(before[n], after[n]) for n in routers)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in routers)
    assert sorted(calls) == sorted(["mlp", "expert_embedding"] * cfg.n_layers * 3)


class _Terminal(io.StringIO):
    """stderr as a terminal: the progress bar draws into it."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_each_steps_loss_and_eval_lines_print_above_it(tmp_path, monkeypatch):
    """On a terminal, the bar drawn at step n shows step n's loss (it showed step n-1's), and an eval line
    is printed on a line of its own, the bar cleared first (it was written onto the bar)."""
    import tqdm

    class EveryStep(tqdm.tqdm):  # redraw at every update, not every 0.1 s: the test reads each drawing
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(tqdm, "tqdm", EveryStep)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    res = train(_cfg(tmp_path, preset="tiny", steps=3, save_every=0, eval_every=2, eval_tokens=64, progress=True))
    shown = sys.stderr.getvalue()
    losses = _losses(res.run)
    drawn = re.findall(r"(\d+)/3 \[([^\]]*)\]", shown)
    assert {int(n) for n, _ in drawn} == {0, 1, 2, 3}
    for n, status in drawn:
        if int(n):
            assert f"loss={losses[int(n) - 1]:.4f}," in status, (n, status)
    evals = [line for line in shown.split("\n") if "eval step" in line]
    assert len(evals) == 2 and all(line.rsplit("\r", 1)[-1].startswith("eval step") for line in evals), evals
