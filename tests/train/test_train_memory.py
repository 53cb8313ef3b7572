"""Training memory (issue 40): the estimate printed before the first step (train/memory.py) against what autograd
saves and what a run's peak is, the refusal that names the option that fits, and the three levers, each keeping
the loss curve: bf16 optimizer state (BF16StateAdamW: loss curve within 2% of fp32 state per step here, resumed
bit for bit), activation checkpointing (the same loss and gradients to 1e-6, routing statistics collected once),
and a final checkpoint without the optimizer state (resume refused in one line)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_model, max_diff, random_state, tiny_config, tokens_for, train_interrupted_after
from bam_surgery.runtime import Model, ModelConfig
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.safetensors_file import SafetensorsFile
from bam_surgery.train import TrainConfig, TrainError, load_run_config, train
from bam_surgery.train import memory
from bam_surgery.train.optim import BF16StateAdamW, build_optimizer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"
DATA = f"code={CORPUS}/code:0.5,law={CORPUS}/law:0.5"
BASE = dict(vocab_size=256, max_positions=256, block="sequential", norm="rmsnorm", activation="swiglu",
            d_model=64, n_heads=4, ffn_hidden=128, n_layers=2)
KINDS = {
    "dense": {}, "gqa": dict(n_kv_heads=2), "head_dim": dict(head_dim=32), "wide_ffn": dict(ffn_hidden=256),
    "btx": dict(ffn_experts=4, ffn_top_k=1, gate_norm="topk_softmax"), "btx_top2": dict(ffn_experts=4, ffn_top_k=2),
    "bam": dict(ffn_experts=4, ffn_top_k=1, attn_experts=4),
    "bam_shared": dict(ffn_experts=4, ffn_top_k=1, attn_experts=4, kv_mode="shared", n_kv_heads=2),
    "bam_wide": dict(d_model=128, ffn_experts=8, ffn_top_k=1, attn_experts=8),
    "qk_norm": dict(qk_norm="head"), "gelu": dict(activation="gelu"),
}
pytestmark = pytest.mark.usefixtures("one_thread")


def saved_bytes(model: Model, tokens: torch.Tensor, bf16: bool) -> int:
    """Bytes of the distinct storages autograd keeps from the trunk's forward (parameters themselves excluded)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model.hidden_states(model.embed_tokens(tokens))
    return sum(seen.values())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_activation_formula_against_what_autograd_saves(kind, bf16):
    """activation_bytes_per_token x tokens x layers (and, under autocast, the bf16 weight copies) is within
    [0.8, 1.25] of the bytes the fused path's blocks keep for the backward pass."""
    cfg = ModelConfig(**{**BASE, **KINDS[kind]})
    torch.manual_seed(0)
    model = Model(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    measured = saved_bytes(model, tokens, bf16)
    shapes = {n: s for n, s in tensor_shapes(cfg).items() if n.startswith("layers.")}
    formula = cfg.n_layers * 128 * memory.activation_bytes_per_token(cfg, bf16)
    if bf16:
        formula += 2 * memory._matmul_params(shapes)
    assert 0.8 <= formula / measured <= 1.25, (formula, measured)


def _plan(cfg: ModelConfig, **kw) -> memory.MemoryPlan:
    args = dict(micro_batch=1, seq_len=64, trainable=None, bf16=False, optimizer_state="fp32", checkpointing=False,
                device=torch.device("cpu"))
    return memory.estimate_training_memory(cfg, **{**args, **kw})


QWEN_1_5B = dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_hidden=8960,
                 max_positions=4096, qkv_bias=True, norm="rmsnorm", activation="swiglu", block="sequential",
                 tie_embeddings=True)


