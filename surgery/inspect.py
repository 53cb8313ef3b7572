"""What is in a checkpoint, from its header: config, tensor groups, provenance, layout check.

No tensor data is read. Built on the audit (surgery.audit.audit_checkpoint), so the parameter
counts shown by `inspect` and `count-params` are the same numbers.
"""
from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass, field
from typing import Any

from bam_surgery.runtime.checkpoint import CONFIG_KEY, PROVENANCE_KEY, provenance_inputs
from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.errors import CheckpointError, printable
from bam_surgery.runtime.jsonfile import parse_json
from bam_surgery.runtime.layout import GROUPS
from bam_surgery.runtime.reader import Reader
from bam_surgery.runtime.text import render_table

from .audit import Audit, audit_checkpoint, routing_label

# The config fields a reader wants first (inspect's table, the model cards); the JSON output carries the whole config.
KEY_FIELDS = ("name", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
              "activation", "norm", "norm_eps", "norm_position", "qk_norm", "position", "max_positions", "block",
              "qkv_bias", "o_bias", "ffn_bias", "lm_head_bias", "tie_embeddings")
ROPE_FIELDS = ("rope_theta", "rotary_fraction", "rope_interleaved", "scaled_rope", "nope_layers")
# shown where they differ from the default (the features of Gemma, Cohere, Granite, Ministral 3 and the windowed
# families)
OPTIONAL_FIELDS = ("norm_bias", "norm_unit_offset", "scale_embeddings", "attn_window", "attn_window_layers",
                   "window_rope_theta", "attn_scale_dim", "attn_softcap", "final_softcap", "logit_scale",
                   "embedding_multiplier", "residual_multiplier", "attn_scale", "attn_temperature",
                   "attn_temperature_length", "final_norm")
MIXTURE_FIELDS = ("ffn_experts", "ffn_top_k", "gate_norm", "ffn_shared_hidden", "attn_experts", "attn_top_k",
                  "kv_mode", "router", "attn_router", "lb_coef", "z_coef")
# the hybrid layers' fields (Qwen3.5, Gemma 4), shown where a model has them
HYBRID_FIELDS = ("linear_layers", "global_head_dim", "global_kv_heads", "kv_shared_layers", "per_layer_dim",
                 "linear_experts")


def describe_kind(cfg: ModelConfig) -> str:
    """One line: dense, or which experts the mixture has and how they are routed."""
    if not cfg.is_mixture:
        return "dense"
    parts = []
    if cfg.ffn_experts:
        router = f", key-store router at temperature {cfg.router_temperature:g}" if cfg.router == "key_store" else ""
        parts.append(f"{cfg.ffn_experts} FFN experts, top-{cfg.ffn_top_k} ({cfg.gate_norm}){router}")
        if cfg.ffn_shared_hidden:
            parts.append(f"a shared FFN expert of width {cfg.ffn_shared_hidden} (sigmoid gate)")
    if cfg.attn_experts:
        routing = "soft routing" if cfg.attn_top_k is None else f"top-{cfg.attn_top_k}"
        kv = "shared K/V" if cfg.kv_mode == "shared" else "expert K/V"
        parts.append(f"{cfg.attn_experts} attention experts, {routing}, {kv}")
    else:
        parts.append("dense attention")
    if cfg.linear_experts:
        parts.append(f"{cfg.linear_experts} Gated DeltaNet experts in each linear-attention layer")
    return "mixture: " + "; ".join(parts)


def key_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config's fields as inspect shows them: the key ones, RoPE's where the model has RoPE, the optional ones
    that differ from their default, the mixture's."""
    default = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    fields = [*KEY_FIELDS, *(ROPE_FIELDS if cfg.position == "rope" else ()),
              *(f for f in OPTIONAL_FIELDS + HYBRID_FIELDS if getattr(cfg, f) != default[f]),
              *(MIXTURE_FIELDS if cfg.is_mixture else ())]
    out = {f: getattr(cfg, f) for f in fields}
    out["n_kv_heads"], out["head_dim"] = cfg.n_kv_heads or cfg.n_heads, cfg.head_dim or cfg.d_model // cfg.n_heads
    return out


