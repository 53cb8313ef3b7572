"""`bam-surgery pipeline`: a micro pipeline (tiny model, a few steps per stage) end to end; its report against
`bam-surgery eval` and its recorded commands against their own outputs; resume after the process is killed
mid-training; malformed pipeline files refused before any work with one line and exit 2."""
from __future__ import annotations

import copy
import errno
import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli
from bam_surgery.runtime import load_checkpoint
from bam_surgery.pipeline.run import PipelineRun
from bam_surgery.pipeline.schema import load_pipeline, shipped_pipelines

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "domains"
DOMAINS = ("general", "code", "law")
TIMING = ("wall_s", "cpu_s", "train_s")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (conftest.one_thread)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 24 kB of each domain's train and val text: real text, tokenized in no time."""
    root = tmp_path_factory.mktemp("corpus")
    for dom in DOMAINS:
        (root / dom).mkdir()
        for split, size in (("train", 24000), ("val", 6000)):
            with gzip.open(CORPUS / dom / f"{split}.txt.gz", "rt", encoding="utf-8") as f:
                text = f.read(size)
            (root / dom / f"{split}.txt").write_text(text, encoding="utf-8")
    return root


PAPER_GATES = {"ffn_top_k": 1, "gate_norm": "softmax"}


def micro_doc(corpus: Path, cache: Path) -> dict:
    return {
        "name": "micro", "description": "micro pipeline for the tests", "seed": 3, "threads": 1,
        "data": {"general": str(corpus / "general"), "domains": {"code": str(corpus / "code"),
                                                                "law": str(corpus / "law")},
                 "tokenizer": "bytes", "seq_len": 16, "token_cache": str(cache)},
        "knobs": {"micro_batch": 4, "save_every": 4, "eval_every": -1, "plot": False, "progress": False},
        "stages": {
            "seed": {"preset": "tiny", "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                                                 "ffn_hidden": 48, "max_positions": 16},
                     "knobs": {"steps": 8, "lr": 3.0e-3, "warmup_steps": 2}},
            "branch": {"general_share": 0.1, "knobs": {"steps": 4, "warmup_steps": 1}},
            "mix": {"mixtures": [  # the paper's gates (top-1, full softmax), as the replication pipelines set them
                {"name": "btx", "recipe": "btx", **PAPER_GATES},
                {"name": "bam", "recipe": "bam", **PAPER_GATES},
                {"name": "bam-shared-kv", "recipe": "bam-shared-kv", **PAPER_GATES},
                {"name": "bam-top1", "recipe": "bam", "attention_routing": 1, "router_std": 0.05, **PAPER_GATES},
                {"name": "btx-total", "recipe": "btx", "extra_ffn_experts": 1, "ffn_top_k": 2, "gate_norm": "softmax",
                 "weights": [2, 1, 1], "lb_coef": 0}]},
            "train": {"compute_reference": "btx", "knobs": {"steps": 12, "lr": 2.0e-3, "warmup_steps": 2}},
            "eval": {"max_tokens": 192, "batch_size": 4},
            "report": {"attention_routing": ["bam", "bam-top1"], "baseline": "btx"},
        },
    }


