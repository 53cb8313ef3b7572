"""Linear routers initialized from prompts (merge --router-prompts, surgery/prompts.py): each expert's row is the unit
vector along the mean router-input state of its positive prompts minus that of its negative ones, for the FFN and
the attention routers, checked against the states captured from the merged model itself; cheap_embed from the token
embeddings; fine-grained mixtures keep their virtual groups; the file is mergekit-moe's shape, every mistake in it
one line; the prompts are in the provenance."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import branched_family, cli_error_line, merge, save_family, tiny_config
from bam_surgery.app.merge import merge as merge_call
from bam_surgery.runtime import load_model
from bam_surgery.runtime.checkpoint import CheckpointReader, PROVENANCE_KEY
from bam_surgery.surgery.options import MergeOptions

CFG = tiny_config(vocab_size=256, block="sequential", norm="rmsnorm", max_positions=64)  # byte tokens
PROMPTS = {
    "seed": (["The weather is mild today.", "We talked about the garden."], []),
    "code": (["def add(a, b):\n    return a + b", "for i in range(10): print(i)"], ["Dear Sir, the court held"]),
    "law": (["The court held that the contract was void.", "Pursuant to section 12,"], ["x = 1"]),
}


def prompt_file(path, names, mode="hidden", **extra):
    doc = {"base_model": "seed", "gate_mode": mode, **extra,
           "experts": [{"source_model": n, "positive_prompts": PROMPTS[n][0],
                        **({"negative_prompts": PROMPTS[n][1]} if PROMPTS[n][1] else {})} for n in names]}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    return save_family(root, CFG, branched_family(CFG, 3, spread=0.3), names=("seed", "code", "law"))


def _inputs(paths):
    return [(None, str(paths[0])), *(("code" if i == 1 else "law", str(p)) for i, p in enumerate(paths[1:], 1))]


def _router_inputs(model, text_ids: list[list[int]], last_only: bool) -> dict[str, torch.Tensor]:
    """Per router: the mean of its input state over the prompts (each prompt's last token, or every token but the
    start token), captured from the model's own forward."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach()))
             for n, m in model.routers().items()]
    with torch.no_grad():
        for ids in text_ids:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return {n: torch.cat([x[-1:] if last_only else x[1:] for x in xs]).double().mean(0) for n, xs in seen.items()}


def _ids(texts: list[str]) -> list[list[int]]:
    return [[0, *t.encode()] for t in texts]  # the byte tokenizer's document boundary (EOS 0) first


@pytest.mark.parametrize("recipe, mode", [("btx", "hidden"), ("bam", "hidden_avg")])
def test_rows_are_the_prompts_mean_router_states(tmp_path, family, recipe, mode):
    names = ("seed", "code", "law")
    out = tmp_path / "mix.safetensors"
    merge_call(_inputs(family), out, recipe=recipe,
               options=MergeOptions(router_prompts=str(prompt_file(tmp_path / "p.yaml", names, mode))))
    model = load_model(out).eval()
    last = mode == "hidden"
    pos = [_router_inputs(model, _ids(PROMPTS[n][0]), last) for n in names]
    neg = [_router_inputs(model, _ids(PROMPTS[n][1]), last) if PROMPTS[n][1] else None for n in names]
    routers = model.routers()
    assert any(".attn_router" in n for n in routers) == (recipe == "bam")
    for name, router in routers.items():
        for e in range(len(names)):
            v = pos[e][name] - (neg[e][name] if neg[e] is not None else 0)
            assert torch.allclose(router.weight[e].double(), v / v.norm(), atol=1e-5), (name, e)
    record = json.loads(CheckpointReader(out).metadata[PROVENANCE_KEY])["options"]["router_prompts"]
    assert record["gate_mode"] == mode and record["experts"][1]["negative_prompts"] == PROMPTS["code"][1]


def test_cheap_embed_rows_and_fine_grained_groups(tmp_path, family):
    names = ("seed", "code", "law")
    out = tmp_path / "mix.safetensors"
    merge_call(_inputs(family), out, recipe="btx",
               options=MergeOptions(ffn_granularity=2, router_prompts=str(prompt_file(tmp_path / "p.yaml", names,
                                                                                        "cheap_embed"))))
    state = CheckpointReader(out)
    embed = CheckpointReader(family[0]).get("embed.weight").double()  # embeddings shared by the family

    def unit_sum(texts):
        s = embed[[t for ids in _ids(texts) for t in ids[1:]]].sum(0)
        return s / s.norm()

    rows = []
    for n in names:
        v = unit_sum(PROMPTS[n][0]) - (unit_sum(PROMPTS[n][1]) if PROMPTS[n][1] else 0)
        rows.append(v / v.norm())
    expected = torch.stack(rows).repeat_interleave(2, dim=0)  # each coarse row over its two fine-grained experts
    for layer in range(CFG.n_layers):
        assert torch.allclose(state.get(f"layers.{layer}.ffn_router.weight").double(), expected, atol=1e-6)


def test_upcycle_entries_all_name_the_seed(tmp_path, family):
    doc = {"gate_mode": "hidden", "experts_per_token": 2,
           "experts": [{"source_model": str(family[0]), "positive_prompts": [p]} for p in
                       ("def f(x):", "The court held", "3 + 4 = 7", "Once upon a time")]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    merge("--recipe", "upcycle", "--seed", family[0], "--router-prompts", tmp_path / "p.yaml",
          "--out", tmp_path / "up.safetensors")
    w = CheckpointReader(tmp_path / "up.safetensors").get("layers.0.ffn_router.weight")
    assert torch.allclose(w.norm(dim=1), torch.ones(4)) and len({tuple(r.tolist()) for r in w}) == 4


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["experts"].pop(), "2 entries for 3 FFN experts"),
    (lambda d: d["experts"][1].update(source_model="law"), "experts[1].source_model"),
    (lambda d: d.update(dtype="bfloat16"), "dtype: not read from this file (--dtype)"),
    (lambda d: d.update(gate_mode="sideways"), "gate_mode"),
    (lambda d: d["experts"][2].pop("positive_prompts"), "experts[2].positive_prompts: required"),
    (lambda d: d.update(experts_per_token=3), "--ffn-top-k 3"),
    (lambda d: d.update(base_model="code"), "base_model"),
    (lambda d: [e.update(positive_prompts=["same"], negative_prompts=[]) for e in d["experts"]], "same prompts"),
    (lambda d: d["experts"][0].update(noise_scale=0.1), "noise_scale"),
])
def test_a_bad_prompt_file_is_one_line_and_nothing_is_written(tmp_path, family, edit, needle):
    doc = yaml.safe_load(prompt_file(tmp_path / "p.yaml", ("seed", "code", "law")).read_text())
    edit(doc)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "mix.safetensors"
    line = cli_error_line("merge", "--recipe", "btx", "--seed", family[0], "--experts",
                          f"code={family[1]},law={family[2]}", "--router-prompts", tmp_path / "p.yaml", "--out", out)
    assert needle in line and "p.yaml" in line
    assert not out.exists()


def test_non_linear_routers_are_refused(tmp_path, family):
    line = cli_error_line("merge", "--recipe", "btx", "--seed", family[0], "--experts",
                          f"code={family[1]},law={family[2]}", "--router", "mlp", "--router-prompts",
                          prompt_file(tmp_path / "p.yaml", ("seed", "code", "law")), "--dry-run")
    assert "linear routers" in line and "mlp" in line