def test_a_1_5b_model_is_refused_on_24_gb_and_fits_with_the_levers():
    """Qwen2.5-1.5B's shape (1.54B parameters, tied head) at 2 x 64 tokens: fp32 AdamW needs about 24 GiB, more
    than a 24 GB machine has free; the refusal names --optimizer-state bf16, which brings it under 19 GiB."""
    cfg = ModelConfig(**QWEN_1_5B)
    params = sum(math.prod(s) for s in tensor_shapes(cfg).values())
    assert 1.5e9 < params < 1.6e9
    full = _plan(cfg, micro_batch=2)
    assert full.weights == full.gradients == 4 * params and full.optimizer == 8 * params
    lean = _plan(cfg, micro_batch=2, optimizer_state="bf16", checkpointing=True)
    assert lean.optimizer == 4 * params + 5 * 4 * 2**24  # and the update's fp32 temporaries, a slice at a time
    assert lean.peak < 19 * 2**30 < 22 * 2**30 < full.peak
    cfg_train = TrainConfig(micro_batch=2, batch_tokens=128)
    plan_for = lambda changes: _plan(cfg, micro_batch=changes.get("micro_batch", 2),  # noqa: E731
                                     optimizer_state=changes.get("optimizer_state", "fp32"),
                                     checkpointing=changes.get("activation_checkpointing", False))
    with pytest.raises(TrainError) as e:
        memory.check_training_memory(full, 21 * 2**30, cfg_train, plan_for, "training this model")
    line = str(e.value)
    assert "\n" not in line and "needs about" in line and "GiB of RAM at its peak" in line
    assert "21.0 GiB is available to it: --optimizer-state bf16 brings it to" in line
    memory.check_training_memory(lean, 21 * 2**30, cfg_train, plan_for, "x")  # fits: no error
    with pytest.raises(TrainError, match="even --micro-batch 1 --batch-tokens 128 and --activation-checkpointing "
                                         "and --optimizer-state bf16 leave it above that"):
        memory.check_training_memory(full, 4 * 2**30, cfg_train, plan_for, "x")


def test_the_levers_lower_their_parts():
    cfg = ModelConfig(**{**BASE, "d_model": 256, "n_layers": 8, "vocab_size": 4096})
    full = _plan(cfg, micro_batch=8, seq_len=256)
    assert _plan(cfg, micro_batch=8, seq_len=256, checkpointing=True).activations < full.activations / 3
    assert _plan(cfg, micro_batch=8, seq_len=256, optimizer_state="bf16").optimizer == full.optimizer // 2 + 20 * 4096 * 256
    assert _plan(cfg, micro_batch=1, seq_len=256).activations < full.activations / 6
    half = _plan(cfg, micro_batch=8, seq_len=256, trainable={"layers.0.ffn.up.weight"})
    assert half.gradients == 4 * 256 * 128 and half.weights == full.weights
    gpu = _plan(cfg, device=torch.device("cuda"), bf16=True)
    assert gpu.where == "GPU memory" and "GPU memory" in gpu.line(None)


@pytest.mark.slow
def test_the_estimate_against_a_measured_run(tmp_path):
    """A run's peak resident memory (VmHWM: its own, where ru_maxrss also keeps the pytest process's size at the
    fork) against the estimate it printed before its first step: the estimate is not below 0.9x the peak and not
    above 1.4x (a 60M-parameter model, 2 steps, a checkpoint)."""
    body = dict(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, ffn_hidden=1536, max_positions=128)
    (tmp_path / "m.json").write_text(json.dumps(body))
    script = ("import json, sys\nfrom bam_surgery.train import TrainConfig, train\nlines = []\n"
              "cfg = TrainConfig.from_dict(json.loads(sys.argv[1]))\ntrain(cfg, log=lines.append)\n"
              "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
              "print(json.dumps({'lines': lines, 'peak': int(hwm.split()[1]) * 1024}))")
    cfg = dict(model_config=str(tmp_path / "m.json"), data=DATA, out=str(tmp_path / "run"), steps=2, seq_len=128,
               micro_batch=4, save_every=0, eval_every=-1, token_cache=str(tmp_path / "cache"), progress=False,
               plot=False, tokenizer="bytes")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=900, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    line = next(x for x in out["lines"] if x.startswith("memory: estimated peak"))
    estimate = float(line.split("estimated peak ")[1].split(" ")[0]) * (2**30 if " GiB of" in line else 2**20)
    assert 0.9 * out["peak"] <= estimate <= 1.4 * out["peak"], (line, out["peak"] / 2**30)


# ---- the levers keep the loss curve -----------------------------------------------------------------
def _cfg(tmp_path, name, **kw) -> TrainConfig:
    base = dict(preset="tiny", data=DATA, out=str(tmp_path / name), steps=12, warmup_steps=2, lr=3e-3, seq_len=32,
                micro_batch=4, save_every=6, eval_every=-1, token_cache=str(tmp_path / "cache"), progress=False,
                plot=False)
    return TrainConfig(**{**base, **kw})


