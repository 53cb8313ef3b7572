"""Specialists added to a trained mixture (bam-surgery extend): a plan of the extended mixture, its new router rows,
and its provenance. app/extend.py is the use case (inputs opened, OUT checked, written).

    ext = plan_extension(mixture_reader, [math_reader], ["math"], ExtendOptions())
    ext = extension_rows(ext)            # --router-init prompts | domain: data through the extended model
    PlanReader(ext).get(name)            # every tensor, computed as a merge plan's are (surgery/kernels.py)

The specialists are dense models branched from the seed the mixture came from (the mixture's architecture; a
fine-grained mixture's FFN is G times narrower: G = the specialists' FFN width / the mixture's). The extended
mixture, with E FFN experts and A attention experts before and n specialists added:

    FFN experts         the mixture's E, then each specialist's FFN; fine-grained, its G parts along the
                        intermediate dimension, down projections times the mixture's own fine-grained scale
                        (surgery/plan.py:ffn_scale, what merge --ffn-granularity gave its experts)
    attention experts   the mixture's A, then each specialist's attention (q, k, v, o and QK-norms); a shared-KV
                        mixture keeps its one K/V, which the specialist's queries and outputs then read
    routers             the mixture's rows, then one row per new expert (the --router-init rule below; a
                        fine-grained FFN router's row repeated over the G experts, virtual groups as in a merge);
                        router tensors that are not per expert (an mlp router's hidden layer) kept
    everything else     the mixture's, as training left them: the averaged norms, embeddings and output head, a
                        BTX's averaged attention, the shared expert and its gate
New router rows:
    random    normal(0, --router-std) for the tensor a kind's logits are read from, normal(0, 1) for expert
              embeddings, seeded from --router-seed and the tensor's name
    prompts   linear routers: --router-prompts (mergekit-moe's file, surgery/prompts.py), one entry per new
              specialist; the entry's unit contrast through the extended model, router by router in execution order,
              times the mean norm of the router's trained rows
    domain    linear routers: --calibration, a domain named like each new specialist and at least one other; the
              unit contrast of the mean router-input state over the specialist's domain against the mean of the
              other domains' means (the first --calibration-tokens of each), times the trained rows' mean norm
Identities (tests/app/test_extend.py): routing that never picks a new expert (its logits -inf) computes the trained
mixture; routing forced to new expert j (fine-grained: its G experts at 1/G each) computes specialist j's FFN and
attention inside the trained trunk. Key-store routers are refused (their keys and usage move by rules that a new
expert would enter mid-way).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from bam_surgery.runtime import model_from_reader
from bam_surgery.runtime.config import MAX_EXPERTS, ConfigError, ModelConfig
from bam_surgery.runtime.dtypes import COMPUTE_DTYPES
from bam_surgery.runtime.layout import router_tensors, tensor_shapes
from bam_surgery.runtime.reader import Reader, check_layout
from bam_surgery.runtime.routers import KeyStoreRouter, LinearRouter, RouterTensor, init_tensor
from bam_surgery.train.provenance import expert_names, read_provenance

from .errors import BamSurgeryError, InputError
from .options import ExtendOptions
from .plan import (STACKED, PlanInput, Source, TensorOp, ffn_part, ffn_scale, input_label, per_expert_router_tensors,
                   router_rng_seed)
from .plan_reader import PlanReader, read_source
from .prompts import (PromptFile, cheap_rows, layer_by_layer, prompt_contrasts, prompt_ids, prompt_windows,
                      read_prompt_file, unit)


@dataclass
class Extension:
    """The plan of an extended mixture: TensorOps over the inputs (0: the mixture, then the specialists), read by
    surgery/plan_reader.PlanReader as a merge's plan is."""

    inputs: list[PlanInput]
    options: ExtendOptions
    before: ModelConfig  # the mixture's config
    config: ModelConfig  # the extended mixture's
    granularity: int  # fine-grained experts per specialist FFN (1: coarse)
    tensors: list[TensorOp] = field(default_factory=list)
    calibrated: dict[str, torch.Tensor] = field(default_factory=dict)  # op calibrated: the routers' full tensors
    rows: dict[str, Any] = field(default_factory=dict)  # how the new router rows were made (provenance)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tensors}

    def __getitem__(self, name: str) -> TensorOp:
        return self._by_name[name]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def specialists(self) -> list[PlanInput]:
        return self.inputs[1:]

    def new_experts(self, group: str) -> range:
        """The output indices of the new experts of `group` (ffn or attn)."""
        if group == "ffn":
            return range(self.before.ffn_experts, self.config.ffn_experts)
        return range(self.before.attn_experts, self.config.attn_experts)


