"""Input digests for the provenance (surgery/hashing.py): BLAKE3 of the bytes, reused from the
digest cache when the file is provably the same, or the sha256 a Hugging Face cache names a blob
by; inspect says which digest each input has and how it was obtained."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import blake3
import pytest
from click.testing import CliRunner

from conftest import llama_state, merge, random_state, tiny_config, write_llama_dir
from bam_surgery.runtime.checkpoint import CheckpointReader, save_checkpoint
from bam_surgery.surgery import hashing
from bam_surgery.cli.commands import cli

CFG = tiny_config(block="parallel", norm="layernorm")


def provenance(path: Path) -> dict:
    return json.loads(CheckpointReader(path).metadata["bam_provenance"])


@pytest.fixture
def inputs(tmp_path):
    base = random_state(CFG)
    return [save_checkpoint({k: v * (1 + 0.01 * i) for k, v in base.items()}, CFG, tmp_path / f"{n}.safetensors")
            for i, n in enumerate(("seed", "code", "math"))]


def test_digests_are_blake3_of_the_bytes_and_reused_only_for_the_same_file(tmp_path, inputs, monkeypatch):
    merge("--seed", inputs[0], "--experts", f"{inputs[1]},{inputs[2]}", "--out", tmp_path / "a.safetensors")
    files = [f for i in provenance(tmp_path / "a.safetensors")["inputs"] for f in i["files"]]
    assert [f["digest"] for f in files] == [f"blake3:{blake3.blake3(p.read_bytes()).hexdigest()}" for p in inputs]
    assert {f["how"] for f in files} == {"bytes"}
    assert hashing.cache_file().is_file()

    hashed = []
    real = hashing.InputHasher._hash
    monkeypatch.setattr(hashing.InputHasher, "_hash", lambda self, p: hashed.append(p) or real(self, p))
    merge("--seed", inputs[0], "--experts", f"{inputs[1]},{inputs[2]}", "--out", tmp_path / "b.safetensors")
    assert hashed == []  # every digest came from the cache
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()  # deterministic

    # a rewritten file (same size, mtime set back) is hashed again: its ctime moved
    st = inputs[1].stat()
    data = bytearray(inputs[1].read_bytes())
    data[-1] ^= 1
    inputs[1].write_bytes(bytes(data))
    os.utime(inputs[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    merge("--seed", inputs[0], "--experts", f"{inputs[1]},{inputs[2]}", "--out", tmp_path / "c.safetensors",
          "--allow-nonfinite")
    assert hashed == [inputs[1].resolve()]


def test_a_corrupt_digest_cache_is_only_a_miss(tmp_path, inputs):
    hashing.cache_file().parent.mkdir(parents=True, exist_ok=True)
    hashing.cache_file().write_text("{not json")
    merge("--seed", inputs[0], "--experts", inputs[1], "--out", tmp_path / "a.safetensors")
    assert json.loads(hashing.cache_file().read_text())["version"] == 1


def test_a_changed_digest_cache_is_not_trusted(tmp_path, inputs):
    """One digest of the cache changed (valid JSON still: a bit flipped on disk, an edit): the entry no longer
    matches its DIGEST, so nothing in it is used and the provenance carries the file's own digest."""
    merge("--seed", inputs[0], "--experts", inputs[1], "--out", tmp_path / "a.safetensors")
    body = json.loads(hashing.cache_file().read_text())
    entry = body["entries"][str(inputs[1].resolve())]
    entry[6] = ("1" if entry[6][0] == "0" else "0") + entry[6][1:]
    hashing.cache_file().write_text(json.dumps(body))
    merge("--seed", inputs[0], "--experts", inputs[1], "--out", tmp_path / "b.safetensors")
    files = [f for i in provenance(tmp_path / "b.safetensors")["inputs"] for f in i["files"]]
    assert [f["digest"] for f in files] == [f"blake3:{blake3.blake3(p.read_bytes()).hexdigest()}" for p in inputs[:2]]


def test_hugging_face_cache_blobs_give_their_sha256_without_reading(tmp_path, monkeypatch):
    """A hub snapshot: files are links to blobs named by the sha256 of their bytes."""
    repo = tmp_path / "hub" / "models--org--seed"
    plain = tmp_path / "plain"
    write_llama_dir(plain, llama_state(0), "seed")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in plain.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    expert = tmp_path / "code"
    write_llama_dir(expert, llama_state(1, llama_state(0)), "seed")
    hashed = []
    real = hashing.InputHasher._hash
    monkeypatch.setattr(hashing.InputHasher, "_hash", lambda self, p: hashed.append(p.name) or real(self, p))
    out = tmp_path / "mix.safetensors"
    merge("--seed", snapshot, "--experts", expert, "--recipe", "btx", "--out", out)
    seed_file = provenance(out)["inputs"][0]["files"][0]
    assert seed_file["digest"] == "sha256:" + hashlib.sha256((plain / "model.safetensors").read_bytes()).hexdigest()
    assert seed_file["how"] == "hf-blob" and hashed == ["model.safetensors"]  # only the expert was read
    text = CliRunner().invoke(cli, ["inspect", str(out)]).stdout
    assert "sha256 from the Hugging Face cache's blob name" in text and "BLAKE3 of the file's bytes" in text


