"""`bam-surgery merge`'s contract, through the CLI: atomicity under SIGINT/SIGTERM/SIGKILL, every bad input and
option (exit 2, one line naming file and tensor or option, nothing at OUT), OUT refused without --force, the
warnings (non-finite values, an expert far from the seed, the same expert twice, untrained gates), --dry-run
reading no tensor data, expert names, and a plan of a paper-sized model from headers alone.

What a merge computes (the identities, tensor contents, options, determinism, provenance, shards, streaming) is
tested on the library call, app.merge.merge: tests/app/test_app_merge.py.
"""
from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import MERGE_CONFIGS as CONFIGS
from conftest import branched_family, leftovers, merge, merge_family, random_state, save_family
from bam_surgery.runtime.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from bam_surgery.cli.commands import cli
from bam_surgery.runtime.sizes import parse_size
from bam_surgery.surgery.plan import compile_plan
from bam_surgery.surgery.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4

# ---- atomicity --------------------------------------------------------------------------------------
SLOW_MERGE = """
import sys, time
import bam_surgery.runtime.safetensors_file as sf
write = sf.SafetensorsStreamWriter.write
def slow_write(self, name, tensor):
    n = write(self, name, tensor)
    print("wrote", name, flush=True)
    time.sleep(0.5)
    return n
sf.SafetensorsStreamWriter.write = slow_write
from bam_surgery.cli.commands import main
main(sys.argv[1:])
"""


