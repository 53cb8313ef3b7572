"""open_checkpoint: every accepted checkpoint form, and one-line errors for the rest.

Canonical file and directory, HF directory (safetensors; pickle only with allow_pickle), a hub id
resolved from a hand-made local cache with HF_HUB_OFFLINE=1 (no network), tokenizer files.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.hf import HFCheckpointReader, save_hf
from bam_surgery.runtime.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from bam_surgery.runtime.config import ConfigError, ModelConfig
from bam_surgery.runtime.layout import tensor_shapes
from conftest import export_carries

transformers = pytest.importorskip("transformers")

TOKENIZER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
                   "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}'}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny llama saved by transformers, with some tokenizer files next to it."""
    d = tmp_path_factory.mktemp("llama")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(d)
    for name, body in TOKENIZER_FILES.items():
        (d / name).write_text(body)
    return d


def canonical_state(reader) -> dict[str, torch.Tensor]:
    return {n: reader.get(n) for n in reader.names()}


def test_canonical_file_and_directory(tmp_path):
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, ffn_hidden=16)
    state = {n: torch.randn(s) for n, s in tensor_shapes(cfg).items()}
    for target in (tmp_path / "m.safetensors", tmp_path / "m_dir"):
        save_checkpoint(state, cfg, target)
        reader = open_checkpoint(str(target))
        assert isinstance(reader, CheckpointReader) and reader.config == cfg
        assert all(torch.equal(reader.get(n), state[n]) for n in state)


def test_hf_directory_and_tokenizer_files(hf_dir, tmp_path):
    reader = open_checkpoint(str(hf_dir))
    assert isinstance(reader, HFCheckpointReader)
    assert reader.source_dir == hf_dir and reader.path == hf_dir
    assert sorted(p.name for p in reader.tokenizer_files()) == sorted(TOKENIZER_FILES)
    assert reader.files() == [hf_dir / "model.safetensors"]
    assert isinstance(open_checkpoint(str(hf_dir / "model.safetensors")), HFCheckpointReader)  # its directory
    out = save_hf(reader, tmp_path / "out", "llama", **export_carries(reader))  # what every export carries
    for name in TOKENIZER_FILES:  # the tokenizer files as they are; the generation config's entries rewritten
        got = (out / name).read_text()
        assert got == TOKENIZER_FILES[name] if name != "generation_config.json" else \
            json.loads(got) == json.loads(TOKENIZER_FILES[name])
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)  # the generation config's token ids
    assert written["architectures"] == ["LlamaForCausalLM"]


def test_pickle_weights_need_allow_pickle(hf_dir, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    safetensors_reader = open_checkpoint(str(hf_dir))
    torch.save(load_file(hf_dir / "model.safetensors"), d / "pytorch_model.bin")
    for spec in (d, d / "pytorch_model.bin"):
        with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: pickle weights .* pass --allow-pickle"):
            open_checkpoint(str(spec))
    for spec in (d, d / "pytorch_model.bin"):
        reader = open_checkpoint(str(spec), allow_pickle=True)
        assert reader.config == safetensors_reader.config
        assert reader.files() == [d / "pytorch_model.bin"]
        assert all(torch.equal(reader.get(n), safetensors_reader.get(n)) for n in reader.names())


def _hand_made_cache(root, hf_dir, repo="tiny-org/tiny-llama", sha="0123456789abcdef0123456789abcdef01234567"):
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    shutil.copytree(hf_dir, repo_dir / "snapshots" / sha)
    return sha


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_id_from_local_cache_offline(hf_dir, tmp_path, monkeypatch, env):
    cache = tmp_path / "hub"
    sha = _hand_made_cache(cache, hf_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else tmp_path))
    expected = canonical_state(open_checkpoint(str(hf_dir)))
    for spec in ("tiny-org/tiny-llama", "tiny-org/tiny-llama@main", f"tiny-org/tiny-llama@{sha}"):
        reader = open_checkpoint(spec)
        assert isinstance(reader, HFCheckpointReader)
        assert reader.source_dir.resolve() == (cache / "models--tiny-org--tiny-llama" / "snapshots" / sha).resolve()
        got = canonical_state(reader)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
        assert len(reader.tokenizer_files()) == len(TOKENIZER_FILES)
    with pytest.raises(CheckpointError, match=r"^tiny-org/absent: not a local path, and resolving it as a hub id "
                                              r"\(offline, from the cache only"):
        open_checkpoint("tiny-org/absent")
    with pytest.raises(CheckpointError, match=r"^tiny-org/tiny-llama@v9: not a local path"):
        open_checkpoint("tiny-org/tiny-llama@v9")


def test_bad_specs_are_one_line_errors(tmp_path):
    cases = {
        str(tmp_path / "nope"): r"no such file or directory \(and not a hub id",
        "not-a-hub-id": r"^not-a-hub-id: no such file or directory",
        "./org/name": r"no such file or directory",
        "org/model.safetensors": r"^org/model\.safetensors: no such file or directory",
    }
    for spec, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as e:
            open_checkpoint(spec)
        assert "\n" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no config\.json"):
        open_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(CheckpointError, match=r"config\.json: has neither 'bam_config' \(canonical\) nor 'model_type'"):
        open_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8,
                                                                 "hidden_size": 8, "num_hidden_layers": 1,
                                                                 "num_attention_heads": 2, "intermediate_size": 8}))
    with pytest.raises(CheckpointError, match=r"empty: no weights found"):
        open_checkpoint(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"notes\.txt: not a checkpoint"):
        open_checkpoint(str(tmp_path / "notes.txt"))


def test_missing_config_key_names_the_file(hf_dir, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(hf_dir, d)
    body = json.loads((d / "config.json").read_text())
    del body["hidden_size"]
    (d / "config.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=r"broken/config\.json: hidden_size: required key is missing"):
        open_checkpoint(str(d))


def test_truncated_weights_are_an_error(hf_dir, tmp_path):
    d = tmp_path / "truncated"
    shutil.copytree(hf_dir, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-64])
    # the same message as a truncated canonical file: it names the file and the first tensor cut off
    with pytest.raises(CheckpointError, match=r"truncated/model\.safetensors: truncated: tensor \S+ ends at byte"):
        open_checkpoint(str(d))


def test_a_refused_pickle_prints_no_torch_warning(hf_dir, tmp_path, monkeypatch):
    """Issue 20: `--allow-pickle` on a refused pickle printed two torch UserWarning lines besides the error: the
    warnings torch.load gives on the way are silenced (injected here: which ones torch gives depends on its
    version), so only the one error line shows."""
    import pickle
    import warnings

    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(hf_dir / "config.json", d / "config.json")
    torch.save(load_file(hf_dir / "model.safetensors"), d / "pytorch_model.bin")

    def warn_then_refuse(*args, **kwargs):
        warnings.warn("Weights only load failed. In PyTorch 2.6, we changed the default value ...", UserWarning)
        warnings.warn("mmap can only be used with files saved with torch.save(_use_new_zipfile_...)", UserWarning)
        raise pickle.UnpicklingError("Weights only load failed: Unsupported global: GLOBAL posix.system")

    monkeypatch.setattr(torch, "load", warn_then_refuse)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="refused to load this pickle: it calls posix.system"):
            open_checkpoint(str(d), allow_pickle=True).get("model.embed_tokens.weight")
    assert [str(w.message) for w in seen] == []