def test_inspect_reads_older_sha256_provenance():
    from bam_surgery.surgery.inspect import input_digest

    assert input_digest({"sha256": "ab" * 32, "files": [{"name": "x"}]}) == (
        "sha256:" + "ab" * 32, "sha256 of the file's bytes (older bam-surgery)")
    assert input_digest({"digest": "blake3:" + "cd" * 32, "files": [{"how": "bytes"}, {"how": "bytes"}]})[1] == \
        "BLAKE3 of the manifest of 2 files (BLAKE3 of the file's bytes)"


# ---- hashing started at launch (cli/launch.py, surgery/digests.py) -------------------------------
@pytest.fixture
def early():
    from bam_surgery.surgery import digests
    yield digests
    digests.stop_early()
    digests._early = None


def test_launch_finds_the_weight_files_a_merge_command_names(tmp_path):
    from bam_surgery.cli.launch import merge_input_files

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    shards = tmp_path / "sharded"
    shards.mkdir()
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (shards / n).write_bytes(b"z")
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors", "z": "../a.safetensors"}}))
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").write_bytes(b"w")
    found = merge_input_files(["--seed", f"seed={a}", f"--experts=code={b},{shards}", "--experts", str(single),
                               "--experts", "org/model-on-the-hub", "--out", str(tmp_path / "o.safetensors")])
    assert found == [a, b, shards / "model-00001-of-00002.safetensors", shards / "model-00002-of-00002.safetensors",
                     single / "model.safetensors"]  # the index's "../a.safetensors" is not followed
    assert merge_input_files(["--seed", str(a), "--experts", str(b), "--dry-run"]) == []


def test_digests_started_at_launch_are_taken_over_by_the_merge(tmp_path, inputs, monkeypatch, early):
    early.start_early(inputs)
    hashed = []
    real = hashing.InputHasher._hash
    monkeypatch.setattr(hashing.InputHasher, "_hash", lambda self, p: hashed.append(p) or real(self, p))
    merge("--seed", inputs[0], "--experts", f"{inputs[1]},{inputs[2]}", "--out", tmp_path / "a.safetensors")
    files = [f for i in provenance(tmp_path / "a.safetensors")["inputs"] for f in i["files"]]
    assert [f["digest"] for f in files] == [f"blake3:{blake3.blake3(p.read_bytes()).hexdigest()}" for p in inputs]
    assert hashed == []  # every digest came from the hashing started at launch


def test_a_file_rewritten_after_launch_is_hashed_again_by_the_merge(tmp_path, inputs, monkeypatch, early):
    started = early.start_early(inputs)
    for fut in started._futures:
        fut.result()  # hashed early, then rewritten (same size)
    data = bytearray(inputs[2].read_bytes())
    data[-1] ^= 1
    inputs[2].write_bytes(bytes(data))
    hashed = []
    real = hashing.InputHasher._hash
    monkeypatch.setattr(hashing.InputHasher, "_hash", lambda self, p: hashed.append(p) or real(self, p))
    merge("--seed", inputs[0], "--experts", f"{inputs[1]},{inputs[2]}", "--out", tmp_path / "a.safetensors",
          "--allow-nonfinite")
    assert hashed == [inputs[2].resolve()]
    digest = provenance(tmp_path / "a.safetensors")["inputs"][2]["files"][0]["digest"]
    assert digest == f"blake3:{blake3.blake3(bytes(data)).hexdigest()}"


@pytest.mark.slow
def test_the_command_hashes_at_launch_and_fails_fast_with_one_line(tmp_path, inputs):
    import subprocess
    import sys

    env = {**os.environ, "BAM_SURGERY_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "mix.safetensors"
    cmd = [sys.executable, "-m", "bam_surgery", "merge", "--quiet", "--seed", str(inputs[0]), "--experts",
           f"{inputs[1]},{inputs[2]}", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env)
    files = [f for i in provenance(out)["inputs"] for f in i["files"]]
    assert [f["digest"] for f in files] == [f"blake3:{blake3.blake3(p.read_bytes()).hexdigest()}" for p in inputs]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)  # OUT exists, no --force
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and again.stderr.startswith("bam-surgery: error: ")


def test_the_launch_path_imports_no_torch():
    """Hashing can only start before torch is imported if the launch path does not import it."""
    import subprocess
    import sys

    code = ("import sys, bam_surgery.cli.launch, bam_surgery.surgery.digests; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
