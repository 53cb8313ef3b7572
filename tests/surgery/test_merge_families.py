"""Every merge recipe over the families of 2024-25 (Llama 3.2 with llama3 RoPE, Qwen3, Phi-3 with longrope, OLMo 2,
SmolLM3), from Hugging Face folders, held by the identities against transformers' own models:

  * forced routing to expert i reproduces specialist i (transformers' logits, fp32, <= 1e-4) when the inputs share
    what the recipe averages: norms and embeddings; K/V and the k norm for shared K/V; the attention for BTX;
  * the shared-expert recipe with the shared expert's gate forced to 0 and expert i reproduces specialist i;
  * upcycling reproduces the seed under any forced expert;
  * the QK-norm of each attention expert is its own: the specialists' q norms differ, and forcing another expert
    moves the logits.
The specialists are the seed with its projections (and QK-norms) moved by 10%, written back in the family's own
format by the exporter, so every input is a folder transformers loads (conftest.hf_specialists).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import hf_specialists, max_diff, merge, merge_family  # noqa: E402
from bam_surgery.converters import open_checkpoint  # noqa: E402
from bam_surgery.runtime import ForcedRouting, load_model  # noqa: E402

TOL = 1e-4
FAMILIES = ("llama3.2", "qwen3", "phi3", "olmo2", "smollm3", "gemma2", "gemma3", "olmo3", "mistral-window", "granite",
            "ministral3", "exaone4")
# what the specialists keep equal to the seed, per recipe: the tensors the recipe averages or shares
KEEP = {
    "bam": lambda n: False,
    "bam-shared-kv": lambda n: any(f".attn.{p}." in n for p in ("k", "v", "k_norm")),
    "btx": lambda n: ".attn." in n,
    "btx-shared-expert": lambda n: ".attn." in n,
}


def family_folders(tmp_path_factory, families, keep: dict) -> dict:
    """family -> recipe -> [seed, specialist, specialist] folders in the family's HF format, the specialists keeping
    equal to the seed what keep[recipe] holds (test_merge_2026.py takes this too)."""
    out = {}
    for family in families:
        root = tmp_path_factory.mktemp(family)
        out[family] = {recipe: hf_specialists(root / recipe, family, keep=k) for recipe, k in keep.items()}
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return family_folders(tmp_path_factory, FAMILIES, KEEP)


def hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def mix_logits(mix, tokens, routing):
    with torch.no_grad():
        return mix(tokens, routing=routing).logits


def merged_with_references(dirs, tmp_path, recipe: str, tokens_of):
    """(the merge of dirs by recipe, its tokens = tokens_of(vocab), transformers' logits of each member on them,
    whether the recipe's routed experts are the specialists alone: btx-shared-expert, whose seed is its shared
    expert)."""
    out = tmp_path / "mix.safetensors"
    merge_family(dirs, out, "--recipe", recipe)
    mix = load_model(out)
    tokens = tokens_of(mix.config.vocab_size)
    want = [hf_logits(d, tokens) for d in dirs]
    shared = recipe == "btx-shared-expert"
    return mix, tokens, want[1:] if shared else want, shared


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(KEEP))
@pytest.mark.parametrize("family", FAMILIES)
def test_forced_routing_reproduces_each_specialist(families, tmp_path, family, recipe):
    mix, tokens, members, shared = merged_with_references(families[family][recipe], tmp_path, recipe, _tokens)
    for i, ref in enumerate(members):
        routing = ForcedRouting(expert=i, shared_gate=0.0 if shared else None)
        assert max_diff(mix_logits(mix, tokens, routing), ref) <= TOL, (family, recipe, i)
    # the experts really differ: forcing expert 1 is not specialist 0 of the list
    other = ForcedRouting(expert=1, shared_gate=0.0 if shared else None)
    assert max_diff(mix_logits(mix, tokens, other), members[0]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_upcycle_reproduces_the_seed(families, tmp_path, family):
    seed = families[family]["bam"][0]
    out = tmp_path / "up.safetensors"
    merge("--recipe", "upcycle", "--seed", seed, "--out", out)
    mix = load_model(out)
    tokens = _tokens(mix.config.vocab_size)
    want = hf_logits(seed, tokens)
    for i in range(mix.config.ffn_experts):
        assert max_diff(mix_logits(mix, tokens, ForcedRouting(expert=i)), want) <= TOL


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_attention_experts_keep_their_own_qk_norms(families, tmp_path, family):
    """bam stacks each specialist's q and k norms; bam-shared-kv stacks the q norms and keeps one k norm."""
    dirs = families[family]["bam"]
    merge_family(dirs, tmp_path / "bam.safetensors")
    merge_family(families[family]["bam-shared-kv"], tmp_path / "kv.safetensors", "--recipe", "bam-shared-kv")
    specialists = [open_checkpoint(str(d)) for d in dirs]
    with open_checkpoint(str(tmp_path / "bam.safetensors")) as mix:
        q = mix.get("layers.1.attn_experts.q_norm.weight")
        for e, s in enumerate(specialists):
            assert torch.equal(q[e], s.get("layers.1.attn.q_norm.weight"))
        assert not torch.equal(q[1], q[2])
        assert mix.get("layers.1.attn_experts.k_norm.weight").shape[0] == 3
    with open_checkpoint(str(tmp_path / "kv.safetensors")) as mix:
        assert "layers.1.attn_experts.k_norm.weight" not in mix
        assert mix.get("layers.1.attn.k_norm.weight").shape == specialists[0].get("layers.1.attn.k_norm.weight").shape
