"""Hugging Face modeling code for bam-surgery mixtures: BAM (attention + FFN experts), BAM with shared K/V,
BTX (FFN experts only), sparse upcycling, and dense models.

Remote code: this file, configuration_bam.py and blocks_bam.py are copied into every exported directory,
loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. blocks_bam.py is bam-surgery's
own model math (runtime/blocks.py, byte for byte): the norms, projections, RoPE, routing and the fused
transformer block all come from there, so the export computes what the runtime computes. This file adds only
what transformers needs: the config class, weight init, the output head, labels and the transformers cache.
It imports only torch, transformers and its two sibling files.

Weight names: bam-surgery's canonical names (runtime/layout.py) under the prefix "model.", except the output
head, which stays at the top level as "lm_head.weight" / "lm_head.bias" (where transformers looks for it when
tying, resizing or evaluating). With tie_embeddings, lm_head.weight is not stored: it is model.embed.weight.

Shapes: B batch, T new tokens, P cached tokens, S = P + T, D d_model, H heads, G kv heads, Dh head dim,
E experts, V vocab.

KV cache: a transformers DynamicCache, one cache layer per block, holding what the block attends over.
Attention experts with their own K/V (kv_mode "expert") keep all E experts' keys and values in that one
cache layer, side by side along the head axis: [B, E*G, S, Dh], expert-major. Shared-KV and dense blocks
cache [B, G, S, Dh]. Keys are cached after RoPE. Every expert's K/V is computed for every token, as in the
runtime: attention experts see whole sequences and top-k routing only zeroes their output gates.
transformers' StaticCache is not supported (the runtime has its own static cache, runtime.generate).

Padding: attention_mask [B, S] (1 token, 0 padding) on either side, any batch size. Positions count real
tokens only (cumsum of the mask), so a left-padded row gets the logits and greedy continuation of its unpadded
sequence. Padding positions produce finite values that nothing reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .blocks_bam import ACTIVATIONS, Norm, StackedLinear, Transformer  # noqa: F401  (ACTIVATIONS: what is supported)
from .configuration_bam import BamConfig
from .routers import Router  # noqa: F401  (blocks_bam.py's import; named here so that every transformers'
#                                            remote-code loader copies routers.py too, 4.x's included)
from .config_rules import ConfigRules  # noqa: F401  (configuration_bam.py's imports, named here for the same
from .schema_bam import MODEL_TYPE  # noqa: F401  reason)
from .deltanet import CHUNK  # noqa: F401  (blocks_bam.py's import, named here for the same reason)

# keyword arguments forward() takes besides its named ones (see its docstring); anything else is a TypeError
EXTRA_KWARGS = frozenset({"cache_position", "num_items_in_batch", "output_attentions"})
# the output's cache field: `cache` from transformers 5.24 on, `past_key_values` before
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


LINEAR_STATES = "bam_linear_states"  # the attribute of a transformers Cache holding Gated DeltaNet states


class TransformersCache:
    """A transformers Cache seen through the blocks' cache protocol: update(layer, input_pos, k, v) appends
    the new keys and values [B, heads, T, Dh] and returns every cached one [B, heads, S, Dh]; state(layer) and
    write_state(layer, conv, rec), a Gated DeltaNet layer's states, kept on the Cache object itself (a dict by layer,
    attribute LINEAR_STATES: a fixed size per sequence, replaced at every step; zeros before the first)."""

    def __init__(self, cache: Cache, cfg):
        self.cache, self.cfg = cache, cfg

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, layer)

    def state(self, layer: int) -> tuple[Tensor, Tensor]:
        states = getattr(self.cache, LINEAR_STATES, {})
        if layer not in states:
            return linear_zeros(self.cfg, self._batch, self._device, self._dtype)
        return states[layer]

    def write_state(self, layer: int, conv: Tensor, rec: Tensor) -> None:
        if not hasattr(self.cache, LINEAR_STATES):
            setattr(self.cache, LINEAR_STATES, {})
        getattr(self.cache, LINEAR_STATES)[layer] = (conv, rec)

    def start(self, x: Tensor) -> "TransformersCache":
        """The batch, device and dtype of a pass's hidden states x [B, T, D] (the zero states' shape)."""
        self._batch, self._device, self._dtype = x.shape[0], x.device, x.dtype
        return self


def linear_zeros(cfg, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A Gated DeltaNet layer's states at a sequence's start: conv [B, E*C, K-1], rec [B, E*Hv, Dk, Dv] float32."""
    E = cfg.linear_experts or 1
    channels = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
    return (torch.zeros(batch, E * channels, cfg.linear_conv - 1, device=device, dtype=dtype),
            torch.zeros(batch, E * cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim, device=device,
                        dtype=torch.promote_types(dtype, torch.float32)))


