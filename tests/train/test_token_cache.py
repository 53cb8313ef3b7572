"""The tokenized-data cache (train/tokenize.py) under the caches' one trust rule (runtime/cache.py; docs/safety.md,
"The caches"). Before it, `KEY.json`/`KEY.bin` were trusted whenever both existed: another user sharing the cache
could plant token ids that `train` trained on and `eval` scored (exit 0), a truncated entry failed every later run
("unusable token cache entry"), a changed one was read as data and a link was followed. Here:

* a second user, for real where the tests run as root (a forked child that drops to another uid: conftest's
  as_other_user), plants the entry of a split (its key is a predictable digest) or the whole folder; the same rule
  against files of "another" uid (os.geteuid patched) runs everywhere, through `eval`;
* partial, corrupt and linked entries are rebuilt, and hypothesis fuzzes an entry's bytes: whatever they become,
  the tokens read are the text's own;
* a --token-cache folder that others may write is not written to; calibration (merge --router-init) reads only a
  verified entry.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import as_other_user, error_line, needs_root, other_uid, plant_entry, run_cli, shared_folder

from bam_surgery.runtime import cache, preset, save_model
from bam_surgery.runtime.model import Model
from bam_surgery.train.data import DOC_SEPARATOR, Domain, open_source
from bam_surgery.train.tokenize import CACHE_VERSION, ByteTokenizer, cache_key, default_cache_dir, tokenize_source

DOCS = ["the cat sat", "on the mat", "é and ü"]
TRUTH = [b for d in DOCS for b in [*d.encode(), 0]]  # bytes, EOS 0 after each document
PLANTED = [ord("x")] * (len(TRUTH) - 1) + [0]  # the attacker's ids, the same length
TOK = ByteTokenizer()


def text_file(folder: Path) -> Path:
    path = folder / "d.txt"
    path.write_text(DOC_SEPARATOR.join(DOCS))
    os.chmod(path, 0o644)
    return path


def source(path: Path):
    return open_source(Domain("d", str(path), 1.0), "train")


def planted_files(ids: list[int]) -> dict[str, bytes]:
    meta = {"version": CACHE_VERSION, "dtype": "<u2", "tokens": len(ids), "documents": ids.count(0)}
    return {"tokens.bin": np.asarray(ids, dtype="<u2").tobytes(), "tokens.json": json.dumps(meta).encode()}


def plant(folder: Path, key: str, ids: list[int] = PLANTED, mode: int | None = None) -> None:
    """The entry of `key` in `folder` (made with `mode` if given), as an attacker writes it: the cache's entry folder
    (DIGEST and all), and the KEY.json/KEY.bin of the layout before the rule (what the old code read)."""
    folder.mkdir(parents=True, exist_ok=True)
    if mode is not None:
        os.chmod(folder, mode)
    files = planted_files(ids)
    plant_entry(folder / key, files)
    (folder / f"{key}.bin").write_bytes(files["tokens.bin"])
    (folder / f"{key}.json").write_bytes(files["tokens.json"])


def tokens(src, folder: Path) -> list[int]:
    return tokenize_source(src, TOK, folder).tokens.tolist()


def entry_files(folder: Path) -> list[Path]:
    """Every file of the cache folder's entries (one source here), below entry folders too."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


# ---- a second user, for real ------------------------------------------------------------------------------------
@needs_root
def test_a_second_user_plants_the_token_cache(public_tmp, monkeypatch):
    """The default cache in a folder both users may write (sticky, as /tmp): the second user made `tokens` and the
    split's entry first. Their folder is not trusted: the split is tokenized privately, their files left alone."""
    shared = shared_folder(public_tmp)
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(shared / "cache"))
    src = source(text_file(public_tmp))
    folder = default_cache_dir()

    def attack() -> None:
        (shared / "cache").mkdir(mode=0o777)
        plant(folder, cache_key(src, TOK), mode=0o777)
    as_other_user(attack)
    assert folder.stat().st_uid == other_uid()
    tf = tokenize_source(src, TOK, folder)
    assert tf.tokens.tolist() == TRUTH and not tf.path.is_relative_to(shared)
    assert (folder / f"{tf.key}.bin").read_bytes() == planted_files(PLANTED)["tokens.bin"]  # left alone
    from bam_surgery.train.tokenize import token_cache_note
    assert f"belongs to user {other_uid()}" in token_cache_note(None)