def _foreground_signals() -> None:
    """In the child before exec: Ctrl-C as in a terminal. A shell that starts the test run in the background
    (`cmd &` without job control) leaves SIGINT ignored, the child inherits that, and Python then installs no
    KeyboardInterrupt handler: the merge would not see the SIGINT this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_merge_leaves_nothing_at_out(tmp_path, sig):
    cfg = CONFIGS["parallel"]
    paths = save_family(tmp_path, cfg, branched_family(cfg, 3, seed=15))
    out = tmp_path / "out" / "mix.safetensors"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_MERGE, "merge", "--quiet", "--seed", str(paths[0]),
                             "--experts", f"{paths[1]},{paths[2]}", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_foreground_signals)
    try:
        first = proc.stdout.readline()
        assert first.startswith("wrote "), proc.stderr.read()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0, f"exit 0 after {sig.name}; stderr: {proc.stderr.read()!r}"
    assert not out.exists()
    if sig == signal.SIGINT:  # Ctrl-C: one line, exit status 130
        assert proc.returncode == 130 and proc.stderr.read() == "bam-surgery: interrupted; nothing was written\n"
    if sig != signal.SIGKILL:  # unwinds: the work folder is removed too, and the folder the run created for OUT
        assert not out.parent.exists()
    else:  # kill -9 leaves the work folder; the next run on the same OUT removes it
        assert leftovers(out.parent) == [f".{out.name}.bam-surgery.partial"]
        result = merge("--seed", paths[0], "--experts", f"{paths[1]},{paths[2]}", "--out", out)
        assert "removed" in result.stderr and "interrupted run" in result.stderr
        assert out.is_file() and leftovers(out.parent) == []


# ---- bad input --------------------------------------------------------------------------------------
def _family(tmp_path, cfg=None, n=3, seed=20):
    cfg = cfg or CONFIGS["parallel"]
    states = branched_family(cfg, n, seed=seed)
    return cfg, states, save_family(tmp_path, cfg, states)


def _broken(tmp_path, case):
    """(paths, file the error must name, text the error must contain)."""
    cfg, states, paths = _family(tmp_path)
    bad = paths[2]
    state = dict(states[2])
    if case in ("d_model", "vocab_size", "n_layers", "n_heads"):
        other = cfg.replace(**{case: {"d_model": 48, "vocab_size": 80, "n_layers": 3, "n_heads": 8}[case]})
        save_checkpoint(random_state(other, 1), other, bad)
        return paths, bad, case
    if case == "missing":
        del state["layers.1.ffn.down.weight"]
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.1.ffn.down.weight"
    if case == "shape":
        state["layers.0.attn.q.weight"] = state["layers.0.attn.q.weight"][:, :16].contiguous()
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.attn.q.weight"
    if case == "unexpected":
        state["layers.0.attn.rotary.inv_freq"] = torch.ones(4)
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.attn.rotary.inv_freq"
    if case in ("nan", "inf"):
        state["lm_head.weight"] = state["lm_head.weight"].clone()
        state["lm_head.weight"][3, 5] = float(case)
        save_checkpoint(state, cfg, bad)
        return paths, bad, "lm_head.weight has 1 non-finite value"
    if case == "-inf_bf16":
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
        state["layers.0.ffn.up.weight"][7, 1] = float("-inf")
        save_checkpoint(state, cfg, bad)
        return paths, bad, "layers.0.ffn.up.weight has 1 non-finite value"
    if case == "truncated":
        data = bad.read_bytes()
        bad.write_bytes(data[: len(data) * 2 // 3])
        return paths, bad, "truncated: tensor "
    if case == "garbage":
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + bytes(64))
        return paths, bad, "unreadable"
    if case == "mixture_seed":
        merge_family(paths[1:], tmp_path / "premixed.safetensors")
        return [tmp_path / "premixed.safetensors", *paths[1:]], tmp_path / "premixed.safetensors", "mixture"
    raise AssertionError(case)


BAD_CASES = ["d_model", "vocab_size", "n_layers", "n_heads", "missing", "shape", "unexpected", "nan", "inf", "-inf_bf16",
             "truncated", "garbage", "mixture_seed"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_naming_file_and_tensor(tmp_path, case):
    paths, bad, needle = _broken(tmp_path, case)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, code=None)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip().splitlines()[-1]
    assert err.startswith("bam-surgery: error: ") and "Traceback" not in result.output
    assert result.stderr.count("error") == 1 and "warning" not in result.stderr
    assert str(bad) in err and needle in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_allow_nonfinite_merges_with_a_warning(tmp_path):
    paths, bad, _ = _broken(tmp_path, "nan")
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, "--allow-nonfinite")
    assert "warning" in result.stderr and str(bad) in result.stderr and "lm_head.weight" in result.stderr
    assert torch.isnan(load_checkpoint(out)[1]["lm_head.weight"]).any()


def test_existing_out_is_refused_without_force(tmp_path):
    _, _, paths = _family(tmp_path)
    out = tmp_path / "mix.safetensors"
    out.write_bytes(b"precious")
    result = merge_family(paths, out, code=None)
    assert result.exit_code == 2 and str(out) in result.stderr and "--force" in result.stderr
    assert out.read_bytes() == b"precious"
    result = merge_family(paths, out, "--force", code=None)  # not ours: --force does not replace it either
    assert result.exit_code == 2 and "did not write" in result.stderr and out.read_bytes() == b"precious"
    out.unlink()
    merge_family(paths, out)
    merge_family(paths, out, "--force", "--router-seed", "9")  # ours: replaced
    assert load_checkpoint(out)[0].attn_experts == 3
    result = merge_family(paths, paths[1], "--force", code=None)  # never over an input
    assert result.exit_code == 2 and "is input" in result.stderr
    result = merge_family(paths, tmp_path, "--force", code=None)  # nor over the directory holding them
    assert result.exit_code == 2 and "is input" in result.stderr
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    result = merge_family(paths, home, "--force", code=None)  # nor over a directory that is not a checkpoint
    assert result.exit_code == 2 and "notes" in result.stderr and (home / "notes").is_dir()
    merge_family(paths, tmp_path / "dir")
    merge_family(paths, tmp_path / "dir", "--force", "--max-shard-size", "50KB")  # a checkpoint dir is replaced
    assert len(list((tmp_path / "dir").glob("model-*.safetensors"))) > 1


def test_expert_not_branched_from_the_seed_is_reported(tmp_path):
    cfg, states, paths = _family(tmp_path)
    stranger = random_state(cfg, 999)  # an independent model: distance ~ sqrt(2)
    save_checkpoint(stranger, cfg, paths[2])
    result = merge_family(paths, tmp_path / "mix.safetensors")
    line = next(l for l in result.stderr.splitlines() if str(paths[2]) in l)
    assert "warning" in line and "relative distance" in line
    figure = float(line.split("is ")[1].split()[0])
    assert 1.0 < figure < 2.0
    assert str(paths[1]) not in result.stderr  # a real branch (distance ~0.?) is not reported


OPTION_ERRORS = [
    (["--recipe", "upcycle"], "takes no --experts"),
    (["--recipe", "bam", "--shared-kv-rule", "seed"], "--shared-kv-rule"),
    (["--recipe", "btx", "--attention-routing", "top2"], "no attention experts"),
    (["--attention-routing", "sideways"], "neither 'soft' nor 'topK'"),
    (["--ffn-top-k", "5"], "ffn_top_k"),
    (["--weights", "1,2"], "--weights"),
    (["--weights", "1,x,2"], "--weights"),
    (["--max-shard-size", "2GB"], "--max-shard-size"),
    (["--recipe", "no-such-recipe"], "choose one of bam, bam-shared-kv, btx, btx-shared-expert, upcycle"),
    (["--recipe", "bam-shared-kv", "--extra-ffn-experts", "1", "--no-seed-expert", "--ffn-top-k", "9"], "ffn_top_k"),
]


@pytest.mark.parametrize("args,needle", OPTION_ERRORS)
def test_bad_options_are_one_line_errors(tmp_path, args, needle):
    _, _, paths = _family(tmp_path)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, *args, code=None)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("bam-surgery: error: ") and needle in result.stderr, result.stderr
    assert not out.exists()


def test_upcycle_without_seed_expert_is_refused(tmp_path):
    _, _, paths = _family(tmp_path, n=1)
    result = merge("--recipe", "upcycle", "--seed", paths[0], "--out", tmp_path / "x.safetensors",
                   "--no-seed-expert", code=None)
    assert result.exit_code == 2 and "--no-seed-expert" in result.stderr


# ---- dry run ----------------------------------------------------------------------------------------
def test_dry_run_reads_no_tensor_data(tmp_path, monkeypatch):
    _, _, paths = _family(tmp_path)

    def no_data(self, name):
        raise AssertionError(f"dry run read tensor {name}")
    monkeypatch.setattr(CheckpointReader, "get", no_data)
    out = tmp_path / "mix.safetensors"
    result = merge_family(paths, out, "--dry-run", "--recipe", "bam-shared-kv", "--extra-ffn-experts", "2")
    text = result.stdout
    assert "layers.{i}.attn_experts.q.weight" in text and "i=0-1" in text
    assert "stack inputs 0,1,2,0,0 <- layers.{i}.ffn.up.weight" in text
    assert "layers.{i}.attn.k.weight" in text and "mean inputs 0,1,2" in text
    assert "ffn_experts" in text and re.search(r"^total +23 ", text, re.M)  # the parameter audit
    assert not out.exists()


# ---- small pieces -----------------------------------------------------------------------------------
def test_every_merge_option_has_help():
    merge_cmd = cli.commands["merge"]
    for p in merge_cmd.params:
        assert getattr(p, "help", None), p.name


@pytest.mark.parametrize("text,size", [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30),
                                       ("1000", 1000), ("1.5kb", 1500)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_plan_compiles_from_headers_for_a_paper_sized_model(tmp_path):
    """The paper's 590M model (Table 4) planned from shapes alone: expert shapes as in Table 5."""
    from bam_surgery.runtime.config import preset

    class Header:  # a reader with headers only: no data at all
        def __init__(self, cfg, path):
            from bam_surgery.runtime.layout import tensor_shapes
            self.config, self.path, self.metadata = cfg, path, {}
            self._shapes = tensor_shapes(cfg)

        def names(self):
            return list(self._shapes)

        def shape(self, n):
            return self._shapes[n]

        def dtype(self, n):
            return torch.bfloat16

        def get(self, n):
            raise AssertionError("no data")

    cfg = preset("paper-small")
    plan = compile_plan(load_recipe("bam"), [Header(cfg, f"m{i}") for i in range(4)])
    assert plan["layers.0.attn_experts.q.weight"].shape == (4, 1024, 1024)
    assert plan["layers.0.ffn_experts.gate.weight"].shape == (4, 2048, 1024)
    assert plan.config.ffn_experts == plan.config.attn_experts == 4
    total = sum(math.prod(t.shape) for t in plan.tensors)
    assert total == 776_002_560  # Table 5, BAM total


