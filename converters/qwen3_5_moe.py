"""The `qwen3_5_moe` format: FFN-expert mixtures (BTX, btx-shared-expert, sparse upcycling) of Qwen3.5 models as HF
Qwen3.5-MoE, loaded natively (`Qwen3_5MoeForCausalLM`, no remote code).

On disk (what `Qwen3_5MoeForCausalLM.save_pretrained` writes; transformers fuses the experts when it loads them):

    model.layers.{i}.linear_attn.* / self_attn.*                       Qwen3.5's layers (hf/architectures.py)
    model.layers.{i}.mlp.gate.weight                          [E, D]   router
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight        routed expert e
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight      the shared expert
    model.layers.{i}.mlp.shared_expert_gate.weight            [1, D]   its gate: sigmoid(x . w)

Qwen3.5-MoE always has a shared expert: a mixture without one is written through `with_zero_shared_expert`, a
reader view with a shared expert of width 1 whose weights are zeros, so the model computes exactly the same
function (read back, it is a mixture with that zero shared expert). The config map and the capability check are in
hf/qwen3_5_moe_config.py.
"""
from __future__ import annotations

from bam_surgery.runtime.reader import Reader

from .hf.qwen3_5_moe_config import MODEL_TYPE
from .mixtral import NativeMixtureExporter
from .qwen2_moe import WithZeros


def with_zero_shared_expert(inner: Reader) -> WithZeros:
    """A mixture seen with a shared expert of width 1, every weight zero (its output is exactly 0)."""
    cfg, dtype = inner.config, inner.dtype("embed.weight")
    added = {}
    for i in range(cfg.n_layers):
        after = f"layers.{i}.ffn_experts.down.weight"
        for name, shape in (("gate", (1, cfg.d_model)), ("up", (1, cfg.d_model)), ("down", (cfg.d_model, 1))):
            added[f"layers.{i}.ffn_shared.{name}.weight"] = (shape, dtype, after)
        added[f"layers.{i}.ffn_shared_gate.weight"] = ((1, cfg.d_model), dtype, after)
    return WithZeros(inner, cfg.replace(ffn_shared_hidden=1), added)


class Qwen35MoeExporter(NativeMixtureExporter):
    name, model_type = "qwen3_5_moe", MODEL_TYPE
    summary = "HF Qwen3.5-MoE directory, btx/btx-shared-expert/upcycle of Qwen3.5 inputs"

    def source(self, reader: Reader) -> Reader:
        """Qwen3.5-MoE always has a shared expert: a mixture without one is seen through with_zero_shared_expert."""
        return reader if reader.config.ffn_shared_hidden else with_zero_shared_expert(reader)