@needs_root
def test_a_second_user_plants_an_entry_in_an_open_token_folder_of_ours(public_tmp, monkeypatch):
    """Our `tokens`, left writable by an older version (0777), with the second user's entry in it (and their files
    of the old layout): the folder is made 0700 again, the entry swapped for ours."""
    root = public_tmp / "cache"
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(root))
    src = source(text_file(public_tmp))
    folder = default_cache_dir()
    folder.mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(folder, 0o777)
    as_other_user(lambda: plant(folder, cache_key(src, TOK)))
    tf = tokenize_source(src, TOK, folder)
    assert tf.tokens.tolist() == TRUTH and tf.path.is_relative_to(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    entry = folder / tf.key
    assert entry.stat().st_uid == os.geteuid() and stat.S_IMODE(entry.stat().st_mode) == 0o700


@needs_root
def test_a_second_user_plants_an_input_digest(public_tmp, monkeypatch):
    """The merge's input-digest cache, which feeds the provenance: the second user plants a wrong digest for the
    victim's input file (its key is what anyone may stat). The provenance carries the file's own BLAKE3."""
    from conftest import b3, random_state, save_family, tiny_config
    from bam_surgery.runtime.checkpoint import CheckpointReader
    from bam_surgery.surgery import hashing
    from bam_surgery.surgery.digests import file_key

    shared = shared_folder(public_tmp)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))  # where the digest cache lay before the rule
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(shared / "bam-surgery"))
    cfg = tiny_config()
    inputs = save_family(public_tmp, cfg, [random_state(cfg, seed=i) for i in range(2)], names=("seed", "code"))
    for p in (public_tmp, *inputs):
        os.chmod(p, 0o755)
    lie = "0" * 64
    entries = {str(p.resolve()): [*file_key(os.stat(p)), "blake3", lie, 1e12] for p in inputs}
    body = json.dumps({"version": 1, "entries": entries}).encode()
    target = hashing.cache_file()

    def attack() -> None:
        (shared / "bam-surgery").mkdir(mode=0o777)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o777)
        target.write_bytes(body)
        plant_entry(target.parent, {target.name: body})
    as_other_user(attack)
    out = public_tmp / "mix.safetensors"
    run_cli("merge", "--quiet", "--seed", inputs[0], "--experts", inputs[1], "--out", out)
    provenance = json.loads(CheckpointReader(out).metadata["bam_provenance"])
    digests = [f["digest"] for i in provenance["inputs"] for f in i["files"]]
    assert digests == [b3(p) for p in inputs]
    assert target.read_bytes() == body  # theirs, left alone


# ---- the rule against "another" uid, everywhere -------------------------------------------------------------
def _tiny_model(folder: Path) -> Path:
    model = Model(preset("tiny", d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_positions=16))
    model.reset_parameters(std=0.2, seed=0)
    return save_model(model, folder / "m.safetensors")


def _eval_loss(ckpt: Path, data: Path, *extra) -> tuple[float, str]:
    result = run_cli("eval", ckpt, "--data", f"d={data}", "--split", "train", "--tokenizer", "bytes", "--seq-len",
                     8, "--json", *extra)
    return json.loads(result.stdout)["domains"]["d"]["loss"], result.stderr