def write_doc(doc: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def without_timing(x):
    if isinstance(x, dict):
        return {k: without_timing(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [without_timing(v) for v in x]
    return x


def recorded(out: Path, program: str) -> list[list[str]]:
    """The `bam-surgery PROGRAM ...` lines of DIR/commands.sh as argument lists (redirections cut)."""
    lines = (out / "commands.sh").read_text().splitlines()
    return [shlex.split(ln.split(" > ")[0])[1:] for ln in lines if ln.startswith(f"bam-surgery {program} ")]


@pytest.fixture(scope="module")
def micro(tmp_path_factory, corpus) -> tuple[Path, Path]:
    """One uninterrupted run of the micro pipeline: (pipeline file, DIR). A few seconds: the tests that use it
    are marked slow."""
    root = tmp_path_factory.mktemp("micro")
    path = write_doc(micro_doc(corpus, root / "tokens"), root / "micro.yaml")
    out = root / "out"
    run_cli("pipeline", path, "--out", out)
    return path, out


# ---- end to end -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_report_numbers_equal_eval_on_the_same_checkpoints(micro):
    _, out = micro
    rep = json.loads((out / "report.json").read_text())
    models = {m["id"]: m for m in rep["models"]}
    evals = recorded(out, "eval")
    # seed, specialists, untrained, DM, CM (bam, bam-shared-kv, btx-total top-2: more FLOPs than btx)
    assert len(evals) == len(models) == 1 + 2 + 5 + 5 + 3
    for args in evals:
        printed = run_cli(*args).stdout
        ev = json.loads(printed)
        model = next(m for m in models.values() if m["checkpoint"] == ev["checkpoint"])
        assert printed == (out / "eval" / f"{model['id']}.json").read_text()  # the file is what eval prints
        for dom in DOMAINS:
            assert model["perplexity"][dom] == ev["domains"][dom]["perplexity"]
            assert model["loss"][dom] == ev["domains"][dom]["loss"]
        assert model["average_perplexity"] == pytest.approx(sum(model["perplexity"].values()) / 3, rel=1e-12)
    md = (out / "report.md").read_text()
    for m in models.values():  # every model's row in the markdown carries its numbers
        if m["kind"] != "untrained":
            row = next(ln for ln in md.splitlines() if ln.startswith(f"| {m['label']} |"))
            assert f"{m['perplexity']['code']:.3f}" in row and f"{m['average_perplexity']:.3f}" in row


@pytest.mark.slow
def test_report_contents(micro):
    _, out = micro
    rep = json.loads((out / "report.json").read_text())
    models = {m["id"]: m for m in rep["models"]}
    # experts are named by domain; the audit's counts
    assert models["dm-bam"]["experts"] == {"ffn": ["seed", "code", "law"], "attn": ["seed", "code", "law"]}
    assert models["dm-btx-total"]["experts"]["ffn"] == ["seed", "code", "law", "expert3"]
    assert models["seed"]["params"]["total"] == models["seed"]["params"]["active"]
    assert models["dm-bam"]["params"]["total"] > models["dm-btx"]["params"]["total"]
    assert models["dm-bam"]["params"]["active"] > models["dm-bam-top1"]["params"]["active"]
    # the Table-3-style comparison, both settings
    assert [r["attention"] for r in rep["attention_routing"]["compute-matched"]] == ["dense attention", "soft",
                                                                                    "top-1"]
    # routing statistics of every trained mixture, per domain
    assert set(models["cm-bam"]["routing"]) == set(DOMAINS)
    assert len(models["cm-bam"]["routing"]["law"]["attn"]["mean_gate"]) == 3
    assert all(rep["stages"][s]["tokens"] >= 0 and rep["stages"][s]["wall_s"] >= 0
               for s in ("seed", "branch", "mix", "train", "eval"))
    for png in ("training", "perplexity", "routing-dm-bam", "routing-cm-bam-shared-kv"):
        assert (out / "plots" / f"{png}.png").stat().st_size > 1000
    assert "(Table 1 style)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_compute_matching_and_data_matching(micro):
    _, out = micro
    rep = json.loads((out / "report.json").read_text())
    models = {m["id"]: m for m in rep["models"]}
    ref = models["dm-btx"]["training"]
    for unit in ("cm-bam", "cm-bam-shared-kv"):
        t = models[unit]["training"]
        assert t["steps"] < ref["steps"]
        per_step = t["flops"] / t["steps"]
        assert abs(t["flops"] - ref["flops"]) <= per_step / 2  # the nearest whole number of steps
    # BTX and top-1 attention have the reference's FLOPs per token (to rounding): their CM run is the DM run
    assert "cm-btx" not in models and "cm-bam-top1" not in models
    assert models["dm-bam-top1"]["settings"] == ["data-matched", "compute-matched"]
    # data-matched: every mixture's training config is the same but for the init and the run folder
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (out / "configs").glob("dm-*.yaml")}
    strip = lambda c: {k: v for k, v in c.items() if k not in ("init", "out")}  # noqa: E731
    assert len(configs) == 5 and all(strip(c) == strip(configs["dm-btx"]) for c in configs.values())
    # 25% general text, the rest split evenly over the domains (the paper: 25% each of three domains)
    assert configs["dm-btx"]["data"].count(":0.375,") == 2 and configs["dm-btx"]["data"].endswith("general:0.25")
    branch = yaml.safe_load((out / "configs" / "branch-code.yaml").read_text())
    seed = yaml.safe_load((out / "configs" / "seed.yaml").read_text())
    assert branch["lr"] == seed["lr"] / 2 and ":0.9," in branch["data"] and branch["data"].endswith(":0.1")


@pytest.mark.slow
def test_recorded_merge_and_train_commands_reproduce_the_outputs(micro, tmp_path):
    _, out = micro
    merge = next(a for a in recorded(out, "merge") if "bam-top1" in a[-1])
    assert merge[merge.index("--attention-routing") + 1] == "top1" and "--router-std" in merge
    merge[-1] = str(tmp_path / "again.safetensors")
    run_cli(*merge, "--quiet")
    assert (tmp_path / "again.safetensors").read_bytes() == (out / "mixes" / "bam-top1.safetensors").read_bytes()
    weighted = next(a for a in recorded(out, "merge") if "btx-total" in a[-1])
    weighted[-1] = str(tmp_path / "weighted.safetensors")
    run_cli(*weighted, "--quiet")
    assert (tmp_path / "weighted.safetensors").read_bytes() == (out / "mixes" / "btx-total.safetensors").read_bytes()

    train = next(a for a in recorded(out, "train") if a[-1].endswith("branch-law.yaml"))
    run_cli(*train, "--out", tmp_path / "run")
    mine = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000004")[1]
    theirs = load_checkpoint(out / "runs" / "branch-law" / "checkpoints" / "step-00000004")[1]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
def test_a_complete_pipeline_is_skipped_on_resume(micro):
    _, out = micro
    before = (out / "report.json").read_text()
    # the resolved pipeline is itself a pipeline file, the same pipeline (what the report's command uses)
    result = run_cli("pipeline", out / "pipeline.resolved.yaml", "--out", out, "--resume")
    assert result.stderr.count("complete, skipped") == 6
    assert (out / "report.json").read_text() == before


# ---- resume after a kill ------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_after_the_process_is_killed_mid_training(micro, tmp_path):
    path, ref_out = micro
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bam_surgery", "pipeline", str(path), "--out",
                             str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    ckpts = out / "runs" / "dm-bam" / "checkpoints"
    deadline = time.monotonic() + 120
    try:
        while not (ckpts / "step-00000004").is_dir():  # the first checkpoint of the second mixture run
            assert proc.poll() is None and time.monotonic() < deadline, "the pipeline ended before the kill"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (ckpts / "step-00000012").exists()  # killed mid-run, not after it
    assert not (out / "stages" / "train.json").exists()

    result = run_cli("pipeline", path, "--out", out, "--resume")
    assert "resuming" in result.stderr and "stage seed: complete, skipped" in result.stderr
    assert json.loads((out / "stages" / "units" / "dm-bam.json").read_text())["resumed"] is True
    mine = json.loads((out / "report.json").read_text().replace(str(out), "DIR"))
    theirs = json.loads((ref_out / "report.json").read_text().replace(str(ref_out), "DIR"))
    for rep in (mine, theirs):
        for stage in rep["stages"].values():
            for unit in stage["units"].values():
                unit.pop("resumed", None)
    assert without_timing(mine) == without_timing(theirs)


# ---- bad input ------------------------------------------------------------------------------------------
def _set(doc: dict, dotted: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = dotted.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return doc


BAD = [
    ("stages.deploy", {}, "stages.deploy: unknown field"),
    ("stages.mix.mixtures.1.recipe", "bamm", "stages.mix.mixtures[1].recipe: recipe 'bamm': no such recipe"),
    ("data.domains.code", "/nonexistent/code", "data.domains.code: /nonexistent/code: no such file or folder"),
    ("stages.train.knobs.steps", 0, "stages.train.knobs.steps: must be > 0"),
    ("stages.branch.general_share", 1.5, "stages.branch.general_share: must be in [0, 1)"),
    ("stages.eval.max_tokens", -1, "stages.eval.max_tokens: must be >= 0"),
    ("stages.seed.knobs.lr", "fast", "stages.seed.knobs: lr: expected float"),
    ("stages.mix.mixtures.3.attention_routing", "top5", "stages.mix.mixtures[3]: attn_top_k: top-5 routing needs"),
    ("stages.train.knobs.data", "x=y", "stages.train.knobs.data: set by the pipeline"),
    ("stages.report.attention_routing", ["bam", "moa"], "stages.report.attention_routing: 'moa' is not a mixture"),
    ("stages.train.settings", ["data-matched", "flop-matched"], "stages.train.settings: 'flop-matched' is not one"),
    ("stages.seed", KeyError, "stages.seed: required"),
    ("data.seq_len", 64, "data.seq_len: 64 exceeds the seed's max_positions (16)"),
    ("knobs.micro_batch", 3, "stages.seed.knobs.batch_tokens"),
    ("knobs.batch_tokens", 100, "batch_tokens: 100 is not a multiple of micro_batch * seq_len"),
    ("stages.mix.mixtures.0.top_k", 2, "stages.mix.mixtures[0].top_k: unknown field"),
    ("stages.mix.mixtures.4.weights", [1, 1], "stages.mix.mixtures[4].weights: 2 weights for 3 mixture members"),
    ("stages.mix.mixtures.0.router", "moe", "stages.mix.mixtures[0]: router: unknown router kind 'moe'"),
    ("stages.mix.mixtures.0.router_hidden", 8, "stages.mix.mixtures[0]: router_hidden: applies to mlp and attention"),
]


@pytest.mark.parametrize("dotted,value,message", BAD, ids=[b[0] for b in BAD])
def test_malformed_pipeline_refused_before_any_work(corpus, tmp_path, dotted, value, message):
    doc = _set(micro_doc(corpus, tmp_path / "tokens"), dotted, value)
    if dotted == "knobs.micro_batch":  # 3 x 16 does not divide the batch
        doc["knobs"]["batch_tokens"] = 64
        message = "knobs.batch_tokens: 64 is not a multiple of micro_batch * seq_len = 3 * 16"
    path = write_doc(doc, tmp_path / "bad.yaml")
    result = run_cli("pipeline", path, "--out", tmp_path / "out", code=2)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"bam-surgery: error: {path}: "), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "tokens").exists()


def test_domain_without_held_out_split_and_bad_yaml(corpus, tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "all.txt").write_text("some text\n")
    doc = _set(micro_doc(corpus, tmp_path / "tokens"), "data.domains.law", str(tmp_path / "flat"))
    result = run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "out", code=2)
    assert "data.domains.law: " in result.stderr and "no held-out split" in result.stderr
    (tmp_path / "broken.yaml").write_text("name: x\nstages: [\n")
    result = run_cli("pipeline", tmp_path / "broken.yaml", "--out", tmp_path / "out", code=2)
    assert result.stderr.startswith("bam-surgery: error: ") and "not valid YAML" in result.stderr
    result = run_cli("pipeline", "no-such-pipeline", "--out", tmp_path / "out", code=2)
    assert "choose one of paper-shape, paper-shape-time, paper-small, tiny, tiny-upcycling" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_out_policy_resume_and_only(micro, corpus, tmp_path):
    path, out = micro
    err = run_cli("pipeline", path, "--out", out, code=2).stderr
    assert "holds a pipeline run; pass --resume" in err
    # another token cache is no change (it holds the same tokens); another learning rate is
    changed = write_doc(_set(micro_doc(corpus, tmp_path / "t"), "stages.train.knobs.lr", 1e-3), tmp_path / "c.yaml")
    err = run_cli("pipeline", changed, "--out", out, "--resume", code=2).stderr
    assert "stages.train.knobs.lr differs" in err and err.count("\n") == 1
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "notes.txt").write_text("mine")
    err = run_cli("pipeline", path, "--out", tmp_path / "stray", code=2).stderr
    assert "holds no pipeline run" in err and (tmp_path / "stray" / "notes.txt").read_text() == "mine"
    err = run_cli("pipeline", path, "--out", tmp_path / "new", "--resume", code=2).stderr
    assert "holds no pipeline run" in err
    err = run_cli("pipeline", path, "--out", tmp_path / "new", "--only", "mix", code=2).stderr
    assert "stage seed is not complete" in err and not (tmp_path / "new").exists()
    err = run_cli("pipeline", path, "--out", tmp_path / "new", "--only", "seed,deploy", code=2).stderr
    assert "'deploy' is not a stage" in err


