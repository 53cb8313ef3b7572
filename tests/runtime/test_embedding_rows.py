"""Transformer.embedding_grad_rows: a tied model's input-embedding gradient added into embed.weight.grad row by row
(blocks._EmbeddingRows) instead of autograd's dense [V, D] gradient. The weights' gradients must equal autograd's,
over one backward and accumulated over two, with the head in the loss or not."""
from __future__ import annotations

import pytest
import torch

from bam_surgery.runtime import blocks
from conftest import build_model, max_diff, random_state, tiny_config, tokens_for


def _grads(model, flag: bool, backwards: int, head: bool = True) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.embedding_grad_rows = flag
    for seed in range(backwards):
        tokens = tokens_for(model.config, seed)
        if head:
            out = model(tokens, targets=tokens)
            (out.nll + 0.01 * out.lb_loss + 0.001 * out.z_loss).backward()
        else:  # the input embeddings alone reach the loss: the rows go into a fresh gradient
            model.embed_tokens(tokens).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("experts", [0, 3])
def test_gradients_equal_autograds(backwards, experts):
    cfg = tiny_config(tie_embeddings=True, ffn_experts=experts, attn_experts=experts)
    model = build_model(cfg, random_state(cfg, 1)).train()
    want = _grads(model, False, backwards)
    calls = []
    original = blocks._EmbeddingRows.backward
    blocks._EmbeddingRows.backward = staticmethod(lambda ctx, g: calls.append(1) or original(ctx, g))
    try:
        got = _grads(model, True, backwards)
    finally:
        blocks._EmbeddingRows.backward = staticmethod(original)
    assert len(calls) == backwards  # the row path ran
    assert got.keys() == want.keys()
    for name in want:
        assert max_diff(got[name], want[name]) < 1e-6, name


def test_without_the_head_the_rows_make_the_gradient():
    cfg = tiny_config(tie_embeddings=True)
    model = build_model(cfg, random_state(cfg, 2)).train()
    want = _grads(model, False, 1, head=False)["embed.weight"]
    assert max_diff(_grads(model, True, 1, head=False)["embed.weight"], want) < 1e-6


def test_off_where_it_does_not_apply():
    cfg = tiny_config(tie_embeddings=True)
    model = build_model(cfg, random_state(cfg, 3))
    model.embedding_grad_rows = True
    tokens = tokens_for(cfg)
    with torch.no_grad():  # no gradient: the plain embedding, no anchor
        assert model.embed_tokens(tokens).grad_fn is None
    model.embed.weight.requires_grad_(False)  # a frozen embedding: likewise
    assert model.embed_tokens(tokens).grad_fn is None