# ---- expert names ---------------------------------------------------------------------------------
def test_experts_carry_names_into_provenance_inspect_and_the_plan(tmp_path):
    cfg, states, paths = _family(tmp_path)
    odd = tmp_path / "with,comma"
    odd.mkdir()
    comma_path = save_checkpoint(states[2], cfg, odd / "math.safetensors")
    out = tmp_path / "mix.safetensors"
    result = merge("--seed", f"base={paths[0]}", "--experts", f"code={paths[1]}", "--experts", comma_path,
                   "--out", out)
    prov = json.loads(CheckpointReader(out).metadata["bam_provenance"])
    assert [(i["name"], i["role"]) for i in prov["inputs"]] == [("base", "seed"), ("code", "expert"),
                                                               ("math", "expert")]
    assert prov["inputs"][2]["path"] == str(comma_path)
    text = CliRunner().invoke(cli, ["inspect", str(out)]).stdout
    assert re.search(r"^\s+code\s+expert\s+\S*code\.safetensors", text, re.M)
    dry = merge("--seed", paths[0], "--experts", ",".join(map(str, paths[1:])), "--dry-run").stdout
    assert f"input 1  expert code={paths[1]}" in dry and f"input 0  seed   seed={paths[0]}" in dry
    assert result.exit_code == 0


