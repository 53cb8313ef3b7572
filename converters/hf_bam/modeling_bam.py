"""Hugging Face modeling code for bam-surgery mixtures: BAM (attention + FFN experts), BAM with shared K/V,
BTX (FFN experts only), sparse upcycling, and dense models.

Remote code: this file and configuration_bam.py are copied into every exported directory, loaded with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. It imports only torch and transformers.
Its forward pass computes exactly what bam-surgery's reference runtime computes (runtime/model.py); the
export tests compare the two.

Weight names: bam-surgery's canonical names (runtime/layout.py) under the prefix "model.", except the output
head, which stays at the top level as "lm_head.weight" / "lm_head.bias" (where transformers looks for it when
tying, resizing or evaluating). With tie_embeddings, lm_head.weight is not stored: it is model.embed.weight.

Shapes: B batch, T new tokens, P cached tokens, S = P + T, D d_model, H heads, G kv heads, Dh head dim,
E experts, V vocab.

KV cache: a transformers DynamicCache, one cache layer per block. Attention experts with their own K/V
(kv_mode "expert") keep all E experts' keys and values in that one cache layer, side by side along the head
axis: [B, E*G, S, Dh], expert-major. Shared-KV and dense blocks cache [B, G, S, Dh]. Keys are cached after
RoPE. Every expert's K/V is computed for every token, as in the runtime, where attention experts see whole
sequences and top-k routing only zeroes their output gates. Static caches are not supported.

Padding: attention_mask [B, S] (1 token, 0 padding) on either side, any batch size. Positions count real
tokens only (cumsum of the mask), so a left-padded row gets the logits and greedy continuation of its unpadded
sequence. Padding positions produce finite values that nothing reads.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_bam import BamConfig

ACTIVATIONS = {
    "swiglu": F.silu,  # gated: act(gate x) * up x
    "silu": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# ---- building blocks ------------------------------------------------------------------------
class BamNorm(nn.Module):
    """LayerNorm (optional bias) in the input dtype, or RMSNorm computed in float32."""

    def __init__(self, config: BamConfig):
        super().__init__()
        self.kind, self.eps = config.norm, config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.d_model))
        self.bias = nn.Parameter(torch.zeros(config.d_model)) if config.norm_bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class BamExpertLinear(nn.Module):
    """E independent linear maps in one tensor: weight [E, out, in], bias [E, out]."""

    def __init__(self, n_experts: int, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_experts, n_out)) if bias else None

    def forward(self, x: Tensor, e: int) -> Tensor:
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


def projections(specs: dict[str, tuple[int, int, bool]], n_experts: int = 0) -> nn.ModuleDict:
    """{name: (in, out, bias)} -> nn.Linear per name, or BamExpertLinear stacks when n_experts > 0."""
    return nn.ModuleDict({
        name: BamExpertLinear(n_experts, n_in, n_out, bias) if n_experts else nn.Linear(n_in, n_out, bias=bias)
        for name, (n_in, n_out, bias) in specs.items()})


def project(mod: nn.Module, x: Tensor, e: int | None) -> Tensor:
    return mod(x, e) if isinstance(mod, BamExpertLinear) else mod(x)


class BamRotary:
    """RoPE on the first rotary_dim dims of each head: half-split (rotate_half) or interleaved pairs."""

    def __init__(self, config: BamConfig):
        self.dim, self.interleaved = config.rotary_dim, config.rope_interleaved
        # float64 then float32, as the reference runtime; built on CPU, moved on first use per device
        exps = torch.arange(0, self.dim, 2, dtype=torch.float64, device="cpu") / self.dim
        self._inv_freq = {torch.device("cpu"): (1.0 / (config.rope_theta ** exps)).float()}

    def inv_freq(self, device: torch.device) -> Tensor:  # [rot/2]
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    def __call__(self, x: Tensor, pos: Tensor) -> Tensor:  # x [B, T, heads, Dh], pos [B, T]
        ang = pos.float()[..., None] * self.inv_freq(x.device)  # [B, T, rot/2]
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        rot, rest = x[..., : self.dim].float(), x[..., self.dim:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out.to(x.dtype), rest), dim=-1)


def route(router: nn.Linear, x: Tensor, top_k: int | None, gate_norm: str) -> Tensor:
    """Gates [B*T, E] in float32: the full softmax (soft routing) or its top-k, zeros elsewhere."""
    probs = router(x).reshape(-1, router.out_features).float().softmax(-1)
    if top_k is None:
        return probs
    top_p, top_i = probs.topk(top_k, dim=-1)  # [N, K]
    if gate_norm == "topk_softmax":
        top_p = top_p / top_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, top_i, top_p)


def attention_mask_4d(attention_mask: Tensor | None, B: int, T: int, past: int, device) -> Tensor | None:
    """Boolean [B, 1, T, S] (True = may attend), or None for plain causal attention (no cache, no padding)."""
    if past == 0 and (attention_mask is None or bool(attention_mask.all())):
        return None
    S = past + T
    allowed = torch.arange(S, device=device)[None, :] <= torch.arange(past, S, device=device)[:, None]  # [T, S]
    allowed = allowed[None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()  # [B, T, S]
    # A padding query may see no key at all; let it see every key so that softmax stays finite.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return allowed[:, None]


# ---- the block ------------------------------------------------------------------------------
class BamBlock(nn.Module):
    """One transformer block; parameters carry the canonical names (attn, attn_experts, attn_router, ffn,
    ffn_experts, ffn_router, attn_norm, ffn_norm)."""

    def __init__(self, config: BamConfig, index: int):
        super().__init__()
        self.config, self.index = config, index
        c, D = config, config.d_model
        self.attn_norm = BamNorm(c)
        if c.block != "parallel":
            self.ffn_norm = BamNorm(c)
        q = {"q": (D, c.n_heads * c.head_dim, c.qkv_bias)}
        kv = {"k": (D, c.n_kv_heads * c.head_dim, c.qkv_bias), "v": (D, c.n_kv_heads * c.head_dim, c.qkv_bias)}
        o = {"o": (c.n_heads * c.head_dim, D, c.o_bias)}
        Ea = c.attn_experts
        self.expert_kv = bool(Ea) and c.kv_mode == "expert"
        self.kv_sets = Ea if self.expert_kv else 1  # how many K/V pairs this block computes and caches
        if not Ea:
            self.attn = projections({**q, **kv, **o})
        else:
            self.attn_router = nn.Linear(D, Ea, bias=False)
            if self.expert_kv:
                self.attn_experts = projections({**q, **kv, **o}, Ea)
            else:
                self.attn = projections(kv)
                self.attn_experts = projections({**q, **o}, Ea)
        ffn = {"gate": (D, c.ffn_hidden, c.ffn_bias)} if c.activation == "swiglu" else {}
        ffn.update(up=(D, c.ffn_hidden, c.ffn_bias), down=(c.ffn_hidden, D, c.ffn_bias))
        if c.ffn_experts:
            self.ffn_router = nn.Linear(D, c.ffn_experts, bias=False)
            self.ffn_experts = projections(ffn, c.ffn_experts)
        else:
            self.ffn = projections(ffn)
        self.act = ACTIVATIONS[c.activation]
        self.rotary = BamRotary(c) if c.position == "rope" else None

    # -- attention -------------------------------------------------------------------------
    def keys_values(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of the new tokens for every K/V set: each [B, kv_sets*G, T, Dh]."""
        c, (B, T, _) = self.config, x.shape
        owner = self.attn_experts if self.expert_kv else self.attn
        ks, vs = [], []
        for s in range(self.kv_sets):
            e = s if self.expert_kv else None
            k = project(owner["k"], x, e).view(B, T, c.n_kv_heads, c.head_dim)
            v = project(owner["v"], x, e).view(B, T, c.n_kv_heads, c.head_dim)
            if self.rotary is not None:
                k = self.rotary(k, pos)
            ks.append(k.transpose(1, 2))
            vs.append(v.transpose(1, 2))
        return torch.cat(ks, 1), torch.cat(vs, 1)

    def attend(self, x: Tensor, pos: Tensor, mask: Tensor | None, k: Tensor, v: Tensor, e: int | None) -> Tensor:
        """MHA_e(x) with keys/values k, v [B, G, S, Dh]: [B, T, D] -> [B, T, D] (e=None: dense attention)."""
        c, (B, T, _) = self.config, x.shape
        qo = self.attn_experts if self.config.attn_experts else self.attn
        q = project(qo["q"], x, e).view(B, T, c.n_heads, c.head_dim)
        if self.rotary is not None:
            q = self.rotary(q, pos)
        q = q.transpose(1, 2)  # [B, H, T, Dh]
        rep = c.n_heads // c.n_kv_heads
        if rep > 1:  # GQA: query head h reads kv head h // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=1.0 / math.sqrt(c.head_dim))
        return project(qo["o"], y.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim), e)

    def attention(self, x: Tensor, pos: Tensor, mask: Tensor | None, cache: Cache | None) -> Tensor:
        c, (B, T, D) = self.config, x.shape
        k, v = self.keys_values(x, pos)
        if cache is not None:
            k, v = cache.update(k, v, self.index)
        S = k.shape[2]
        k = k.reshape(B, self.kv_sets, c.n_kv_heads, S, c.head_dim)  # expert-major
        v = v.reshape(B, self.kv_sets, c.n_kv_heads, S, c.head_dim)
        E = c.attn_experts
        if not E:
            return self.attend(x, pos, mask, k[:, 0], v[:, 0], None)
        gates = route(self.attn_router, x, c.attn_top_k, c.gate_norm).view(B, T, E)
        out = torch.zeros_like(x)
        for e in range(E):  # same order and skipping as the reference runtime
            if bool((gates[..., e] != 0).any()):
                s = e if self.expert_kv else 0
                out = out + gates[..., e, None].to(x.dtype) * self.attend(x, pos, mask, k[:, s], v[:, s], e)
        return out

    # -- feed-forward ----------------------------------------------------------------------
    def ffn_expert(self, x: Tensor, e: int | None) -> Tensor:
        p = self.ffn_experts if self.config.ffn_experts else self.ffn
        h = project(p["up"], x, e)
        h = self.act(project(p["gate"], x, e)) * h if "gate" in p else self.act(h)
        return project(p["down"], h, e)

    def feed_forward(self, x: Tensor) -> Tensor:
        c, (B, T, D) = self.config, x.shape
        if not c.ffn_experts:
            return self.ffn_expert(x, None)
        gates = route(self.ffn_router, x, c.ffn_top_k, c.gate_norm)  # [B*T, E]
        flat = x.reshape(B * T, D)
        out = torch.zeros_like(flat)
        for e in range(c.ffn_experts):  # sparse dispatch: each expert sees only its tokens
            idx = gates[:, e].nonzero(as_tuple=True)[0]
            if idx.numel():
                y = self.ffn_expert(flat[idx], e)
                out = out.index_add(0, idx, gates[idx, e, None].to(y.dtype) * y)
        return out.view(B, T, D)

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor | None, cache: Cache | None) -> Tensor:
        style = self.config.block
        if style == "sequential":
            h = x + self.attention(self.attn_norm(x), pos, mask, cache)
            return h + self.feed_forward(self.ffn_norm(h))
        if style == "parallel":  # one shared norm
            n = self.attn_norm(x)
            return x + self.attention(n, pos, mask, cache) + self.feed_forward(n)
        return x + self.attention(self.attn_norm(x), pos, mask, cache) + self.feed_forward(self.ffn_norm(x))


