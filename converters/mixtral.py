"""Export FFN-expert mixtures (BTX, sparse upcycling) of Llama/Mistral-family models as HF Mixtral, and back.

A mixture exports to Mixtral only if Mixtral computes exactly what our runtime computes: a
sequential pre-norm block, RMSNorm, half-split RoPE over the whole head, dense (GQA) attention,
SwiGLU experts, no biases, and top-k gates renormalized to sum to 1. `check_mixtral` says what
is missing before any tensor is read.

On disk (what `MixtralForCausalLM.save_pretrained` writes in transformers 5.x, and what
`from_pretrained` converts into its fused in-memory `mlp.experts.gate_up_proj` / `down_proj`):

    model.layers.{i}.block_sparse_moe.gate.weight            [E, D]   router
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  [F, D]   gate projection of expert e
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  [F, D]   up projection
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  [D, F]   down projection

Canonical expert tensors are stacked [E, ...] (runtime/layout.py); each becomes E Mixtral tensors
(`unstack_experts`), and `stack_experts` is the inverse used by `import_mixtral`.

    from bam_surgery.converters.mixtral import export_mixtral, import_mixtral
    export_mixtral(open_checkpoint("btx.safetensors"), "btx-mixtral/", tokenizer_files=[...])
    reader = import_mixtral("btx-mixtral/")     # canonical names, lazy, same protocol as CheckpointReader
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from bam_surgery.runtime.checkpoint import (INDEX_NAME, CheckpointError, ReaderBase, SafetensorsFile, SafetensorsStreamWriter,
                                atomic_path, iter_tensors, nbytes, plan_shards, shard_name, write_index)
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes

from .hf.config_map import CapabilityError  # one error type for every format's capability checks
from .hf.reader import read_hf_config, weight_files

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"




# ---- the one name table: canonical -> Mixtral ------------------------------------------------
# {i} is the layer index. A Mixtral name with {e} holds one expert of a canonical tensor that is
# stacked over experts (leading dim E). The Mixtral -> canonical direction is derived below.
MIXTRAL_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.o.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.ffn_router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers.{i}.ffn_experts.gate.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "layers.{i}.ffn_experts.up.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "layers.{i}.ffn_experts.down.weight": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _template_regex(template: str) -> re.Pattern:
    """'layers.{i}.x' -> ^layers\\.(?P<i>\\d+)\\.x$"""
    parts = re.split(r"(\{[ie]\})", template)
    body = "".join(f"(?P<{p[1]}>\\d+)" if p in ("{i}", "{e}") else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


_TO_MIXTRAL = [(_template_regex(c), m) for c, m in MIXTRAL_NAMES.items()]
_TO_CANONICAL = [(_template_regex(m), c) for c, m in MIXTRAL_NAMES.items()]


def to_mixtral(canonical: str) -> tuple[str, bool]:
    """Canonical name -> (Mixtral name, stacked). A stacked tensor's name keeps the "{e}" placeholder."""
    for rx, template in _TO_MIXTRAL:
        m = rx.match(canonical)
        if m:
            stacked = "{e}" in template
            return template.format(**m.groupdict(), **({"e": "{e}"} if stacked else {})), stacked
    raise KeyError(f"{canonical}: canonical tensor has no Mixtral name")


def mixtral_names(canonical: str, n_experts: int) -> list[str]:
    """The Mixtral names holding one canonical tensor: one name, or E names (expert order) if stacked."""
    name, stacked = to_mixtral(canonical)
    return [name.format(e=e) for e in range(n_experts)] if stacked else [name]


def canonical_name(mixtral: str) -> tuple[str, int | None]:
    """Mixtral name -> (canonical name, expert index or None). KeyError for names not in the table."""
    for rx, template in _TO_CANONICAL:
        m = rx.match(mixtral)
        if m:
            fields = m.groupdict()
            expert = fields.pop("e", None)
            return template.format(**fields), None if expert is None else int(expert)
    raise KeyError(f"{mixtral}: not a Mixtral weight name")