@dataclass(frozen=True)
class GroupStorage:
    tensors: int
    params: int
    active: int
    bytes: int
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class Provenance:
    """metadata["bam_provenance"], parsed. `raw` is kept when it is not a JSON object."""

    fields: dict[str, Any] | None
    error: str | None = None
    raw: str | None = None

    @property
    def recipe(self) -> str | None:
        r = (self.fields or {}).get("recipe")
        if isinstance(r, dict):
            return r.get("name") or r.get("path") or json.dumps(r, sort_keys=True)
        return None if r is None else str(r)

    @property
    def tool_version(self) -> str | None:
        f = self.fields or {}
        tool = f.get("tool")
        if isinstance(tool, dict):
            return " ".join(str(tool[k]) for k in ("name", "version") if k in tool) or None
        for key in ("tool_version", "version"):
            if key in f:
                return str(f[key])
        return None if tool is None else str(tool)

    @property
    def training(self) -> list[dict[str, Any]]:
        """Training runs since the merge (or the first run), oldest first (bam_surgery.train.provenance)."""
        runs = (self.fields or {}).get("training") or []
        return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return provenance_inputs(self.fields)


HOW_OBTAINED = {
    "bytes": "BLAKE3 of the file's bytes",
    "hf-blob": "sha256 from the Hugging Face cache's blob name (checked by huggingface_hub when downloaded)",
}


def input_digest(entry: dict[str, Any]) -> tuple[str, str]:
    """(digest, how it was obtained) of one provenance input, for every provenance version: older
    merges recorded a bare sha256 of each file (or of a sha256sum manifest for a sharded input)."""
    files = entry.get("files") if isinstance(entry.get("files"), list) else []
    if "digest" in entry:
        hows = sorted({str(f["how"]) for f in files if isinstance(f, dict) and f.get("how") is not None})
        how = "; ".join(HOW_OBTAINED.get(h, str(h)) for h in hows) or "-"
        if len(files) > 1:
            how = f"BLAKE3 of the manifest of {len(files)} files ({how})"
        return str(entry["digest"] or "-"), how
    if "sha256" in entry:
        what = "sha256 of the file's bytes" if len(files) <= 1 else f"sha256 of the sha256sum manifest of {len(files)} files"
        return f"sha256:{entry['sha256']}" if entry["sha256"] else "-", f"{what} (older bam-surgery)"
    return "-", "-"


def parse_provenance(metadata: dict[str, str]) -> Provenance | None:
    raw = metadata.get(PROVENANCE_KEY)
    if raw is None:
        return None
    try:
        value = parse_json(raw, PROVENANCE_KEY, expect=dict)
    except CheckpointError as e:  # shown as a finding of inspect, not an error
        return Provenance(None, str(e).removeprefix(f"{PROVENANCE_KEY}: "), raw)
    return Provenance(value)


@dataclass
class Inspection:
    path: str
    config: ModelConfig
    audit: Audit
    files: list[str]
    metadata: dict[str, str]
    provenance: Provenance | None
    groups: dict[str, GroupStorage] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(g.bytes for g in self.groups.values())

    def table(self) -> str:
        """The inspection as `bam-surgery inspect` prints it (render_inspection)."""
        return render_inspection(self)

    def to_dict(self) -> dict[str, Any]:
        other_meta = {k: v for k, v in self.metadata.items() if k not in (CONFIG_KEY, PROVENANCE_KEY)}
        prov = None
        if self.provenance is not None:
            prov = self.provenance.fields if self.provenance.fields is not None else {
                "error": self.provenance.error, "raw": self.provenance.raw}
        return dict(
            path=self.path,
            kind=describe_kind(self.config),
            config=self.config.to_dict(),
            files=self.files,
            tensors=len(self.audit.tensors),
            params=self.audit.total,
            active_params=self.audit.active,
            bytes=self.total_bytes,
            groups={g: dict(tensors=s.tensors, params=s.params, active=s.active, bytes=s.bytes,
                            dtypes=list(s.dtypes)) for g, s in self.groups.items()},
            provenance=prov,
            metadata=other_meta,
            mismatches=[m.to_dict() for m in self.audit.mismatches],
        )