# ---- models ---------------------------------------------------------------------------------
class BamPreTrainedModel(PreTrainedModel):
    config_class = BamConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["past_key_values"]

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights missing from a checkpoint: normal(0, 0.02) matrices, unit norms, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding, StackedLinear)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Norm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class BamModel(Transformer):
    """Embeddings, blocks, final norm (runtime/blocks.py's Transformer): canonical names embed, pos_embed,
    layers.{i}.*, final_norm. Always the fused path."""

    def forward(self, input_ids: Tensor | None, inputs_embeds: Tensor | None, attention_mask: Tensor | None,
                position_ids: Tensor | None, cache: Cache | None, output_hidden_states: bool
                ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, D]
        B, T, _ = x.shape
        past = cache.get_seq_length(self.config.first_cached_layer) if cache is not None else 0
        if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, {past + T}): "
                             "one entry per cached and new token (4D masks are not supported)")
        if self.config.position == "learned" and past + T > self.config.max_positions:
            raise ValueError(f"position {past + T - 1} exceeds max_positions={self.config.max_positions}")
        hidden: list | None = [] if output_hidden_states else None
        x, _ = self.hidden_states(x, attention_mask=attention_mask, positions=position_ids,
                                  input_pos=torch.arange(past, past + T, device=x.device), tokens=input_ids,
                                  cache=None if cache is None else TransformersCache(cache, self.config).start(x),
                                  all_hidden=hidden)
        if hidden is not None:
            hidden[-1] = x
        return x, tuple(hidden) if hidden is not None else None


def _next_token_loss(logits: Tensor, labels: Tensor, items) -> Tensor:
    """Mean next-token NLL (labels shifted here, -100 ignored); summed over `items` (num_items_in_batch) instead
    when given."""
    shifted = logits[:, :-1].float()
    loss = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1).to(logits.device),
                           ignore_index=-100, reduction="mean" if items is None else "sum")
    if items is not None:
        loss = loss / torch.as_tensor(items, device=loss.device)
    return loss


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
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits [B, T, V]; loss = mean next-token NLL when labels [B, T] are given (labels are shifted here,
        as usual in transformers; -100 is ignored; summed over num_items_in_batch instead when given). Router
        auxiliary losses are not added.

        The KV cache comes as `cache` (transformers >= 5.24) or `past_key_values` (earlier), either name at any
        version, and goes back under both (the output's field has the version's name, the other reads through).
        Other keyword arguments transformers passes: `cache_position` (4.x generate; positions come from the
        cache itself, so it must agree with the cache's length), `num_items_in_batch` (Trainer) and
        `output_attentions` (False only: attention weights are never materialized). Anything else is a
        TypeError: an argument this model would not honour is never dropped silently.
        """
        self._check_kwargs(kwargs)
        cache, use_cache = self._cache(input_ids, inputs_embeds, cache, past_key_values, use_cache,
                                       kwargs.get("cache_position"))
        x, hidden = self.model(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                               bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states))
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        logits = self.model.output_logits(self.lm_head(x))
        loss = None if labels is None else _next_token_loss(logits, labels, kwargs.get("num_items_in_batch"))
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden,
                                     **{CACHE_FIELD: cache if use_cache else None})
        use_dict = getattr(self.config, "return_dict", True) if return_dict is None else return_dict
        return out if use_dict else out.to_tuple()

    @staticmethod
    def _reorder_cache(cache: Cache, beam_idx: Tensor) -> Cache:
        """Beam search: the cache's rows (the Gated DeltaNet states too) follow the beams kept."""
        cache.reorder_cache(beam_idx)
        states = getattr(cache, LINEAR_STATES, {})
        for layer, (conv, rec) in states.items():
            states[layer] = (conv.index_select(0, beam_idx.to(conv.device)), rec.index_select(0, beam_idx.to(rec.device)))
        return cache

    def _check_kwargs(self, kwargs: dict) -> None:
        unknown = sorted(set(kwargs) - EXTRA_KWARGS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword argument(s) {', '.join(unknown)}"
                            f" (accepted besides the named ones: {', '.join(sorted(EXTRA_KWARGS))})")
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True is not supported: attention runs fused (scaled_dot_product_"
                             "attention) and its weights are never materialized")

    def _cache(self, input_ids, inputs_embeds, cache, past_key_values, use_cache, cache_position):
        """(the KV cache to use, under either name; whether to return it), checked against cache_position."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the KV cache as one of cache and past_key_values, not both")
        cache = cache if cache is not None else past_key_values
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache_position is not None:
            past = cache.get_seq_length(self.config.first_cached_layer) if cache is not None else 0
            new = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
            if cache_position.numel() != new or (new and int(cache_position.reshape(-1)[0]) != past):
                raise ValueError(f"cache_position {cache_position.tolist()} does not continue the cache: it holds "
                                 f"{past} tokens and {new} new ones are given")
        return cache, use_cache
