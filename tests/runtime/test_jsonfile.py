"""runtime/jsonfile.py, the one JSON/JSONL reader: every bound refused in one line naming the file (and
line and field), before anything is built from the input."""
from __future__ import annotations

import json
import os

import pytest

from bam_surgery.runtime.errors import CheckpointError
from bam_surgery.runtime.jsonfile import (MAX_JSON_DEPTH, json_field, iter_jsonl, parse_json, read_bounded, read_json)


@pytest.mark.parametrize("text,needle", [
    ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nested more than"),
    ('{"a": ' * 900 + "1" + "}" * 900, "nested more than"),  # under json's own recursion limit
    ('{"n": ' + "9" * 200 + "}", r"too many digits \(200; at most 40\)"),
    ('{"n": 1e400}', "out of range"),
    ('{"n": -Infinity}', "not a JSON number"),
    ('{"s": "\\ud800"}', "lone UTF-16 surrogate"),
    ('{"\\udfff": 1}', "lone UTF-16 surrogate"),
])
def test_bounds_are_one_line_naming_where(text, needle):
    with pytest.raises(CheckpointError, match=f"^cfg.json: .*{needle}") as e:
        parse_json(text, "cfg.json")
    assert "\n" not in str(e.value)


def test_what_stays_inside_the_bounds_parses():
    text = json.dumps({"emoji": "\ud83d\ude00", "deep": [[[[1]]]], "big": 2**64, "x": 1e300})
    assert parse_json(text, "ok.json")["big"] == 2**64
    assert parse_json('"\\ud83d\\ude00"', "pair.json") == "\U0001f600"


def test_devices_and_fifos_are_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="fifo.json: not a regular file"):
        read_json(fifo)  # used to block until a writer came
    with pytest.raises(CheckpointError, match="/dev/zero: not a regular file"):
        read_json("/dev/zero")


def test_a_sparse_huge_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(4 << 30)
    with pytest.raises(CheckpointError, match="too large"):
        read_bounded(big, max_bytes=1 << 20)


def test_jsonl_lines_name_their_number_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"a": 1}\n\n[2]\n{"torn": ')
    assert [v for _, v in iter_jsonl(path, torn_last=True)] == [{"a": 1}, [2]]
    path.write_bytes(b"{\"a\": 1}\n" + b"[" * 100 + b"]" * 100 + b"\n")
    with pytest.raises(CheckpointError, match=r"m.jsonl line 2: not valid here: nested"):
        list(iter_jsonl(path, torn_last=True))


def test_a_jsonl_file_without_newlines_is_read_a_bounded_line_at_a_time(tmp_path):
    path = tmp_path / "zeros.jsonl"
    with open(path, "wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GB of zeros, no newline
    with pytest.raises(CheckpointError, match="zeros.jsonl line 1: longer than"):
        list(iter_jsonl(path, max_line=1 << 20))


@pytest.mark.parametrize("value,types,needle", [
    ([], int, "must be an integer, got an array"), ("7", (int, list), "must be an integer or an array, got a string"),
    (True, int, "must be an integer, got a boolean"), ({"a": 1}, str, "must be a string, got an object")])
def test_field_names_the_file_and_the_field(value, types, needle):
    with pytest.raises(CheckpointError, match=f"^gen.json: field 'eos_token_id' {needle}"):
        json_field({"eos_token_id": value}, "eos_token_id", types, "gen.json")
    assert json_field({}, "eos_token_id", int, "gen.json", default=3) == 3
