"""The model math of bam-surgery in one torch-only file: norms, stacked expert projections, RoPE, routing and
router losses, the transformer block (a readable reference loop and a fused path), the static KV cache and
the transformer trunk.

One copy: the runtime (runtime/model.py) builds its Model on it, and every HF BAM export ships this very file
(as blocks_bam.py, byte for byte) next to modeling_bam.py, which imports it, together with runtime/routers.py
(as routers.py: the router kinds). So it imports only torch, the standard library and .routers. Configs are duck-typed: anything with ModelConfig's field names and its
`rotary_dim` works (runtime.config.ModelConfig, the export's BamConfig).

Shapes: B batch, T new tokens, S key slots (T, or the cache's length), D d_model, H heads, G kv heads,
Dh head dim, E experts, K top-k, N = B*T tokens, A = N*K expert assignments, V vocab.

Three implementations of a block, picked per forward (`impl`):
    reference  each expert in a plain Python loop: the oracle the tests hold the fused path to.
    fused      the path training and inference use; same parameters, same routing trace:
      attention experts   one wide attention. Q (and K, V with expert KV) for all E experts come from one
                          matmul over the stacked weights viewed as [E*out, D]; scaled-dot-product attention
                          runs over E*H query heads at once (expert KV: E*G kv heads; shared KV: the G shared
                          kv heads, GQA style, without copying them); each expert's head group is scaled by
                          its gate and the E output projections run as one batched matmul.
                          Top-k attention routing uses the same computation with unselected gates zero:
                          every expert still attends for every token (a token's keys serve later tokens
                          routed elsewhere, so they are always computed and cached); only the gate zeroes an
                          unselected expert's output. Nothing is skipped.
      FFN experts         the N*K (token, expert) assignments are sorted by expert and run through grouped
                          matmuls over the stacked [E, out, in] weights, then weighted by their gates and
                          summed per token: cost proportional to K, no Python loop over experts, no
                          host-device synchronisation per expert (see `expert_kernel`).
    export     the fused attention, and FFN experts by sparse dispatch without data-dependent control flow, for
               graph exporters (ONNX): a static loop over the E experts, each gathering the tokens routed to
               it (none, some or all: nonzero, gather, index_add), so each token runs through its K experts
               only; no grouped-matmul kernel, no host synchronisation. expert_kernel "dense" instead runs
               every expert on every token weighted by its gate (E FFNs per token: only to measure against).

Routing and auxiliary losses (paper, Appendix B.1), per router with N experts over B tokens:
    L_LB = N * sum_i f_i * P_i     f_i: fraction of the B*K top-k assignments that went to expert i
                                   P_i: mean over tokens of the full-softmax gate p_i(x)
    L_z  = (1/B) * sum_b (logsumexp_j x_j^b)^2
FFN routers and top-k attention routers contribute both; soft attention routers only L_z (every token goes
to every attention expert, so there is no load to balance). Router logits are computed in float32 (also
under autocast) unless the weights themselves are low precision.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .deltanet import causal_conv, gated_delta_chunked, gated_delta_recurrent, gated_rms_norm
from .routers import Router, make_router

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "swiglu": F.silu,  # gated: act(gate x) * up x
    "silu": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # gated (Gemma): act(gate x) * up x
}
GATED = ("swiglu", "geglu_tanh")
Impl = Literal["fused", "reference", "export"]  # a block's implementations (the module docstring)
IMPLS = get_args(Impl)
# Device types whose causal GQA goes straight to scaled_dot_product_attention(enable_gqa=True), whose flash
# kernel reads the shared kv heads itself: CUDA since torch 2.5 (where enable_gqa appeared), the CPU at the
# version tested, 2.13 (a profile shows no K/V copies; older versions took the math path, which copies them).
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_GQA_DEVICES = ("cuda", "cpu") if _TORCH >= (2, 13) else ("cuda",) if _TORCH >= (2, 5) else ()


# ---- routing --------------------------------------------------------------------------------
@dataclass
class ForcedRouting:
    """Override every router's gates (used by identity tests and debugging commands).

    expert=i       every router (attention and FFN) sends every token to expert i with gate 1.
    ffn_gates      Tensor [E]: the FFN gate values for every token (experts with gate 0 are skipped).
    attn_gates     Tensor [E]: the attention gate values for every token.
    shared_gate    the shared FFN expert's gate (in place of sigmoid(x . w)) for every token; 0: off.
    Unset parts keep the learned routers.
    """

    expert: Optional[int] = None
    ffn_gates: Optional[Tensor] = None
    attn_gates: Optional[Tensor] = None
    shared_gate: Optional[float] = None

    def gates(self, kind: str, n_experts: int) -> Optional[Tensor]:
        if self.expert is not None:
            if not 0 <= self.expert < n_experts:
                raise ValueError(f"ForcedRouting.expert={self.expert} out of range for {n_experts} {kind} experts")
            return F.one_hot(torch.tensor(self.expert), n_experts).float()
        g = self.ffn_gates if kind == "ffn" else self.attn_gates
        if g is not None and g.shape != (n_experts,):
            raise ValueError(f"ForcedRouting.{kind}_gates has shape {tuple(g.shape)}, expected ({n_experts},)")
        return g


@dataclass
class Routing:
    """Gates for one router over N = B*T tokens: dense [N, E] (zeros for unselected experts)."""

    gates: Tensor
    logits: Optional[Tensor] = None  # [N, E] router logits, float32 (None when forced)
    probs: Optional[Tensor] = None  # [N, E] full softmax
    topk: Optional[Tensor] = None  # [N, K] selected experts


def route(router: Router, x: Tensor, n_experts: int, top_k: Optional[int], gate_norm: str,
          forced: Optional[Tensor]) -> Routing:
    """Gates of any router kind (runtime/routers.py) for x [B, T, D]."""
    n_tok = x.shape[0] * x.shape[1]
    if forced is not None:
        return Routing(gates=forced.to(x.device, torch.float32).expand(n_tok, n_experts))
    flat = x.reshape(n_tok, x.shape[-1])  # [N, D]
    if _autocast_on(x.device.type):  # router logits in the weights' precision, not autocast's
        with torch.autocast(x.device.type, enabled=False):
            logits = router(flat.to(router.dtype))
    else:
        logits = router(flat)
    logits = logits.float()  # [N, E]
    probs = logits.softmax(-1)
    if top_k is None:  # soft routing: every expert, full softmax gates
        return Routing(gates=probs, logits=logits, probs=probs)
    top_p, top_i = probs.topk(top_k, dim=-1)  # [N, K]
    if gate_norm == "topk_softmax":
        top_p = top_p / top_p.sum(-1, keepdim=True)
    gates = torch.zeros_like(probs).scatter(-1, top_i, top_p)
    return Routing(gates=gates, logits=logits, probs=probs, topk=top_i)


def load_balancing_loss(probs: Tensor, topk: Tensor, n_experts: int) -> Tensor:
    """N * sum_i f_i * P_i; f from the top-k assignments (each token counts 1/K per slot)."""
    counts = torch.zeros(n_experts, device=probs.device).scatter_add(
        0, topk.reshape(-1), torch.ones(topk.numel(), device=probs.device))
    f = counts / topk.numel()
    P = probs.mean(0)
    return n_experts * (f * P).sum()


def z_loss(logits: Tensor) -> Tensor:
    return logits.logsumexp(-1).pow(2).mean()


def router_losses(trace: dict[str, Routing], device: torch.device) -> tuple[Tensor, Tensor]:
    """(sum of L_LB, sum of L_z) over a forward's routing trace: top-k routers (FFN, top-k attention) add
    both, soft attention routers only L_z; forced routers have nothing learned to regularize and add nothing."""
    lb = z = torch.zeros((), device=device)
    for r in trace.values():
        if r.logits is None:
            continue
        z = z + z_loss(r.logits)
        if r.topk is not None:
            lb = lb + load_balancing_loss(r.probs, r.topk, r.probs.shape[-1])
    return lb, z


# ---- building blocks ------------------------------------------------------------------------
class Norm(nn.Module):
    """LayerNorm (optional bias) in the input dtype, or RMSNorm computed in float32 (scaling by 1 + weight with
    norm_unit_offset, Gemma's convention, so its zero-initialised weights are ones), over the last `width` dims
    (default d_model). With experts > 0, E norms stacked (weight [E, width]): forward(x, e) applies expert e's,
    all_experts(x) expert e's to x[..., e, :, :] (a QK-norm of every attention expert at once)."""

    def __init__(self, cfg, width: Optional[int] = None, experts: int = 0):
        super().__init__()
        self.kind, self.eps, self.unit_offset = cfg.norm, cfg.norm_eps, cfg.norm_unit_offset
        width = width or cfg.d_model
        self.shape = (width,)  # a constant, not x.shape[-1]: graph exporters trace x's sizes as tensors
        lead = (experts,) if experts else ()
        self.weight = nn.Parameter(torch.ones(*lead, width))
        self.bias = nn.Parameter(torch.zeros(*lead, width)) if cfg.norm_bias else None

    def forward(self, x: Tensor, e: Optional[int] = None) -> Tensor:
        if self.weight.dim() == 1:
            return self._normed(x, self.weight, self.bias)
        return self._normed(x, self.weight[e], None if self.bias is None else self.bias[e])

    def all_experts(self, x: Tensor) -> Tensor:
        """x [..., E, n, width] -> the same shape, x[..., e, :, :] normed with expert e's weights."""
        view = (self.weight.shape[0], 1) + self.shape
        return self._normed(x, self.weight.view(view), None if self.bias is None else self.bias.view(view))

    def _normed(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        if self.kind == "layernorm":
            if weight.dim() == 1:
                return F.layer_norm(x, self.shape, weight, bias, self.eps)
            y = F.layer_norm(x, self.shape, None, None, self.eps) * weight
            return y if bias is None else y + bias
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + weight.float() if self.unit_offset else weight.float())).to(x.dtype)


