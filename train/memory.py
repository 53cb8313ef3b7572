"""The memory a training run will need, estimated before its first step, and the levers that lower it.

    plan = estimate_training_memory(model_config, cfg, seq_len, trainable_names, device, world, strategy)
    print(plan.line(available))                    # "memory: estimated peak 3.2 GiB of RAM (weights 0.5, ...)"
    check_training_memory(plan, ...)               # TrainError naming the option that fits, when none is given

The peak of a step is the sum of (bytes; P the parameters, Pt the trainable ones, N = micro_batch x seq_len):
    weights      4 P: fp32 master weights (whatever the checkpoint's dtype)
    gradients    4 Pt (DDP keeps a second copy in its buckets)
    optimizer    AdamW's two moments: 8 Pt in fp32 (the fused step adds nothing), 4 Pt with optimizer_state bf16
                 (train/optim.py) and its fp32 temporaries over a slice of the largest parameter
    activations  what autograd keeps for the backward pass: N x per-layer bytes (activation_bytes_per_token, a
                 formula fitted to, and tested against, the tensors the fused path saves for every block kind)
                 x layers; with activation_checkpointing each layer keeps its input [N, D] only, and one block's
                 activations exist again while it is recomputed. Under bf16 autocast add the bf16 copies of
                 the matmul weights, which autocast keeps from the forward pass to the backward pass (2 P).
    loss head    the chunked cross-entropy (runtime/model.py): its fp32 [V, D] gradient, one chunk's fp32 logits
                 and their softmax, and under autocast the head's bf16 copy
    process      what the process holds besides (CPU: its resident memory now, less the initial weights it has
                 read, which become the model's)
With FSDP the weights, gradients and moments are divided over the processes (plus two blocks gathered whole).
Everything is summed, as at the end of a step's last forward pass with gradients of earlier micro-batches
held: a slight overestimate when there is one micro-batch. tests/train/test_train_memory.py holds the
activation formula to what autograd saves and the whole estimate to a measured run's peak.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.model import loss_chunk_rows

from .config import KNOB_BOUNDS
from .errors import TrainError
from .optim import SLICE

GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """One training configuration's estimated peak, in bytes, by part."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    head: int
    process: int
    where: str  # "RAM" or "GPU memory"
    state_dtype: str = "fp32"

    @property
    def peak(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.head + self.process

    def parts(self) -> str:
        return (f"weights {size(self.weights)}, gradients {size(self.gradients)}, AdamW state "
                f"{size(self.optimizer)}{' (bf16)' if self.state_dtype == 'bf16' else ''}, activations "
                f"{size(self.activations)}, loss head {size(self.head)}, process {size(self.process)}")

    def line(self, available: int | None) -> str:
        free = f"; {size(available)} available" if available is not None else ""
        return f"memory: estimated peak {size(self.peak)} of {self.where} ({self.parts()}){free}"


def size(n: int) -> str:
    """Bytes as GiB (one decimal), or MiB below one GiB."""
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.0f} MiB"


# ---- activations ---------------------------------------------------------------------------------
def activation_bytes_per_token(mcfg: ModelConfig, bf16: bool) -> float:
    """Bytes autograd keeps per token and layer for the fused path (fp32, or bf16 autocast): a formula in the
    widths, fitted to the saved tensors of every block kind (tests/train/test_train_memory.py holds it within
    [0.8, 1.25] of them). m: bytes of a matmul output; norms compute in fp32."""
    m = 2 if bf16 else 4
    D, Hq, Gk, H, F = mcfg.d_model, mcfg.q_dim, mcfg.kv_dim, mcfg.n_heads, mcfg.ffn_hidden
    norms = _norms_per_block(mcfg)
    total = norms * D * (13 if bf16 else 12) + 8
    Ea = mcfg.attn_experts
    if not Ea:
        total += 2 * m * (Hq + Gk) + 4 * H
    elif mcfg.kv_mode == "expert":
        total += Ea * ((7 if bf16 else 12) * Hq + 2 * m * Gk + 4 * H)
    else:
        total += Ea * ((9 if bf16 else 16) * Hq + 4 * H) + 2 * m * Gk
    if mcfg.qk_norm != "none":  # each of q and k normed in fp32 (input and output kept)
        total += 8 * (Hq * max(Ea, 1) + Gk * (Ea if Ea and mcfg.kv_mode == "expert" else 1))
    per_ffn = (2 if mcfg.gated_ffn else 1) * 2 * m * F
    Ef = mcfg.ffn_experts
    if not Ef:
        total += per_ffn
    else:
        K = mcfg.ffn_top_k or Ef
        total += K * (per_ffn + (8 if bf16 else 12) * D + 20) + 8 * Ef + 24
        if mcfg.ffn_shared_hidden:
            total += (2 if mcfg.gated_ffn else 1) * 2 * m * mcfg.ffn_shared_hidden + 2 * m
    return float(total)


def _norms_per_block(mcfg: ModelConfig) -> int:
    if mcfg.norm_position == "sandwich":
        return 4
    if mcfg.norm_position == "post" or mcfg.block == "parallel_two_norms" or mcfg.block == "sequential":
        return 2
    return 1  # parallel: one shared norm


def _matmul_params(shapes: dict[str, tuple[int, ...]]) -> int:
    """Parameters of the matrices autocast casts to bf16 (every 2-D or stacked 3-D weight but the embeddings,
    norms and routers: routers run in fp32)."""
    return sum(math.prod(s) for n, s in shapes.items()
               if len(s) >= 2 and "router" not in n and not n.startswith(("embed.", "pos_embed.", "lm_head.")))