# ---- models ---------------------------------------------------------------------------------
class BamPreTrainedModel(PreTrainedModel):
    config_class = BamConfig
    base_model_prefix = "model"
    _no_split_modules = ["BamBlock"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights missing from a checkpoint: normal(0, 0.02) matrices, unit norms, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding, BamExpertLinear)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, BamNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class BamModel(nn.Module):
    """Embeddings, blocks, final norm: canonical names embed, pos_embed, layers.{i}.*, final_norm."""

    def __init__(self, config: BamConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.position == "learned":
            self.pos_embed = nn.Embedding(config.max_positions, config.d_model)
        self.layers = nn.ModuleList(BamBlock(config, i) for i in range(config.n_layers))
        self.final_norm = BamNorm(config)

    def forward(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, attention_mask: Tensor | None,
                position_ids: Tensor | None, cache: Cache | None, output_hidden_states: bool
                ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, D]
        B, T, _ = x.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, {past + T}): "
                             "one entry per cached and new token (4D masks are not supported)")
        if position_ids is None:
            if attention_mask is not None:  # count real tokens only, so padding does not shift positions
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=x.device)[None]
        pos = position_ids.to(x.device).expand(B, T)  # [B, T]
        if self.config.position == "learned":
            if int(pos.max()) >= self.config.max_positions:
                raise ValueError(f"position {int(pos.max())} exceeds max_positions={self.config.max_positions}")
            x = x + self.pos_embed(pos)
        mask = attention_mask_4d(attention_mask, B, T, past, x.device)
        hidden = [x] if output_hidden_states else None
        for block in self.layers:
            x = block(x, pos, mask, cache)
            if hidden is not None:
                hidden.append(x)
        x = self.final_norm(x)
        if hidden is not None:
            hidden[-1] = x
        return x, tuple(hidden) if hidden is not None else None


class BamForCausalLM(BamPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: BamConfig):
        super().__init__(config)
        self.model = BamModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits [B, T, V]; loss = mean next-token NLL when labels [B, T] are given (labels are shifted here,
        as usual in transformers; -100 is ignored). Router auxiliary losses are not added."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        x, hidden = self.model(input_ids, inputs_embeds, attention_mask, position_ids, past_key_values,
                               bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states))
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        logits = self.lm_head(x)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float()
            loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None,
                                     hidden_states=hidden)
        use_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        return out if use_dict else out.to_tuple()
