"""One model class for dense and mixture (BAM / BTX / upcycled) transformers: the trunk of runtime/blocks.py
(where all of the model math lives) plus the output head and the training loss.

    model = Model(cfg)                       # model.impl = "fused" (default) or "reference" (the per-expert loop)
    out = model(tokens, targets=targets)     # out.logits [B, T, V]; out.loss = nll + alpha*lb_loss + beta*z_loss
    out = model(tokens, targets=targets, return_logits=False)   # loss only: the head and the fp32 cross-entropy
                                                                 # run in chunks of rows, no [B, T, V] logits

Targets: targets[b, t] is the token that position t predicts (the caller shifts; nothing is shifted here);
-100 is ignored. Shapes: B batch, T time, D d_model, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .blocks import (ForcedRouting, ModelKVCache, Routing, Transformer, _onednn, linear, load_balancing_loss,  # noqa: F401
                     mm, onednn_linear, route, router_losses, z_loss)
from .config import ModelConfig
from .layout import router_tensors
from .key_store import KeyStoreCollector
from .routers import KeyStoreRouter, init_tensor

# Rows of logits per chunk of the loss-only path (loss_chunk_rows): 2**26 fp32 logits (256 MiB) at most, e.g. 262
# rows at vocab 256000, the whole batch at once for small vocabularies; on a CUDA device 2**28 (1 GiB, 1,048 rows).
LOSS_CHUNK_ELEMENTS = 1 << 26
CUDA_LOSS_CHUNK_ELEMENTS = 1 << 28


@dataclass
class ModelOutput:
    logits: Optional[Tensor]  # [B, T, V] ([B, logits_to_keep, V]); None with return_logits=False
    loss: Optional[Tensor] = None  # nll + alpha * lb_loss + beta * z_loss
    nll: Optional[Tensor] = None
    lb_loss: Optional[Tensor] = None  # summed over routers that balance load
    z_loss: Optional[Tensor] = None  # summed over all routers
    # every router of the forward pass by name ("layers.3.ffn_router"), in execution order: the gates
    # actually applied [B*T, E], and (unless forced) the logits, full softmax and top-k choices
    routing: dict[str, Routing] = field(default_factory=dict)


class Model(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.lm_head_bias:
            self.lm_head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.loss_chunk_rows: Optional[int] = None  # rows per chunk of the loss-only path (None: automatic)
        for router in self.routers().values():  # the runtime's key stores learn (an HF export's only route)
            if isinstance(router, KeyStoreRouter):
                router.collector = KeyStoreCollector(cfg, router.n_experts)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init (normal(0, std) for matrices, ones/zeros for norms and biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        routers = router_tensors(self.config)  # each router tensor's own init (runtime/routers.py)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            with torch.no_grad():
                if name in routers:
                    p.copy_(init_tensor(routers[name], self.config, std, gen))
                elif name.endswith(("norm.weight", "layer_scale.weight")):
                    p.fill_(1.0)
                elif p.dim() == 1 or name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in self.named_buffers():  # router state moved by rules (a key store's keys and usage)
            if name in routers and not b.is_meta:
                with torch.no_grad():
                    b.copy_(init_tensor(routers[name], self.config, std, gen))

    # lm_head.bias is a canonical name but nn.Linear(bias=False) has no slot when tied; keep one place.
    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        if "lm_head_bias" in sd:
            sd["lm_head.bias"] = sd.pop("lm_head_bias")
        return sd

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        state = dict(state)
        if "lm_head.bias" in state:
            state["lm_head_bias"] = state.pop("lm_head.bias")
        return super().load_state_dict(state, strict=strict, assign=assign)

    @property
    def head_weight(self) -> Tensor:  # [V, D]
        return self.embed.weight if self.config.tie_embeddings else self.lm_head.weight

    def head(self, x: Tensor) -> Tensor:
        """Logits [..., V] of final-normed hidden states x [..., D]."""
        return self.output_logits(linear(x, self.head_weight, getattr(self, "lm_head_bias", None)))

    def forward(self, tokens: Tensor, targets: Tensor | None = None, routing: ForcedRouting | None = None, *,
                attention_mask: Tensor | None = None, positions: Tensor | None = None,
                input_pos: Tensor | None = None, cache: ModelKVCache | None = None, return_logits: bool = True,
                logits_to_keep: int = 0) -> ModelOutput:
        """tokens [B, T] -> ModelOutput.

        targets         [B, T]: targets[b, t] is the token position t predicts (not shifted here); -100 ignored
        routing         ForcedRouting to override the routers
        attention_mask  [B, S] 1 token, 0 padding (left or right); with a cache, over its slots
        positions       [B, T] position ids; default: real tokens counted from attention_mask, else input_pos
        input_pos       [T] key slots of the new tokens in the cache (required with a cache)
        cache           a ModelKVCache (model.new_cache(batch, max_len)) that the new keys and values go into
        return_logits   False: no logits; the loss (with targets) is computed chunk by chunk with the head,
                        never holding [B, T, V] fp32 logits or their gradient
        logits_to_keep  n > 0: logits of the last n positions only (decoding)
        Router losses average over every position, padding included; with a cache and no targets (decoding)
        they are not computed (None).
        """
        cfg = self.config
        B, T = tokens.shape
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {(B, T)} (one target per token)")
        if attention_mask is not None and cache is None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, T)}")
        x, trace = self.hidden_states(self.embed_tokens(tokens), attention_mask=attention_mask, positions=positions,
                                      input_pos=input_pos, cache=cache, routing=routing, tokens=tokens)
        out = ModelOutput(logits=None, routing=trace)
        if targets is not None or cache is None:  # not while decoding: nothing would read them
            out.lb_loss, out.z_loss = router_losses(trace, x.device)
        if return_logits:
            out.logits = self.head(x[:, -logits_to_keep:] if logits_to_keep else x)
        if targets is not None:
            if (out.logits is not None and not logits_to_keep) or cfg.final_softcap is not None:
                # whole logits: these, or (soft-capped logits, which the chunked head does not compute) new ones
                logits = (out.logits if out.logits is not None and not logits_to_keep else self.head(x)).float()
                out.nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
            else:
                rows = self.loss_chunk_rows or loss_chunk_rows(cfg.vocab_size, x.device)
                out.nll = linear_cross_entropy(x.reshape(B * T, -1), self.head_weight,
                                               getattr(self, "lm_head_bias", None), targets.reshape(-1),
                                               cfg.logit_scale, rows)
            out.loss = out.nll + cfg.lb_coef * out.lb_loss + cfg.z_coef * out.z_loss
        return out


# ---- loss-only head: chunked, gradients computed chunk by chunk -----------------------------
def loss_chunk_rows(vocab_size: int, device: torch.device) -> int:
    """Rows per chunk of the loss-only head: LOSS_CHUNK_ELEMENTS fp32 logits at most (256 MiB), or on a CUDA
    device CUDA_LOSS_CHUNK_ELEMENTS (1 GiB): each chunk adds its partial head gradient into the fp32
    accumulator (a pass over the [V, D] gradient), so fewer, larger chunks keep that traffic small."""
    limit = CUDA_LOSS_CHUNK_ELEMENTS if device.type == "cuda" else LOSS_CHUNK_ELEMENTS
    return max(1, limit // vocab_size)


def linear_cross_entropy(x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, scale: float,
                         chunk_rows: int) -> Tensor:
    """Mean cross-entropy of logits = scale * (x @ weight.T + bias) against targets (-100 ignored), for
    x [N, D], weight [V, D], targets [N], chunk_rows rows at a time. With gradients wanted, they are computed
    in the same pass (fp32 softmax minus one-hot, per chunk) and only scaled in backward, so no [N, V] tensor
    is ever held; the head's matmuls run once forward and twice for the gradients, as without chunking.
    Under autocast the weight (and x) are cast to the matmul dtype once per call, not per chunk and matmul: at
    vocab 256k the fp32 head is 1 GiB, and three casts per chunk were the largest single cost of a GPU step."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        return _LinearCrossEntropy.apply(x, weight, bias, targets, scale, chunk_rows)
    xm, wm, bm = _matmul_operands(x, weight, bias)
    total = torch.zeros((), device=x.device)
    for start in range(0, x.shape[0], chunk_rows):
        logits, t = _chunk_logits(xm[start:start + chunk_rows], wm, bm, scale), targets[start:start + chunk_rows]
        total = total + F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum()


