"""Token generation with the static KV cache: one prefill, then one-token decode steps (gpt-fast's design).

    from bam_surgery.runtime import generate, load_model
    new = generate(model, prompt, max_new_tokens=32)                                # greedy, [B, <=32]
    new = generate(model, prompt, 32, temperature=0.8, top_p=0.95, seed=1, eos_token_id=2)
    new = generate(model, padded, 32, attention_mask=mask)    # batched prompts, left-padded (mask: 1 token, 0 pad)

The decode step (`decode_step`) is plain tensor code over static shapes (cache [B, heads, max_len, Dh], a
[B, max_len] mask, the one new token's slot as a tensor), so `compile=True` captures it whole with
torch.compile (mode "reduce-overhead", i.e. CUDA graphs, on a GPU) whenever the FFN expert kernel needs no
host synchronisation: always in bf16 where torch._grouped_mm runs, and for up to 2*E/K sequences otherwise
(blocks.expert_kernel); larger fp32/fp16 batches of FFN-expert models take one graph break per layer. Sampling draws its uniform numbers
outside the step from a private generator, so a seed gives the same tokens every time and the global RNG
is left alone.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from .model import Model


def sample_next(logits: Tensor, temperature: float, top_p: float, uniform: Tensor | None) -> Tensor:
    """Next token ids [B] from logits [B, V]: argmax at temperature 0; else a draw from softmax(logits / T)
    restricted to the smallest set of most likely tokens whose probability reaches top_p, by inverting
    its CDF at uniform [B] (numbers in [0, 1))."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    probs, order = probs.sort(-1, descending=True)
    if top_p < 1.0:  # keep a token if the tokens before it do not reach top_p yet (the first always stays)
        probs = probs * ((probs.cumsum(-1) - probs) < top_p)
    cdf = probs.cumsum(-1)
    choice = (cdf < uniform[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)
    return order.gather(-1, choice[:, None])[:, 0]


def decode_step(model: Model, cache, token: Tensor, input_pos: Tensor, attention_mask: Tensor, temperature: float,
                top_p: float, uniform: Tensor | None) -> Tensor:
    """One token per sequence: token [B, 1] at key slot input_pos [1] -> the next token ids [B]."""
    logits = model(token, attention_mask=attention_mask, input_pos=input_pos, cache=cache).logits[:, -1]
    return sample_next(logits, temperature, top_p, uniform)


@torch.no_grad()
def generate(model: Model, tokens: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
             attention_mask: Tensor | None = None, pad_token_id: int | None = None, compile: bool = False,
             timings: dict[str, float] | None = None) -> Tensor:
    """Continue prompts tokens [B, T] by up to max_new_tokens tokens each; returns the new tokens [B, n].

    temperature     0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_p           nucleus sampling: sample among the most likely tokens whose probability reaches top_p
    seed            seeds the sampler's private generator (same seed, same tokens); None: a random seed
    eos_token_id    a row stops after emitting it (one id or several); generation ends when every row has
    pad_token_id    fills a row's slots after its eos (default: the eos id)
    attention_mask  [B, T] 1 token, 0 padding: batched prompts of different lengths, padded on the left
    compile         run the decode step through torch.compile ("reduce-overhead" on CUDA)
    timings         a dict given receives prefill_s (the prompt's forward pass and the first token) and decode_s
                    (every later token), in seconds, the device synchronized at both ends
    n is max_new_tokens unless every row emitted eos earlier. The model runs in whatever mode and autocast
    state the caller set; the cache takes the autocast dtype if autocast is on, else the weights' dtype.
    """
    _check_generate_args(tokens, max_new_tokens, temperature, top_p)
    device = model.embed.weight.device
    tokens = tokens.to(device).long()
    B, T = tokens.shape
    max_len = T + max_new_tokens
    mask = _generation_mask(attention_mask, B, T, max_len, device)
    eos = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    fill = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos is not None else 0)
    uniform = _uniforms(B, device, temperature, seed)
    autocast = torch.is_autocast_enabled(device.type)  # the cache takes the autocast dtype, else the weights'
    cache = model.new_cache(B, max_len, dtype=torch.get_autocast_dtype(device.type) if autocast else None)
    step: Callable[..., Tensor] = decode_step
    if compile:  # whole-graph whenever the expert kernel needs no host sync (see blocks.expert_kernel)
        step = torch.compile(decode_step, mode="reduce-overhead" if device.type == "cuda" else None)
    out = torch.full((B, max_new_tokens), fill, dtype=torch.long, device=device)
    refill_at = _longrope_refill(model.config, T)
    if not max_new_tokens:
        return out
    clock = _Clock(device, timings)
    logits = model(tokens, attention_mask=mask, input_pos=torch.arange(T, device=device), cache=cache,
                   logits_to_keep=1).logits[:, -1]
    token = sample_next(logits, temperature, top_p, uniform())
    clock.lap("prefill_s")
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if eos is not None:
            token = torch.where(done, fill, token)
            done = done | torch.isin(token, eos)
        out[:, i] = token
        if i == max_new_tokens - 1 or (eos is not None and bool(done.all())):
            clock.lap("decode_s")
            return out[:, :i + 1]
        pos = torch.tensor([T + i], device=device)
        if T + i == refill_at:  # the sequence passes longrope's original length: every key with long factors
            so_far = torch.cat((tokens, out[:, :i + 1]), dim=1)
            logits = model(so_far, attention_mask=mask, input_pos=torch.arange(T + i + 1, device=device),
                           cache=cache, logits_to_keep=1).logits[:, -1]
            token = sample_next(logits, temperature, top_p, uniform())
            continue
        token = step(model, cache, token[:, None], pos, mask, temperature, top_p, uniform()).clone()
    return out