def test_only_runs_the_named_stages(corpus, tmp_path):
    doc = micro_doc(corpus, tmp_path / "tokens")
    doc["stages"]["mix"]["mixtures"] = doc["stages"]["mix"]["mixtures"][:2]
    doc["stages"]["report"]["attention_routing"] = ["bam"]
    path = write_doc(doc, tmp_path / "p.yaml")
    run_cli("pipeline", path, "--out", tmp_path / "out", "--prepare")  # the files, no stage
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["commands.sh", "configs", "pipeline.resolved.yaml"]
    run_cli("pipeline", path, "--out", tmp_path / "out", "--resume", "--only", "seed,branch")
    assert sorted(p.stem for p in (tmp_path / "out" / "stages").glob("*.json")) == ["branch", "seed"]
    assert (tmp_path / "out" / "models" / "code").is_symlink() and not (tmp_path / "out" / "mixes").exists()
    run_cli("pipeline", path, "--out", tmp_path / "out", "--resume", "--only", "mix")
    assert sorted(p.name for p in (tmp_path / "out" / "mixes").iterdir()) == ["bam.safetensors", "btx.safetensors"]
    assert not (tmp_path / "out" / "runs" / "dm-btx").exists()


def test_a_full_disk_leaves_no_partial_file(corpus, tmp_path, monkeypatch):
    """Disk full while the pipeline writes its resolved file (issue 20): one line naming the file, no
    `.pipeline.resolved.yaml.*.partial` left (the line says nothing was left), and the next run goes on."""
    path = write_doc(micro_doc(corpus, tmp_path / "tokens"), tmp_path / "p.yaml")
    out = tmp_path / "out"

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    lines = run_cli("pipeline", path, "--out", out, "--prepare", code=2).stderr.splitlines()
    monkeypatch.undo()
    assert lines == [f"bam-surgery: error: {out / 'pipeline.resolved.yaml'}: could not be written (No space left "
                     "on device); nothing was left there"]
    assert [p.name for p in out.rglob("*")] == []
    run_cli("pipeline", path, "--out", out, "--prepare")
    assert sorted(p.name for p in out.iterdir()) == ["commands.sh", "configs", "pipeline.resolved.yaml"]