def _run(tmp_path, name, **kw):
    res = train(_cfg(tmp_path, name, **kw), log=lambda m: None)
    recs = [json.loads(x) for x in open(res.run / "metrics.jsonl")]
    return res, [r["loss"] for r in recs if r["kind"] == "train"]


def test_bf16_optimizer_state_keeps_the_loss_curve_and_resumes_exactly(tmp_path, monkeypatch):
    """The moments in bf16 (stochastically rounded): every step's loss within 2% of fp32 state's, the saved moments
    bf16 (half the bytes), and a run resumed half-way equals the uninterrupted run bit for bit."""
    _, fp32 = _run(tmp_path, "fp32")
    res, low = _run(tmp_path, "bf16", optimizer_state="bf16")
    assert max(abs(a - b) / a for a, b in zip(fp32, low)) < 0.02, (fp32, low)
    trainer = SafetensorsFile(res.checkpoint / "trainer.safetensors")
    moments = [k for k in trainer.keys() if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert moments and all(trainer.get(k).dtype == torch.bfloat16 for k in moments)
    cfg = _cfg(tmp_path, "resumed", optimizer_state="bf16")
    train_interrupted_after(monkeypatch, 7, cfg)  # stopped after step 7, its checkpoint at 6
    resumed = train(load_run_config(cfg.out), resume=True, log=lambda m: None)
    assert resumed.loss == res.loss
    a, b = (SafetensorsFile(r.checkpoint / "model-00001-of-00001.safetensors") for r in (resumed, res))
    assert a.keys() == b.keys() and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


def test_bf16_state_adamw_is_adamw_up_to_the_rounding_of_its_moments():
    """One step from zero state is exactly AdamW's (the moments' rounding only acts from the second step); over 20
    steps the parameters stay within 1% of torch's AdamW's movement."""
    cfg = tiny_config(ffn_experts=3, attn_experts=2)
    models = [build_model(cfg, random_state(cfg, 3)).train() for _ in range(2)]
    tokens = tokens_for(cfg, 3, batch=4)
    opts = [torch.optim.AdamW(models[0].parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1),
            BF16StateAdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)]
    start = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    for step in range(20):
        for model, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss.backward()
            opt.step()
        if step == 0:
            for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
                assert max_diff(a, b) < 1e-6, n
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        moved = (a - start[n]).norm()
        assert (a - b).norm() <= 0.01 * moved + 1e-6, n
    assert all(s.dtype == torch.bfloat16 for st in opts[1].state.values() for k, s in st.items() if k != "step")


@pytest.mark.parametrize("kind", [dict(), dict(ffn_experts=3, attn_experts=3, ffn_top_k=1),
                                  dict(ffn_experts=3, ffn_top_k=2, router="key_store")])
def test_activation_checkpointing_gives_the_same_loss_gradients_and_routing(kind):
    """Each block run again in the backward pass: the loss and every gradient equal (1e-6), the routing trace the
    forward pass's, and a key-store router's statistics of the step collected once (its update equal)."""
    cfg = tiny_config(**kind)
    outs, grads, stores = [], [], []
    for checkpointing in (False, True):
        model = build_model(cfg, random_state(cfg, 7)).train()
        model.activation_checkpointing = checkpointing
        tokens = tokens_for(cfg, 7, batch=3)
        out = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False)
        out.loss.backward()
        model.after_step()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        stores.append({n: b.clone() for n, b in model.named_buffers()})
    assert outs[0].loss.item() == pytest.approx(outs[1].loss.item(), abs=1e-6)
    assert list(outs[0].routing) == list(outs[1].routing)
    for name, r in outs[0].routing.items():
        assert torch.equal(r.gates, outs[1].routing[name].gates), name
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert max_diff(g, grads[1][name]) < 1e-6, name
    for name, b in stores[0].items():
        assert torch.equal(b, stores[1][name]), name