# ---- reshapes: named, with inverses ---------------------------------------------------------
def unstack_experts(stacked: torch.Tensor) -> list[torch.Tensor]:
    """[E, ...] -> E tensors [...] (views; no copy)."""
    return list(stacked.unbind(0))


def stack_experts(per_expert: list[torch.Tensor]) -> torch.Tensor:
    """E tensors [...] -> [E, ...]; inverse of unstack_experts."""
    return torch.stack(per_expert, 0)


# ---- capability checks ----------------------------------------------------------------------
def mixtral_problems(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(what Mixtral needs, what this model has) for every feature Mixtral cannot express."""
    out: list[tuple[str, str]] = []

    def need(ok: bool, needs: str, has: str) -> None:
        if not ok:
            out.append((needs, has))

    need(cfg.activation == "swiglu", "SwiGLU FFNs", f"activation {cfg.activation}")
    need(cfg.attn_experts == 0, "dense attention", f"{cfg.attn_experts} attention experts")
    need(cfg.ffn_experts >= 2, "FFN experts", "a dense FFN (ffn_experts=0)")
    need(cfg.norm == "rmsnorm", "RMSNorm", f"norm {cfg.norm}")
    need(not cfg.norm_bias, "norms without bias", "norm biases")
    need(cfg.block == "sequential", "sequential blocks", f"block {cfg.block}")
    need(cfg.position == "rope", "RoPE", f"position {cfg.position}")
    need(not cfg.rope_interleaved, "half-split RoPE", "interleaved RoPE")
    need(cfg.rotary_fraction == 1.0, "RoPE over the whole head", f"rotary_fraction {cfg.rotary_fraction}")
    biases = [n for n, on in (("q/k/v", cfg.qkv_bias), ("o", cfg.o_bias), ("ffn", cfg.ffn_bias),
                              ("lm_head", cfg.lm_head_bias)) if on]
    need(not biases, "bias-free projections", f"{', '.join(biases)} biases")
    need(cfg.logit_scale == 1.0, "unscaled logits", f"logit_scale {cfg.logit_scale}")
    # Mixtral renormalizes the top-k probabilities to sum to 1. Plain softmax gates agree only
    # when every expert is selected (then the top-k probabilities already sum to 1).
    if cfg.ffn_experts >= 2 and cfg.gate_norm != "topk_softmax" and cfg.ffn_top_k != cfg.ffn_experts:
        out.append(("top-k gates renormalized to sum to 1 (gate_norm topk_softmax)",
                    f"gate_norm {cfg.gate_norm} with top-{cfg.ffn_top_k} of {cfg.ffn_experts} experts, "
                    "whose gates p_i do not sum to 1, so Mixtral's outputs would differ "
                    "(rebuild the mixture with gate_norm: topk_softmax)"))
    return out


def check_mixtral(cfg: ModelConfig, recipe: str | None = None) -> None:
    """Raise CapabilityError (one line) if Mixtral cannot compute exactly what this model computes."""
    problems = mixtral_problems(cfg)
    if problems:
        who = f"recipe {recipe}" if recipe else "the model"
        raise CapabilityError(f"mixtral export needs {' and '.join(n for n, _ in problems)}; "
                              f"{who} has {', '.join(h for _, h in problems)}")


# ---- config.json ----------------------------------------------------------------------------
# canonical field -> MixtralConfig field (inverse derived in config_from_mixtral)
CONFIG_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "ffn_hidden": "intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "max_positions": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "ffn_experts": "num_local_experts",
    "ffn_top_k": "num_experts_per_tok",
    "lb_coef": "router_aux_loss_coef",
}
# MixtralConfig's defaults (transformers 5.23) for fields a config.json may leave out.
MIXTRAL_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
    "hidden_act": "silu", "rope_theta": 1e6, "head_dim": None, "num_key_value_heads": None,
}
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def mixtral_config(cfg: ModelConfig, dtype: torch.dtype, token_ids: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json body for MixtralForCausalLM."""
    body: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    body.update({hf: getattr(cfg, ours) for ours, hf in CONFIG_FIELDS.items()})
    dtype_name = str(dtype).removeprefix("torch.")
    body.update(
        hidden_act="silu",
        # transformers >= 5 reads rope_parameters; older readers read rope_theta.
        rope_parameters={"rope_theta": float(cfg.rope_theta), "rope_type": "default"},
        rope_theta=float(cfg.rope_theta),
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        output_router_logits=False,
        use_cache=True,
        initializer_range=0.02,
        dtype=dtype_name,
        torch_dtype=dtype_name,
    )
    for k in TOKEN_ID_FIELDS:  # None rather than MixtralConfig's Llama-tokenizer defaults (1, 2)
        body[k] = (token_ids or {}).get(k)
    return body


def config_from_mixtral(hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Mixtral config.json body; refuses features the runtime does not compute."""
    def get(key: str) -> Any:
        if key in hf:
            return hf[key]
        if key in MIXTRAL_DEFAULTS:
            return MIXTRAL_DEFAULTS[key]
        raise CheckpointError(f"{source}: required field {key!r} is missing")

    arch = hf.get("architectures") or [ARCHITECTURE]
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE or ARCHITECTURE not in arch:
        raise CheckpointError(f"{source}: not a Mixtral config (model_type={hf.get('model_type')!r}, "
                              f"architectures={arch})")
    if get("hidden_act") != "silu":
        raise CheckpointError(f"{source}: hidden_act {get('hidden_act')!r} is not supported (Mixtral experts use silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type {rope_type!r} is not supported (only default RoPE)")
    window = hf.get("sliding_window")
    if window is not None and window < get("max_position_embeddings"):
        raise CheckpointError(f"{source}: sliding_window={window} is not supported (the runtime attends to all "
                              "previous tokens)")
    fields = {ours: get(theirs) for ours, theirs in CONFIG_FIELDS.items()}
    fields["norm_eps"] = float(fields["norm_eps"])
    fields["lb_coef"] = float(fields["lb_coef"])
    return ModelConfig(
        **fields,
        rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
        activation="swiglu", norm="rmsnorm", position="rope", block="sequential",
        gate_norm="topk_softmax", attn_experts=0,
        z_coef=0.0,  # Mixtral's training objective has no router z-loss
        name=str(hf.get("_name_or_path") or MODEL_TYPE),
    )


# ---- export ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WriteStep:
    """Output tensor `mixtral` <- canonical tensor `canonical` (its slice [expert] when stacked)."""

    mixtral: str
    canonical: str
    expert: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def _reader_label(reader) -> str:
    return str(getattr(reader, "path", "<reader>"))


def plan_export(reader, dtype: torch.dtype | None = None) -> list[WriteStep]:
    """Check the reader's tensors against the layout and list the Mixtral tensors to write, in order."""
    cfg: ModelConfig = reader.config
    src = _reader_label(reader)
    expected = tensor_shapes(cfg)
    present = set(reader.names())
    for name in expected:
        if name not in present:
            raise CheckpointError(f"{src}: tensor {name} is missing")
    for name in reader.names():
        if name not in expected:
            raise CheckpointError(f"{src}: tensor {name} is not in the layout of its own config")
    steps: list[WriteStep] = []
    for name, shape in expected.items():
        if tuple(reader.shape(name)) != tuple(shape):
            raise CheckpointError(f"{src}: tensor {name} has shape {tuple(reader.shape(name))}, "
                                  f"the config says {tuple(shape)}")
        out_dtype = dtype or reader.dtype(name)
        names = mixtral_names(name, cfg.ffn_experts)
        if to_mixtral(name)[1]:  # stacked over experts: one output tensor per expert
            steps += [WriteStep(n, name, e, tuple(shape[1:]), out_dtype) for e, n in enumerate(names)]
        else:
            steps.append(WriteStep(names[0], name, None, tuple(shape), out_dtype))
    return steps


def _model_dtype(steps: list[WriteStep]) -> torch.dtype:
    """The dtype holding most of the bytes (what config.json's dtype reports)."""
    by_bytes: Counter = Counter()
    for s in steps:
        by_bytes[s.dtype] += nbytes(s.shape, s.dtype)
    return by_bytes.most_common(1)[0][0]


RESERVED_FILES = ("config.json", "generation_config.json", "README.md", INDEX_NAME)


def export_mixtral(reader, out_dir: str | os.PathLike, tokenizer_files: Iterable[str | os.PathLike] = (),
                   model_card: str | None = None, max_shard_bytes: int | None = None,
                   generation_config: Mapping[str, Any] | None = None, *, recipe: str | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Write an HF Mixtral directory from a canonical mixture reader, one canonical tensor in memory at a time.

    tokenizer_files  copied into the directory by file name (tokenizer.json, tokenizer_config.json, ...)
    model_card       markdown text written as README.md
    generation_config  generation_config.json fields; its bos/eos/pad token ids also go to config.json
    recipe           recipe name used in capability error messages
    dtype            cast every tensor (default: keep each tensor's dtype)
    Nothing is left at out_dir if anything fails.
    """
    cfg: ModelConfig = reader.config
    check_mixtral(cfg, recipe or getattr(reader, "metadata", {}).get("recipe"))
    tokenizer_files = [Path(p) for p in tokenizer_files]
    for p in tokenizer_files:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: tokenizer file not found")
        if p.name in RESERVED_FILES or p.name.endswith(".safetensors"):
            raise ValueError(f"{p}: tokenizer file name {p.name!r} clashes with a file the export writes")
    steps = plan_export(reader, dtype)
    by_name = {s.mixtral: s for s in steps}
    shards = plan_shards([(s.mixtral, s.shape, s.dtype) for s in steps], max_shard_bytes)
    generation = dict(generation_config or {})
    token_ids = {k: generation[k] for k in TOKEN_ID_FIELDS if k in generation}

    with atomic_path(out_dir, is_dir=True) as tmp:
        tmp.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        held_name, held = None, []  # the canonical tensor being written, as its output parts
        # canonical tensors in the order the shards need them, read ahead in a background thread
        source = iter_tensors(reader, list(dict.fromkeys(s.canonical for s in steps)))
        for i, shard in enumerate(shards):
            fname = shard_name(i, len(shards))
            writer = SafetensorsStreamWriter(tmp / fname, shard, {"format": "pt"})
            for out_name, _, _ in shard:
                step = by_name[out_name]
                if step.canonical != held_name:
                    held_name, held = None, []  # free the previous tensor before taking the next
                    name, tensor = next(source)
                    assert name == step.canonical, (name, step.canonical)
                    tensor = tensor.to(step.dtype)
                    held = [tensor] if step.expert is None else unstack_experts(tensor)
                    held_name, tensor = step.canonical, None
                writer.write(out_name, held[step.expert or 0])
                weight_map[out_name] = fname
            writer.close()
        held_name, held = None, []
        write_index(tmp, weight_map, sum(nbytes(s.shape, s.dtype) for s in steps), {})
        config = mixtral_config(cfg, _model_dtype(steps), token_ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        for p in tokenizer_files:
            shutil.copyfile(p, tmp / p.name)
        if model_card is not None:
            (tmp / "README.md").write_text(model_card)
    return Path(out_dir)


# ---- import ---------------------------------------------------------------------------------
class MixtralReader(ReaderBase):
    """Lazy view of an HF Mixtral directory under canonical names (CheckpointReader's protocol).

    `get` of a stacked expert tensor reads its E per-expert tensors and stacks them.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config = config_from_mixtral(read_hf_config(self.path), str(self.path / "config.json"))
        self.metadata = {"source_format": MODEL_TYPE, "source": str(self.path)}
        self._handles: dict[Path, Any] = {}
        # canonical name -> {expert index or None: (file, Mixtral name)}
        self._parts: dict[str, dict[int | None, tuple[Path, str]]] = {}
        for file in self._shard_files():
            handle = self._open(file)
            for key in handle.keys():
                try:
                    canonical, expert = canonical_name(key)
                except KeyError:
                    raise CheckpointError(f"{file}: tensor {key} is not a Mixtral weight name") from None
                self._parts.setdefault(canonical, {})[expert] = (file, key)
        self._expected = tensor_shapes(self.config)
        self._check()

    def _shard_files(self) -> list[Path]:
        files, _, _ = weight_files(self.path)  # safetensors only: pickles are refused there
        return sorted(files)

    def _open(self, file: Path) -> SafetensorsFile:
        self._handles[file] = SafetensorsFile(file)
        return self._handles[file]

    def _header(self, file: Path, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._handles[file].meta[key]

    def _check(self) -> None:
        E = self.config.ffn_experts
        for canonical, shape in self._expected.items():
            parts = self._parts.get(canonical)
            names = mixtral_names(canonical, E)
            if not parts:
                raise CheckpointError(f"{self.path}: tensor {names[0]} is missing")
            stacked = to_mixtral(canonical)[1]
            keys = list(range(E)) if stacked else [None]
            part_shape = tuple(shape[1:]) if stacked else tuple(shape)
            dtypes = set()
            for k, mixtral in zip(keys, names):
                if k not in parts:
                    raise CheckpointError(f"{self.path}: tensor {mixtral} is missing")
                file, key = parts[k]
                got_shape, got_dtype = self._header(file, key)
                if got_shape != part_shape:
                    raise CheckpointError(f"{file}: tensor {key} has shape {got_shape}, config.json implies {part_shape}")
                dtypes.add(got_dtype)
            if len(dtypes) > 1:
                raise CheckpointError(f"{self.path}: the experts of {canonical} have mixed dtypes {sorted(map(str, dtypes))}")
            extra = set(parts) - set(keys)
            if extra:
                file, key = parts[sorted(extra, key=lambda x: -1 if x is None else x)[0]]
                raise CheckpointError(f"{file}: tensor {key} does not fit config.json "
                                      f"(num_local_experts={E}, num_hidden_layers={self.config.n_layers})")
        for canonical, parts in self._parts.items():
            if canonical not in self._expected:
                file, key = next(iter(parts.values()))
                raise CheckpointError(f"{file}: tensor {key} does not fit config.json "
                                      f"(num_hidden_layers={self.config.n_layers}, "
                                      f"tie_word_embeddings={self.config.tie_embeddings})")

    # -- reader protocol -------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._expected)

    def __contains__(self, name: str) -> bool:
        return name in self._expected

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._expected[name])

    def dtype(self, name: str) -> torch.dtype:
        file, key = next(iter(self._parts[name].values()))
        return self._header(file, key)[1]

    def file_of(self, name: str) -> Path:
        return next(iter(self._parts[name].values()))[0]

    def files(self) -> list[Path]:
        return list(self._handles)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._expected:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        parts = self._parts[name]
        if None in parts:
            file, key = parts[None]
            return self._handles[file].get(key)
        return stack_experts([self._handles[f].get(k) for f, k in (parts[e] for e in sorted(parts))])



def import_mixtral(path: str | os.PathLike) -> MixtralReader:
    """Open an HF Mixtral directory as a lazy canonical reader (use load_state to materialize it)."""
    return MixtralReader(path)


def load_state(reader) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Materialize every tensor of a reader: (config, canonical state dict). Small models only."""
    return reader.config, {n: reader.get(n) for n in reader.names()}
