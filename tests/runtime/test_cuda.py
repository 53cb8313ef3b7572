"""The runtime on a CUDA device (issue 24; `make test-gpu`). Every test is skipped when torch sees no CUDA device;
what a CPU can check of the same code paths runs in `make test` (tests/runtime/test_fused.py,
tests/runtime/test_generation.py, tests/runtime/test_gpu_ready.py).

BAM_CUDA_TEST_DEVICE=cpu runs this file on the CPU instead (bf16 CPU autocast, torch.compile with aot_eager where
CUDA uses inductor): a check of the tests themselves, not of a GPU.

Tolerances (bf16 against the fp32 reference loop, tiny models of 2 layers): bf16 keeps 8 bits of mantissa, about
0.4% per rounding, and a forward rounds at every matmul input and output, so logits may move by a few percent of
their largest magnitude: 3% of it (as tests/runtime/test_fused.py's CPU autocast test); the loss within 2%; gradients,
as a whole, within 5% in relative L2 norm (observed about 1%); where bf16 flips a top-k routing near-tie, see
test_fused_bf16_against_the_fp32_reference. A semantic slip (a wrong head, a dropped gate) moves logits by tens of
percent. CUDA graphs against eager: the same greedy tokens, fp32. Grouped matmul against the per-expert fallback:
the same bf16 inputs, outputs within 2% of their largest magnitude (different summation orders in bf16 outputs).
FSDP2 at world size 1 against plain training: fp32, losses within 1e-5 and parameters within 1e-5 after 3 steps.
Blocks compiled once (train.optim.compile_blocks, inductor) against eager under bf16 autocast: loss within 1%,
gradients within 2% (relative L2); the chunked loss head against the full logits, bf16: loss within 0.5%, gradients
within 2%.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_model, max_diff, random_state, tiny_config, tokens_for
from test_model import MIXTURES, ROUTER_KIND_MIXTURES
from bam_surgery.runtime import generate, save_model
from bam_surgery.runtime.blocks import expert_kernel, expert_mixture
from bam_surgery.runtime.routers import ROUTER_KINDS

DEVICE = os.environ.get("BAM_CUDA_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
pytestmark = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="torch sees no CUDA device")
COMPILE_BACKEND = "inductor" if ON_CUDA else "aot_eager"
ROOT = Path(__file__).resolve().parents[2]

# every model kind: dense, the mixtures of the reference tests, each router kind (key_store on FFN routers only)
KINDS = {"dense": {}, **MIXTURES, **{f"router_{k}": v for k, v in ROUTER_KIND_MIXTURES.items()},
         **{f"router_kind_{kind}": dict(ffn_experts=3, ffn_top_k=2, attn_experts=2, router=kind,
                                        attn_router=None if ROUTER_KINDS[kind].routes_attention else "linear")
            for kind in ROUTER_KINDS}}


def on_device(kind: str, seed: int, **extra):
    cfg = tiny_config(**KINDS[kind], **extra)
    return build_model(cfg, random_state(cfg, seed)).to(DEVICE)


def bf16():
    return torch.autocast(DEVICE, dtype=torch.bfloat16)


def bf16_steps(model, opt, tokens, steps: int):
    """`steps` optimizer steps on tokens (next-token targets) under bf16 autocast; the last loss."""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with bf16():
            loss = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss
        loss.backward()
        opt.step()
    return loss


def loss_and_grads(model, impl: str, tokens, targets, autocast: bool):
    model.impl = impl
    model.zero_grad(set_to_none=True)
    with bf16() if autocast else torch.autocast(DEVICE, enabled=False):
        out = model(tokens, targets=targets)
    out.loss.backward()
    return out, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def routing_flips(exact, out, shape) -> torch.Tensor:
    """[B, T] True where some top-k router chose other experts in `out` than in `exact` (a near-tie that bf16
    decides the other way)."""
    flipped = torch.zeros(shape[0] * shape[1], dtype=torch.bool, device=DEVICE)
    for name, r in exact.routing.items():
        if r.topk is not None:
            flipped |= (r.topk.sort(-1).values != out.routing[name].topk.sort(-1).values).any(-1)
    return flipped.view(shape)


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_bf16_against_the_fp32_reference(kind):
    """Where bf16 flips a top-k routing choice (a near-tie), that token and every later one in its row may differ
    by more than rounding (attention carries the change forward): logits are then compared on the positions
    before a row's first flip only, and gradients not at all; at most 2 of the 16 tokens may flip."""
    model = on_device(kind, 1)
    tokens, targets = tokens_for(model.config, 1).to(DEVICE), tokens_for(model.config, 2).to(DEVICE)
    exact, exact_grads = loss_and_grads(model, "reference", tokens, targets, autocast=False)
    out, grads = loss_and_grads(model, "fused", tokens, targets, autocast=True)
    scale = exact.logits.abs().max().item()
    assert out.logits.dtype == torch.bfloat16
    flips = routing_flips(exact, out, tokens.shape)
    assert flips.sum() <= 2, flips
    same_routing = flips.long().cumsum(1) == 0  # [B, T] positions before the row's first flip
    diff = (out.logits.float() - exact.logits).abs().amax(-1)
    assert diff[same_routing].max() < 0.03 * scale, diff
    assert abs(out.loss.item() - exact.loss.item()) < 0.02 * exact.loss.item()
    assert set(grads) == set(exact_grads)
    if not flips.any():
        names = sorted(grads)
        flat, want = torch.cat([grads[n].flatten() for n in names]), torch.cat([exact_grads[n].flatten() for n in names])
        assert ((flat - want).norm() / want.norm()).item() < 0.05
    # bf16 weights too (what inference runs), fused against the same fp32 reference
    model.to(torch.bfloat16)
    model.impl = "fused"
    with torch.no_grad():
        low = model(tokens)
    same_routing = routing_flips(exact, low, tokens.shape).long().cumsum(1) == 0
    diff = (low.logits.float() - exact.logits).abs().amax(-1)
    assert low.logits.dtype == torch.bfloat16 and diff[same_routing].max() < 0.05 * scale, diff


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_autocast_training_step(kind, impl):
    """One AdamW step under bf16 autocast with fp32 weights on both paths (the reference loop's index_add once
    crashed on mixed dtypes here): finite loss and gradients, every trainable parameter moved."""
    model = on_device(kind, 3).train()
    model.impl = impl
    tokens = tokens_for(model.config, 3).to(DEVICE)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with bf16():
        out = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    moved = [n for n, p in model.named_parameters() if p.grad is not None and not torch.equal(p, before[n])]
    assert moved and len(moved) == sum(p.grad is not None for p in model.parameters())