# ---- checks -----------------------------------------------------------------------------------------------
def trunk_fields() -> list[str]:
    """The ModelConfig fields a specialist must share with the mixture: the architecture (every field before the
    mixture's) but the FFN width, which a fine-grained mixture divides."""
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    return [n for n in names[:names.index("ffn_experts")] if n != "ffn_hidden"]


def check_extension(mixture: PlanInput, specialists: Sequence[PlanInput], options: ExtendOptions) -> int:
    """The inputs against each other (headers only); the granularity G."""
    mix = mixture.reader.config
    if not mix.is_mixture:
        raise InputError(f"{mixture.label}: a dense model; extend adds experts to a mixture (merge makes one)")
    if mix.linear_experts:
        raise BamSurgeryError(f"{mixture.label}: has {mix.linear_experts} linear-attention (Gated DeltaNet) experts; "
                              "extend appends FFN and softmax-attention experts only (merge the specialists anew)")
    kinds = {k for k, n in ((mix.ffn_router_kind, mix.ffn_experts), (mix.attn_router_kind, mix.attn_experts)) if n}
    if KeyStoreRouter.kind in kinds:
        raise BamSurgeryError(f"{mixture.label}: key_store routers are not extended (their keys and usage move by "
                              "rules a new expert would enter mid-way)")
    if options.router_init in ("prompts", "domain") and kinds != {LinearRouter.kind}:
        raise BamSurgeryError(f"--router-init {options.router_init}: sets rows of linear routers; this mixture's "
                              f"routers are {', '.join(sorted(kinds))} (use --router-init random)")
    check_layout(mixture.reader, label=mixture.label, dtypes=COMPUTE_DTYPES.values())
    granularities = set()
    for spec in specialists:
        cfg = spec.reader.config
        if cfg.is_mixture:
            raise InputError(f"{spec.label}: a mixture; extend adds dense specialists branched from the seed")
        diff = [f for f in trunk_fields() if getattr(cfg, f) != getattr(mix, f)]
        if diff:
            shown = ", ".join(f"{f}={getattr(cfg, f)!r} (mixture: {getattr(mix, f)!r})" for f in diff[:3])
            raise InputError(f"{spec.label}: config disagrees with the mixture {mixture.label}: {shown}; a specialist "
                             "has the mixture's architecture")
        F, Fm = cfg.ffn_hidden, mix.ffn_hidden
        G = F // Fm if mix.ffn_experts and F % Fm == 0 else (1 if F == Fm else 0)
        if not G:
            raise InputError(f"{spec.label}: FFN width {F} is not a multiple of the mixture's expert width {Fm}")
        granularities.add(G)
        check_layout(spec.reader, tensor_shapes(cfg), label=spec.label, dtypes=COMPUTE_DTYPES.values())
    if len(granularities) > 1:
        raise InputError(f"the specialists' FFN widths differ ({', '.join(map(str, sorted(granularities)))} times the "
                         "mixture's expert width); they are branches of one seed")
    G = granularities.pop()
    n_ffn = mix.ffn_experts + len(specialists) * G if mix.ffn_experts else 0
    if n_ffn > MAX_EXPERTS or mix.attn_experts + len(specialists) > MAX_EXPERTS:
        raise BamSurgeryError(f"--experts: {len(specialists)} more experts make more than {MAX_EXPERTS}")
    return G