# ---- linear maps ------------------------------------------------------------------------------
# A CPU BLAS runs a linear map of a few rows (a decoding step, a short prompt) on one thread: a matrix-vector
# product reads the weight at one core's memory bandwidth. `linear` runs it instead as one bmm over row blocks
# of the weight, one block per thread, which torch spreads over its threads (1.9x the decoding rate of a 135M
# model on 2 cores: BENCHMARKS.md, "CPU decoding"). Up to ROW_BLOCK_ROWS rows, measured faster on CPUs up to there.
ROW_BLOCK_ROWS = 128


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias); on a CPU, for at most ROW_BLOCK_ROWS rows outside autograd, autocast, compile
    and tracing, one bmm over torch.get_num_threads() row blocks of the weight: the same dot products, each summed
    by the BLAS in its own order (equal to F.linear's within float rounding); under autograd in float32 on an
    AVX-512 CPU, oneDNN's product (`onednn_linear`). Only there: a training run's shapes are the same every step,
    while oneDNN makes and keeps a primitive, with memory of its own, for every shape it meets (prompts of 5 to 400
    tokens through SmolLM2 kept 378 MiB more), and an expert's share of the tokens changes every call (a BAM
    mixture's training peaked 2.6 GiB higher with its experts' products in oneDNN)."""
    blocks = _row_blocks(x, weight)
    if blocks < 2:
        if _recording(x, weight, bias) and _onednn(x, weight, bias):
            return _OneDnnLinear.apply(x, weight, bias)
        return F.linear(x, weight, bias)
    n_out, n_in = weight.shape
    M, w = x.numel() // n_in, weight.view(blocks, n_out // blocks, n_in)
    rows = x.reshape(M, n_in)
    if M <= 4:  # [out/b, in] @ [in, M] per block (x transposed: a [in, 1] column of stride 1 takes a slow path)
        y = torch.bmm(w, rows.t().expand(blocks, n_in, M)).view(n_out, M).t()
    else:  # [M, in] @ [in, out/b] per block, as F.linear computes each row
        y = torch.bmm(rows.expand(blocks, M, n_in), w.transpose(1, 2)).transpose(0, 1).reshape(M, n_out)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n_out)


def _eager_cpu(x: Tensor) -> bool:
    """x on the CPU in an eager forward: no autocast, compile or tracing (TorchScript's ONNX export traces;
    torch.export and the dynamo ONNX export compile). Where `linear`'s row blocks and the "loop" expert kernel run."""
    return (x.device.type == "cpu" and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing())


def _row_blocks(x: Tensor, weight: Tensor) -> int:
    """How many row blocks `linear` splits the weight into: 1 (F.linear) unless the case above."""
    if (x.numel() == 0 or x.numel() > ROW_BLOCK_ROWS * weight.shape[-1] or x.dtype != weight.dtype
            or weight.dim() != 2 or not weight.is_contiguous()
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) or not _eager_cpu(x)):
        return 1
    threads, n_out = torch.get_num_threads(), weight.shape[0]
    if n_out % threads == 0:  # the usual case, without a search
        return threads
    return next((b for b in range(min(threads - 1, n_out), 1, -1) if n_out % b == 0), 1)  # the most that divide


# On a CPU torch runs an fp32 F.linear or matmul through MKL's sgemm, which takes its AVX2 kernels on CPUs not made
# by Intel; oneDNN (torch.ops.mkldnn._linear_pointwise, what inductor emits for a CPU linear map) takes the kernels
# of the instruction set the CPU reports. On an AMD Zen 5 (2 cores, AVX-512) a 2048^3 fp32 product runs at 475
# GFLOP/s against 205, a 135M model's training step in 0.7 s against 1.3 s (BENCHMARKS.md, "CPU training"); on an
# Intel CPU both reach the same peak. Both are float32 products, summed in their own orders (equal within float32
# rounding). BAM_SURGERY_CPU_MATMUL=blas keeps torch's own products everywhere.
def _onednn_available() -> bool:
    choice = os.environ.get("BAM_SURGERY_CPU_MATMUL", "auto")
    if choice == "blas":
        return False
    try:  # an older torch (the HF export runs on the user's) may lack either
        ops = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        return ops and (choice == "onednn" or torch.backends.cpu.get_cpu_capability() == "AVX512")
    except (AttributeError, RuntimeError):
        return False


ONEDNN_FP32 = _onednn_available()


