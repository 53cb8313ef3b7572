"""Hostile YAML (issue 20, item 5): every YAML file the tool reads goes through converters/yamlfile.py,
which refuses alias bombs, deep nesting, huge integers and huge files before building anything, with one
line naming the file and the bound. Each command that reads YAML is tried: merge/count-params --recipe,
train --config, train --model-config, pipeline (and --dry-run), a run's config.yaml on --resume.
"""
from __future__ import annotations

import resource
from pathlib import Path

import pytest
import yaml

from conftest import cli_error_line
from bam_surgery.converters.yamlfile import (MAX_INT_DIGITS, MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES,
                                             parse_yaml, read_yaml, shown)
from bam_surgery.surgery.recipe import parse_recipe
from bam_surgery.surgery.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]


def laughs(levels: int, width: int = 9, key: str = "name") -> str:
    """The 'billion laughs' document: each level a list of `width` aliases of the level below, so the
    last one expands to width**levels strings; the top-level `key` holds the last level."""
    lines = ['l0: &l0 "lol"']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{key}: *l{levels}\n"


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the loader -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,needle", [
    (laughs(9), f"more than {MAX_YAML_NODES:,} values once its aliases"),   # 426 bytes, 9**9 strings
    (laughs(8), f"more than {MAX_YAML_NODES:,} values once its aliases"),
    ("a: &a {x: 1, y: 2}\n" + "".join(f"m{i}: &m{i} {{<<: [*{'a' if i == 0 else f'm{i - 1}'}] , k{i}: 1}}\n"
                                        for i in range(3)) + "b: &b [*a, *a]\n" +
     "".join(f"c{i}: &c{i} [*{'b' if i == 0 else f'c{i - 1}'}, *{'b' if i == 0 else f'c{i - 1}'}]\n"
             for i in range(20)), f"more than {MAX_YAML_NODES:,} values"),
    ("[" * 50_000 + "]" * 50_000, f"nested too deeply (more than {MAX_YAML_DEPTH} levels)"),
    ("".join(" " * i + "a:\n" for i in range(200)), f"nested too deeply (more than {MAX_YAML_DEPTH} levels)"),
    ("x: " + "9" * 5000, f"a number has too many digits (more than {MAX_INT_DIGITS})"),
    ("x: " + ":".join(["59"] * 2000), f"a number has too many digits (more than {MAX_INT_DIGITS})"),
    ("a: &a [1, *a]", "alias *a refers to the value that contains it"),
    ("a: !!timestamp soon", "a value does not fit its tag"),
    ("a: *nowhere", "not valid YAML (found undefined alias"),
    ("x" * (MAX_YAML_BYTES + 1), f"(limit {MAX_YAML_BYTES:,} bytes)"),
])
def test_hostile_yaml_is_one_short_line_naming_the_bound(text, needle):
    before = rss_mb()
    with pytest.raises(RecipeError) as e:
        parse_yaml(text, "h.yaml", error=RecipeError)
    line = str(e.value)
    assert line.startswith("h.yaml: ") and needle in line and "\n" not in line and len(line) < 400, line
    assert rss_mb() - before < 200  # refused before anything big was built


def test_yaml_the_tool_writes_reads_back_aliases_included():
    """safe_dump writes anchors for a value shared in what it dumps; those read back (counted, not refused)."""
    shared = {"lr": 0.001, "patterns": ["ffn.*", "router.*"]}
    text = yaml.safe_dump({"a": shared, "b": shared, "c": [shared] * 3})
    assert "&id" in text
    assert parse_yaml(text, "x") == {"a": shared, "b": shared, "c": [shared] * 3}
    for path in [*ROOT.glob("recipes/*.yaml"), *ROOT.glob("recipes/pipelines/*.yaml")]:
        assert read_yaml(path) == yaml.safe_load(path.read_text())