# ---- the shipped pipelines -------------------------------------------------------------------------
def test_shipped_pipelines_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the shipped pipelines' data paths are relative to the repository root
    assert shipped_pipelines() == ["paper-shape", "paper-shape-time", "paper-small", "tiny", "tiny-upcycling"]
    timed = load_pipeline("paper-shape-time", check_data=False)  # BAM gets BTX's time at the H200's throughputs
    assert {s: timed.train_steps(timed.mixture("bam"), s) for s in timed.settings} == {
        "data-matched": 200, "compute-matched": 140, "time-matched": 169}
    upcycling = load_pipeline("tiny-upcycling", check_data=False)
    assert [m.config.ffn_experts for m in upcycling.mixtures] == [4, 4, 16]
    tiny = load_pipeline("tiny")  # the repository's corpus is there
    assert tiny.domains.keys() == {"code", "law", "math"} and tiny.tokenizer == "bytes"
    assert [m.name for m in tiny.mixtures][:3] == ["btx", "bam", "bam-shared-kv"]
    paper = load_pipeline("paper-small", check_data=False)
    cfg = paper.dense_config
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab_size, 2 * cfg.ffn_hidden) == (1024, 6, 8, 256000, 4096)
    assert paper.knobs["batch_tokens"] == 1048576 and paper.knobs["lr"] == 1.2e-4 and paper.mixture_steps == 95367
    assert paper.branch_knobs["lr"] == pytest.approx(0.6e-4)
    again = load_pipeline("tiny", seed=5)  # --seed: every run's seed and the routers' seed
    assert again.doc["seed"] == 5 and {m.options.router_seed for m in again.mixtures} == {5}
    result = run_cli("pipeline", "tiny", "--out", tmp_path / "plan", "--dry-run", "--seed", 5)
    assert "--router-seed 5" in result.stdout
    assert "bam-surgery train --config" in result.stdout and "total training FLOPs" in result.stdout
    assert not (tmp_path / "plan").exists()
    assert PipelineRun(tiny, tmp_path / "x").units()[-1].name == "report"