def test_compiled_fused_training_step():
    """torch.compile (inductor on CUDA) of the fused forward and backward, whole, under bf16 autocast."""
    model = on_device("bam", 5, n_layers=1)
    tokens, targets = tokens_for(model.config, 5).to(DEVICE), tokens_for(model.config, 6).to(DEVICE)
    eager, eager_grads = loss_and_grads(model, "fused", tokens, targets, autocast=True)
    compiled = torch.compile(model, backend=COMPILE_BACKEND, fullgraph=True)
    model.zero_grad(set_to_none=True)
    with bf16():
        out = compiled(tokens, targets=targets)
    out.loss.backward()
    assert abs(out.loss.item() - eager.loss.item()) < 1e-2 * eager.loss.item()
    for name, p in model.named_parameters():
        assert max_diff(p.grad.float(), eager_grads[name]) < 2e-2 * max(1.0, eager_grads[name].abs().max().item()), name


def test_compiled_blocks_training_step():
    """train.optim.compile_blocks (what train --compile auto does on CUDA: each block compiled once, inductor on
    CUDA) under bf16 autocast: one graph for every layer and the loss within 1% of eager; in fp32 the gradients
    within 1e-3 of eager's (relative, per tensor: bf16's rounding, not the compiler, moved a norm weight's by 2.4%
    on an H200); then two steps of fused AdamW (build_optimizer) move every parameter, finite."""
    from torch._dynamo.utils import counters

    from bam_surgery.train import TrainConfig
    from bam_surgery.train.optim import build_optimizer, compile_blocks

    model = on_device("bam", 15, n_layers=3).train()
    tokens, targets = tokens_for(model.config, 15).to(DEVICE), tokens_for(model.config, 16).to(DEVICE)
    eager, _ = loss_and_grads(model, "fused", tokens, targets, autocast=True)
    _, eager_grads = loss_and_grads(model, "fused", tokens, targets, autocast=False)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, backend=COMPILE_BACKEND)
    out, _ = loss_and_grads(model, "fused", tokens, targets, autocast=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert abs(out.loss.item() - eager.loss.item()) < 1e-2 * eager.loss.item()
    _, grads = loss_and_grads(model, "fused", tokens, targets, autocast=False)
    for name, g in eager_grads.items():
        assert (grads[name] - g).norm() <= 1e-3 * g.norm() + 1e-6, name
    opt, _ = build_optimizer(model, TrainConfig(lr=1e-2, warmup_steps=0))
    assert opt.defaults["fused"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = bf16_steps(model, opt, tokens, 2)
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, before[n]) and torch.isfinite(p).all() for n, p in model.named_parameters())
    torch._dynamo.reset()