def test_the_node_count_includes_expanded_aliases_exactly():
    ten = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\nb: [" + ", ".join(["*a"] * 9) + "]\n"
    # the mapping 1, keys a and b 2, a's list 10, b's list 1 + 9 aliases of 10 each
    assert parse_yaml(ten, "x", max_nodes=104)["b"][8][8] == 9
    with pytest.raises(ValueError, match="more than 103 values"):
        parse_yaml(ten, "x", max_nodes=103)


def test_a_file_too_large_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"a: 1\n" + b"#" * MAX_YAML_BYTES)
    with pytest.raises(ValueError, match=rf"big.yaml: {MAX_YAML_BYTES + 5:,} bytes is too large .*limit"):
        read_yaml(path)
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_yaml(path)


def test_messages_quote_values_cut_short():
    assert len(shown("x" * 1_000_000)) < 120
    assert len(shown(list(range(100_000)))) < 120
    assert len(shown(10 ** 4000)) < 120
    huge = "name: &n " + "x" * 500_000 + "\nschema: 1\ntensors: {embed: *n}\n"
    with pytest.raises(RecipeError) as e:
        parse_recipe(huge, "r.yaml")
    assert len(str(e.value)) < 400


# ---- every command that reads YAML --------------------------------------------------------------------
BOMB = laughs(9)
assert len(BOMB.encode()) < 450


@pytest.mark.parametrize("args", [
    ["count-params", "--preset", "paper-small", "--recipe", "{f}", "--experts", 2],
    ["merge", "--seed", "{seed}", "--experts", "{seed}", "--recipe", "{f}", "--dry-run"],
])
def test_recipe_alias_bombs_are_refused(tmp_path, args):
    from conftest import random_state, tiny_config
    from bam_surgery.runtime.checkpoint import save_checkpoint

    cfg = tiny_config()
    seed = save_checkpoint(random_state(cfg), cfg, tmp_path / "seed.safetensors")
    f = tmp_path / "bomb.yaml"
    f.write_text(BOMB)
    before = rss_mb()
    line = cli_error_line(*[str(a).format(f=f, seed=seed) for a in args])
    assert f"recipe {f}: not valid here: more than {MAX_YAML_NODES:,} values" in line and len(line) < 400
    assert rss_mb() - before < 200


@pytest.mark.parametrize("body,needle", [
    (BOMB.replace("name:", "steps:"), f"more than {MAX_YAML_NODES:,} values"),
    ("[" * 50_000, f"nested too deeply (more than {MAX_YAML_DEPTH} levels)"),
    ("steps: " + "9" * 5000, f"too many digits (more than {MAX_INT_DIGITS})"),
    ("steps: 2\n? " + "x" * 70 + "y" * 10_000 + "\n: 1\n", "unknown training knob"),
])
@pytest.mark.parametrize("where", ["config", "model-config", "pipeline", "pipeline-dry-run"])
def test_train_configs_and_pipelines_refuse_hostile_yaml(tmp_path, body, needle, where):
    f = tmp_path / "hostile.yaml"
    f.write_text(body)
    if where == "config":
        line = cli_error_line("train", "--config", f, "--out", tmp_path / "run")
    elif where == "model-config":
        if "knob" in needle:
            return
        line = cli_error_line("train", "--model-config", f, "--data", f"code={tmp_path}", "--out", tmp_path / "run")
    else:
        if "knob" in needle:
            return
        extra = ["--dry-run"] if where == "pipeline-dry-run" else []
        line = cli_error_line("pipeline", f, "--out", tmp_path / "out", *extra)
    assert str(f) in line and needle in line and len(line) < 400, line


def test_a_resumed_runs_config_yaml_is_read_with_the_bounds(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(BOMB.replace("name:", "steps:"))
    line = cli_error_line("train", "--out", run, "--resume")
    assert f"{run / 'config.yaml'}: not valid here: more than {MAX_YAML_NODES:,} values" in line
