"""What the model math derives from a config's fields, for both config classes: runtime.config.ModelConfig and
the HF BAM export's BamConfig inherit ConfigRules, so the two can never derive differently.

Shipped into every HF BAM export next to configuration_bam.py (as config_rules.py, byte for byte), so it
imports nothing.

Per-layer geometry: a layer is a Gated DeltaNet layer (linear_layers) or an attention layer; an attention layer is
a window layer (attn_window, attn_window_layers) or a global one, and global layers may have their own head size,
kv heads and K = V (Gemma 4); the last kv_shared_layers layers read another layer's keys and values.
"""


class ConfigRules:
    """Properties over the fields `router`, `attn_router`, `head_dim`, `rotary_fraction`, and the per-layer rules."""

    @property
    def ffn_router_kind(self) -> str:
        return self.router

    @property
    def attn_router_kind(self) -> str:
        """attn_router, or router when it is None."""
        return self.attn_router or self.router

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the first rotary_dim dims of each head (of the window layers, where the global ones differ)."""
        return int(round(self.head_dim * self.rotary_fraction))

    @property
    def global_rotary_dim(self) -> int:
        """rotary_dim of the global layers' heads."""
        return int(round((self.global_head_dim or self.head_dim) * self.rotary_fraction))

    @property
    def first_cached_layer(self) -> int:
        """The first layer that caches keys and values (a cache's length is its length: a Gated DeltaNet layer
        keeps a fixed-size state instead)."""
        return next((i for i in range(self.n_layers) if not self.is_linear_layer(i)), 0)

    # -- per layer -------------------------------------------------------------------------------
    def is_linear_layer(self, i: int) -> bool:
        """A Gated DeltaNet layer (no softmax attention)."""
        return i in (self.linear_layers or ())

    def is_window_layer(self, i: int) -> bool:
        """A sliding-window attention layer."""
        return self.attn_window is not None and (self.attn_window_layers is None or i in self.attn_window_layers)

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.is_window_layer(i) else (self.global_head_dim or self.head_dim)

    def layer_kv_heads(self, i: int) -> int:
        return self.n_kv_heads if self.is_window_layer(i) else (self.global_kv_heads or self.n_kv_heads)

    def layer_k_eq_v(self, i: int) -> bool:
        """The layer's values are its keys' projection (no V of its own)."""
        return bool(self.global_k_eq_v) and not self.is_window_layer(i)

    def kv_source(self, i: int):
        """The layer whose keys and values layer i attends over: i, or for the last kv_shared_layers layers the last
        attention layer of the same kind (window or global) before them; None where there is none."""
        first = self.n_layers - self.kv_shared_layers
        if i < first:
            return i
        for j in range(first - 1, -1, -1):
            if not self.is_linear_layer(j) and self.is_window_layer(j) == self.is_window_layer(i):
                return j
        return None

    def layer_ffn_hidden(self, i: int) -> int:
        if self.kv_shared_ffn_hidden and i >= self.n_layers - self.kv_shared_layers:
            return self.kv_shared_ffn_hidden
        return self.ffn_hidden

    def layer_shared_hidden(self, i: int) -> int:
        """The shared FFN expert's width in layer i: ffn_shared_hidden, except that one as wide as the FFN (a copy of
        the seed's) is as wide as each layer's FFN (Gemma 4's double-wide K/V-sharing layers)."""
        if self.ffn_shared_hidden and self.ffn_shared_hidden == self.ffn_hidden:
            return self.layer_ffn_hidden(i)
        return self.ffn_shared_hidden

    def layer_attn_experts(self, i: int) -> int:
        """The token mixer's experts in layer i: linear_experts in a Gated DeltaNet layer, attn_experts elsewhere."""
        return self.linear_experts if self.is_linear_layer(i) else self.attn_experts