def test_chunked_loss_head_on_the_device():
    """The loss-only head in chunks (3 rows here) under bf16 autocast against the full logits' cross-entropy: loss
    within 0.5%, gradients within 2% (relative L2); the head's weight is cast to bf16 once per call."""
    model = on_device("bam", 17).train()
    tokens, targets = tokens_for(model.config, 17).to(DEVICE), tokens_for(model.config, 18).to(DEVICE)
    full, full_grads = loss_and_grads(model, "fused", tokens, targets, autocast=True)
    model.loss_chunk_rows = 3
    model.zero_grad(set_to_none=True)
    with bf16():
        out = model(tokens, targets=targets, return_logits=False)
    out.loss.backward()
    assert abs(out.loss.item() - full.loss.item()) < 5e-3 * full.loss.item()
    for name, p in model.named_parameters():
        g = full_grads[name]
        assert (p.grad.float() - g).norm() <= 0.02 * g.norm() + 1e-6, name


def test_train_on_the_device_with_fused_adamw(tmp_path):
    """bam-surgery train's loop on the device (fused AdamW, bf16 autocast, the chunked head, the memory estimate
    against the device's free memory): three steps, a finite loss, the memory line printed before the first step.
    Compiling is left out here (test_compiled_blocks_training_step compiles the same way; a second compile would
    add half a minute to make test-gpu)."""
    from bam_surgery.train import TrainConfig, train

    lines = []
    corpus = ROOT / "data" / "domains"
    cfg = TrainConfig(preset="tiny", data=f"code={corpus}/code", out=str(tmp_path / "run"), steps=3, warmup_steps=0,
                      lr=1e-3, seq_len=32, micro_batch=4, save_every=0, eval_every=-1, device=DEVICE,
                      compile="off", progress=False, plot=False,
                      token_cache=str(tmp_path / "cache"))
    res = train(cfg, log=lines.append)
    assert res.loss is not None and math.isfinite(res.loss)
    memory = [line for line in lines if line.startswith("memory: estimated peak")]
    assert len(memory) == 1 and ("of GPU memory" in memory[0]) == ON_CUDA, memory


@pytest.mark.parametrize("kind", ["dense", "moe_ffn", "soft_moa_expert_kv", "soft_moa_shared_kv", "bam"])
def test_cuda_graph_decoding_equals_eager(kind):
    """generate(compile=True): the decode step through torch.compile(mode="reduce-overhead"), i.e. CUDA graphs over
    the static cache, gives the eager tokens (fp32, greedy, batch 1 and 3)."""
    if not ON_CUDA:
        pytest.skip("CUDA graphs need CUDA (on the CPU generate(compile=True) builds inductor's C++)")
    model = on_device(kind, 7, max_positions=32)
    for batch in (1, 3):
        prompt = tokens_for(model.config, 7, batch=batch, length=6).to(DEVICE)
        want = generate(model, prompt, 12)
        torch._dynamo.reset()
        assert torch.equal(generate(model, prompt, 12, compile=True), want), batch