def inspect_checkpoint(reader: Reader) -> Inspection:
    """Summarize an open checkpoint reader (header only)."""
    a = audit_checkpoint(reader, "exact")
    nbytes: dict[str, int] = {g: 0 for g in GROUPS}
    dtypes: dict[str, set[str]] = {g: set() for g in GROUPS}
    for t in a.tensors:
        nbytes[t.group] += t.nbytes or 0
        dtypes[t.group].add(t.dtype)
    groups = {g: GroupStorage(c.tensors, c.total, c.active, nbytes[g], tuple(sorted(d for d in dtypes[g] if d)))
              for g, c in a.groups.items()}
    metadata = dict(reader.metadata)
    return Inspection(str(reader.path or ""), reader.config, a, [str(f) for f in reader.files()], metadata,
                      parse_provenance(metadata), groups)


# ---- the inspect table (bam-surgery inspect) ------------------------------------------------------------------------------
def _show(field: str, value: Any) -> str:
    if field == "attn_top_k" and value is None:
        return "soft (every expert)"
    if field == "attn_router" and value is None:
        return "as router"
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return f"{value:g}" if isinstance(value, float) else str(value)


def render_inspection(ins: Inspection) -> str:
    cfg = ins.config
    out = [f"checkpoint  {printable(ins.path)}", f"kind        {describe_kind(cfg)}"]
    if ins.files:
        out.append(f"files       {len(ins.files)}: " + ", ".join(printable(f.rsplit('/', 1)[-1]) for f in ins.files))
    other = {k: v for k, v in ins.metadata.items() if k not in (CONFIG_KEY, PROVENANCE_KEY, "total_size")}
    if other:
        out += ["", "metadata", render_table(("key", "value"), [(k, v if len(v) <= 100 else v[:97] + "...")
                                                               for k, v in other.items()], indent="  ", left=2)]
    out += ["", "config", render_table(("field", "value"), [(k, _show(k, v)) for k, v in key_config(cfg).items()],
                                        indent="  ", left=2)]
    rows = [(g, s.tensors, s.params, s.active, s.bytes, ",".join(s.dtypes) or "-") for g, s in ins.groups.items()]
    rows.append(("total", len(ins.audit.tensors), ins.audit.total, ins.audit.active, ins.total_bytes, ""))
    out += ["", "tensors", render_table(("group", "tensors", "params", "active", "bytes", "dtypes"), rows,
                                         indent="  ")]
    out += ["", "provenance"]
    prov = ins.provenance
    if prov is None:
        out.append(f"  none (no {PROVENANCE_KEY!r} in the checkpoint metadata)")
    elif prov.fields is None:
        out.append(f"  unreadable: {prov.error}")
    else:
        head = [("recipe", prov.recipe or "-"), ("tool", prov.tool_version or "-")]
        shown = {"recipe", "tool", "tool_version", "version", "inputs", "tensors", "training", "experts"}
        head += [(k, v if isinstance(v, str) else json.dumps(v, sort_keys=True))
                 for k, v in prov.fields.items() if k not in shown]
        experts = prov.fields.get("experts")
        if isinstance(experts, dict):
            head.append(("experts", "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in experts.items()
                                              if isinstance(v, list) and v) or "-"))
        per_tensor = prov.fields.get("tensors")
        if isinstance(per_tensor, dict):  # one line per op; the full map is in --json
            ops: dict[str, int] = {}
            for rec in per_tensor.values():
                op = str(rec.get("op", "?")) if isinstance(rec, dict) else "?"
                ops[op] = ops.get(op, 0) + 1
            head.append(("tensors", ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) + " (--json: each)"))
        out.append(render_table(("field", "value"), head, indent="  ", left=2))
        if prov.inputs:
            cols = ["name", "role", "path", "digest", "how it was obtained"]
            extra = sorted({k for i in prov.inputs for k in i} - {"name", "role", "path", "spec", "files", "digest",
                                                                    "sha256"})
            rows = [(i.get("name", "-"), i.get("role", "-"), i.get("path", i.get("spec", "-")), *input_digest(i),
                     *[str(i.get(k, "")) for k in extra]) for i in prov.inputs]
            out += ["  inputs", render_table((*cols, *extra), rows, indent="    ", left=len(cols) + len(extra))]
        if prov.training:  # the chain: merge (above) -> each training run, oldest first
            rows = [_training_row(i, r) for i, r in enumerate(prov.training)]
            out += ["  training (oldest first)", render_table(("run", "init", "steps", "tokens", "data"), rows,
                                                              indent="    ", left=2)]
    out += ["", "layout check"]
    if ins.audit.mismatches:
        out.append(f"  {len(ins.audit.mismatches)} mismatches with the layout its config implies:")
        out += [f"  {m.message()}" for m in ins.audit.mismatches]
    else:
        out.append("  ok: every tensor name and shape matches the config")
    return "\n".join(out)


