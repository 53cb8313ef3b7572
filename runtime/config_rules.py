"""What the model math derives from a config's fields, for both config classes: runtime.config.ModelConfig and
the HF BAM export's BamConfig inherit ConfigRules, so the two can never derive differently.

Shipped into every HF BAM export next to configuration_bam.py (as config_rules.py, byte for byte), so it
imports nothing.
"""


class ConfigRules:
    """Properties over the fields `router`, `attn_router`, `head_dim` and `rotary_fraction`."""

    @property
    def ffn_router_kind(self) -> str:
        return self.router

    @property
    def attn_router_kind(self) -> str:
        """attn_router, or router when it is None."""
        return self.attn_router or self.router

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the first rotary_dim dims of each head."""
        return int(round(self.head_dim * self.rotary_fraction))