def test_time_matched_runs_and_upcycle_mixtures(corpus, tmp_path):
    """time-matched: steps times the model's throughput over the reference's (a model within the tolerance is
    trained once); the throughputs given or in a JSON file (benchmarks/throughput.py's); an upcycle mixture is made
    from the seed alone."""
    doc = micro_doc(corpus, tmp_path / "tokens")
    doc["stages"]["mix"]["mixtures"].append({"name": "up", "recipe": "upcycle", "ffn_granularity": 2})
    tps = {"btx": 100.0, "bam": 80.0, "bam-shared-kv": 90.0, "bam-top1": 100.5, "btx-total": 50.0, "up": 70.0}
    doc["stages"]["train"].update(settings=["data-matched", "compute-matched", "time-matched"],
                                  throughput={"source": "given for the test", "tokens_per_s": tps})
    spec = load_pipeline(str(write_doc(doc, tmp_path / "timed.yaml")))
    assert [spec.train_steps(spec.mixture(n), "time-matched") for n in ("btx", "bam", "btx-total", "up")] == \
        [12, round(12 * 0.8), 6, round(12 * 0.7)]
    assert spec.unit_name("time-matched", spec.mixture("bam-top1")) == "dm-bam-top1"  # within 1%: trained once
    run = PipelineRun(spec, tmp_path / "out")
    names = [u.name for u in run.units()]
    assert "tm-bam" in names and "tm-bam-top1" not in names and "tm-btx" not in names
    up = spec.mixture("up")
    assert "--experts" not in run.merge_args(up) and up.config.ffn_experts == 8
    (tmp_path / "tps.json").write_text(json.dumps({"source": "given for the test", "tokens_per_s": tps}))
    doc["stages"]["train"]["throughput"] = str(tmp_path / "tps.json")
    again = load_pipeline(str(write_doc(doc, tmp_path / "file.yaml")))
    assert again.throughput == spec.throughput and again.doc["stages"]["train"]["throughput"] == spec.throughput
    sys.path.insert(0, str(ROOT))  # the benchmark's file is what the pipeline reads
    from benchmarks import throughput
    throughput.main([str(tmp_path / "timed.yaml"), "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "b.json")])
    doc["stages"]["train"]["throughput"] = str(tmp_path / "b.json")
    measured = load_pipeline(str(write_doc(doc, tmp_path / "measured.yaml")))
    assert measured.throughput["tokens_per_s"].keys() == tps.keys() and "cpu" in measured.throughput["source"]
    del tps["up"]
    doc["stages"]["train"]["throughput"] = {"source": "given", "tokens_per_s": tps}
    err = run_cli("pipeline", write_doc(doc, tmp_path / "bad.yaml"), "--out", tmp_path / "o", code=2).stderr
    assert "stages.train.throughput.tokens_per_s: no number for up" in err
    doc["stages"]["train"]["settings"] = ["data-matched"]
    err = run_cli("pipeline", write_doc(doc, tmp_path / "bad.yaml"), "--out", tmp_path / "o", code=2).stderr
    assert "stages.train.throughput: only the time-matched setting reads it" in err


def test_docs_state_what_the_code_computes(tmp_path, monkeypatch):
    """docs/pipeline.md quotes paper-small's compute-matched steps and FLOPs, and an error message."""
    monkeypatch.chdir(ROOT)
    doc = (ROOT / "docs" / "pipeline.md").read_text()
    paper = load_pipeline("paper-small", check_data=False)
    cm = {m.name: paper.train_steps(m, "compute-matched") for m in paper.mixtures}
    assert cm["btx"] == cm["bam-top1"] == cm["btx-6"] == 95367  # within 1% of BTX's FLOPs: the DM run
    for name in ("bam", "bam-shared-kv", "bam-top2", "btx-6-top3"):
        assert f"{name} {cm[name]:,}" in doc
    run = PipelineRun(paper, tmp_path / "x")
    total = sum(float(line.split()[-1]) for line in run.describe().splitlines()[1:] if line.startswith(("seed",
                                                                                                      "branch", "dm-",
                                                                                                      "cm-")))
    assert f"{total:.2e}".replace("+", "") in doc  # 4.02e21
    tiny = yaml.safe_load((ROOT / "recipes" / "pipelines" / "tiny.yaml").read_text())
    tiny["stages"]["mix"]["mixtures"][3]["attention_routing"] = "top5"
    bad = write_doc(tiny, tmp_path / "my.yaml")
    err = run_cli("pipeline", bad, "--out", tmp_path / "out", code=2).stderr
    quoted = "stages.mix.mixtures[3]: attn_top_k: top-5 routing needs between 1 and 4 attention experts"
    assert quoted in err and quoted in doc


@pytest.mark.slow
def test_a_given_seed_checkpoint(micro, corpus, tmp_path):
    _, out = micro
    doc = micro_doc(corpus, tmp_path / "tokens")
    doc["stages"]["seed"] = {"init": str(out / "runs" / "seed" / "checkpoints" / "step-00000008")}
    err = run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "out", code=2).stderr
    assert "stages.branch.knobs.lr: required when the seed is a given checkpoint" in err
    doc["stages"]["branch"]["knobs"]["lr"] = 1.5e-3  # the seed's peak was 3e-3
    run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "out", "--only", "seed,branch")
    assert (tmp_path / "out" / "models" / "seed").resolve() == (out / "models" / "seed").resolve()
    assert not (tmp_path / "out" / "runs" / "seed").exists()
    # the same specialist as the pipeline that trained that seed (same seed checkpoint, knobs and data)
    mine = load_checkpoint(tmp_path / "out" / "models" / "code")[1]
    theirs = load_checkpoint(out / "models" / "code")[1]
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.slow
def test_a_given_seed_as_one_safetensors_file(micro, corpus, tmp_path):
    """Issue 20: `stages.seed.init: seed.safetensors` (the documented `init: CKPT`, a single file) failed at the
    branch stage with `models/seed: not a checkpoint`: the link now keeps the file's suffix."""
    from bam_surgery.runtime import save_checkpoint

    _, out = micro
    state, cfg = load_checkpoint(out / "models" / "seed")[1], load_checkpoint(out / "models" / "seed")[0]
    save_checkpoint(state, cfg, tmp_path / "seed.safetensors")
    doc = micro_doc(corpus, tmp_path / "tokens")
    doc["stages"]["seed"] = {"init": str(tmp_path / "seed.safetensors")}
    doc["stages"]["branch"]["knobs"]["lr"] = 1.5e-3
    run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "out", "--only", "seed,branch")
    link = tmp_path / "out" / "models" / "seed.safetensors"
    assert link.is_symlink() and link.resolve() == (tmp_path / "seed.safetensors").resolve()
    mine = load_checkpoint(tmp_path / "out" / "models" / "code")[1]
    theirs = load_checkpoint(out / "models" / "code")[1]
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# ---- the tokenizer stage and the dense baseline -------------------------------------------------------
BPE_VOCAB = 320