# ---- the count-params table (count-params, merge --dry-run, model cards) ---------------------------
def render_audit(a: Audit, source: str) -> str:
    out = [f"model       {printable(source)}", f"kind        {describe_kind(a.config)}",
           f"convention  {a.convention}", ""]
    rows = [(g, c.tensors, c.total, c.active) for g, c in a.groups.items()]
    rows.append(("total", len(a.parameters), a.total, a.active))
    out.append(render_table(("group", "tensors", "total", "active"), rows))
    if a.buffers.tensors or a.trainable_patterns != ["*"]:  # otherwise every parameter trains: the table says it
        patterns = ",".join(a.trainable_patterns)
        share = f"{100 * a.trainable / a.total:.2f}% of total" if a.total else "no parameters"
        out += ["", f"total       {a.total:,} = {millions(a.total)}",
                f"trainable   {a.trainable:,} = {millions(a.trainable)} ({share}; --trainable {patterns})"]
    if a.buffers.tensors:
        out.append(f"buffers     {a.buffers.total:,} = {millions(a.buffers.total)} in {a.buffers.tensors} tensors "
                   "(router state moved by rules, not by gradient, e.g. a key store's keys and usage EMA; in the "
                   "checkpoint, not parameters, not in total)")
    if a.convention == "paper":
        out += ["", "paper convention: deviations from exact (already applied above)"]
        if not a.adjustments:
            out.append("  none apply to this model: paper == exact")
        for adj in a.adjustments:
            out.append(f"  {adj.key} ({adj.group}, {adj.tensors} tensors): "
                       f"total {adj.total_delta:+,}, active {adj.active_delta:+,}")
            out.append(f"    {adj.explanation}")
        exact_active = a.active - sum(adj.active_delta for adj in a.adjustments)
        exact_total = a.total - sum(adj.total_delta for adj in a.adjustments)
        out.append(f"  exact: total {exact_total:,}, active {exact_active:,}")
        label = routing_label(a.config)
        out += ["", f"as in the paper's Table 5{', ' + label if label else ''} (per-block rows: one transformer "
                "block, active)", render_table(("row", "params"), a.table5(), indent="  ")]
    if a.mismatches:
        out += ["", f"layout mismatches ({len(a.mismatches)})"]
        out += [f"  {m.message()}" for m in a.mismatches]
    return "\n".join(out)


def millions(n: int) -> str:
    """2,717,711,360 -> '2717.71M' (rounded to the nearest 10,000)."""
    return f"{n / 1e6:.2f}M"


def _training_row(i: int, run: dict) -> tuple:
    """One training run of a provenance record as a row, whatever types its fields hold (a file we did not write)."""
    init = run.get("init")
    data = run.get("data") if isinstance(run.get("data"), list) else []

    def weight(w) -> str:
        return f"{w:.2g}" if isinstance(w, (int, float)) and not isinstance(w, bool) else str(w)
    domains = ", ".join(f"{d.get('domain')} {weight(d.get('weight', 0))}" for d in data if isinstance(d, dict))
    return (i + 1, init.get("spec", "-") if isinstance(init, dict) else "-", run.get("steps", "-"),
            run.get("tokens", "-"), domains or "-")