# ---- the plan ---------------------------------------------------------------------------------------------
def plan_extension(mixture: Reader, specialists: Sequence[Reader], names: Sequence[str],
                   options: ExtendOptions = ExtendOptions()) -> Extension:
    """The extended mixture's tensors from headers (and the mixture's router tensors, which are small), with random
    new router rows (extension_rows replaces them for --router-init prompts and domain). `names`: the mixture's,
    then the specialists'."""
    inputs = [PlanInput(i, "mixture" if i == 0 else "expert", input_label(r, i), r, n)
              for i, (r, n) in enumerate(zip([mixture, *specialists], names))]
    G = check_extension(inputs[0], inputs[1:], options)
    before = mixture.config
    n = len(specialists)
    try:
        config = before.replace(ffn_experts=before.ffn_experts + n * G if before.ffn_experts else 0,
                                attn_experts=before.attn_experts + n if before.attn_experts else 0)
    except ConfigError as e:
        raise BamSurgeryError(f"extend: {e}") from None
    ext = Extension(inputs, options, before, config, G)
    routers = router_tensors(config)
    ext.tensors = [_router_op(ext, name, routers[name]) if name in routers else _tensor_op(ext, name, shape)
                   for name, shape in tensor_shapes(config).items()]
    ext.rows = {"rule": "random", "std": options.router_std, "seed": options.router_seed}
    return dataclasses.replace(ext)  # __post_init__ indexes the tensors


def _tensor_op(ext: Extension, name: str, shape: tuple[int, ...]) -> TensorOp:
    """An expert tensor: the mixture's experts, then the specialists'; anything else the mixture's."""
    mix = ext.inputs[0].reader
    stacked = STACKED.match(name)
    if not stacked:
        return TensorOp(name, "copy", shape, mix.dtype(name), (Source(0, name),))
    src = f"{stacked['layer']}.{stacked['group']}.{stacked['rest']}"  # the dense tensor a specialist has
    old = tuple(Source(0, name, e) for e in range(mix.shape(name)[0]))
    if stacked["group"] == "ffn":
        G, scale = ext.granularity, ffn_scale(ext.before, ext.granularity)
        new = tuple(ffn_part(s.index, src, g, G, scale) for s in ext.specialists for g in range(G))
    else:
        new = tuple(Source(s.index, src) for s in ext.specialists)
    return TensorOp(name, "stack", shape, mix.dtype(name), old + new)


def _router_op(ext: Extension, name: str, spec: RouterTensor) -> TensorOp:
    """A router tensor: per expert, the mixture's rows and the new ones (op calibrated: routers are small, made
    whole here); else the mixture's."""
    prefix, _, tensor = name.rpartition("_router.")
    group = prefix.rsplit(".", 1)[-1]  # ffn or attn
    cfg = ext.config
    kind, E = (cfg.ffn_router_kind, cfg.ffn_experts) if group == "ffn" else (cfg.attn_router_kind, cfg.attn_experts)
    shape, dtype = tuple(spec.shape), ext.inputs[0].reader.dtype(name)
    if tensor not in per_expert_router_tensors(kind, cfg, E):
        return TensorOp(name, "copy", shape, dtype, (Source(0, name),))
    old = read_source(ext, Source(0, name), ext.options.allow_nonfinite).float()
    gen = torch.Generator().manual_seed(router_rng_seed(ext.options.router_seed, f"{name}/extend"))
    new = init_tensor(dataclasses.replace(spec, shape=(len(ext.specialists), *shape[1:])), cfg,
                      ext.options.router_std, gen)
    ext.calibrated[name] = torch.cat([old, _grouped(ext, group, new)])
    return TensorOp(name, "calibrated", shape, dtype)