def bpe_doc(corpus: Path, cache: Path) -> dict:
    """The micro pipeline with a BPE trained by the pipeline, the dense baseline, and two mixtures."""
    doc = micro_doc(corpus, cache)
    doc["data"]["tokenizer"] = {"bpe": {"vocab_size": BPE_VOCAB}}
    doc["stages"]["seed"]["model"]["vocab_size"] = BPE_VOCAB
    doc["stages"]["mix"]["mixtures"] = doc["stages"]["mix"]["mixtures"][:2]  # btx, bam
    doc["stages"]["train"]["dense_baseline"] = True
    doc["stages"]["report"] = {"attention_routing": ["bam"], "baseline": "btx"}
    return doc


@pytest.fixture(scope="module")
def micro_bpe(tmp_path_factory, corpus) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("micro-bpe")
    path = write_doc(bpe_doc(corpus, root / "tokens"), root / "bpe.yaml")
    run_cli("pipeline", path, "--out", root / "out")
    return path, root / "out"


@pytest.mark.slow
def test_the_tokenizer_stage_learns_a_bpe_from_the_train_split_and_every_stage_uses_it(micro_bpe, corpus, tmp_path):
    from bam_surgery.train.bpe import train_bpe
    from bam_surgery.train.data import Domain, open_source

    _, out = micro_bpe
    tok = out / "tokenizer" / "tokenizer.json"
    # the train split only, general first then the domains: the same bytes again (deterministic)
    again = train_bpe([open_source(Domain(d, str(corpus / d), 1.0), "train") for d in DOMAINS], BPE_VOCAB, tmp_path)
    assert again.read_bytes() == tok.read_bytes()
    rec = json.loads((out / "stages" / "units" / "tokenizer.json").read_text())
    assert rec["stage"] == "tokenizer" and len(rec["sha256"]) == 64
    # the seed checkpoint carries it; eval without --tokenizer takes the checkpoint's and gives the report's numbers
    seed_dir = (out / "models" / "seed").resolve()
    assert (seed_dir / "tokenizer.json").read_bytes() == tok.read_bytes()
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (out / "configs").glob("*.yaml")}
    assert {c["tokenizer"] for c in configs.values()} == {str(tok)}
    ev = json.loads(run_cli("eval", seed_dir, "--data", f"law={corpus / 'law'}", "--seq-len", 16, "--batch-size", 4,
                            "--max-tokens", 192, "--json").stdout)
    rep = json.loads((out / "report.json").read_text())
    seed_row = next(m for m in rep["models"] if m["id"] == "seed")
    assert ev["domains"]["law"]["perplexity"] == seed_row["perplexity"]["law"]
    # generate finds no tokenizer for a 320-token vocabulary unless the checkpoint carries one (exit 2 otherwise)
    assert run_cli("generate", seed_dir, "--prompt", "The court", "--max-new-tokens", 4, "--temperature", 0).stdout
    # a second run's --only tokenizer finds it complete
    assert "complete" in run_cli("pipeline", out / "pipeline.resolved.yaml", "--out", out, "--resume", "--only",
                                 "tokenizer").stderr