@pytest.mark.parametrize("experts,needle", [
    (["code=A", "code=B"], "expert name 'code' is given twice"),
    (["1st=A"], "no such file"),  # not a name: the whole value is a path
    (["seed=A"], "expert name 'seed' is given twice"),
])
def test_bad_expert_names_are_one_line(tmp_path, experts, needle):
    _, _, paths = _family(tmp_path)
    args = [e.replace("=A", f"={paths[1]}").replace("=B", f"={paths[2]}") for e in experts]
    result = merge("--seed", f"seed={paths[0]}", *[x for a in args for x in ("--experts", a)], "--dry-run", code=None)
    assert result.exit_code == 2 and needle in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_the_same_expert_twice_is_warned_about(tmp_path):
    _, _, paths = _family(tmp_path)
    result = merge("--seed", paths[0], "--experts", paths[1], "--experts", paths[1], "--experts", paths[2],
                   "--out", tmp_path / "mix.safetensors")
    assert "(expert code_2): identical to" in result.stderr and "the same expert given twice" in result.stderr


def test_untrained_softmax_top1_mixture_gets_a_note(tmp_path):
    _, _, paths = _family(tmp_path)
    args = ("--seed", paths[0], "--experts", ",".join(map(str, paths[1:])))
    note = "bam-surgery: note: until the routers are trained each FFN output is scaled by its gate, about 1/3"
    paper = ["--ffn-top-k", "1", "--gate-norm", "softmax"]  # the paper's gates (the recipes' are renormalized)
    result = CliRunner().invoke(cli, ["merge", *map(str, args), *paper, "--out", str(tmp_path / "a.safetensors")])
    assert note in result.stderr and "perplexity before training is not representative" in result.stderr
    for i, extra in enumerate(([], ["--ffn-top-k", "1", "--gate-norm", "topk_softmax"],
                               ["--ffn-top-k", "3", "--gate-norm", "softmax"])):  # gates sum to 1: no note
        result = CliRunner().invoke(cli, ["merge", *map(str, args), *extra, "--out", str(tmp_path / f"b{i}")])
        assert result.exit_code == 0 and "note:" not in result.stderr
