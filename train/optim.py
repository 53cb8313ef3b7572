"""AdamW with the paper's defaults, the learning-rate schedule, and which parameters train.

Schedule (update n = 1, 2, ..., steps; the paper, Appendix B.2: warm-up 1500 to 1.2e-4, cosine to a tenth):
    n <= warmup:  lr_n = peak * n / warmup                           (linear from 0)
    n >  warmup:  lr_n = min + (peak - min) * (1 + cos(pi * p)) / 2,  p = (n - warmup) / (steps - warmup)
                  with min = min_lr_ratio * peak; so lr_steps = min.     (constant: lr_n = peak)
Weight decay applies to matrices (routers included) but not to norms, biases and embeddings unless
asked (decay_norms_and_biases, decay_embeddings); the LM head is a matrix and is decayed unless tied.
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


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over the trainable parameters in two groups (decay, no decay); returns the optimizer and
    the parameter names in the optimizer's order (the key of its saved state)."""
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
    opt = torch.optim.AdamW(groups, lr=lr_at(1, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    return opt, order


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