@pytest.mark.slow
def test_the_dense_baseline_trains_the_seed_on_the_mixture_data_and_is_shown_first(micro_bpe):
    _, out = micro_bpe
    rep = json.loads((out / "report.json").read_text())
    models = {m["id"]: m for m in rep["models"]}
    dense = models["dense-dm"]
    # the seed (dense FLOPs: within 1% of BTX's) trained like the data-matched mixtures: one run is DM and CM
    assert "dense-cm" not in models and dense["settings"] == ["data-matched", "compute-matched"]
    assert dense["label"] == "dense DM = CM" and dense["kind"] == "dense"
    cfg = {n: yaml.safe_load((out / "configs" / f"{n}.yaml").read_text()) for n in ("dense-dm", "dm-btx")}
    strip = lambda c: {k: v for k, v in c.items() if k not in ("init", "out")}  # noqa: E731
    assert strip(cfg["dense-dm"]) == strip(cfg["dm-btx"])
    assert Path(cfg["dense-dm"]["init"]) == out / "models" / "seed"
    assert dense["training"]["tokens"] == models["dm-btx"]["training"]["tokens"]
    # first among the trained models in the tables, and the first row of the attention-routing comparison
    order = [m["id"] for m in rep["models"] if m["kind"] in ("dense", "trained")]
    assert order[0] == "dense-dm"
    assert rep["attention_routing"]["data-matched"][0]["id"] == "dense-dm"
    md = (out / "report.md").read_text().splitlines()
    assert md.index(next(ln for ln in md if ln.startswith("| dense DM = CM |"))) < \
        md.index(next(ln for ln in md if ln.startswith("| btx DM = CM |")))


@pytest.mark.slow
def test_the_report_records_commit_machine_and_time_of_every_stage(micro_bpe):
    from bam_surgery.pipeline.files import code_commit, machine

    _, out = micro_bpe
    rep = json.loads((out / "report.json").read_text())
    assert rep["provenance"]["commit"] == code_commit() and rep["provenance"]["machine"] == machine()
    for stage in ("tokenizer", "seed", "branch", "mix", "train", "eval"):
        s = rep["stages"][stage]
        assert s["commits"] == [code_commit()] and s["machines"] == [machine()] and s["cpu_s"] >= 0
    assert f"Machine: {machine()}" in (out / "report.md").read_text()


@pytest.mark.slow
def test_the_replication_summary_of_a_run(micro_bpe, tmp_path):
    sys.path.insert(0, str(ROOT))
    from benchmarks import replication

    _, out = micro_bpe
    summary = replication.summarize([out])
    assert summary["pipeline"] == "micro" and [r["seed"] for r in summary["runs"]] == [3]
    text = replication.render(summary)
    assert "| dense DM = CM |" in text and "bam beats the dense baseline, DM" in text
    assert "**within noise**" in text and "| holds" not in text  # one seed never decides
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- replication:micro begin -->\nold\n<!-- replication:micro end -->\ny\n")
    (tmp_path / "s.json").write_text(json.dumps(summary))
    replication.write_doc(doc, [tmp_path / "s.json"])
    assert replication.doc_blocks(doc.read_text()) == {"micro": text}


