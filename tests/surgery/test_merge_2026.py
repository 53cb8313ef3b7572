"""Every merge recipe over Qwen3.5 (Gated DeltaNet layers) and Gemma 4 (per-layer inputs, K/V shared across layers,
global layers of their own geometry), from Hugging Face folders, held by the identities against transformers'
own models, without a cache and with one (a prefill past the delta rule's chunk of 64 and Gemma's window, then
step-by-step decoding):

  * forced routing to expert i reproduces specialist i (the last one through the cache too), whatever the recipe does with a linear-attention layer:
    bam and bam-shared-kv stack it (each expert its own DeltaNet and recurrent state, mixed by the attention
    router; forcing expert i runs specialist i's), btx and btx-shared-expert average it, upcycle copies the seed's;
  * N identical experts reproduce the dense model under the learned (random) routers, soft or top-k;
  * a Gated DeltaNet expert is its own: forcing another expert moves the logits.
The specialists are the seed with its projections (the Gated DeltaNet's included) moved by 10%, keeping equal to
the seed what the recipe averages (conftest.hf_specialists).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import max_diff, merge_family  # noqa: E402
from test_merge_families import family_folders, hf_logits, merged_with_references  # noqa: E402
from bam_surgery.runtime import ForcedRouting, load_model  # noqa: E402

TOL = 1e-4
FAMILIES = ("qwen3.5", "gemma4")
KEEP = {
    "bam": lambda n: False,
    "bam-shared-kv": lambda n: any(f".attn.{p}." in n for p in ("k", "v", "k_norm")),
    "btx": lambda n: ".attn." in n or ".linear." in n,
    "btx-shared-expert": lambda n: ".attn." in n or ".linear." in n,
}
LENGTH, PREFILL = 70, 66  # a prefill past the delta rule's chunk of 64 (and many Gemma windows), then 4 steps


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return family_folders(tmp_path_factory, FAMILIES, KEEP)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, LENGTH), generator=torch.Generator().manual_seed(1))


def cached_logits(mix, tokens, routing=None) -> torch.Tensor:
    """The prefill's logits, then each decoding step's, side by side [B, T, V]."""
    cache = mix.new_cache(tokens.shape[0], tokens.shape[1])
    out = []
    with torch.no_grad():
        for a, b in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, tokens.shape[1])]:
            out.append(mix(tokens[:, a:b], routing=routing, input_pos=torch.arange(a, b), cache=cache).logits)
    return torch.cat(out, dim=1)


def check(mix, tokens, routing, ref, what, cached: bool = True) -> None:
    with torch.no_grad():
        assert max_diff(mix(tokens, routing=routing).logits, ref) <= TOL, what
    if cached:
        assert max_diff(cached_logits(mix, tokens, routing), ref) <= TOL, (what, "cached")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(KEEP))
@pytest.mark.parametrize("family", FAMILIES)
def test_forced_routing_reproduces_each_specialist(families, tmp_path, family, recipe):
    mix, tokens, members, shared = merged_with_references(families[family][recipe], tmp_path, recipe,
                                                          lambda vocab: _tokens())
    assert (mix.config.linear_experts > 0) == (family == "qwen3.5" and recipe.startswith("bam"))
    for i, ref in enumerate(members):
        check(mix, tokens, ForcedRouting(expert=i, shared_gate=0.0 if shared else None), ref, (family, recipe, i),
              cached=i == len(members) - 1)  # through the cache too: the last expert (another state than the first)
    other = ForcedRouting(expert=1, shared_gate=0.0 if shared else None)
    with torch.no_grad():
        assert max_diff(mix(tokens, routing=other).logits, members[0]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("family, routing", [("qwen3.5", "soft"), ("qwen3.5", "top1"), ("gemma4", "soft")])
def test_identical_experts_reproduce_the_dense_model(families, tmp_path, family, routing):
    """bam over the seed three times: every expert (the DeltaNet ones included) is the seed's, so the learned
    routers' gates, soft or top-1, sum one copy of it (and upcycle reproduces the seed under any expert)."""
    seed = families[family]["bam"][0]
    out = tmp_path / "mix.safetensors"
    merge_family([seed, seed, seed], out, "--recipe", "bam", "--attention-routing", routing)
    mix = load_model(out)
    tokens = _tokens()
    check(mix, tokens, None, hf_logits(seed, tokens), (family, routing))
    up = tmp_path / "up.safetensors"
    merge_family([seed], up, "--recipe", "upcycle", "--extra-ffn-experts", "2")
    check(load_model(up), tokens, ForcedRouting(expert=1), hf_logits(seed, tokens), (family, "upcycle"))
