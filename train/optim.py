"""AdamW with the paper's defaults, the learning-rate schedule, and which parameters train.

Schedule (update n = 1, 2, ..., steps; the paper, Appendix B.2: warm-up 1500 to 1.2e-4, cosine to a tenth):
    n <= warmup:  lr_n = peak * n / warmup                           (linear from 0)
    n >  warmup:  lr_n = min + (peak - min) * (1 + cos(pi * p)) / 2,  p = (n - warmup) / (steps - warmup)
                  with min = min_lr_ratio * peak; so lr_steps = min.     (constant: lr_n = peak)
Weight decay applies to matrices (routers included) but not to norms, biases and embeddings unless
asked (decay_norms_and_biases, decay_embeddings); the LM head is a matrix and is decayed unless tied.

The optimizer (build_optimizer): torch's AdamW with fused=True (one kernel over all parameters, CPU and CUDA)
where torch has it for the parameters at hand, else its default implementation; with optimizer_state "bf16",
BF16StateAdamW: the same update in fp32, its two moments kept in bfloat16 (4 bytes per parameter instead of 8).
"""
from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from bam_surgery.runtime.layout import GROUPS, tensor_group

from .config import TrainConfig
from .errors import TrainError


def lr_at(n: int, cfg: TrainConfig) -> float:
    """Learning rate of update n (1-based)."""
    peak, warm = cfg.lr, cfg.warmup_steps
    if warm and n <= warm:
        return peak * n / warm
    if cfg.schedule == "constant" or cfg.steps <= warm:
        return peak
    p = min(1.0, (n - warm) / (cfg.steps - warm))
    low = cfg.min_lr_ratio * peak
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * p))


def canonical_name(param_name: str) -> str:
    """Model parameter name -> canonical tensor name (the one difference: lm_head_bias)."""
    return "lm_head.bias" if param_name == "lm_head_bias" else param_name


def select_trainable(names: list[str], patterns: list[str]) -> set[str]:
    """Apply the patterns in order: NAME-or-GLOB selects, !NAME-or-GLOB deselects. A pattern is a
    group name (runtime.layout.GROUPS) or an fnmatch glob over canonical names; one that matches
    nothing is an error (a typo would otherwise freeze or train the wrong thing silently)."""
    chosen: set[str] = set()
    for pat in patterns:
        neg = pat.startswith("!")
        body = pat[1:] if neg else pat
        if body in GROUPS:
            hit = {n for n in names if tensor_group(canonical_name(n)) == body}
        else:
            hit = {n for n in names if fnmatch.fnmatchcase(canonical_name(n), body)}
        if not hit:
            raise TrainError(f"trainable: pattern {pat!r} matches no parameter of this model (groups: "
                             f"{', '.join(GROUPS)}; or a glob such as 'layers.*.ffn_router.weight')")
        chosen = chosen - hit if neg else chosen | hit
    if not chosen:
        raise TrainError(f"trainable: {','.join(patterns)} leaves no parameter to train")
    return chosen


def apply_trainable(model: nn.Module, patterns: list[str]) -> list[str]:
    """Freeze what the patterns do not select; returns the trainable names in model order."""
    names = [n for n, _ in model.named_parameters()]
    chosen = select_trainable(names, patterns)
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
    return [n for n in names if n in chosen]