def test_the_tokenizer_field_is_checked(corpus, tmp_path):
    doc = bpe_doc(corpus, tmp_path / "tokens")
    doc["stages"]["seed"]["model"]["vocab_size"] = 400
    err = run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "o", code=2).stderr
    assert "data.tokenizer.bpe.vocab_size: 320 differs from the seed model's vocab_size (400" in err
    doc["data"]["tokenizer"] = {"bpe": {"vocab_size": 100}}
    err = run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "o", code=2).stderr
    assert "data.tokenizer.bpe.vocab_size: must be in [257, " in err
    doc["data"]["tokenizer"] = {"bpe": {"vocab": 300}}
    err = run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "o", code=2).stderr
    assert "data.tokenizer.bpe.vocab: unknown field (did you mean vocab_size?)" in err
    assert not (tmp_path / "o").exists()
    doc = bpe_doc(corpus, tmp_path / "tokens")
    doc["data"]["tokenizer"] = {"bpe": {"vocab_size": 100000}}
    doc["stages"]["seed"]["model"]["vocab_size"] = 100000
    run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out", tmp_path / "o", "--only", "tokenizer", code=2)
    assert "fewer than vocab_size 100000" in run_cli("pipeline", write_doc(doc, tmp_path / "p.yaml"), "--out",
                                                     tmp_path / "o2", "--only", "tokenizer", code=2).stderr


def test_replication_verdict_rule():
    sys.path.insert(0, str(ROOT))
    from benchmarks.replication import verdict

    assert verdict([0.2, 0.25, 0.22])[0] == "holds"
    assert verdict([-0.2, -0.25, -0.22])[0] == "does not hold"
    assert verdict([0.2, 0.3, -0.1])[0] == "within noise"  # t = 1.1 < 2.92
    assert verdict([0.1, 0.1, 0.1]) == ("holds", None)  # no spread: the sign decides
    assert verdict([0.5]) == ("within noise", None)
    v, t = verdict([0.1, 0.12, 0.2])
    assert v == "holds" and t == pytest.approx(0.14 / (0.0529150262 / 3 ** 0.5), rel=1e-6)


@pytest.mark.slow
def test_a_finished_run_grows_by_a_mixture_and_the_dense_baseline(micro, corpus, tmp_path):
    """--resume with mixtures appended and dense_baseline turned on runs only the new units; every product of
    the old run is kept as it was; any other change is still refused."""
    import shutil

    path, out = micro
    grown = tmp_path / "out"
    shutil.copytree(out, grown, symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in grown.rglob("*") if p.is_file() and "stages" not in p.parts
              and p.name not in ("report.json", "report.md", "pipeline.resolved.yaml", "commands.sh")
              and "plots" not in p.parts and "configs" not in p.parts}
    doc = yaml.safe_load(Path(path).read_text())
    doc["stages"]["mix"]["mixtures"].append({"name": "btx-topk", "recipe": "btx", "ffn_top_k": 1,
                                               "gate_norm": "topk_softmax"})
    doc["stages"]["train"]["dense_baseline"] = True
    changed = copy.deepcopy(doc)
    changed["stages"]["train"]["knobs"]["lr"] = 1.0e-3
    err = run_cli("pipeline", write_doc(changed, tmp_path / "changed.yaml"), "--out", grown, "--resume",
                  code=2).stderr
    assert "stages.train.knobs.lr differs" in err
    result = run_cli("pipeline", write_doc(doc, tmp_path / "grown.yaml"), "--out", grown, "--resume")
    assert "grows by mixture btx-topk, the dense baseline" in result.stderr
    ran = [ln.split("] ")[1] for ln in result.stderr.splitlines() if ln.startswith("[") and ": done in" in ln]
    # the new units only (btx-topk and the dense model have BTX's FLOPs per token: one run each is DM and CM)
    assert sorted(u.split(":")[0] for u in ran) == sorted(["mix-btx-topk", "dense-dm", "dm-btx-topk",
                                                           "eval-mix-btx-topk", "eval-dense-dm", "eval-dm-btx-topk",
                                                           "report"])
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # nothing of the old run was redone
    rep = json.loads((grown / "report.json").read_text())
    ids = {m["id"] for m in rep["models"]}
    assert {"dense-dm", "dm-btx-topk"} <= ids and {m["id"] for m in json.loads((out / "report.json").read_text())[
        "models"]} < ids
    # the grown run is the grown pipeline: resuming it again does nothing
    again = run_cli("pipeline", tmp_path / "grown.yaml", "--out", grown, "--resume")
    assert "grows by" not in again.stderr and again.stderr.count("complete, skipped") == 6
