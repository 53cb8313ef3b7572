"""Property-based fuzzing of the YAML loaders (hypothesis; issue 20): recipes, training configs, pipeline files
and merge --router-prompts files, read through converters/yamlfile.py. Inputs are built from YAML's own pieces (anchors,
aliases, merge keys, tags, brackets, long digit runs) and from the shipped files with fields replaced;
each loader may only succeed or raise a user error whose message is one short line. Bounded like
tests/project/test_fuzz.py (150 examples each, no deadline, small bounds so a loaded machine stays fast).
"""
from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from test_fuzz import FUZZ, json_values
from bam_surgery.converters.yamlfile import parse_yaml
from bam_surgery.runtime.errors import UserError, one_line
from bam_surgery.pipeline.schema import load_pipeline
from bam_surgery.surgery.prompts import read_prompt_file
from bam_surgery.surgery.recipe import parse_recipe
from bam_surgery.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = yaml.safe_load((ROOT / "recipes" / "pipelines" / "tiny.yaml").read_text())
BTX = yaml.safe_load((ROOT / "recipes" / "btx.yaml").read_text())
KNOBS = ["steps", "lr", "micro_batch", "seq_len", "trainable", "preset", "warmup_steps", "name", "schema",
         "stages", "data", "knobs", "threads", "tensors", "routers", "defaults"]

# YAML's pieces: with these, hypothesis writes alias chains, merge keys, recursive anchors, deep brackets
PIECES = st.sampled_from([
    "&a ", "&b ", "*a", "*b", "[", "]", "{", "}", ", ", ": ", "\n", "  ", "- ", "<<: ", "? ", "!!int ",
    "!!float ", "!!timestamp ", "!!binary ", "!!set ", "!!python/object ", "9" * 120, "1:2:3", "0x1f", "1e9",
    "-.inf", ".nan", "'", '"', "#", "---\n", "...\n", "%YAML 1.1\n", "\t", "\\x00", "lol", "~", "null", "yes",
    "2020-13-45", *KNOBS])
yaml_texts = st.one_of(st.text(max_size=60), st.lists(PIECES, max_size=40).map("".join))


def aliased(doc: object, key: str, levels: int, width: int) -> str:
    """`doc` dumped with a 'laughs' chain prepended and `key` set to its top: small text, big expansion."""
    chain = ['l0: &l0 "lol"'] + [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * width) + "]"
                                 for i in range(1, levels + 1)]
    body = yaml.safe_dump(doc if isinstance(doc, dict) else {"value": doc})
    return "\n".join(chain) + "\n" + body + f"{key}: *l{levels}\n"


def near(base: dict) -> st.SearchStrategy[str]:
    """The shipped `base` with a field replaced, or with an alias chain hung under one of its fields."""
    return st.one_of(
        st.tuples(st.sampled_from(sorted(base) + KNOBS), json_values)
          .map(lambda kv: yaml.safe_dump({**base, kv[0]: kv[1]})),
        st.tuples(st.sampled_from(sorted(base) + KNOBS), st.integers(1, 9), st.integers(1, 9))
          .map(lambda t: aliased(base, *t)),
    )


def clean(call) -> None:
    """call() succeeds or raises a user error whose message is one line, cut short whatever the input."""
    try:
        call()
    except UserError as e:
        line = one_line(e)
        assert line and "\n" not in line and "\r" not in line and len(line) < 1000, line


@FUZZ
@given(yaml_texts)
def test_the_yaml_loader_itself(text):
    try:
        parse_yaml(text, "fuzz.yaml")
    except ValueError as e:
        line = str(e)
        assert line.startswith("fuzz.yaml: ") and "\n" not in line and len(line) < 500, line


@FUZZ
@given(st.one_of(yaml_texts, near(BTX)))
def test_recipes(text):
    clean(lambda: parse_recipe(text, "fuzz.yaml"))


@FUZZ
@given(st.one_of(yaml_texts, near({"steps": 10, "lr": 0.001, "micro_batch": 2, "trainable": ["ffn.*"]})))
def test_train_configs(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("config") / "train.yaml"
    path.write_text(text, encoding="utf-8")
    clean(lambda: TrainConfig.from_yaml(path).validate())


@FUZZ
@given(st.one_of(yaml_texts, near(TINY)))
def test_pipelines(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("pipeline") / "p.yaml"
    path.write_text(text, encoding="utf-8")
    clean(lambda: load_pipeline(str(path), check_data=False))


PROMPTS = {"base_model": "seed", "gate_mode": "hidden", "experts_per_token": 2,
           "experts": [{"source_model": "seed", "positive_prompts": ["a b"]},
                       {"source_model": "code", "positive_prompts": ["def f():"], "negative_prompts": ["the court"]}]}


@FUZZ
@given(st.one_of(yaml_texts, near(PROMPTS), st.tuples(st.sampled_from(["source_model", "positive_prompts",
                                                                       "negative_prompts", "noise_scale"]),
                                                      json_values)
       .map(lambda kv: yaml.safe_dump({**PROMPTS, "experts": [{**PROMPTS["experts"][1], kv[0]: kv[1]}]}))))
def test_router_prompt_files(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("prompts") / "p.yaml"
    path.write_text(text, encoding="utf-8")
    clean(lambda: read_prompt_file(str(path)))