class _Clock:
    """generate's timings: seconds between laps (the device synchronized), written into `into` when given."""

    def __init__(self, device: torch.device, into: dict[str, float] | None):
        self.device, self.into = device, into
        self.last = self._now() if into is not None else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        if self.into is not None:
            now = self._now()
            self.into[name] = now - self.last
            self.last = now


def _longrope_refill(cfg, prompt_len: int) -> int | None:
    """The slot whose decode step recomputes the whole cache instead: longrope switches every frequency once the
    sequence passes original_max_position_embeddings, so keys cached before then (short factors) are computed
    again with the long ones, as transformers' Phi-3 generation does (it drops its cache there). None: never."""
    s = cfg.scaled_rope
    if s is None or s["rope_type"] != "longrope":
        return None
    original = s["original_max_position_embeddings"]
    return original if original >= prompt_len else None


def _check_generate_args(tokens: Tensor, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64) or not tokens.shape[1]:
        raise ValueError(f"tokens must be a [batch, length >= 1] integer tensor, got {tuple(tokens.shape)} "
                         f"{tokens.dtype}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")


def _generation_mask(attention_mask: Tensor | None, B: int, T: int, max_len: int, device: torch.device) -> Tensor:
    """[B, max_len] over every key slot: the prompts' mask (left padding only), then 1s for the new tokens."""
    mask = torch.ones(B, max_len, dtype=torch.long, device=device)
    if attention_mask is not None:
        prompt_mask = attention_mask.to(device).long()
        if tuple(prompt_mask.shape) != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(prompt_mask.shape)}, expected {(B, T)}")
        if bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any()) or not bool(prompt_mask[:, -1].all()):
            raise ValueError("attention_mask: generate needs prompts padded on the left (0s, then 1s)")
        mask[:, :T] = prompt_mask
    return mask


def _uniforms(B: int, device: torch.device, temperature: float, seed: int | None) -> Callable[[], Tensor | None]:
    """One uniform [B] per sampled token from a private generator (None when greedy: temperature 0)."""
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)

    def uniform() -> Tensor | None:
        return None if gen is None else torch.rand(B, generator=gen, device=device)

    return uniform
