"""Writes docs/families.md: for every architecture the tool reads, every recipe, every output format, whether the
format carries the model and, where it does not, the format's own one-line refusal.

    .venv/bin/python docs/gen_families.py           # rewrite docs/families.md
    .venv/bin/python docs/gen_families.py --check   # exit 1 if docs/families.md is not what this would write

Nothing here is typed by hand but the list of families: each is a config.json with the features of the real
model it stands for (tiny sizes), read by the family's own config map; each recipe's mixture config comes from
surgery.recipe.mixture_config with the recipe's defaults (seed and two specialists); each cell asks the format's
own capability check (converters.export.check_export), as `merge --format` and `convert --format` do before they
read a tensor. tests/project/test_families_doc.py fails when docs/families.md is out of date.
"""
from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "families.md"
REGENERATE = ".venv/bin/python docs/gen_families.py"
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
# family -> (the model it stands for, its config.json with the real features; Gemma's query_pre_attn_scalar is its
# head_dim, as in Gemma 2 2B / 9B and Gemma 3 up to 12B)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama 3.2 (llama3 RoPE, tied)", dict(SIZES, model_type="llama", tie_word_embeddings=True,
                                                     max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2.5 (q/k/v biases)", dict(SIZES, model_type="qwen2", tie_word_embeddings=True)),
    "qwen3": ("Qwen3 (QK-norm)", dict(SIZES, model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "phi3": ("Phi-3.5-mini (fused projections, longrope)",
             dict(SIZES, model_type="phi3", num_key_value_heads=4, max_position_embeddings=131072,
                  original_max_position_embeddings=4096,
                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                       long_factor=[4.0] * 8))),
    "olmo2": ("OLMo 2 (post-norms, full QK-norm)", dict(SIZES, model_type="olmo2", rms_norm_eps=1e-6,
                                                         rope_parameters=dict(rope_type="default",
                                                                              rope_theta=500000.0))),
    "smollm3": ("SmolLM3 (no RoPE every 4th layer)", dict(SIZES, model_type="smollm3")),
    "olmo3": ("OLMo 3 (sliding windows in 3 of 4 layers)", dict(SIZES, model_type="olmo3", sliding_window=512)),
    "gemma2": ("Gemma 2 (sandwich norms, soft-capping, every other layer sliding)",
               dict(SIZES, model_type="gemma2", head_dim=32, query_pre_attn_scalar=32, sliding_window=512)),
    "gemma3_text": ("Gemma 3 270M (QK-norm, 5 of 6 layers sliding, local RoPE base)",
                    dict(SIZES, model_type="gemma3_text", num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                         sliding_window=512)),
    "mistral": ("Mistral 7B v0.1 (4096-token window)", dict(SIZES, model_type="mistral", sliding_window=4096)),
    "qwen3_5_text": ("Qwen3.5 (Gated DeltaNet in 3 of 4 layers, gated attention)",
                     dict(SIZES, model_type="qwen3_5_text", head_dim=32, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)),
    "gemma4_text": ("Gemma 4 E2B (per-layer inputs, shared K/V layers, global layers of their own head size)",
                    dict(SIZES, model_type="gemma4_text", num_hidden_layers=6, head_dim=32, global_head_dim=64,
                         num_key_value_heads=1, num_kv_shared_layers=2, use_double_wide_mlp=True,
                         hidden_size_per_layer_input=16, sliding_window=512,
                         layer_types=["sliding_attention", "full_attention"] * 3)),
    "gpt_neox": ("Pythia (parallel, partial rotary)", dict(SIZES, model_type="gpt_neox", num_key_value_heads=None,
                                                           rotary_pct=0.25)),
    "gpt2": ("GPT-2 (learned positions)", dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=4, n_head=4)),
    "cohere": ("Command R (parallel, interleaved RoPE)", dict(SIZES, model_type="cohere")),
    "phi": ("Phi-2 (parallel, biases)", dict(SIZES, model_type="phi", num_key_value_heads=4,
                                              partial_rotary_factor=0.5)),
}


def cells() -> dict[tuple[str, str], dict[str, str | None]]:
    """(family, recipe or 'dense') -> format -> None (carried) or the format's refusal."""
    from bam_surgery.converters.base import CapabilityError
    from bam_surgery.converters.export import check_export, exporters
    from bam_surgery.converters.hf.architectures import ARCHITECTURES
    from bam_surgery.surgery.recipe import available_recipes, load_recipe, mixture_config

    out: dict[tuple[str, str], dict[str, str | None]] = {}
    for family, (_, hf) in FAMILIES.items():
        dense, _notes = ARCHITECTURES[family].config.read(hf, family)
        models = {"dense": (dense, None)}
        for name in available_recipes():
            recipe = load_recipe(name)
            experts = min(max(2, recipe.min_experts), recipe.max_experts if recipe.max_experts is not None else 2)
            models[name] = (mixture_config(recipe, dense, experts + recipe.defaults["seed_expert"]), name)
        for row, (cfg, recipe) in models.items():
            verdicts: dict[str, str | None] = {}
            for fmt in exporters():
                try:
                    check_export(fmt, cfg, recipe=recipe, architecture=family)
                    verdicts[fmt] = None
                except CapabilityError as e:
                    verdicts[fmt] = str(e)
            out[family, row] = verdicts
    return out


def render() -> str:
    from bam_surgery.converters.export import exporters

    formats = list(exporters())
    table = cells()
    reasons: dict[str, int] = {}
    lines = [
        "# Families x recipes x formats",
        "",
        f"<!-- Generated by docs/gen_families.py from the code; do not edit by hand ({REGENERATE}). -->",
        "",
        "Every architecture the tool reads (the model each row stands for in parentheses), as the seed alone (`dense`)",
        "and merged with each shipped recipe at its defaults (the seed and two specialists), against every output",
        "format: `yes` where the format carries the model, otherwise the number of the format's own refusal, the",
        "line `merge --format` and `convert --format` print before reading a tensor. Some refusals name the flag",
        "that lifts them (a Mixtral export needs `--gate-norm topk_softmax`, for instance).",
        "",
        "| family | model | " + " | ".join(formats) + " |",
        "|---|---|" + "---|" * len(formats),
    ]
    for (family, row), verdicts in table.items():
        shown = []
        for fmt in formats:
            why = verdicts[fmt]
            if why is None:
                shown.append("yes")
            else:
                shown.append(f"no ({reasons.setdefault(why, len(reasons) + 1)})")
        label = FAMILIES[family][0] if row == "dense" else ""
        lines.append(f"| {family if row == 'dense' else ''} | {row}{' - ' + label if label else ''} | "
                     + " | ".join(shown) + " |")
    lines += ["", "## Refusals", ""]
    lines += [f"{n}. {why}" for why, n in reasons.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from gen_cli import write_or_check  # docs/, this script's folder

    return write_or_check(DOC, render(), REGENERATE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