def test_grouped_mm_against_the_per_expert_fallback():
    """The FFN expert kernels on the same bf16 inputs: grouped (torch._grouped_mm, where the device has it for bf16),
    gather and padded against a plain loop over experts."""
    model = on_device("moe_ffn", 9, ffn_hidden=64).to(torch.bfloat16)
    ffn = model.layers[0].ffn_experts
    gen = torch.Generator().manual_seed(9)
    N, E, K = 40, ffn.up.weight.shape[0], 2
    x = torch.randn(N, model.config.d_model, generator=gen).to(DEVICE, torch.bfloat16)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).to(DEVICE)
    gates = torch.rand(N, K, generator=gen).to(DEVICE)
    act = model.layers[0].act
    want = torch.zeros(N, x.shape[1], device=DEVICE)
    for n in range(N):
        for k in range(K):
            e = int(experts[n, k])
            h = act(x[n].float() @ ffn.gate.weight[e].float().T) * (x[n].float() @ ffn.up.weight[e].float().T)
            want[n] += gates[n, k] * (h @ ffn.down.weight[e].float().T)
    kernels = ["gather", "padded"]
    if expert_kernel(x, N * K, E) == "grouped":
        kernels.append("grouped")
    elif ON_CUDA:
        print(f"grouped kernel not used on {torch.cuda.get_device_name()} in bf16 (needs sm90+)")
    for kernel in kernels:
        got = expert_mixture(x, experts, gates, ffn, act, True, kernel).float()
        assert max_diff(got, want) < 0.02 * want.abs().max().item(), (kernel, max_diff(got, want))


def test_fsdp2_world_size_one_equals_plain_training(tmp_path, monkeypatch):
    """train.distributed.wrap's FSDP2 (fully_shard per block, then the model) in a one-process group: three AdamW
    steps give the losses and parameters of the same steps without it."""
    import torch.distributed as dist

    from bam_surgery.train import distributed as dist_

    plain, sharded = on_device("bam", 11).train(), on_device("bam", 11).train()
    tokens = tokens_for(plain.config, 11, batch=4).to(DEVICE)
    dist.init_process_group("nccl" if ON_CUDA else "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist_.Dist, "active", property(lambda self: True))  # wrap() shards at world size 1 too
        wrapped = dist_.wrap(sharded, dist_.Dist(device=torch.device(DEVICE), strategy="fsdp"))
        losses = []
        for model in (plain, wrapped):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            run = []
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss = model(tokens[:, :-1], targets=tokens[:, 1:], return_logits=False).loss
                loss.backward()
                opt.step()
                run.append(loss.item())
            losses.append(run)
        assert max(abs(a - b) for a, b in zip(*losses)) < 1e-5, losses
        full = {n: dist_.local_value(p.detach()) for n, p in sharded.named_parameters()}
        for name, p in plain.named_parameters():
            assert max_diff(full[name], p.detach()) < 1e-5, name
    finally:
        dist.destroy_process_group()


# the command needs every package setup.py declares; a lent GPU machine's preinstalled environment may lack some
# (the first one had no blake3, and no network to install it)
CLI_PACKAGES = ("blake3", "onnx", "onnxruntime", "onnxscript", "click", "yaml", "safetensors")


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in CLI_PACKAGES),
                    reason="this environment lacks a package the export-onnx command imports: "
                    + ", ".join(p for p in CLI_PACKAGES if importlib.util.find_spec(p) is None))
def test_export_onnx_of_a_cuda_trained_model_verifies(tmp_path):
    """Trained on the device under bf16 autocast, saved, exported by the CLI with --verify (onnxruntime on the CPU
    against the runtime): the export verifies."""
    model = on_device("bam", 13, max_positions=32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = tokens_for(model.config, 13, batch=4, length=16).to(DEVICE)
    bf16_steps(model, opt, tokens, 3)
    save_model(model.cpu().eval(), tmp_path / "trained.safetensors")
    proc = subprocess.run([sys.executable, "-m", "bam_surgery", "export-onnx", str(tmp_path / "trained.safetensors"),
                           "--out", str(tmp_path / "onnx"), "--verify"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK" in proc.stdout + proc.stderr and (tmp_path / "onnx" / "model.onnx").is_file()