def decays(name: str, param: torch.Tensor, cfg: TrainConfig, tied: bool) -> bool:
    cname = canonical_name(name)
    group = tensor_group(cname)
    if cname.startswith(("embed.", "pos_embed.")) or (tied and cname.startswith("lm_head.")):
        return cfg.decay_embeddings
    if group == "norms" or cname.endswith(".bias") or param.dim() < 2:
        return cfg.decay_norms_and_biases
    return True


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool = True) -> tuple[torch.optim.Optimizer, list[str]]:
    """AdamW over the trainable parameters in two groups (decay, no decay); returns the optimizer and
    the parameter names in the optimizer's order (the key of its saved state). fused: torch's fused kernel where
    it takes these parameters (not for FSDP2's sharded ones: train/distributed.py passes False)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False))
    decay, plain, order = [], [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if decays(n, p, cfg, tied) else plain).append((n, p))
    groups = []
    for members, wd in ((decay, cfg.weight_decay), (plain, 0.0)):
        if members:
            groups.append({"params": [p for _, p in members], "weight_decay": wd})
            order += [n for n, _ in members]
    settings = dict(lr=lr_at(1, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if cfg.optimizer_state == "bf16":
        return BF16StateAdamW(groups, seed=cfg.seed, **settings), order
    if fused and _fused_adamw_takes(groups):
        return torch.optim.AdamW(groups, fused=True, **settings), order
    return torch.optim.AdamW(groups, **settings), order


def _fused_adamw_takes(groups: list[dict]) -> bool:
    """torch's fused AdamW (CPU since torch 2.4, CUDA) for these parameters: floating point, on a device it
    supports, plain tensors. It computes the same update as the default implementation (the tests hold the
    two to 1e-6 after several steps)."""
    params = [p for g in groups for p in g["params"]]
    supported = ("cpu", "cuda")
    return all(p.is_floating_point() and p.device.type in supported and type(p) in (torch.Tensor, nn.Parameter)
               for p in params)


# ---- AdamW with bfloat16 moments ----------------------------------------------------------------
SR_POOL = 1 << 20  # dither values drawn per step for stochastic rounding, reused across a parameter's elements
MOMENTS = ("exp_avg", "exp_avg_sq")
SLICE = 1 << 24  # elements of a parameter updated at a time: bounds the fp32 temporaries to 4 x 64 MiB


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's update: decoupled weight decay, bias-corrected moments) whose exp_avg and
    exp_avg_sq are stored in bfloat16: 4 bytes of state per parameter instead of 8. Each step reads the moments
    into fp32 a slice at a time, computes the update exactly as torch's single-tensor AdamW does, applies it to
    the (fp32) parameter with the fp32 moments, and stores them back in bf16 rounded stochastically: the 16
    dropped bits are dithered by uniform noise, so a moment's small increments (beta2 close to 1) are kept in
    expectation instead of being rounded away every step. The noise comes from a generator seeded by
    (seed, step): a run and its resumed copy take the same steps. Loss curves stay within the tolerance
    tests/train/test_train_memory.py states of fp32 state."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's Optimizer.load_state_dict casts floating state to the parameter's dtype (fp32); the moments
        are set aside, the rest loaded, and the moments put in as bf16, never held in fp32."""
        moments = {i: {k: v for k, v in st.items() if k in MOMENTS} for i, st in state_dict["state"].items()}
        rest = {i: {k: v for k, v in st.items() if k not in MOMENTS} for i, st in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in moments.get(i, {}).items():
                self.state[p][k] = v.to(device=p.device, dtype=torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        pools: dict[tuple[torch.device, int], torch.Tensor] = {}
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = int(state["step"])
                key = (p.device, t)
                if key not in pools:
                    gen = torch.Generator(device=p.device).manual_seed((group["seed"] * 1_000_003 + t) % 2**63)
                    pools[key] = torch.randint(0, 1 << 16, (SR_POOL,), generator=gen, dtype=torch.int32,
                                               device=p.device)
                bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
                p.mul_(1 - lr * wd)
                flat_p, flat_g = p.view(-1), p.grad.view(-1)
                flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for start in range(0, flat_p.numel(), SLICE):
                    s = slice(start, start + SLICE)
                    g = flat_g[s].float()
                    m = flat_m[s].float().lerp_(g, 1 - b1)
                    v = flat_v[s].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
                    flat_p[s].addcdiv_(m, denom, value=-lr / bias1)
                    flat_m[s] = _stochastic_bf16(m, pools[key])
                    flat_v[s] = _stochastic_bf16(v, pools[key])
        return loss


def _stochastic_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 x (1-D, a temporary: overwritten) rounded to bfloat16 stochastically: the low 16 bits of each value's
    magnitude get uniform noise [0, 2^16) added (the noise pool tiled over x), then are cut off, so the value
    rounds up with probability equal to the dropped fraction. Sign-magnitude bits make this symmetric in sign."""
    bits, n, k = x.view(torch.int32), x.numel(), noise.numel()
    whole = n // k * k
    if whole:
        bits[:whole].view(-1, k).add_(noise)
    bits[whole:].add_(noise[:n - whole])
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def compile_blocks(model: nn.Module, **options) -> None:
    """torch.compile each transformer block in place (nn.Module.compile), before any wrapping: the blocks of a
    model share one compiled graph (the trunk hands every block the same kind of input; runtime/blocks.py),
    so compiling costs one block's time whatever the depth; the embeddings, the chunked loss head and the
    optimizer stay eager. options go to torch.compile (e.g. backend)."""
    for block in model.layers:
        block.compile(**options)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