def test_eval_never_scores_planted_token_ids(tmp_path, monkeypatch):
    """`eval` on a cache whose folder and entry belong to "another" user (this process's uid seen as a stranger's):
    the loss is the text's own, and a note says where the tokens went; the planted files are left alone."""
    ckpt, data = _tiny_model(tmp_path), text_file(tmp_path)
    clean, _ = _eval_loss(ckpt, data, "--token-cache", tmp_path / "clean")
    folder = tmp_path / "cache" / "tokens"
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(tmp_path / "cache"))
    plant(folder, cache_key(source(data), TOK), mode=0o700)
    real = os.geteuid()
    monkeypatch.setattr(cache.os, "geteuid", lambda: real + 1)
    loss, stderr = _eval_loss(ckpt, data)
    assert loss == clean
    assert stderr.strip() == (f"bam-surgery: note: token cache {folder} is not trusted ({folder} belongs to user "
                              f"{real}, not to this user ({real + 1})): tokenized into a private temporary folder of "
                              "this run; pass --token-cache a folder of your own (or set BAM_SURGERY_CACHE)")
    assert (folder / cache_key(source(data), TOK) / "tokens.bin").read_bytes() == planted_files(PLANTED)["tokens.bin"]


def test_a_token_cache_others_may_write_is_not_written_to(tmp_path):
    """--token-cache DIR below a folder anyone may write (not sticky): another user could swap DIR for theirs."""
    src = source(text_file(tmp_path))
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    assert tokens(src, open_folder / "tokens") == TRUTH
    assert entry_files(open_folder) == []


# ---- partial, corrupt and linked entries ----------------------------------------------------------------------
def test_partial_corrupt_and_linked_entries_are_rebuilt(tmp_path):
    src = source(text_file(tmp_path))
    folder = tmp_path / "tokens"
    tf = tokenize_source(src, TOK, folder)
    assert tf.tokens.tolist() == TRUTH
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    stamp = tf.path.stat().st_mtime_ns
    assert tokens(src, folder) == TRUTH and tf.path.stat().st_mtime_ns == stamp  # found and verified, not rebuilt

    tf.path.write_bytes(tf.path.read_bytes()[:-3])  # a partial write (a full disk, a kill)
    assert tokens(src, folder) == TRUTH
    data = bytearray(tf.path.read_bytes())
    data[0] = ord("x")  # a corrupt one, the same size
    tf.path.write_bytes(bytes(data))
    assert tokens(src, folder) == TRUTH
    for f in entry_files(folder):  # each file missing in turn
        f.unlink()
        assert tokens(src, folder) == TRUTH
    elsewhere = tmp_path / "elsewhere.bin"  # a link to a file of the planted ids
    elsewhere.write_bytes(planted_files(PLANTED)["tokens.bin"])
    tf.path.unlink()
    tf.path.symlink_to(elsewhere)
    assert tokens(src, folder) == TRUTH
    assert not tf.path.is_symlink() and elsewhere.read_bytes() == planted_files(PLANTED)["tokens.bin"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_a_sealed_entry_that_does_not_describe_its_tokens_is_rebuilt(tmp_path):
    """An entry of ours whose DIGEST matches but whose tokens.json is not this version's or gives another size
    (an older tool's, a bug's): tokenized again and swapped in, never read."""
    src = source(text_file(tmp_path))
    folder = tmp_path / "tokens"
    key = cache_key(src, TOK)
    for meta in ({"version": CACHE_VERSION - 1}, {"tokens": len(PLANTED) + 1}, {"dtype": "<u4"}, {"documents": -1}):
        files = planted_files(PLANTED)
        files["tokens.json"] = json.dumps({**json.loads(files["tokens.json"]), **meta}).encode()
        shutil.rmtree(folder / key, ignore_errors=True)
        plant_entry(folder / key, files)
        os.chmod(folder / key, 0o700)
        assert tokens(src, folder) == TRUTH, meta


def test_a_failed_tokenization_leaves_nothing(tmp_path):
    (tmp_path / "empty.txt").write_text(DOC_SEPARATOR.join(["", " "]))
    private = set(Path(tempfile.gettempdir()).glob("bam-surgery-rebuilt-*"))
    for folder in (tmp_path / "tokens", tmp_path / "open" / "tokens"):
        if folder.parent.name == "open":
            folder.parent.mkdir()
            os.chmod(folder.parent, 0o777)
        with pytest.raises(Exception, match="no text"):
            tokenize_source(source(tmp_path / "empty.txt"), TOK, folder)
        assert list(folder.iterdir()) == []
    assert set(Path(tempfile.gettempdir()).glob("bam-surgery-rebuilt-*")) == private  # the private one removed


def test_nothing_is_kept_of_a_build_that_gives_no_files(tmp_path, monkeypatch):
    """A build that says why there are no files (a GGUF tokenizer that cannot be rebuilt), in a trusted folder and
    in one that is not: no entry, and the private temporary folder removed now, not at exit."""
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o777)
    private = set(Path(tempfile.gettempdir()).glob("bam-surgery-rebuilt-*"))
    for root in (tmp_path / "cache", open_folder / "cache"):
        monkeypatch.setenv("BAM_SURGERY_CACHE", str(root))
        assert cache.cached_build("things", "k", ["a"], lambda: "not rebuilt: why", "m.gguf") == "not rebuilt: why"
        assert list((root / "things").iterdir()) == []
    assert set(Path(tempfile.gettempdir()).glob("bam-surgery-rebuilt-*")) == private