# ---- the plan ------------------------------------------------------------------------------------
def estimate_training_memory(mcfg: ModelConfig, *, micro_batch: int, seq_len: int, trainable: set[str] | None,
                             bf16: bool, optimizer_state: str, checkpointing: bool, device: torch.device,
                             world: int = 1, strategy: str = "ddp", process: int = 0) -> MemoryPlan:
    """The estimated peak of training mcfg (trainable: canonical names that train; None: all)."""
    shapes = tensor_shapes(mcfg)
    params = sum(math.prod(s) for s in shapes.values())
    trained = params if trainable is None else sum(math.prod(s) for n, s in shapes.items() if n in trainable)
    weights, gradients = 4 * params, 4 * trained
    optimizer = (4 if optimizer_state == "bf16" else 8) * trained
    if optimizer_state == "bf16":  # BF16StateAdamW's fp32 temporaries: five of a slice of the largest parameter
        largest = max((math.prod(s) for n, s in shapes.items() if trainable is None or n in trainable), default=0)
        optimizer += 5 * 4 * min(SLICE, largest)
    if world > 1 and strategy == "fsdp":
        block = max(sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"layers.{i}."))
                    for i in range(mcfg.n_layers))
        weights, gradients, optimizer = (weights // world + 2 * 4 * block, gradients // world + 2 * 4 * block,
                                         optimizer // world)
    elif world > 1:
        gradients *= 2  # DDP's buckets
    tokens = micro_batch * seq_len
    per_layer = activation_bytes_per_token(mcfg, bf16) * tokens
    if checkpointing:
        activations = mcfg.n_layers * 4 * tokens * mcfg.d_model + per_layer
    else:
        activations = mcfg.n_layers * per_layer
    activations += 3 * 4 * tokens * mcfg.d_model  # embeddings out, final norm, the head's saved input gradient
    if bf16:
        activations += 2 * _matmul_params(shapes)
    rows = min(tokens, loss_chunk_rows(mcfg.vocab_size, device))
    head = 4 * mcfg.vocab_size * mcfg.d_model + 3 * 4 * rows * mcfg.vocab_size  # fp32 grad; logits, lse, softmax
    if bf16:
        head += 2 * mcfg.vocab_size * mcfg.d_model + 2 * rows * mcfg.vocab_size
    where = "GPU memory" if device.type == "cuda" else "RAM"
    return MemoryPlan(weights, gradients, optimizer, int(activations), head, process, where, optimizer_state)


# ---- what the machine has -----------------------------------------------------------------------
def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can use now: CUDA, the device's free memory; else the RAM the kernel reports
    available (MemAvailable), within the cgroup's limit where one is set. None when unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    avail = _meminfo_available()
    limit = _cgroup_room()
    if avail is None:
        return limit
    return avail if limit is None else min(avail, limit)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max less memory.current of this process's cgroup; None without a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, ValueError, IndexError):
        return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---- the check ----------------------------------------------------------------------------------
def levers(cfg) -> list[tuple[str, dict]]:
    """The options that lower the peak and keep the loss curve (within the tolerances docs/training.md
    states), cheapest first, each with the TrainConfig changes it makes; only those not already on. cfg has
    batch_tokens resolved (the global batch a smaller micro-batch keeps by accumulating)."""
    out = []
    if cfg.micro_batch > 1 and cfg.batch_tokens <= KNOB_BOUNDS["batch_tokens"]:  # the same global batch in smaller
        # pieces: the same steps
        out.append((f"--micro-batch 1 --batch-tokens {cfg.batch_tokens}", {"micro_batch": 1}))
    if not cfg.activation_checkpointing:
        out.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if cfg.optimizer_state != "bf16":
        out.append(("--optimizer-state bf16", {"optimizer_state": "bf16"}))
    return out


def fitting_option(cfg, plan_for, need_limit: int) -> tuple[str, int] | None:
    """The first option, or combination in order, whose plan (plan_for(changes)) fits need_limit bytes:
    (its flags, its peak); None if even all of them do not fit."""
    options = levers(cfg)
    combos = [[o] for o in options] + [options[:k] for k in range(2, len(options) + 1)]
    for combo in combos:
        changes = {k: v for _, c in combo for k, v in c.items()}
        plan = plan_for(changes)
        if plan.peak - plan.process <= need_limit:
            return " with ".join(flag for flag, _ in combo), plan.peak
    return None


def check_training_memory(plan: MemoryPlan, available: int | None, cfg, plan_for, what: str) -> None:
    """Refuse (TrainError, one line) when the plan's peak, less what the process already holds, exceeds the
    memory available, naming the option (or options) that fits."""
    if available is None or plan.peak - plan.process <= available:
        return
    room = available + plan.process
    hint = fitting_option(cfg, plan_for, available)
    if hint is not None:
        advice = f"{hint[0]} brings it to {size(hint[1])}"
    else:
        names = " and ".join(flag for flag, _ in levers(cfg)) or "the memory options"
        advice = (f"even {names} leave it above that: use a machine with more memory, fewer trainable "
                  f"parameters (--trainable) or a shorter --seq-len")
    raise TrainError(f"{what} needs about {size(plan.peak)} of {plan.where} at its peak ({plan.parts()}); "
                     f"{size(room)} is available to it: {advice}")