def _grouped(ext: Extension, group: str, rows: torch.Tensor) -> torch.Tensor:
    """One row per specialist as the router holds it: an FFN router's repeated over the G fine-grained experts."""
    return rows.repeat_interleave(ext.granularity, dim=0) if group == "ffn" else rows


# ---- rows from data ---------------------------------------------------------------------------------------
def _linear_routers(ext: Extension) -> list[str]:
    cfg = ext.config
    return [f"layers.{i}.{group}_router" for i in range(cfg.n_layers) for group, E in
            (("attn", cfg.attn_experts), ("ffn", cfg.ffn_experts)) if E]


def _full_rows(ext: Extension, router: str, new: torch.Tensor) -> torch.Tensor:
    """The router's weight: its trained rows, then the new unit rows times the trained rows' mean norm."""
    old = read_source(ext, Source(0, f"{router}.weight"), ext.options.allow_nonfinite).float()
    scale = float(old.norm(dim=1).mean())
    return torch.cat([old, _grouped(ext, router.rsplit(".", 1)[-1].removesuffix("_router"), new * scale)])


def _check_prompt_entries(ext: Extension, prompts: PromptFile) -> None:
    where = f"--router-prompts {prompts.path}"
    if len(prompts.experts) != len(ext.specialists):
        raise BamSurgeryError(f"{where}: experts: {len(prompts.experts)} entries for {len(ext.specialists)} new "
                              f"experts ({', '.join(s.name for s in ext.specialists)}, in this order)")
    for e, (entry, spec) in enumerate(zip(prompts.experts, ext.specialists)):
        if entry.source_model not in (spec.name, spec.label):
            raise BamSurgeryError(f"{where}: experts[{e}].source_model: {entry.source_model!r} is not new expert {e}, "
                                  f"{spec.name}={spec.label}")


@torch.no_grad()
def extension_rows(ext: Extension, log=None) -> Extension:
    """The extension with its new router rows from prompts or domain data (--router-init prompts | domain)."""
    log = log or (lambda msg: None)
    opts = ext.options
    if opts.router_init == "random":
        return ext
    routers = _linear_routers(ext)
    if opts.router_init == "prompts":
        if not opts.router_prompts:
            raise BamSurgeryError("--router-init prompts: needs --router-prompts FILE")
        prompts = read_prompt_file(opts.router_prompts)
        _check_prompt_entries(ext, prompts)
        ids = prompt_ids(prompts, ext.inputs[0].reader, ext.config, opts.tokenizer)
        rows = prompts.record()
        if prompts.gate_mode == "cheap_embed":
            same = cheap_rows(read_source(ext, Source(0, "embed.weight"), opts.allow_nonfinite), ids)
            weights = {r: _full_rows(ext, r, same) for r in routers}
        elif prompts.gate_mode == "random":
            return ext
        else:
            windows, labels, ignore = prompt_windows(ids, prompts.gate_mode != "hidden_avg")
            model = model_from_reader(PlanReader(ext, hash_inputs=False), dtype=torch.float32)
            weights = layer_by_layer(model, routers, windows, labels, ignore + 1,
                                     lambda r, means: _full_rows(ext, r, prompt_contrasts(ids, r)(means)))
    else:
        weights, rows = _domain_rows(ext, routers, log)
    calibrated = {**ext.calibrated, **{f"{r}.weight": w for r, w in weights.items()}}
    log(f"extend: {len(weights)} routers' new rows from {opts.router_init}")
    return dataclasses.replace(ext, calibrated=calibrated, rows={"rule": opts.router_init, **rows,
                                                                 "scale": "the mean norm of the trained rows"})


