"""`bam-surgery count-params` and `bam-surgery inspect`: thin click commands over app/params.py (count_params,
inspect), and the rendering of an inspection. Both read checkpoint headers only."""
from __future__ import annotations

import json
import re
from typing import Any

import click

from bam_surgery.app.params import count_params, inspect
from bam_surgery.runtime.checkpoint import CONFIG_KEY, PROVENANCE_KEY
from bam_surgery.runtime.config import MAX_EXPERTS, PRESETS, ROUTERS
from bam_surgery.runtime.errors import printable
from bam_surgery.runtime.text import render_table
from bam_surgery.surgery.audit import CONVENTIONS
from bam_surgery.surgery.inspect import Inspection, describe_kind, input_digest, key_config, render_audit

from .options import ALLOW_PICKLE


# ---- rendering ------------------------------------------------------------------------------
def _show(field: str, value: Any) -> str:
    if field == "attn_top_k" and value is None:
        return "soft (every expert)"
    return str(value)


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


def _training_row(i: int, run: dict) -> tuple:
    """One training run of a provenance record as a row, whatever types its fields hold (a file we did not write)."""
    init = run.get("init")
    data = run.get("data") if isinstance(run.get("data"), list) else []

    def weight(w) -> str:
        return f"{w:.2g}" if isinstance(w, (int, float)) and not isinstance(w, bool) else str(w)
    domains = ", ".join(f"{d.get('domain')} {weight(d.get('weight', 0))}" for d in data if isinstance(d, dict))
    return (i + 1, init.get("spec", "-") if isinstance(init, dict) else "-", run.get("steps", "-"),
            run.get("tokens", "-"), domains or "-")


def natural_order(names) -> list[str]:
    """Names sorted with their numbers compared as numbers (some-64 before some-128)."""
    return sorted(names, key=lambda n: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", n)])


# ---- commands -------------------------------------------------------------------------------
@click.command("count-params")
@click.argument("ckpt", required=False)
@click.option("--preset", "preset_name", type=click.Choice(natural_order(PRESETS)),
              help="Count a built-in architecture (e.g. paper-small, Table 4) instead of a checkpoint.")
@click.option("--recipe", "recipe_name", metavar="NAME",
              help="Count the mixture this recipe (name or YAML path) builds from the dense model.")
@click.option("--experts", type=click.IntRange(min=2, max=MAX_EXPERTS), metavar="N",
              help="Number of experts in the --recipe mixture (the seed counts as one; so do extra "
                   "copies of the seed's FFN, as in the paper's Table 6).")
@click.option("--ffn-top-k", type=click.IntRange(min=1, max=MAX_EXPERTS), metavar="K",
              help="FFN experts each token runs (changes the active count only).")
@click.option("--attention-routing", metavar="soft|topK",
              help="Attention experts each token runs: 'soft' (all of them) or topK, e.g. top2.")
@click.option("--router", "router_kind", type=click.Choice(ROUTERS),
              help="Router kind of the --recipe mixture (docs/routers.md; default: the recipe's).")
@click.option("--router-hidden", type=click.IntRange(min=1), metavar="N",
              help="mlp / attention routers of the --recipe mixture: hidden / query-key width.")
@click.option("--trainable", "trainable", metavar="PATTERNS",
              help="Count as trainable what `train --trainable PATTERNS` trains (groups or globs, '!' excludes; "
                   "default: the preset's own patterns, e.g. some-64 freezes its experts, else every parameter).")
@click.option("--convention", type=click.Choice(CONVENTIONS), default="exact", show_default=True,
              help="exact: every parameter that runs; paper: the BAM paper's Table 5 counting "
                   "(each deviation from exact is listed with its size).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
@ALLOW_PICKLE
def count_params_cmd(ckpt, preset_name, recipe_name, experts, ffn_top_k, attention_routing, router_kind,
                     router_hidden, trainable, convention, as_json, allow_pickle):
    """Total and active parameter counts by group, from shapes alone.

    CKPT is a canonical checkpoint (only its header is read); or give --preset. With --recipe and
    --experts, count the mixture the recipe would build from that dense model.
    """
    count = count_params(ckpt, preset_name=preset_name, recipe=recipe_name, experts=experts, ffn_top_k=ffn_top_k,
                         attention_routing=attention_routing, router=router_kind, router_hidden=router_hidden,
                         trainable=trainable, convention=convention, allow_pickle=allow_pickle)
    if as_json:
        click.echo(json.dumps(dict(source=count.source, kind=describe_kind(count.config), **count.audit.to_dict()),
                              indent=2))
    else:
        click.echo(render_audit(count.audit, count.source))


@click.command("inspect")
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print everything as machine-readable JSON.")
@ALLOW_PICKLE
def inspect_cmd(ckpt, as_json, allow_pickle):
    """Show a checkpoint's config, tensor groups (counts, bytes, dtypes) and provenance.

    Reads the header only. Layout mismatches (tensors that disagree with the checkpoint's own
    config) are listed and make the command exit with status 1.
    """
    ins = inspect(ckpt, allow_pickle)
    click.echo(json.dumps(ins.to_dict(), indent=2) if as_json else render_inspection(ins))
    if ins.audit.mismatches:
        click.get_current_context().exit(1)