def test_activation_checkpointing_and_no_final_optimizer_state_in_a_run(tmp_path):
    """train with --activation-checkpointing has the loss curve of the plain run (1e-5); with
    final_optimizer_state false the final checkpoint holds no optimizer state (the earlier one does), and
    --resume of it is refused in one line."""
    _, plain = _run(tmp_path, "plain")
    res, ckpt = _run(tmp_path, "ckpt", activation_checkpointing=True, final_optimizer_state=False)
    assert max(abs(a - b) for a, b in zip(plain, ckpt)) < 1e-5
    final = SafetensorsFile(res.checkpoint / "trainer.safetensors")
    middle = SafetensorsFile(res.run / "checkpoints" / "step-00000006" / "trainer.safetensors")
    assert not [k for k in final.keys() if k.startswith("optim.")]
    assert [k for k in middle.keys() if k.startswith("optim.")]
    with pytest.raises(TrainError, match="written without the optimizer state .* start a new run from it with "
                                         "--init"):
        train(load_run_config(res.run, {"steps": 20}), resume=True, log=lambda m: None)


def test_fused_adamw_equals_the_default_implementation():
    """build_optimizer's AdamW(fused=True) against torch's default implementation: 5 steps, parameters to 1e-6."""
    cfg = tiny_config(ffn_experts=3, attn_experts=2)
    models = [build_model(cfg, random_state(cfg, 5)).train() for _ in range(2)]
    tc = TrainConfig(lr=1e-2, warmup_steps=0)
    opts = [build_optimizer(models[0], tc)[0], build_optimizer(models[1], tc, fused=False)[0]]
    assert opts[0].defaults["fused"] and not opts[1].defaults.get("fused")
    tokens = tokens_for(cfg, 5, batch=4)
    for _ in range(5):
        for model, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss.backward()
            opt.step()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert max_diff(a, b) < 1e-6, n


def test_train_refuses_in_one_line_naming_the_option_that_fits(tmp_path, monkeypatch):
    """`bam-surgery train` with less memory available than its estimate: exit 2, one line, before anything is
    written, naming the option that fits (here --optimizer-state bf16: AdamW's fp32 state dominates); with that
    option the same command trains and prints its estimate before the first step."""
    from conftest import cli_error_line, run_cli
    from bam_surgery.train import loop

    body = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, ffn_hidden=1024, max_positions=64)
    (tmp_path / "m.json").write_text(json.dumps(body))
    args = ["train", "--model-config", tmp_path / "m.json", "--data", f"code={CORPUS}/code", "--out", tmp_path / "run",
            "--steps", 1, "--seq-len", 16, "--micro-batch", 1, "--token-cache", tmp_path / "cache", "--no-plot",
            "--no-progress", "--eval-every", -1, "--tokenizer", "bytes"]
    cfg = ModelConfig(**body)
    full, lean = _plan(cfg, seq_len=16), _plan(cfg, seq_len=16, optimizer_state="bf16")
    room = (full.peak + lean.peak) // 2  # between the two
    monkeypatch.setattr(loop, "resident_bytes", lambda: 0)
    monkeypatch.setattr(loop, "available_memory", lambda device: room)
    line = cli_error_line(*args)
    assert "is available to it: --optimizer-state bf16 brings it to" in line, line
    assert not (tmp_path / "run").exists()
    result = run_cli(*args, "--optimizer-state", "bf16")
    out = result.stderr
    assert out.index("memory: estimated peak") < out.index("training 1 steps from step 0")


def test_the_training_step_takes_the_chunked_loss_head(tmp_path, monkeypatch):
    """The plan above counts the chunked cross-entropy (no [B, T, V] logits held), so the step must run it: the model
    is called with return_logits=False and its whole-logits head is never asked for (it was: 1.9 GB more at 8 x 512
    tokens on the SmolLM2 seed, and at a 256k vocabulary several GB under the printed estimate)."""
    calls = []
    forward = Model.forward

    def spy(self, *args, **kw):
        calls.append(kw.get("return_logits", True))
        return forward(self, *args, **kw)

    def whole_logits(self, *args, **kw):
        raise AssertionError("the training step computed whole logits")

    monkeypatch.setattr(Model, "forward", spy)
    monkeypatch.setattr(Model, "head", whole_logits)
    _run(tmp_path, "chunked", steps=2, save_every=0)
    assert calls and not any(calls), calls