def _domain_rows(ext: Extension, routers: list[str], log) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from bam_surgery.train.data import parse_data_spec  # lazy: the data readers and the tokenizers package, for
    from .warm_start import Calibration, calibration_windows  # --router-init domain only

    opts = ext.options
    if not opts.calibration:
        raise BamSurgeryError("--router-init domain: needs --calibration NAME=SOURCE,... (a domain named like each "
                              "new expert, and at least one other)")
    domains = parse_data_spec(opts.calibration, "--calibration")
    names = [d.name for d in domains]
    own = []
    for spec in ext.specialists:
        if spec.name not in names:
            raise BamSurgeryError(f"--calibration: no domain named {spec.name!r} for the new expert "
                                  f"{spec.name}={spec.label}; the domains are {', '.join(names)}")
        own.append(names.index(spec.name))
    if len(names) < 2:
        raise BamSurgeryError("--calibration: give at least one domain besides the new experts' own (e.g. general): "
                              "a row is a domain's mean state against the others'")
    calib = Calibration(opts.calibration, opts.calibration_tokens, opts.tokenizer, opts.token_cache)
    windows = calibration_windows(ext, calib, domains, log)
    labels = torch.cat([torch.full((len(w.tokens) - 1,), w.domain, dtype=torch.long) for w in windows])

    def rows_of(router: str, means: torch.Tensor) -> torch.Tensor:
        new = [unit(means[d] - torch.stack([means[o] for o in range(len(names)) if o != d]).mean(0),
                    f"--calibration {names[d]}, {router}") for d in own]
        return _full_rows(ext, router, torch.stack(new))

    model = model_from_reader(PlanReader(ext, hash_inputs=False), dtype=torch.float32)
    weights = layer_by_layer(model, routers, windows, labels, len(names), rows_of)
    return weights, {"calibration": opts.calibration, "tokens": int(labels.numel())}


# ---- provenance -------------------------------------------------------------------------------------------
def extension_record(ext: Extension, inputs: list[dict[str, Any]], tool: dict[str, str]) -> dict[str, Any]:
    """One entry of the provenance's "extensions": what was added, from what, how the rows started. `inputs`: the
    provenance's input records (surgery/provenance.py), the mixture's first."""
    training = (mixture_provenance(ext) or {}).get("training")
    ffn, attn = ext.new_experts("ffn"), ext.new_experts("attn")
    G = ext.granularity
    added = []
    for j, rec in enumerate(inputs[1:]):
        slots = {"ffn_experts": [ffn.start + j * G, ffn.start + (j + 1) * G]} if len(ffn) else {}
        added.append({**rec, **slots, **({"attn_expert": attn.start + j} if len(attn) else {})})
    return {"tool": tool, "mixture": inputs[0], "experts": added, "router_rows": ext.rows,
            "after_training_runs": len(training) if isinstance(training, list) else 0,
            "before": {"ffn_experts": ext.before.ffn_experts, "attn_experts": ext.before.attn_experts},
            "tensors": {t.name: t.provenance() for t in ext.tensors if t.op != "copy"}}


def mixture_provenance(ext: Extension) -> dict[str, Any] | None:
    return read_provenance(ext.inputs[0].reader.metadata)


def extended_provenance(ext: Extension, record: dict[str, Any]) -> dict[str, Any]:
    """The extended mixture's provenance: the mixture's own record kept whole (its merge, its training runs), this
    extension appended to "extensions", the experts' names extended."""
    prov = dict(mixture_provenance(ext) or {})
    names = expert_names(prov, ext.before)
    G = ext.granularity
    new_ffn = [s.name if G == 1 else f"{s.name}.{g}" for s in ext.specialists for g in range(G)]
    prov["experts"] = {"ffn": names["ffn"] + (new_ffn if ext.config.ffn_experts else []),
                       "attn": names["attn"] + ([s.name for s in ext.specialists] if ext.config.attn_experts else [])}
    history = prov.get("extensions") if isinstance(prov.get("extensions"), list) else []
    prov["extensions"] = [*history, record]
    return prov
