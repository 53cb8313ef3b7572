"""Small contracts of the runtime's public API that users hit first: reserved checkpoint metadata,
preset overrides, and the targets convention of Model.forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bam_surgery.runtime import CheckpointError, Model, load_model, preset, save_model


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
