"""docs/families.md, the families x recipes x formats table, and docs/deploy.md's per-family table of routes are what
docs/gen_families.py and docs/gen_deploy.py compute from the code
today (each family's config map, each recipe's mixture config, each format's own capability check), and its
verdicts hold where they matter most: every family's seed exports as its own HF architecture, every mixture as
HF BAM, and a refusal is the format's one line."""
from __future__ import annotations

from conftest import assert_doc_current, doc_generator


def _generator():
    return doc_generator("gen_families")


def test_the_families_table_is_current():
    assert_doc_current(_generator())


def test_every_family_and_recipe_is_carried_by_the_runtime_formats():
    """canonical and hf carry every architecture and every recipe (the runtime's own model math), onnx every one but
    the families whose layers it refuses in one line (Qwen3.5's Gated DeltaNet, Gemma 4's per-layer caches)."""
    cells = _generator().cells()
    for (family, row), verdicts in cells.items():
        for fmt in ("canonical", "hf", "onnx"):
            if fmt == "onnx" and family in ("qwen3_5_text", "gemma4_text"):
                assert verdicts[fmt].startswith("onnx export of "), (family, row, verdicts[fmt])
                continue
            assert verdicts[fmt] is None, (family, row, fmt, verdicts[fmt])


def test_the_table_covers_every_readable_architecture_and_recipe():
    from bam_surgery.converters.hf.architectures import ARCHITECTURES
    from bam_surgery.surgery.recipe import available_recipes

    gen = _generator()
    dense = {m for m, a in ARCHITECTURES.items() if not a.mixture}
    assert set(gen.families()) == dense
    rows = {row for _, row in gen.cells()}
    assert rows == {"dense", *available_recipes()}


def test_the_deploy_table_is_current():
    """docs/deploy.md's per-family table (docs/gen_deploy.py, from the same verdicts)."""
    assert_doc_current(doc_generator("gen_deploy"))


def test_every_btx_of_a_llama_or_qwen2_family_has_a_native_route_to_every_client():
    """Issue 41: a BTX (and an upcycling) of Qwen2 models (q/k/v biases) reaches transformers and vLLM natively and
    llama.cpp; so does one of Llama models."""
    routes = doc_generator("gen_deploy").routes()
    for family in ("llama", "qwen2"):
        for recipe in ("btx", "upcycle"):
            hf, vllm, gguf = routes[family, recipe]
            assert "`qwen2_moe`" in hf and "vLLM's own model" in vllm and gguf.startswith("`gguf`"), (family, recipe)