def _onednn(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> bool:
    """Whether x @ weight.T (+ bias) runs through oneDNN: float32 tensors on a CPU in an eager
    forward (`_eager_cpu`: under autocast torch's own bf16 products are oneDNN's already)."""
    return (ONEDNN_FP32 and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() > 0
            and (bias is None or bias.dtype == torch.float32) and _eager_cpu(x))


def _recording(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a product of these: grad mode on and one of them requiring a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _dnn(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [..., in] @ weight.T [in, out] (+ bias) by oneDNN; strided (transposed) operands are read in place."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear by oneDNN, its gradients too (where `_onednn` holds; for shapes that recur: see `linear`)."""
    return _OneDnnLinear.apply(x, weight, bias) if _recording(x, weight, bias) else _dnn(x, weight, bias)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b of 2-D tensors outside autograd: oneDNN's where `_onednn` holds, else torch's."""
    return _dnn(a, b.t()) if _onednn(a, b) else a @ b


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _dnn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [N, out]
        grad_x = _dnn(g, weight.t()).view(x.shape) if ctx.needs_input_grad[0] else None  # g @ W
        grad_w = _dnn(g.t(), x.reshape(-1, x.shape[-1]).t()) if ctx.needs_input_grad[1] else None  # g.T @ x
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (the same parameters and state dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class StackedLinear(nn.Module):
    """E independent linear maps stored as one tensor: weight [E, out, in], bias [E, out]."""

    def __init__(self, n_experts: int, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_experts, n_out)) if bias else None

    def forward(self, x: Tensor, e: int) -> Tensor:
        """Expert e alone: [..., in] -> [..., out]."""
        return linear(x, self.weight[e], None if self.bias is None else self.bias[e])

    def all_experts(self, x: Tensor) -> Tensor:
        """Every expert on every token in one matmul: [..., in] -> [..., E*out], expert-major."""
        E, n_out, n_in = self.weight.shape
        bias = None if self.bias is None else self.bias.reshape(E * n_out)
        return linear(x, self.weight.reshape(E * n_out, n_in), bias)


class Projections(nn.Module):
    """Holds one attention's or FFN's projections, dense (nn.Linear) or stacked per expert."""

    def __init__(self, specs: dict[str, tuple[int, int, bool]], n_experts: int = 0):
        super().__init__()
        for name, (n_in, n_out, bias) in specs.items():
            mod = StackedLinear(n_experts, n_in, n_out, bias) if n_experts else Linear(n_in, n_out, bias=bias)
            self.add_module(name, mod)

    def proj(self, name: str, x: Tensor, e: Optional[int]) -> Tensor:
        mod = getattr(self, name)
        return mod(x) if e is None or isinstance(mod, nn.Linear) else mod(x, e)


def rotary_cos_sin(cfg, positions: Tensor, local: bool = False) -> tuple[Tensor, Tensor]:
    """RoPE tables for positions [B, T], computed once per forward: cos and signed sin [B, T, 1, rotary_dim]
    in float32, laid out so that apply_rotary is x * cos + swap(x) * sin (see there). Scaled RoPE
    (cfg.scaled_rope) changes the frequencies and may scale both tables (rope_frequencies); local: the sliding
    layers' plain RoPE of base cfg.window_rope_theta instead (over their own head size where the global layers'
    differs: cfg.global_head_dim)."""
    needs_length = not local and cfg.scaled_rope is not None and cfg.scaled_rope["rope_type"] in ("dynamic", "longrope")
    if local:
        inv_freq, scale = rope_frequencies(cfg, positions.device, theta=cfg.window_rope_theta, scaled=False,
                                           dim=cfg.rotary_dim)
    else:
        inv_freq, scale = rope_frequencies(cfg, positions.device, positions.max() + 1 if needs_length else None,
                                           dim=cfg.global_rotary_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, rot/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    if cfg.rope_interleaved:  # pairs (2i, 2i+1)
        return torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # pairs (i, i + rot/2)


def rope_frequencies(cfg, device: torch.device, seq_len: Optional[Tensor] = None, theta: Optional[float] = None,
                     scaled: bool = True, dim: Optional[int] = None) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies [dim/2] (dim: the rotated dims, cfg.rotary_dim by default) (float32, not a buffer, so casting the model to bf16 never
    rounds them) and the factor on cos and sin, computed as transformers computes them (modeling_rope_utils),
    op for op in float32 so that angles at long positions agree to the last bit:
        plain     theta^(-2i/d)
        linear    divided by factor
        dynamic   NTK: theta grows with the sequence length (seq_len: the largest position + 1) past max_positions
        yarn      interpolation blended with extrapolation by a linear ramp over the dims; cos, sin times mscale
        longrope  divided by per-pair short factors, or long ones once seq_len passes the original length; cos,
                  sin times sqrt(1 + ln(factor) / ln(original))
        llama3    low frequencies divided by factor, high ones kept, a smooth ramp between
        proportional  the first partial_rotary_factor of the pairs at theta^(-2i/d), the others frequency 0 (not
                  rotated), all divided by factor (Gemma 4's global layers)
    """
    dim, base, s = dim or cfg.rotary_dim, theta or cfg.rope_theta, cfg.scaled_rope if scaled else None
    kind = None if s is None else s["rope_type"]
    if kind == "proportional":
        rotated = int(s.get("partial_rotary_factor", 1.0) * dim // 2)
        exponent = torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = torch.cat((1.0 / (base ** exponent), torch.zeros(dim // 2 - rotated, device=device)))
        return inv_freq / s.get("factor", 1.0), 1.0
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if kind == "dynamic":
        seq = torch.clamp(seq_len, min=cfg.max_positions)
        base = base * ((s["factor"] * seq / cfg.max_positions) - (s["factor"] - 1)) ** (dim / (dim - 2))
    powers = base ** exponent
    inv_freq = 1.0 / powers
    if kind == "linear":
        return inv_freq / s["factor"], 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, s), 1.0
    if kind == "yarn":
        return _yarn_frequencies(cfg, dim, powers, s)
    if kind == "longrope":
        original = s["original_max_position_embeddings"]
        factor = s.get("factor") or cfg.max_positions / original
        scale = s.get("attention_factor")
        if scale is None:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        long, short = (torch.tensor(s[k], dtype=torch.float32, device=device) for k in ("long_factor", "short_factor"))
        return 1.0 / (torch.where(seq_len > original, long, short) * powers), scale
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1's rule: wavelengths past original / low_freq_factor divided by factor, below original /
    high_freq_factor kept, a linear blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(cfg, dim: int, powers: Tensor, s: dict) -> tuple[Tensor, float]:
    """YaRN: dims rotating fewer than beta_slow times over the original length are interpolated (divided by
    factor), those rotating more than beta_fast times extrapolated (kept), a linear ramp between; cos and sin
    scaled by 0.1 ln(factor) + 1 (or DeepSeek's mscale ratio), unless attention_factor says otherwise."""
    base = cfg.rope_theta
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_positions / original

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    scale = s.get("attention_factor")
    if scale is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        scale = float(mscale(m) / mscale(m_all)) if m and m_all else mscale()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(powers.device)
    return (1.0 / (factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation, scale


def query_scale(cfg, positions: Tensor) -> Optional[Tensor]:
    """The queries' scale by position [B, T, 1, 1] (float32) of a config with an attention temperature:
    1 + attn_temperature * ln(1 + floor(position / attn_temperature_length)), op for op as transformers' Ministral 3
    computes it; None without one."""
    if cfg.attn_temperature is None:
        return None
    scale = 1 + cfg.attn_temperature * torch.log(1 + torch.floor(positions / cfg.attn_temperature_length))
    return scale[:, :, None, None]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first rotary_dim dims of each head of x [B, T, heads, Dh] in float32: pair (a, b) becomes
    (a cos - b sin, b cos + a sin), for half-split pairs (i, i + rot/2) (Llama/NeoX) or interleaved pairs
    (2i, 2i+1) (GPT-J/Cohere). swap(x) puts each element's partner in its place."""
    dim = cos.shape[-1]
    rot = (x if dim == x.shape[-1] else x[..., :dim]).float()
    # flip, not slices and cat: one copy forward and backward (slicing's backward zero-fills whole tensors)
    if interleaved:
        swapped = rot.unflatten(-1, (dim // 2, 2)).flip(-1).flatten(-2)
    else:
        swapped = rot.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)
    out = (rot * cos).addcmul_(swapped, sin).to(x.dtype)  # in place: one pass less over [B, T, heads, rot]
    return out if dim == x.shape[-1] else torch.cat((out, x[..., dim:]), dim=-1)


# ---- attention ------------------------------------------------------------------------------
def attention_mask_for(attention_mask: Optional[Tensor], input_pos: Tensor, n_keys: int,
                       window: Optional[int] = None) -> Tensor:
    """Boolean [B or 1, 1, T, S] (True = may attend): key slot s <= the query's slot input_pos[t], within the
    window (s > input_pos[t] - window: the last `window` slots, the query's own included, as transformers'
    sliding-window masks count them), and not padding (attention_mask [B, >= S], 1 token, 0 padding). A
    padding query that may see no key at all sees every key instead, so its softmax stays finite (nothing
    reads its output)."""
    slots = torch.arange(n_keys, device=input_pos.device)[None, :]
    allowed = slots <= input_pos[:, None]  # [T, S]
    if window is not None:
        allowed = allowed & (slots > input_pos[:, None] - window)
    allowed = allowed[None]
    if attention_mask is not None:
        padding = attention_mask[:, :n_keys].to(torch.bool)
        if padding.shape[1] < n_keys:  # slots past the mask are future slots of a static cache: causally hidden
            padding = F.pad(padding, (0, n_keys - padding.shape[1]))
        allowed = allowed & padding[:, None, :]  # [B, T, S]
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return allowed[:, None]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: Optional[float] = None,
           softcap: Optional[float] = None) -> Tensor:
    """Scaled dot-product attention, q [B, Hq, T, Dh] over k, v [B, Hkv, S, Dh]: query head j reads kv head
    j // (Hq / Hkv). mask: bool [B or 1, 1, T, S], or None for plain causal attention (T == S). scale: of the
    logits (default 1/sqrt(Dh)); softcap c: logits become c * tanh(logits / c) before the mask (Gemma 2),
    which no fused kernel does, so that runs the written-out attention of _attend_graph.

    K and V are never copied per query head: the Hq/Hkv query heads that share a kv head are folded into the
    query length (plain attention with a mask, any backend); unmasked causal attention uses SDPA's own GQA
    instead where its flash kernel reads the shared heads itself (CUDA; the CPU at torch >= 2.13), which
    an explicit mask would rule out, and elsewhere one causal attention per group of query heads that share
    a kv head. Graph export traces _attend_graph instead."""
    B, Hq, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    q = q.to(k.dtype)  # a cache may hold another dtype than autocast's; cast the few queries, not the cache
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    if torch.onnx.is_in_onnx_export() or softcap is not None:
        return _attend_graph(q, k, v, mask, scale, softcap)
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    if mask is None:
        if q.device.type in _SDPA_GQA_DEVICES:  # flash attention reads the shared heads itself
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        # elsewhere enable_gqa copies K/V per query head (the math path), and folding needs an explicit
        # mask (no causal block skipping): one causal attention per group of query heads sharing a kv head
        groups = q.view(B, Hkv, rep, T, Dh)
        out = torch.stack([F.scaled_dot_product_attention(groups[:, :, r], k, v, is_causal=True, scale=scale)
                           for r in range(rep)], dim=2)
        return out.view(B, Hq, T, Dh)
    folded = q.reshape(B, Hkv, rep * T, Dh)  # row r*T + t: query head g*rep + r at token t
    mask = mask[:, :, None].expand(mask.shape[0], 1, rep, T, S).reshape(mask.shape[0], 1, rep * T, S)
    # reshape, not view: CUDA's kernels may return the folded rows in a layout a view cannot unfold
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale).reshape(B, Hq, T, Dh)


def _attend_graph(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
                  softcap: Optional[float] = None) -> Tensor:
    """attend() written out for a graph exporter: the exporters' own SDPA decomposition turns a boolean mask
    into a float one in every layer and, after the softmax, replaces NaN rows (a row that may see no key) with
    zeros: two more passes over every [T, S] score matrix. attention_mask_for never leaves a row without a key,
    so here the mask is one additive bias and there is no NaN pass. The query heads that share a kv head are
    folded into the query length (one [rep*T, Dh] @ [Dh, S] product per kv head: no K/V copies), and the bias
    broadcasts over them as [rep, T, S] (no mask copied per query head)."""
    B, Hq, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    scores = torch.matmul(q.reshape(B, Hkv, rep * T, Dh) * scale, k.transpose(-1, -2))  # [B, Hkv, rep*T, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = attention_mask_for(None, torch.arange(T, device=q.device) + (S - T), S)  # causal, the last T slots
    bias = torch.where(mask, torch.zeros((), dtype=scores.dtype), torch.full((), float("-inf"), dtype=scores.dtype))
    weights = torch.softmax(scores.view(B, Hkv, rep, T, S) + bias[:, :, None], dim=-1)
    return torch.matmul(weights.view(B, Hkv, rep * T, S), v).reshape(B, Hq, T, Dh)


# ---- FFN experts: grouped matmuls over assignments sorted by expert -----------------------
ExpertKernel = Literal["grouped", "gather", "padded", "loop"]  # grouped_linear's kernels
EXPERT_KERNELS = get_args(ExpertKernel)
# What a forward may force: one of those, or "dense" (every expert on every token, times its gate)
FFNKernel = Literal[ExpertKernel, "dense"]


def expert_kernel(x: Tensor, n_assignments: int, n_experts: int) -> ExpertKernel:
    """How sorted assignments meet their experts' weights (all three compute the same thing):
    grouped  torch._grouped_mm: one kernel over the per-expert row segments (CPU; CUDA bf16 on sm90+);
             under torch.compile only in bf16 (its meta function allows nothing else).
    gather   each assignment gathers its expert's weight matrix: for a handful of tokens (decoding), static
             shapes, no synchronisation; copies at most 2x the layer's expert weights.
    padded   rows scattered into a [E, C, in] buffer, C the largest expert's row count, then one batched
             matmul: one host synchronisation per layer (to read C), none per expert.
    loop     each expert's row segment through `linear` (row blocks across the threads for a few rows): the CPU
             outside autograd and compile, where _grouped_mm runs each expert's product on one thread and a
             host synchronisation costs nothing (1.8x a BAM mixture's decoding on 2 cores: BENCHMARKS.md)."""
    if _eager_cpu(x) and not torch.is_grad_enabled():
        return "loop"
    dtype = _matmul_dtype(x)
    if hasattr(torch, "_grouped_mm"):
        on_cpu = x.device.type == "cpu"
        on_hopper = (x.device.type == "cuda" and dtype == torch.bfloat16
                     and torch.cuda.get_device_capability(x.device) >= (9, 0))
        if (on_cpu or on_hopper) and (dtype == torch.bfloat16 or not torch.compiler.is_compiling()):
            return "grouped"
    return "gather" if n_assignments <= 2 * n_experts else "padded"


def _autocast_on(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type)


def _matmul_dtype(x: Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if _autocast_on(x.device.type) else x.dtype


def grouped_linear(xs: Tensor, lin: StackedLinear, expert: Tensor, counts: Tensor, ends: Tensor,
                   kernel: ExpertKernel) -> Tensor:
    """Rows xs [A, in] sorted by expert (expert [A]; counts [E] rows per expert, ends [E] their cumulative sum)
    -> [A, out], row a through expert[a]'s linear map."""
    W = lin.weight  # [E, out, in]
    if kernel == "grouped":
        dtype = _matmul_dtype(xs)
        y = torch._grouped_mm(xs.to(dtype), W.to(dtype).transpose(-2, -1), offs=ends.to(torch.int32))
    elif kernel == "gather":
        y = torch.bmm(xs[:, None, :], W[expert].transpose(1, 2))[:, 0]  # [A, 1, in] @ [A, in, out]
    elif kernel == "loop":
        y = xs.new_empty(xs.shape[0], W.shape[1])
        bounds = [0, *ends.tolist()]
        for e, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if end > start:
                y[start:end] = linear(xs[start:end], W[e])
    else:
        E, A = W.shape[0], xs.shape[0]
        capacity = int(counts.max())  # the one host synchronisation of this kernel
        slot = torch.arange(A, device=xs.device) - (ends - counts)[expert]  # row within its expert
        buffer = xs.new_zeros(E, capacity, xs.shape[1]).index_put((expert, slot), xs)
        y = torch.bmm(buffer, W.transpose(1, 2))[expert, slot]  # [E, C, out] -> [A, out]
    if lin.bias is not None:
        y = y + lin.bias[expert].to(y.dtype)
    return y


def expert_mixture(x: Tensor, experts: Tensor, gates: Tensor, ffn: Projections, act: Callable[[Tensor], Tensor],
                   gated: bool, kernel: Optional[ExpertKernel] = None) -> Tensor:
    """sum_k gates[n, k] * FFN_{experts[n, k]}(x[n]) for x [N, D], experts and gates [N, K] -> [N, D] (x's dtype)."""
    N, K = experts.shape
    E = ffn.up.weight.shape[0]
    flat = experts.reshape(-1)  # [A]: assignment a = n*K + k
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    kernel = kernel or expert_kernel(x, flat.numel(), E)
    xs = x[order // K]  # [A, D], sorted by expert
    h = grouped_linear(xs, ffn.up, expert, counts, ends, kernel)
    if gated:
        h = act(grouped_linear(xs, ffn.gate, expert, counts, ends, kernel)) * h
    else:
        h = act(h)
    y = grouped_linear(h, ffn.down, expert, counts, ends, kernel)  # [A, D], sorted
    y = y * gates.reshape(-1)[order, None].to(y.dtype)
    y = torch.zeros_like(y).index_copy(0, order, y)  # back to assignment order n*K + k
    return y.to(x.dtype).view(N, K, -1).sum(1)


# ---- the block ------------------------------------------------------------------------------
@dataclass
class ForwardPass:
    """What one forward pass hands every block."""

    rope: Optional[tuple[Tensor, Tensor]]  # cos, signed sin [B, T, 1, rot] (rotary_cos_sin), or None (no RoPE)
    input_pos: Tensor  # [T] the new tokens' key slots
    attention_mask: Optional[Tensor]  # [B, >= S] 1 token, 0 padding; None: no padding
    cache: object = None  # .update(layer, input_pos, k, v) -> (k, v) [B, Hkv, S, Dh]; None: no cache
    forced: Optional[ForcedRouting] = None
    impl: Impl = "fused"
    expert_kernel: Optional[FFNKernel] = None  # None: expert_kernel() decides
    routing: dict = field(default_factory=dict)  # router name -> Routing, in execution order (a block's own: by kind)
    masks: dict = field(default_factory=dict)  # S -> attention mask, built once per key length
    # a fused prefill into a cache from slot 0, no padding: attend over the first T slots, causally (no mask)
    prefill_from_zero: bool = False
    rope_local: Optional[tuple[Tensor, Tensor]] = None  # the sliding layers' own RoPE (Gemma 3), or None: rope
    # keys and values [B, kv heads, S, Dh] of the layers that others read (kv_source), by layer, this pass
    shared_kv: dict = field(default_factory=dict)
    per_layer: Optional[Tensor] = None  # [B, T, L, Dp] per-layer inputs (Gemma 4's PLE), or None
    query_scale: Optional[Tensor] = None  # [B, T, 1, 1] the queries' scale by position (query_scale()), or None

    def mask(self, n_keys: int, window: Optional[int] = None) -> Optional[Tensor]:
        """The mask over n_keys key slots (a sliding window of `window` slots, or the whole causal prefix), or
        None where plain causal attention over the T new tokens is the same thing."""
        plain = (self.cache is None or self.prefill_from_zero) and self.attention_mask is None
        if plain and (window is None or n_keys <= window):
            return None
        if (n_keys, window) not in self.masks:
            self.masks[n_keys, window] = attention_mask_for(self.attention_mask, self.input_pos, n_keys, window)
        return self.masks[n_keys, window]


def block_norms(cfg) -> tuple[str, ...]:
    """A block's norms by canonical name: before the sublayers (attn_norm, and ffn_norm unless the block is parallel)
    with norm_position pre or sandwich; after them, each output normed before the residual add (attn_post_norm,
    ffn_post_norm), with post (OLMo 2, which has none before) or sandwich (Gemma)."""
    before = ("attn_norm",) + (("ffn_norm",) if cfg.block != "parallel" else ())
    after = ("attn_post_norm", "ffn_post_norm")
    return (before if cfg.norm_position != "post" else ()) + (after if cfg.norm_position != "pre" else ())


def layer_window(cfg, index: int) -> Optional[int]:
    """The sliding window of layer `index` (attn_window in a window layer), else None (the whole causal prefix)."""
    return cfg.attn_window if cfg.is_window_layer(index) else None


class Param(nn.Module):
    """One tensor as a module's parameter under a given name (canonical names such as linear.dt.bias)."""

    def __init__(self, name: str, shape: tuple[int, ...], value: float = 0.0):
        super().__init__()
        self.register_parameter(name, nn.Parameter(torch.full(shape, value)))


class LinearMixer(nn.Module):
    """A Gated DeltaNet token mixer (Qwen3.5's linear attention; runtime/deltanet.py has the math), or E of them
    stacked (experts > 0: each its own projections, convolution and recurrent state). Parameters (canonical names
    under layers.{i}.linear / linear_experts, runtime/layout.py): qkv, z, b, a, out (linear maps), conv.weight
    [C, K], dt.bias and a_log.weight [Hv], norm.weight [Dv]; each with a leading [E] for experts."""

    def __init__(self, cfg, experts: int = 0):
        super().__init__()
        D, Hk, Hv = cfg.d_model, cfg.linear_key_heads, cfg.linear_value_heads
        Dk, Dv, K = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv
        self.shape = (Hk, Hv, Dk, Dv, K)
        self.channels = 2 * Hk * Dk + Hv * Dv
        self.eps, self.experts = cfg.norm_eps, experts
        lead = (experts,) if experts else ()
        for name, (n_in, n_out) in dict(qkv=(D, self.channels), z=(D, Hv * Dv), b=(D, Hv), a=(D, Hv),
                                        out=(Hv * Dv, D)).items():
            self.add_module(name, StackedLinear(experts, n_in, n_out, False) if experts else nn.Linear(n_in, n_out,
                                                                                                        bias=False))
        self.conv = Param("weight", lead + (self.channels, K))
        self.dt = Param("bias", lead + (Hv,))
        self.a_log = Param("weight", lead + (Hv,))
        self.norm = Param("weight", lead + (Dv,), 1.0)

    def _w(self, name: str, e: Optional[int]) -> Tensor:
        """A parameter as [E', ...]: every expert's (e None), expert e's alone, or the dense one (E' = 1)."""
        mod = getattr(self, name)
        w = mod.weight if isinstance(mod, (nn.Linear, StackedLinear)) else next(iter(mod.parameters()))
        if not self.experts:
            return w[None]
        return w if e is None else w[e:e + 1]

    def forward(self, x: Tensor, state: Optional[tuple[Tensor, Tensor]], gates: Optional[Tensor] = None,
                e: Optional[int] = None, recurrent: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, D] -> (output [B, T, D], (conv state [B, E'*C, K-1], recurrent state [B, E'*Hv, Dk, Dv])).

        Every expert at once (e None; E' = E), or expert e alone (E' = 1), or the dense mixer. gates [B*T, E']:
        each expert's output weight (experts only); state: the states before x (None: a sequence's start);
        recurrent: the token-by-token rule instead of the chunked one (always for one token)."""
        Hk, Hv, Dk, Dv, K = self.shape
        B, T, D = x.shape
        w = {n: self._w(n, e) for n in ("qkv", "z", "b", "a", "out", "conv", "dt", "a_log", "norm")}
        E = w["qkv"].shape[0]
        mixed = F.linear(x, w["qkv"].reshape(E * self.channels, D))  # [B, T, E*C]
        conv, rec = (None, None) if state is None else state
        mixed, conv = causal_conv(mixed.transpose(1, 2), w["conv"].reshape(E * self.channels, K), conv)
        q, k, v = mixed.transpose(1, 2).reshape(B, T, E, self.channels).split((Hk * Dk, Hk * Dk, Hv * Dv), -1)
        q, k = q.reshape(B, T, E * Hk, Dk), k.reshape(B, T, E * Hk, Dk)
        if Hv != Hk:  # each key head serves Hv/Hk consecutive value heads of its expert
            q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
        beta = torch.sigmoid(F.linear(x, w["b"].reshape(E * Hv, D)))  # [B, T, E*Hv]
        f32 = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 for a float64 model)
        g = -w["a_log"].reshape(E * Hv).to(f32).exp() * F.softplus(
            F.linear(x, w["a"].reshape(E * Hv, D)).to(f32) + w["dt"].reshape(E * Hv))
        rule = gated_delta_recurrent if recurrent or T == 1 else gated_delta_chunked
        o, rec = rule(q, k, v.reshape(B, T, E * Hv, Dv), g, beta, rec)  # [B, T, E*Hv, Dv]
        z = F.linear(x, w["z"].reshape(E * Hv * Dv, D)).view(B, T, E * Hv, Dv)
        o = gated_rms_norm(o, w["norm"].repeat_interleave(Hv, dim=0), z, self.eps)  # [B, T, E*Hv, Dv]
        if gates is None:
            return F.linear(o.reshape(B, T, Hv * Dv), w["out"][0]), (conv, rec)
        y = o.reshape(B * T, E, Hv * Dv).transpose(0, 1) * gates.t()[:, :, None].to(o.dtype)  # [E, N, Hv*Dv]
        return torch.bmm(y, w["out"].transpose(1, 2)).sum(0).view(B, T, D), (conv, rec)


class Block(nn.Module):
    """One transformer block; dense or mixture attention (or a Gated DeltaNet token mixer), dense or mixture FFN.

    Parameters (canonical names, see runtime/layout.py):
      attn          dense Q, K, V, O; or, in a shared-KV mixture, the one shared K and V
      attn_experts  stacked [E, ...] Q, O and (expert KV) K, V
      attn_router   a Router of kind cfg.attn_router_kind (runtime/routers.py): [N, D] -> logits [N, E]
      linear        in a Gated DeltaNet layer (cfg.linear_layers), the mixer in place of attention (LinearMixer);
                    linear_experts: E of them, mixed by attn_router
      ffn           dense gate/up/down;  ffn_experts: stacked [E, ...];  ffn_router: kind cfg.ffn_router_kind
      ffn_shared    beside ffn_experts, the always-on shared expert (gate/up/down of width ffn_shared_hidden),
                    its output times sigmoid(ffn_shared_gate(x)) (Qwen2-MoE's shared_expert and its gate)
      ple, ple_norm Gemma 4's per-layer input: gate [Dp, D], out [D, Dp], the norm of its output
      layer_scale   Gemma 4's scalar on the block's output
    Per layer (cfg's per-layer rules, runtime/config_rules.py): the head size and kv heads (Gemma 4's global
    layers), no K/V of its own where the layer reads another's (kv_source), no V where K = V.
    """

    def __init__(self, cfg, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        D, H = cfg.d_model, cfg.n_heads
        self.head_dim, self.n_kv = Dh, G = cfg.layer_head_dim(index), cfg.layer_kv_heads(index)
        for name in block_norms(cfg):
            self.add_module(name, Norm(cfg))
        self.window = layer_window(cfg, index)  # attends to the last `window` slots
        # the attention logits' scale: its own (Granite), 1/sqrt(attn_scale_dim) (Gemma), or None: 1/sqrt(head_dim)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else (
            None if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5)
        self.residual = cfg.residual_multiplier  # each sublayer's output times this before it is added (Granite)
        self.use_rope = index not in (cfg.nope_layers or ())  # SmolLM3: no RoPE in some layers
        self.is_linear = cfg.is_linear_layer(index)
        self.kv_source = cfg.kv_source(index)
        self.owns_kv, self.k_eq_v = self.kv_source == index, cfg.layer_k_eq_v(index)
        # whether a later layer reads this one's K/V: only then is it kept in the pass's shared_kv (a block that
        # writes there unread would change its state per layer, and a compiled block would recompile per layer)
        self.kv_read = any(cfg.kv_source(j) == index for j in range(index + 1, cfg.n_layers))
        self._build_mixer(cfg, D, H, Dh, G)
        self.gated = cfg.activation in GATED
        F_ = cfg.layer_ffn_hidden(index)
        ffn = {"gate": (D, F_, cfg.ffn_bias)} if self.gated else {}
        ffn.update(up=(D, F_, cfg.ffn_bias), down=(F_, D, cfg.ffn_bias))
        if cfg.ffn_experts:
            self.ffn_router = make_router(cfg.ffn_router_kind, cfg, cfg.ffn_experts)
            self.ffn_experts = Projections(ffn, cfg.ffn_experts)
        else:
            self.ffn = Projections(ffn)
        if cfg.ffn_shared_hidden:
            Fs = cfg.layer_shared_hidden(index)
            shared = {"gate": (D, Fs, cfg.ffn_bias)} if self.gated else {}
            self.ffn_shared = Projections({**shared, "up": (D, Fs, cfg.ffn_bias), "down": (Fs, D, cfg.ffn_bias)})
            self.ffn_shared_gate = nn.Linear(D, 1, bias=False)
        if cfg.per_layer_dim:
            Dp = cfg.per_layer_dim
            self.ple = Projections({"gate": (D, Dp, False), "out": (Dp, D, False)})
            self.ple_norm = Norm(cfg)
        if cfg.layer_scale:
            self.layer_scale = Param("weight", (1,), 1.0)
        self.act = ACTIVATIONS[cfg.activation]


    def _build_mixer(self, cfg, D: int, H: int, Dh: int, G: int) -> None:
        """The token mixer's modules: a Gated DeltaNet (or its experts and their router), or the attention's
        projections (dense, expert K/V or shared K/V) with their QK-norms, owned like the projection."""
        Ea = self.n_attn_experts = cfg.layer_attn_experts(self.index)  # read once: forward is the same for every layer
        self.expert_kv = bool(Ea) and cfg.kv_mode == "expert" and not self.is_linear
        self.kv_heads = (Ea if self.expert_kv else 1) * G  # heads this block caches (or reads from kv_source)
        if self.is_linear:
            if Ea:
                self.attn_router = make_router(cfg.attn_router_kind, cfg, Ea)
                self.linear_experts = LinearMixer(cfg, Ea)
            else:
                self.linear = LinearMixer(cfg)
        else:
            q = {"q": (D, H * Dh, cfg.qkv_bias)}
            if cfg.attn_output_gate:
                q["gate"] = (D, H * Dh, cfg.qkv_bias)
            kv = {"k": (D, G * Dh, cfg.qkv_bias)} if self.owns_kv else {}
            if self.owns_kv and not self.k_eq_v:
                kv["v"] = (D, G * Dh, cfg.qkv_bias)
            o = {"o": (H * Dh, D, cfg.o_bias)}
            if Ea == 0:
                self.attn = Projections({**q, **kv, **o})
            elif self.expert_kv:
                self.attn_router = make_router(cfg.attn_router_kind, cfg, Ea)
                self.attn_experts = Projections({**q, **kv, **o}, Ea)
            else:
                self.attn_router = make_router(cfg.attn_router_kind, cfg, Ea)
                self.attn = Projections(kv)
                self.attn_experts = Projections({**q, **o}, Ea)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm != "none" and not self.is_linear:  # a norm per projection, owned like the projection
            width = {"q": Dh, "k": Dh} if self.qk_norm == "head" else {"q": H * Dh, "k": G * Dh}
            for name in ("q", "k") if self.owns_kv else ("q",):
                owner, experts = (self.attn_experts, Ea) if self._expert_owned(name) else (self.attn, 0)
                owner.add_module(f"{name}_norm", Norm(cfg, width[name], experts))

    def forward(self, x: Tensor, step: ForwardPass) -> Tensor:
        style, where, r = self.cfg.block, self.cfg.norm_position, self._residual
        if where == "post":  # OLMo 2
            h = x + r(self.attn_post_norm(self.attention(x, step)))
            h = h + r(self.ffn_post_norm(self.feed_forward(h, step)))
        elif where == "sandwich":  # Gemma
            h = x + r(self.attn_post_norm(self.attention(self.attn_norm(x), step)))
            h = h + r(self.ffn_post_norm(self.feed_forward(self.ffn_norm(h), step)))
        elif style == "sequential":
            h = x + r(self.attention(self.attn_norm(x), step))
            h = h + r(self.feed_forward(self.ffn_norm(h), step))
        elif style == "parallel":  # one shared norm (PaLM, GPT-J, Cohere, the paper)
            n = self.attn_norm(x)
            h = x + r(self.attention(n, step)) + r(self.feed_forward(n, step))
        else:  # parallel_two_norms (GPT-NeoX)
            h = x + r(self.attention(self.attn_norm(x), step)) + r(self.feed_forward(self.ffn_norm(x), step))
        if self.cfg.per_layer_dim:  # Gemma 4: the layer's own input, gated by the hidden state, added
            y = self.act(self.ple.gate(h)) * step.per_layer[:, :, self.index].to(h.dtype)
            h = h + self.ple_norm(self.ple.out(y))
        if self.cfg.layer_scale:
            h = h * self.layer_scale.weight
        return h

    def _residual(self, y: Tensor) -> Tensor:
        """A sublayer's output as it joins the residual stream: times residual_multiplier (Granite's), if not 1."""
        return y if self.residual == 1.0 else y * self.residual

    # -- routing ---------------------------------------------------------------------------
    def _route(self, kind: str, x: Tensor, step: ForwardPass) -> Routing:
        cfg = self.cfg
        E, top_k = ((self.n_attn_experts, cfg.attn_top_k) if kind == "attn"
                    else (cfg.ffn_experts, cfg.ffn_top_k))
        router = self.attn_router if kind == "attn" else self.ffn_router
        r = route(router, x, E, top_k, cfg.gate_norm, step.forced.gates(kind, E) if step.forced else None)
        step.routing[f"{kind}_router"] = r  # the trunk names it layers.{index}.{kind}_router
        return r

    def _cache(self, k: Tensor, v: Tensor, step: ForwardPass) -> tuple[Tensor, Tensor]:
        """k, v [B, kv_heads, T, Dh] of the new tokens -> every key slot's [B, kv_heads, S, Dh]."""
        return (k, v) if step.cache is None else step.cache.update(self.index, step.input_pos, k, v)

    def _values(self, x: Tensor, k_raw: Tensor, name_owner: Projections, e: Optional[int], all_experts: bool
                ) -> Tensor:
        """V of the new tokens [..., heads*Dh]: its projection, or (K = V layers) the keys' projection before their
        norm; the caller reshapes to heads and applies _v_norm."""
        if self.k_eq_v:
            return k_raw
        return name_owner.v.all_experts(x) if all_experts else name_owner.proj("v", x, e)

    def _v_norm(self, v: Tensor) -> Tensor:
        """Gemma 4's value norm: RMS over each head [..., Dh], no scale, in float32; unchanged without it."""
        if not self.cfg.v_norm:
            return v
        vf = v.float()
        return (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).to(v.dtype)

    def _gate(self, y: Tensor, x: Tensor, e: Optional[int]) -> Tensor:
        """The attention output y [B, T, H*Dh] times sigmoid(x W_gate) (attn_output_gate, Qwen3.5); unchanged
        without it."""
        if not self.cfg.attn_output_gate:
            return y
        owner = self.attn_experts if self._expert_owned("gate") else self.attn
        return y * torch.sigmoid(owner.proj("gate", x, e))

    def _shared(self, step: ForwardPass) -> tuple[Tensor, Tensor]:
        """The keys and values of the layer this one reads (kv_source), computed earlier in the same pass."""
        return step.shared_kv[self.kv_source]

    def _rope(self, x: Tensor, step: ForwardPass) -> Tensor:
        if step.rope is None or not self.use_rope:
            return x
        rope = step.rope_local if self.window is not None and step.rope_local is not None else step.rope
        return apply_rotary(x, *rope, self.cfg.rope_interleaved)

    def _query(self, q: Tensor, step: ForwardPass) -> Tensor:
        """Queries [B, T, heads, Dh] after RoPE, and times their scale by position where the config has one."""
        q = self._rope(q, step)
        return q if step.query_scale is None else q * step.query_scale.to(q.dtype)

    def _qk(self, name: str, y: Tensor, e: Optional[int]) -> Tensor:
        """Projection q or k of expert e (None: dense or shared), y [B, T, heads*Dh], through its QK-norm: over
        each head (Qwen3) or the full width (OLMo 2); unchanged without one."""
        if self.qk_norm == "none":
            return y
        norm = getattr(self.attn_experts if self._expert_owned(name) else self.attn, f"{name}_norm")
        if self.qk_norm == "full":
            return norm(y, e)
        return norm(y.unflatten(-1, (-1, self.head_dim)), e).flatten(-2)

    def _qk_all(self, name: str, y: Tensor, n_experts: int) -> Tensor:
        """Projection q or k of every expert at once, y [B, T, E*heads*Dh] expert-major, through each expert's
        QK-norm."""
        if self.qk_norm == "none":
            return y
        norm = getattr(self.attn_experts, f"{name}_norm")
        width = self.head_dim if self.qk_norm == "head" else norm.shape[0]
        return norm.all_experts(y.unflatten(-1, (n_experts, -1, width))).flatten(-3)

    def attention(self, x: Tensor, step: ForwardPass) -> Tensor:
        """The token mixer: softmax attention, or in a Gated DeltaNet layer the linear one."""
        if self.is_linear:
            return self.linear_attention(x, step)
        if step.impl == "reference":
            return self._attention_reference(x, step)
        return self._attention_fused(x, step)

    def linear_attention(self, x: Tensor, step: ForwardPass) -> Tensor:
        """The Gated DeltaNet (or its experts, mixed by the attention router) over the new tokens x [B, T, D], its
        states read from and written to the cache (cache.state / cache.write_state). A pass from slot 0 starts a
        sequence afresh (its states start at zero), so a cache can be filled again from the start; padding tokens
        (attention_mask 0) enter as zeros, so they leave the states as they were (left padding)."""
        mask = step.attention_mask
        if mask is not None:
            x = x * mask[:, step.input_pos].to(x.dtype)[..., None]
        state = None
        if step.cache is not None:
            conv, rec = step.cache.state(self.index)
            fresh = (step.input_pos[:1] > 0).to(rec.dtype)  # 0 at a sequence's start: no host synchronisation
            state = (conv * fresh.to(conv.dtype), rec * fresh)
        if not self.cfg.linear_experts:
            out, new = self.linear(x, state, recurrent=step.impl == "reference")
        else:
            r = self._route("attn", x, step)
            if step.impl != "reference":
                out, new = self.linear_experts(x, state, r.gates)
            else:  # expert by expert, token by token: the oracle of the fused chunked path
                B, T, D = x.shape
                C, Hv = self.linear_experts.channels, self.cfg.linear_value_heads
                out, convs, recs = torch.zeros_like(x), [], []
                for e in range(self.cfg.linear_experts):
                    s_e = None if state is None else (state[0][:, e * C:(e + 1) * C], state[1][:, e * Hv:(e + 1) * Hv])
                    y, (c_e, r_e) = self.linear_experts(x, s_e, r.gates[:, e:e + 1], e=e, recurrent=True)
                    out, convs, recs = out + y, convs + [c_e], recs + [r_e]
                new = (torch.cat(convs, 1), torch.cat(recs, 1))
        if step.cache is not None:
            step.cache.write_state(self.index, *new)
        return out

    def feed_forward(self, x: Tensor, step: ForwardPass) -> Tensor:
        if not self.cfg.ffn_experts:
            return self.ffn_expert(x, None)
        r = self._route("ffn", x, step)
        if step.impl == "reference":
            out = self._ffn_reference(x, r)
        elif step.impl == "export":
            out = self._ffn_export(x, r, step)
        else:
            out = self._ffn_fused(x, r, step)
        return out + self.shared_expert(x, step) if self.cfg.ffn_shared_hidden else out

    def shared_expert(self, x: Tensor, step: ForwardPass) -> Tensor:
        """The shared FFN expert, on every token, times its gate sigmoid(x . w) (or the forced gate)."""
        y = self._mlp(self.ffn_shared, x, None)
        forced = step.forced.shared_gate if step.forced is not None else None
        if forced is not None:
            return y * forced
        return torch.sigmoid(self.ffn_shared_gate(x)) * y

    # -- reference: one expert at a time ---------------------------------------------------
    def _expert_owned(self, name: str) -> bool:
        """Is projection `name` (q, gate, k, v, o) one per attention expert, or the block's one (dense, shared
        K/V)?"""
        return bool(self.cfg.attn_experts) and (name in ("q", "gate", "o") or self.expert_kv)

    def _attn_proj(self, name: str, x: Tensor, e: Optional[int]) -> Tensor:
        y = (self.attn_experts if self._expert_owned(name) else self.attn).proj(name, x, e)
        return self._qk(name, y, e if self._expert_owned(name) else None) if name in "qk" else y

    def keys_values(self, x: Tensor, step: ForwardPass) -> tuple[Tensor, Tensor]:
        """K (after RoPE) and V of the new tokens, expert by expert: each [B, kv_heads, T, Dh], expert-major."""
        cfg, (B, T, _) = self.cfg, x.shape
        G, Dh = self.n_kv, self.head_dim
        ks, vs = [], []
        for e in (range(cfg.attn_experts) if self.expert_kv else [None]):
            owner = self.attn_experts if self.expert_kv else self.attn
            k_raw = owner.proj("k", x, e)
            k = self._rope(self._qk("k", k_raw, e).view(B, T, G, Dh), step)
            ks.append(k.transpose(1, 2))
            v = self._values(x, k_raw, owner, e, all_experts=False)
            vs.append(self._v_norm(v.view(B, T, G, Dh)).transpose(1, 2))
        return torch.cat(ks, 1), torch.cat(vs, 1)

    def attention_expert(self, x: Tensor, k: Tensor, v: Tensor, step: ForwardPass, e: Optional[int]) -> Tensor:
        """MHA_e(x) over keys/values k, v [B, G, S, Dh]: [B, T, D] -> [B, T, D] (e=None: dense attention)."""
        cfg, (B, T, _) = self.cfg, x.shape
        H, Dh = cfg.n_heads, self.head_dim
        q = self._query(self._attn_proj("q", x, e).view(B, T, H, Dh), step).transpose(1, 2)
        rep = H // self.n_kv
        if rep > 1:  # GQA: query head h reads kv head h // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = step.mask(k.shape[2], self.window)
        scale = self.scale or 1.0 / math.sqrt(Dh)
        if cfg.attn_softcap is not None:  # Gemma 2: logits c * tanh(s / c), then the mask
            scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / cfg.attn_softcap) * cfg.attn_softcap
            if mask is None:
                mask = attention_mask_for(None, step.input_pos, k.shape[2])
            y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        y = self._gate(y.transpose(1, 2).reshape(B, T, H * Dh), x, e)
        return self._attn_proj("o", y, e)

    def _attention_reference(self, x: Tensor, step: ForwardPass) -> Tensor:
        cfg, E = self.cfg, self.cfg.attn_experts
        if self.owns_kv:
            k, v = self._cache(*self.keys_values(x, step), step)
            if self.kv_read:
                step.shared_kv[self.index] = (k, v)
        else:
            k, v = self._shared(step)
        if not E:
            return self.attention_expert(x, k, v, step, None)
        r = self._route("attn", x, step)
        # Attention needs whole sequences, so each expert runs on every token; its output is
        # weighted by the gate (zero for tokens that top-k routing did not send to it).
        B, T, D = x.shape
        G = self.n_kv
        gates = r.gates.view(B, T, E)
        out = torch.zeros_like(x)
        for e in range(E):
            if bool((gates[..., e] != 0).any()):
                s = slice(e * G, (e + 1) * G) if self.expert_kv else slice(0, G)
                out = out + gates[..., e, None].to(x.dtype) * self.attention_expert(x, k[:, s], v[:, s], step, e)
        return out

    def ffn_expert(self, x: Tensor, e: Optional[int]) -> Tensor:
        """FFN_e(x): [..., D] -> [..., D] (e=None: dense FFN)."""
        return self._mlp(self.ffn_experts if self.cfg.ffn_experts else self.ffn, x, e)

    def _mlp(self, p: Projections, x: Tensor, e: Optional[int]) -> Tensor:
        h = p.proj("up", x, e)
        h = self.act(p.proj("gate", x, e)) * h if self.gated else self.act(h)
        return p.proj("down", h, e)

    def _ffn_reference(self, x: Tensor, r: Routing, skip_idle: bool = True) -> Tensor:
        # Sparse dispatch: each expert sees only the tokens routed to it (skip_idle: experts with none do not run).
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        out = torch.zeros_like(flat)
        for e in range(self.cfg.ffn_experts):
            idx = r.gates[:, e].nonzero(as_tuple=True)[0]
            if not skip_idle or idx.numel():
                y = self.ffn_expert(flat[idx], e)
                out = out.index_add(0, idx, (r.gates[idx, e, None].to(y.dtype) * y).to(out.dtype))
        return out.view(B, T, D)

    def _ffn_export(self, x: Tensor, r: Routing, step: ForwardPass) -> Tensor:
        """Sparse dispatch as in the reference, with no branch on the routing: an expert with no tokens runs on
        zero rows. expert_kernel "dense": every expert on every token, times its gate (zero when unselected)."""
        if step.expert_kernel != "dense":
            return self._ffn_reference(x, r, skip_idle=False)
        gates = r.gates.view(*x.shape[:2], -1, 1)  # [B, T, E, 1]
        return sum(gates[:, :, e].to(x.dtype) * self.ffn_expert(x, e) for e in range(self.cfg.ffn_experts))

    # -- fused: all experts at once --------------------------------------------------------
    def _attention_fused(self, x: Tensor, step: ForwardPass) -> Tensor:
        cfg, (B, T, D) = self.cfg, x.shape
        E, H, G, Dh = cfg.attn_experts, cfg.n_heads, self.n_kv, self.head_dim
        k = v = None
        if not E:
            q = self._qk("q", self.attn.q(x), None).view(B, T, H, Dh)
            if self.owns_kv:
                k_raw = self.attn.k(x)
                k = self._qk("k", k_raw, None).view(B, T, G, Dh)
                v = self._values(x, k_raw, self.attn, None, all_experts=False).view(B, T, G, Dh)
        else:
            q = self._qk_all("q", self.attn_experts.q.all_experts(x), E).view(B, T, E * H, Dh)  # expert-major e*H + h
            if self.owns_kv and self.expert_kv:
                k_raw = self.attn_experts.k.all_experts(x)
                k = self._qk_all("k", k_raw, E).view(B, T, self.kv_heads, Dh)
                v = self._values(x, k_raw, self.attn_experts, None, all_experts=True).view(B, T, self.kv_heads, Dh)
            elif self.owns_kv:
                k_raw = self.attn.k(x)
                k = self._qk("k", k_raw, None).view(B, T, self.kv_heads, Dh)
                v = self._values(x, k_raw, self.attn, None, all_experts=False).view(B, T, self.kv_heads, Dh)
            if not self.expert_kv:
                # Shared KV: query head (e, h) reads kv head h // rep for every e. Order the E*H query heads
                # (g, e, r), h = g*rep + r, so that GQA's j // (E*rep) picks g.
                rep = H // G
                q = q.view(B, T, E, G, rep, Dh).transpose(2, 3).reshape(B, T, E * H, Dh)
        q = self._query(q, step).transpose(1, 2)  # [B, heads, T, Dh]
        if self.owns_kv:
            k = self._rope(k, step).transpose(1, 2)
            k, v = self._cache(k, self._v_norm(v).transpose(1, 2), step)
            if step.prefill_from_zero:  # the slots past the prompt are causally hidden anyway
                k, v = k[:, :, :T], v[:, :, :T]
            if self.kv_read:
                step.shared_kv[self.index] = (k, v)
        else:
            k, v = self._shared(step)
        y = attend(q, k, v, step.mask(k.shape[2], self.window), self.scale, cfg.attn_softcap)  # [B, E*H, T, Dh]
        if not E:
            return self.attn.o(self._gate(y.transpose(1, 2).reshape(B, T, H * Dh), x, None))
        r = self._route("attn", x, step)
        if self.expert_kv:
            y = y.view(B, E, H, T, Dh).permute(1, 0, 3, 2, 4)  # [E, B, T, H, Dh]
        else:
            y = y.view(B, G, E, H // G, T, Dh).permute(2, 0, 4, 1, 3, 5)  # [E, B, T, G, rep, Dh]
        y = y.reshape(E, B * T, H * Dh)
        if cfg.attn_output_gate:  # each expert's own gate, heads in the order h of y
            y = y * torch.sigmoid(self.attn_experts.gate.all_experts(x).view(B * T, E, H * Dh).transpose(0, 1))
        gates = r.gates.t()[:, :, None]  # [E, N, 1]
        y = y * gates.to(y.dtype)
        o = self.attn_experts.o
        if _recording(y, o.weight) and _onednn(y, o.weight):
            # training in float32 on a CPU: the E output projections as one oneDNN product over the experts' heads
            # side by side, [N, E*H*Dh] @ [E*H*Dh, D] (torch's bmm is MKL's); the weights' copy is 1/N of the work
            out = linear(y.transpose(0, 1).reshape(B * T, -1), o.weight.transpose(0, 1).reshape(D, -1))
        else:
            out = torch.bmm(y, o.weight.transpose(1, 2)).sum(0)  # all E output projections: [E, N, D] -> [N, D]
        if o.bias is not None:
            out = out + (r.gates @ o.bias.float()).to(out.dtype)  # sum_e g_e * b_e
        return out.view(B, T, D)

    def _ffn_fused(self, x: Tensor, r: Routing, step: ForwardPass) -> Tensor:
        B, T, D = x.shape
        if r.topk is not None:
            experts, gates = r.topk, r.gates.gather(-1, r.topk)  # [N, K]
        else:  # forced gates, the same for every token: run only the experts with a non-zero gate
            active = r.gates[0].nonzero(as_tuple=True)[0]
            if not active.numel():
                return torch.zeros_like(x)
            experts = active.expand(B * T, active.numel())
            gates = r.gates[:, active]
        out = expert_mixture(x.reshape(B * T, D), experts, gates, self.ffn_experts, self.act, self.gated,
                             step.expert_kernel)
        return out.view(B, T, D)


# ---- KV cache -------------------------------------------------------------------------------
class KVCache(nn.Module):
    """One layer's static cache (gpt-fast style): k, v [B, heads, max_len, Dh], preallocated; `update` writes
    the new tokens' keys and values at their slots and returns the whole cache (slots not yet written are
    zeros, hidden by the causal mask). Shapes never change, so a decode step can be captured whole."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: Optional[torch.device] = None):
        super().__init__()
        shape = (batch, heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """input_pos [T] slots, k, v [B, heads, T, Dh] -> the cache's k, v [B, heads, max_len, Dh]."""
        self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k, self.v


class LinearState(nn.Module):
    """One Gated DeltaNet layer's state: the convolution's last K-1 inputs conv [B, E*C, K-1] (the cache's dtype)
    and the recurrent state rec [B, E*Hv, Dk, Dv] (float32, as the rule computes it). Its size does not grow with
    the sequence."""

    def __init__(self, cfg, batch: int, dtype: torch.dtype, device: Optional[torch.device] = None):
        super().__init__()
        E = cfg.linear_experts or 1
        channels = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
        self.register_buffer("conv", torch.zeros(batch, E * channels, cfg.linear_conv - 1, dtype=dtype,
                                                 device=device), persistent=False)
        self.register_buffer("rec", torch.zeros(batch, E * cfg.linear_value_heads, cfg.linear_key_dim,
                                                cfg.linear_value_dim, dtype=torch.float32, device=device),
                             persistent=False)

    def write(self, conv: Tensor, rec: Tensor) -> None:
        self.conv.copy_(conv)
        self.rec.copy_(rec)


class ModelKVCache(nn.Module):
    """Per layer what the block needs again: a KVCache holding exactly what the block attends over (expert KV
    E*G heads, shared KV and dense attention G heads, at the layer's own head size; keys after RoPE), a
    LinearState in a Gated DeltaNet layer, nothing in a layer that reads another's K/V (kv_source)."""

    def __init__(self, cfg, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.batch, self.max_len = batch, max_len
        layers: list[nn.Module] = []
        for i in range(cfg.n_layers):
            if cfg.is_linear_layer(i):
                layers.append(LinearState(cfg, batch, dtype, device))
            elif cfg.kv_source(i) == i:
                layers.append(KVCache(batch, self.kv_heads(cfg, i), max_len, cfg.layer_head_dim(i), dtype, device))
            else:
                layers.append(nn.Identity())
        self.layers = nn.ModuleList(layers)
        if torch.device(device or "cpu").type == "cuda" and hasattr(torch, "_dynamo"):
            for buffer in self.buffers():  # static addresses: CUDA graphs (compile mode reduce-overhead) reuse them
                torch._dynamo.mark_static_address(buffer)

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.layers[layer].update(input_pos, k, v)

    def state(self, layer: int) -> tuple[Tensor, Tensor]:
        """A Gated DeltaNet layer's (conv, rec) before the new tokens."""
        return self.layers[layer].conv, self.layers[layer].rec

    def write_state(self, layer: int, conv: Tensor, rec: Tensor) -> None:
        self.layers[layer].write(conv, rec)

    @staticmethod
    def kv_heads(cfg, layer: int = 0) -> int:
        """The kv heads layer `layer` caches: E*G with expert K/V, else G (its own G: global layers may differ)."""
        expert_kv = cfg.attn_experts and cfg.kv_mode == "expert"
        return (cfg.attn_experts if expert_kv else 1) * cfg.layer_kv_heads(layer)

    @staticmethod
    def bytes_per_token(cfg, dtype: torch.dtype) -> int:
        """Cache bytes per token and sequence: K and V of every layer that caches them: sum 2 * heads * Dh *
        itemsize (Gated DeltaNet layers hold a fixed-size state instead: state_bytes)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(2 * ModelKVCache.kv_heads(cfg, i) * cfg.layer_head_dim(i) * itemsize for i in range(cfg.n_layers)
                   if not cfg.is_linear_layer(i) and cfg.kv_source(i) == i)

    @staticmethod
    def state_bytes(cfg, dtype: torch.dtype) -> int:
        """The Gated DeltaNet layers' states per sequence, whatever its length (the recurrent state in float32)."""
        n = len(cfg.linear_layers or ())
        if not n:
            return 0
        E, itemsize = cfg.linear_experts or 1, torch.empty((), dtype=dtype).element_size()
        channels = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
        rec = cfg.linear_value_heads * cfg.linear_key_dim * cfg.linear_value_dim * 4
        return n * E * (channels * (cfg.linear_conv - 1) * itemsize + rec)


# ---- the trunk ------------------------------------------------------------------------------
class _EmbeddingRows(torch.autograd.Function):
    """Input embeddings weight[tokens] whose backward adds the gradient's rows into weight.grad in place (index_add_)
    rather than handing autograd a dense [V, D] gradient (zeros filled, the rows added, then the whole added to the
    tied head's gradient: three passes over V x D per step). The weight goes in detached, so its own gradient (the
    tied head's) is accumulated into weight.grad whenever it is ready, before this, the first operation's, backward;
    `anchor` (an empty tensor that requires grad) makes autograd run this backward at all. In whatever order the two
    arrive, weight.grad ends as their sum. Hooks on the weight see only the head's part: single-process training only.
    The embedding module comes in as a plain argument: a tensor argument would tie this backward into the weight's
    accumulation, which would then wait for it."""

    @staticmethod
    def forward(ctx, tokens: Tensor, embed: nn.Embedding, anchor: Tensor) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.embed = embed
        return F.embedding(tokens, embed.weight.detach())

    @staticmethod
    def backward(ctx, grad: Tensor):
        (tokens,) = ctx.saved_tensors
        weight = ctx.embed.weight
        with torch.no_grad():
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, tokens.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(weight.grad.dtype))
        return None, None, None


class Transformer(nn.Module):
    """Embeddings, blocks and the final norm (canonical names embed, pos_embed, layers.{i}.*, final_norm): the
    part the runtime's Model and the HF export's BamModel share; each adds its own head."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if getattr(cfg, "per_layer_dim", 0):  # Gemma 4's per-layer inputs (per_layer_inputs)
            L, Dp = cfg.n_layers, cfg.per_layer_dim
            self.ple_embed = nn.Embedding(cfg.per_layer_vocab or cfg.vocab_size, L * Dp)
            self.ple_proj = nn.Linear(cfg.d_model, L * Dp, bias=False)
            self.ple_proj_norm = Norm(cfg, Dp)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # a model without a final norm (cfg.final_norm False) feeds the last block's output to the head as is
        self.final_norm = Norm(cfg) if getattr(cfg, "final_norm", True) else nn.Identity()
        self.impl: Impl = "fused"  # or "reference": the per-expert loop (the tests' oracle)
        self.expert_kernel: Optional[FFNKernel] = None  # force an FFN expert kernel (EXPERT_KERNELS); None: automatic
        # recompute each block's activations in the backward pass instead of keeping them (training; see run_block)
        self.activation_checkpointing = False
        # add the input embeddings' gradient into embed.weight.grad row by row (_EmbeddingRows): set by the runtime's
        # single-process training of a tied model (train/loop.py), where the tied head's dense gradient is there first
        self.embedding_grad_rows = False

    def hidden_states(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                      positions: Optional[Tensor] = None, input_pos: Optional[Tensor] = None, cache=None,
                      routing: Optional[ForcedRouting] = None, all_hidden: Optional[list] = None,
                      tokens: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Routing]]:
        """Input embeddings x [B, T, D] -> (final-normed hidden states [B, T, D], routing trace by router name).

        attention_mask  [B, S] 1 token, 0 padding, over every key slot (S = T without a cache; with one, at
                        least up to the last new token's slot); None: no padding
        positions       [B, T] or [T] position ids (RoPE, learned table); default: real tokens counted from
                        the mask (padding does not shift them), else the slots input_pos
        input_pos       [T] key slots of the new tokens (required with a cache; default 0..T-1)
        cache           anything with .update(layer, input_pos, k, v) -> (k, v), e.g. ModelKVCache
        all_hidden      if a list, receives the input of every block and the last block's output
        tokens          [B, T] the token ids x embeds: models with per-layer inputs (Gemma 4) need them
        """
        cfg = self.config
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: choose one of {', '.join(IMPLS)}")
        B, T, _ = x.shape
        if input_pos is None:
            if cache is not None:
                raise ValueError("a cache needs input_pos, the key slots of the new tokens")
            input_pos = torch.arange(T, device=x.device)
        if positions is None:
            if attention_mask is not None:  # count real tokens only, so padding does not shift positions
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, input_pos]
            else:
                positions = input_pos
        positions = positions.to(x.device).expand(B, T)
        if cfg.position == "learned":
            if cache is None and T > cfg.max_positions:
                raise ValueError(f"sequence length {T} exceeds max_positions={cfg.max_positions}")
            x = x + self.pos_embed(positions)
        local = cfg.position == "rope" and cfg.window_rope_theta is not None
        per_layer = None
        if cfg.per_layer_dim:
            if tokens is None:
                raise ValueError("per-layer inputs (per_layer_dim) are looked up by token id: pass tokens")
            per_layer = self.per_layer_inputs(tokens, x)
        step = ForwardPass(rope=rotary_cos_sin(cfg, positions) if cfg.position == "rope" else None, input_pos=input_pos,
                    rope_local=rotary_cos_sin(cfg, positions, local=True) if local else None,
                    query_scale=query_scale(cfg, positions), per_layer=per_layer,
                    attention_mask=attention_mask, cache=cache, forced=routing, impl=self.impl,
                    expert_kernel=self.expert_kernel,
                    prefill_from_zero=self._prefill_from_zero(cache, attention_mask, input_pos))
        trace: dict[str, Routing] = {}
        for i, block in enumerate(self.layers):
            if all_hidden is not None:
                all_hidden.append(x)
            # every block records its routing by kind into an empty dict, named here: a block compiled on its
            # own (torch.compile per block, train/) then sees the same input for every layer and compiles once
            step.routing = {}
            x = self.run_block(block, x, step)
            trace.update((f"layers.{i}.{name}", r) for name, r in step.routing.items())
        step.routing = trace
        if all_hidden is not None:
            all_hidden.append(x)
        return self.final_norm(x), step.routing

    def per_layer_inputs(self, tokens: Tensor, x: Tensor) -> Tensor:
        """Gemma 4's per-layer inputs [B, T, L, Dp]: the token's row of ple_embed (times sqrt(Dp), the factor
        rounded to the table's dtype) and the RMS-normed projection of the input embeddings x (times 1/sqrt(D)),
        their sum times 1/sqrt(2)."""
        cfg = self.config
        B, T = tokens.shape
        L, Dp = cfg.n_layers, cfg.per_layer_dim
        table = self.ple_embed(tokens)
        table = table * torch.tensor(Dp ** 0.5, dtype=table.dtype, device=table.device)
        proj = self.ple_proj_norm((self.ple_proj(x) * cfg.d_model ** -0.5).view(B, T, L, Dp))
        return (proj + table.view(B, T, L, Dp)) * 2 ** -0.5

    def run_block(self, block: nn.Module, x: Tensor, step: ForwardPass) -> Tensor:
        """block(x, step); with activation_checkpointing (and gradients wanted), through torch.utils.checkpoint:
        only the block's input is kept, and the block runs again in the backward pass. That second run computes
        the same values (no randomness; the same routing); its routing records go to a scratch ForwardPass, and
        routers that collect statistics while training (key stores) do not collect them a second time."""
        if not (self.activation_checkpointing and torch.is_grad_enabled()):
            return block(x, step)
        from torch.utils.checkpoint import checkpoint  # lazy: training only

        runs: list[int] = []

        def run(x: Tensor) -> Tensor:
            if not runs:
                runs.append(1)
                return block(x, step)
            scratch = ForwardPass(**{**step.__dict__, "routing": {}})
            collectors = [(m, m.collector) for m in block.modules() if getattr(m, "collector", None) is not None]
            try:
                for m, _ in collectors:
                    m.collector = None
                return block(x, scratch)
            finally:
                for m, c in collectors:
                    m.collector = c

        return checkpoint(run, x, use_reentrant=False)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Input embeddings [B, T, D] of tokens [B, T]: times sqrt(d_model) with scale_embeddings (Gemma, which
        rounds the factor to the embeddings' dtype first)."""
        weight = self.embed.weight
        if self.embedding_grad_rows and weight.requires_grad and torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():
            x = _EmbeddingRows.apply(tokens, self.embed, weight.new_empty(0, requires_grad=True))
        else:
            x = self.embed(tokens)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype, device=x.device)
        if self.config.embedding_multiplier != 1.0:  # Granite's
            x = x * self.config.embedding_multiplier
        return x

    def output_logits(self, logits: Tensor) -> Tensor:
        """The head's logits [..., V] times logit_scale (Cohere), then soft-capped c * tanh(l / c) (Gemma 2)."""
        cfg = self.config
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _prefill_from_zero(self, cache, attention_mask: Optional[Tensor], input_pos: Tensor) -> bool:
        """A fused, eager prefill of T > 1 tokens into a cache at slots 0..T-1 with no padding: the blocks then
        attend causally over the first T slots instead of masking every slot of the cache (one look at
        input_pos; never while compiling or tracing, where shapes must not depend on values)."""
        T = input_pos.shape[0]
        if cache is None or attention_mask is not None or T < 2 or self.impl != "fused":
            return False
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return False
        return bool(torch.equal(input_pos.cpu(), torch.arange(T)))

    def routers(self) -> dict[str, Router]:
        """Every router by name (layers.{i}.attn_router, layers.{i}.ffn_router), in execution order."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Router)}

    def after_step(self) -> None:
        """Call after every optimizer step: routers with rule-based (non-gradient) state update it."""
        for router in self.routers().values():
            router.after_step()

    def new_cache(self, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device] = None) -> ModelKVCache:
        """A static KV cache for `batch` sequences of up to max_len tokens, in the embedding's dtype and device
        unless given."""
        cfg = self.config
        if cfg.position == "learned" and max_len > cfg.max_positions:
            raise ValueError(f"cache length {max_len} exceeds max_positions={cfg.max_positions}")
        weight = self.embed.weight
        return ModelKVCache(cfg, batch, max_len, dtype or weight.dtype, device or weight.device)