def test_a_token_cache_that_cannot_be_made_is_one_line(tmp_path):
    """--token-cache naming a file: refused in one line naming it (no note promising a private folder first)."""
    ckpt, data = _tiny_model(tmp_path), text_file(tmp_path)
    (tmp_path / "file").write_text("")
    result = run_cli("eval", ckpt, "--data", f"d={data}", "--split", "train", "--tokenizer", "bytes", "--seq-len", 8,
                     "--token-cache", tmp_path / "file", code=2)
    error_line(result, f"cannot write the cache under {tmp_path / 'file'}", "pass --token-cache")


def test_an_entry_that_is_a_link_is_not_followed(tmp_path):
    src = source(text_file(tmp_path))
    folder = tmp_path / "tokens"
    key = cache_key(src, TOK)
    plant(tmp_path / "elsewhere", key)
    folder.mkdir(mode=0o700)
    (folder / key).symlink_to(tmp_path / "elsewhere" / key)
    assert tokens(src, folder) == TRUTH
    assert not (folder / key).is_symlink()


def test_calibration_reads_only_a_verified_entry(tmp_path):
    """merge --router-init reads the first tokens of a split from its cache entry when one is there."""
    from bam_surgery.surgery.warm_start import first_tokens

    src = source(text_file(tmp_path))
    folder = tmp_path / "tokens"
    tf = tokenize_source(src, TOK, folder)
    data = bytearray(tf.path.read_bytes())
    data[:4] = b"xxxx"
    tf.path.write_bytes(bytes(data))
    assert first_tokens(src, TOK, folder, 5).tolist() == TRUTH[:5]


# ---- hypothesis: an entry's bytes, whatever they become --------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(the text's source, a cache folder holding its entry, a copy of that folder)."""
    root = tmp_path_factory.mktemp("fuzz")
    src = source(text_file(root))
    tokenize_source(src, TOK, root / "tokens")
    shutil.copytree(root / "tokens", root / "copy", symlinks=True)
    return src, root / "tokens", root / "copy"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, 10), cut=st.integers(0, 64), noise=st.binary(max_size=24),
       how=st.sampled_from(["truncate", "overwrite", "append", "replace"]))
def test_fuzzed_entry_bytes_are_never_read_as_data(pristine, which, cut, noise, how):
    src, folder, copy = pristine
    shutil.rmtree(folder)
    shutil.copytree(copy, folder, symlinks=True)
    files = entry_files(folder)
    f = files[which % len(files)]
    data = f.read_bytes()
    changed = {"truncate": data[:min(cut, max(len(data) - 1, 0))], "append": data + (noise or b"\0"),
               "overwrite": data[:cut] + noise + data[cut + len(noise):], "replace": noise}[how]
    f.write_bytes(changed)
    assert tokens(src, folder) == TRUTH