def _matmul_operands(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """x, weight and bias in the dtype the head's matmul runs in: autocast's where it is on (as F.linear would
    cast them), else their own. Without autocast nothing is copied."""
    device = weight.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _chunk_logits(x: Tensor, weight: Tensor, bias: Tensor | None, scale: float, onednn: bool = False) -> Tensor:
    """fp32 logits [n, V] of x [n, D] already in the matmul dtype (_matmul_operands); onednn: by oneDNN where it
    runs (training's head, whose shapes recur: blocks.linear says why only there)."""
    with torch.autocast(weight.device.type, enabled=False):  # the operands are cast already
        logits = (onednn_linear(x, weight, bias) if onednn and _onednn(x, weight, bias)
                  else F.linear(x, weight, bias)).float()
    return logits.mul_(scale) if scale != 1.0 else logits


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, scale: float,
                chunk_rows: int) -> Tensor:
        valid = targets != -100
        count = valid.sum()
        xm, wm, bm = _matmul_operands(x, weight, bias)
        grad_x = torch.empty_like(x)
        # fp32 accumulators: each chunk's partial product (in the matmul dtype) is added in place, with no fp32
        # copy of it; a single chunk (small vocabularies, the CPU) writes its product straight in
        grad_w: Tensor | None = None
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        total = torch.zeros((), device=x.device)
        for start in range(0, x.shape[0], chunk_rows):
            xc, tc = xm[start:start + chunk_rows], targets[start:start + chunk_rows].clamp(min=0)
            vc = valid[start:start + chunk_rows].float()
            logits = _chunk_logits(xc, wm, bm, scale, onednn=True)  # [n, V] fp32
            lse = logits.logsumexp(-1)
            total = total + ((lse - logits.gather(-1, tc[:, None])[:, 0]) * vc).sum()
            # d(sum of NLL)/d logits = softmax - one_hot (valid rows only); times scale for x @ W.T + b; in place
            g = logits.sub_(lse[:, None]).exp_()
            g.scatter_add_(-1, tc[:, None], -torch.ones_like(vc)[:, None])
            g.mul_((vc * scale)[:, None])
            gm = g.to(wm.dtype)
            with torch.autocast(weight.device.type, enabled=False):
                grad_x[start:start + chunk_rows] = mm(gm, wm).to(x.dtype)
                part = mm(gm.t(), xc)  # [V, D]
            grad_w = part.float() if grad_w is None else grad_w.add_(part)
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_x, grad_w, grad_b, count)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total / count

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x, grad_w, grad_b, count = ctx.saved_tensors
        g = grad_out / count
        w_dtype, b_dtype = ctx.dtypes
        return (grad_x * g.to(grad_x.dtype), (grad_w * g).to(w_dtype),
                None if grad_b is None else (grad_b * g).to(b_dtype), None, None, None)
