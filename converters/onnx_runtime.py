"""Running an exported graph in onnxruntime, and checking it against the runtime (`--verify`).

    decoder = OrtDecoder("out/model.onnx")
    logits, present = decoder.forward(ids, mask)                 # numpy int64 [B, T] each; present: name -> array
    tokens = decoder.greedy(ids, mask, max_new_tokens=8)        # [B, 8], through the graph's own KV cache
    report = verify_export(model, "out/model.onnx")             # ORT vs runtime logits and greedy tokens
    report = compare_export(reference_outputs(model), path)     # the same in two steps (the model dropped between)

Greedy decoding feeds each step's present.{i}.key/value back as past_key_values.{i}.key/value, grows the
attention mask by one column of ones and counts position ids from the mask, exactly as runtime.generate does
with its static cache; a graph exported without a cache recomputes the whole sequence every step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from bam_surgery.runtime.generation import generate
from bam_surgery.runtime.model import Model

PAST_PREFIX = "past_key_values."
# --verify: logits of an fp32 graph within FP32_TOLERANCE of the runtime's (fp32), an fp16 graph within
# FP16_TOLERANCE, each times the largest logit where that exceeds 1: rounding grows with the values summed (a real
# 30-layer model with logits of 35 differs by 4e-4 in fp32, 1.2e-5 of its largest logit). An fp16 graph's tokens
# are compared and reported, not required: fp16 rounding may flip a near tie.
FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 2e-2


class OrtDecoder:
    """An onnxruntime CPU session over an exported graph (see onnx_graph for its inputs and outputs)."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None, profile_prefix: str | None = None):
        """profile_prefix: turn on onnxruntime's profiler, writing to that path prefix (session.end_profiling())."""
        import onnxruntime as ort  # lazy: onnxruntime costs 0.07 s at start-up

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        if profile_prefix:
            options.enable_profiling, options.profile_file_prefix = True, profile_prefix
        self.session = ort.InferenceSession(os.fspath(path), options, providers=["CPUExecutionProvider"])
        past = [i for i in self.session.get_inputs() if i.name.startswith(PAST_PREFIX)]
        self.past_names = [i.name for i in past]
        self.kv_cache = bool(past)
        self.past_dtype = np.float16 if past and past[0].type == "tensor(float16)" else np.float32
        self.kv_heads, self.head_dim = (past[0].shape[1], past[0].shape[3]) if past else (0, 0)

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((batch, self.kv_heads, 0, self.head_dim), self.past_dtype) for n in self.past_names}

    def forward(self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray] | None = None
                ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """ids [B, T], mask [B, P+T] (int64) and the past (None: empty) -> (logits [B, T, V], the next past)."""
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask, ids.shape[1])}
        if self.kv_cache:
            feeds.update(self.empty_past(ids.shape[0]) if past is None else past)
        logits, *present = self.session.run(None, feeds)
        return logits, dict(zip(self.past_names, present))

    def greedy(self, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """Greedy continuation [B, max_new_tokens] of left-padded prompts ids [B, T] (mask: 1 token, 0 padding)."""
        new: list[np.ndarray] = []
        past = None
        seq = ids
        for _ in range(max_new_tokens):
            logits, past = self.forward(ids if self.kv_cache else seq, mask, past)
            token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            new.append(token)
            mask = np.concatenate([mask, np.ones_like(token)], axis=1)
            ids, seq = token, np.concatenate([seq, token], axis=1)
        return np.concatenate(new, axis=1) if new else np.zeros((ids.shape[0], 0), np.int64)


def positions(mask: np.ndarray, n_new: int) -> np.ndarray:
    """Position ids [B, n_new] of the last n_new slots: real tokens counted from the mask (padding does not count)."""
    return np.clip(mask.cumsum(-1) - 1, 0, None)[:, -n_new:].astype(np.int64)


@dataclass(frozen=True)
class VerifyReport:
    max_abs_diff: float  # logits, over the real (not padding) positions of the prompt batch
    tolerance: float
    tokens_equal: bool  # greedy tokens through ORT's KV cache == runtime.generate's
    n_tokens: int  # generated per row
    batch: int
    prompt_len: int
    required_tokens: bool  # fp32: tokens must be equal; fp16: reported only

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and (self.tokens_equal or not self.required_tokens)

    def summary(self) -> str:
        tokens = "equal" if self.tokens_equal else "DIFFERENT"
        return (f"verify: logits max abs diff {self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e}) on "
                f"{self.batch} left-padded prompts of up to {self.prompt_len} tokens; greedy tokens "
                f"{tokens} to runtime.generate ({self.n_tokens} per prompt"
                f"{'' if self.required_tokens else ', fp16: reported only'}): {'OK' if self.ok else 'FAILED'}")


def prompt_batch(model: Model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids [3, T], mask [3, T] with rows of T, T-2 and T-4 real tokens padded on the left, new tokens to
    generate), sized to fit learned position tables."""
    cfg = model.config
    length = max(1, min(8, cfg.max_positions // 2))
    n_new = max(1, min(8, cfg.max_positions - length))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    for row, pad in enumerate((0, 2, 4)):
        mask[row, :min(pad, length - 1)] = 0
    return ids, mask, n_new


@dataclass(frozen=True)
class Reference:
    """What --verify compares an export with: the runtime's logits on prompt_batch and its greedy tokens."""
    ids: torch.Tensor  # [3, T]
    mask: torch.Tensor  # [3, T], left padding
    logits: torch.Tensor  # [3, T, V]
    tokens: np.ndarray  # [3, n_new], runtime.generate's


@torch.no_grad()
def reference_outputs(model: Model) -> Reference:
    """The runtime's side of verify_export (taken first, so the model can be dropped before onnxruntime loads the
    graph: export-onnx never holds both)."""
    ids, mask, n_new = prompt_batch(model)
    logits = model(ids, attention_mask=mask).logits
    return Reference(ids, mask, logits, generate(model, ids, n_new, attention_mask=mask).numpy())


def compare_export(reference: Reference, path: str | os.PathLike, fp16: bool = False) -> VerifyReport:
    """Run the export at path in onnxruntime against the runtime's outputs: logits of the left-padded prompt
    batch, and greedy generation through the graph's KV cache against runtime.generate."""
    decoder = OrtDecoder(path)
    ids, mask, ref = reference.ids, reference.mask, reference.logits
    logits, _ = decoder.forward(ids.numpy(), mask.numpy())
    real = mask.bool()
    diff = float((torch.from_numpy(logits.astype(np.float32)) - ref)[real].abs().max())
    tolerance = (FP16_TOLERANCE if fp16 else FP32_TOLERANCE) * max(1.0, float(ref[real].abs().max()))
    n_new = reference.tokens.shape[1]
    got = decoder.greedy(ids.numpy(), mask.numpy(), n_new)
    return VerifyReport(max_abs_diff=diff, tolerance=tolerance, tokens_equal=bool(np.array_equal(reference.tokens, got)),
                        n_tokens=n_new, batch=ids.shape[0], prompt_len=ids.shape[1], required_tokens=not fp16)


def verify_export(model: Model, path: str | os.PathLike, fp16: bool = False) -> VerifyReport:
    """Run the export at path in onnxruntime against `model` (the runtime, fp32, eval): logits of a left-padded
    prompt batch, and greedy generation through the graph's KV cache against runtime.generate."""
    return compare_export(reference_outputs(model), path, fp16=fp16)
