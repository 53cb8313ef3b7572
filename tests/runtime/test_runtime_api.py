"""Small contracts of the runtime's public API that users hit first: reserved checkpoint metadata,
preset overrides, and the targets convention of Model.forward."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bam_surgery.runtime import CheckpointError, Model, ModelConfig, load_model, preset, save_model


@pytest.mark.parametrize("key", ["bam_config", "format", "total_size"])
@pytest.mark.parametrize("target", ["m.safetensors", "m"])
def test_save_model_refuses_reserved_metadata_keys(tmp_path, key, target):
    model = Model(preset("tiny"))
    with pytest.raises(CheckpointError, match=f"metadata key '{key}' is reserved"):
        save_model(model, tmp_path / target, metadata={key: "{}"})
    assert not (tmp_path / target).exists()


def test_save_model_keeps_user_metadata(tmp_path):
    from bam_surgery.runtime import CheckpointReader

    path = save_model(Model(preset("tiny")), tmp_path / "m.safetensors", metadata={"note": "seed"})
    with CheckpointReader(path) as r:
        assert r.metadata["note"] == "seed"
    load_model(path)


def test_preset_name_can_be_overridden():
    cfg = preset("tiny", name="seed", d_model=32)
    assert (cfg.name, cfg.d_model) == ("seed", 32)
    assert preset("tiny").name == "tiny"


def test_targets_are_the_tokens_each_position_predicts():
    """targets[b, t] is the token that position t predicts: the model does not shift; -100 is ignored."""
    torch.manual_seed(0)
    model = Model(preset("tiny", n_layers=1)).eval()
    tokens = torch.randint(0, 256, (2, 9))
    out = model(tokens[:, :-1], targets=tokens[:, 1:])
    want = F.cross_entropy(out.logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    assert torch.allclose(out.nll, want)
    masked = tokens[:, 1:].clone()
    masked[:, :4] = -100
    got = model(tokens[:, :-1], targets=masked).nll
    assert torch.allclose(got, F.cross_entropy(out.logits[:, 4:].reshape(-1, 256), tokens[:, 5:].reshape(-1)))


@pytest.mark.parametrize("fmt, model_type", [("hf", "llama"), ("mixtral", "mixtral"), ("hf", "bam_mixture")])
def test_load_model_of_an_hf_folder_names_the_call_that_opens_it(tmp_path, fmt, model_type):
    """An HF folder, or our Mixtral / HF BAM export, is not canonical: load_model (folder or weight file)
    says, in one line, which call reads it; that call does."""
    from conftest import run_cli

    from bam_surgery.converters import open_checkpoint
    from bam_surgery.runtime import model_from_reader

    llama = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, activation="swiglu",
                 norm="rmsnorm", position="rope", block="sequential", max_positions=16, tie_embeddings=False)
    experts = {} if model_type == "llama" else dict(ffn_experts=2, ffn_top_k=1, gate_norm="topk_softmax")
    ckpt = save_model(Model(ModelConfig(**llama, **experts)), tmp_path / "m.safetensors")
    folder = tmp_path / model_type
    run_cli("convert", ckpt, "--format", fmt, "--architecture", "llama", "--out", folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == model_type
    for path in (folder, sorted(folder.glob("*.safetensors"))[0]):  # the folder, or one of its weight files
        with pytest.raises(CheckpointError) as e:
            load_model(path)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{folder}: a Hugging Face model folder "
                                                          f"(model_type '{model_type}'), not a bam-surgery")
        assert f"bam_surgery.converters.open_checkpoint('{folder}')" in message
        assert "bam_surgery.runtime.model_from_reader(reader)" in message
        assert f"bam_surgery.load('{folder}')" in message
    with open_checkpoint(folder) as reader:
        assert model_from_reader(reader).config.ffn_experts == experts.get("ffn_experts", 0)


@pytest.mark.parametrize("name", ["m.gguf", "m.bin"])
def test_load_model_of_a_gguf_file_points_to_the_api_load(tmp_path, name):
    """A GGUF file (by its name or its magic) given to load_model: one line naming bam_surgery.load, not the
    safetensors header parser's "unreadable safetensors header" about a length prefix of GGUF's magic."""
    path = tmp_path / name
    path.write_bytes(b"GGUF" + bytes(60))
    for target in (path, tmp_path):  # the file, or a folder holding it (no config.json)
        with pytest.raises(CheckpointError) as e:
            load_model(target)
        what = "a GGUF file" if target == path else "a folder of GGUF files"
        if target == tmp_path and name != "m.gguf":
            assert "no config.json" in str(e.value)
            continue
        assert str(e.value).startswith(f"{target}: {what}, not a bam-surgery canonical checkpoint")
        assert f"bam_surgery.load('{target}')" in str(e.value) and "\n" not in str(e.value)
