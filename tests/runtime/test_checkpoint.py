"""Canonical checkpoints: round trips (file and sharded directory), no unpickling, atomic writes,
clear errors on damaged files."""
from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

from conftest import build_model, random_state, tiny_config, tokens_for
from bam_surgery.runtime import load_model, save_model
from bam_surgery.runtime.config import ConfigError
from bam_surgery.runtime.checkpoint import CONFIG_KEY, CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from bam_surgery.runtime.safetensors_file import SafetensorsStreamWriter
from bam_surgery.runtime.shards import INDEX_NAME, plan_shards
from bam_surgery.runtime.layout import tensor_shapes

MIX = dict(ffn_experts=3, ffn_top_k=2, attn_experts=3, kv_mode="shared", position="learned", norm="layernorm",
           norm_bias=True, lm_head_bias=True, tie_embeddings=True)


def model_and_tokens(**overrides):
    cfg = tiny_config(**overrides)
    return build_model(cfg, random_state(cfg, 4)), tokens_for(cfg, 4)


def assert_same_logits(a, b, tokens):
    with torch.no_grad():
        assert torch.equal(a(tokens).logits, b(tokens).logits)


@pytest.mark.parametrize("overrides", [dict(), MIX], ids=["dense", "mixture"])
def test_single_file_round_trip(tmp_path, overrides):
    model, tokens = model_and_tokens(**overrides)
    path = save_model(model, tmp_path / "m.safetensors", metadata={"recipe": "test"})
    assert path.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    again = load_model(path)
    assert again.config == model.config
    assert_same_logits(model, again, tokens)
    with CheckpointReader(path) as r:
        assert r.metadata["recipe"] == "test"
        assert sorted(r.names()) == sorted(tensor_shapes(model.config))
        assert json.loads(r.metadata[CONFIG_KEY]) == model.config.to_dict()


@pytest.mark.parametrize("overrides", [dict(), MIX], ids=["dense", "mixture"])
def test_sharded_directory_round_trip(tmp_path, overrides):
    model, tokens = model_and_tokens(**overrides)
    out = save_model(model, tmp_path / "m", max_shard_bytes=20_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (out / "config.json").exists() and (out / INDEX_NAME).exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]  # no temporary left behind
    again = load_model(out)
    assert again.config == model.config
    assert_same_logits(model, again, tokens)

    state = model.state_dict()
    index = json.loads((out / INDEX_NAME).read_text())
    with CheckpointReader(out) as r:
        assert r.config == model.config
        assert sorted(r.names()) == sorted(state)
        assert sorted(p.name for p in r.files()) == shards
        for name, t in state.items():
            assert r.file_of(name).name == index["weight_map"][name]
            assert r.shape(name) == tuple(t.shape) and r.dtype(name) == t.dtype
            assert torch.equal(r.get(name), t)
        assert int(r.metadata["total_size"]) == sum(t.numel() * t.element_size() for t in state.values())


def test_bfloat16_round_trip_keeps_dtype_and_bits(tmp_path):
    cfg = tiny_config()
    state = random_state(cfg, 1, dtype=torch.bfloat16)
    save_checkpoint(state, cfg, tmp_path / "b.safetensors")
    cfg2, loaded = load_checkpoint(tmp_path / "b.safetensors")
    assert cfg2 == cfg
    assert sorted(loaded) == sorted(state)
    for k in state:
        assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], state[k])


def test_save_overwrites_an_existing_checkpoint(tmp_path):
    a, tokens = model_and_tokens()
    b, _ = model_and_tokens(activation="gelu")
    for path in (tmp_path / "x.safetensors", tmp_path / "x"):
        save_model(a, path)
        save_model(b, path)
        assert load_model(path).config.activation == "gelu"
        assert_same_logits(b, load_model(path), tokens)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model, tokens = model_and_tokens(**MIX)
    file = save_model(model, tmp_path / "m.safetensors")
    directory = save_model(model, tmp_path / "m", max_shard_bytes=20_000)

    def refuse(*a, **k):
        raise AssertionError("a checkpoint load tried to unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    for path in (file, directory):
        assert_same_logits(model, load_model(path), tokens)
        load_checkpoint(path)


@pytest.mark.parametrize("target", ["m.safetensors", "m"])
def test_failed_save_leaves_nothing_at_target(tmp_path, monkeypatch, target):
    model, _ = model_and_tokens()
    real_write = SafetensorsStreamWriter.write
    calls = {"n": 0}

    def write_then_fail(self, name, tensor):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError("disk full (simulated)")
        return real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsStreamWriter, "write", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, tmp_path / target, max_shard_bytes=20_000)
    assert calls["n"] == 2
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, tokens = model_and_tokens()
    path = save_model(model, tmp_path / "m.safetensors")
    before = path.read_bytes()

    def fail(self, name, tensor):
        raise OSError("simulated failure")

    monkeypatch.setattr(SafetensorsStreamWriter, "write", fail)
    with pytest.raises(OSError):
        save_model(model_and_tokens(activation="relu")[0], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_writer_enforces_declared_order_and_shapes(tmp_path):
    entries = [("a", (2, 3), torch.float32), ("b", (4,), torch.float32)]
    w = SafetensorsStreamWriter(tmp_path / "w.safetensors", entries)
    with pytest.raises(CheckpointError, match="b written out of order"):
        w.write("b", torch.zeros(4))
    with pytest.raises(CheckpointError, match="declared"):
        w.write("a", torch.zeros(3, 2))
    w.write("a", torch.zeros(2, 3))
    with pytest.raises(CheckpointError, match="before tensor b"):
        w.close()


# ---- damaged files --------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, _ = model_and_tokens()
    return save_model(model, tmp_path / "good.safetensors")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file_is_a_checkpoint_error_naming_the_file(tmp_path, saved, keep):
    data = saved.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="truncated.safetensors: truncated"):
        CheckpointReader(bad)
    with pytest.raises(CheckpointError, match="truncated.safetensors: truncated"):
        load_model(bad)


def test_truncated_header_is_a_checkpoint_error(tmp_path, saved):
    bad = tmp_path / "short.safetensors"
    bad.write_bytes(saved.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="short.safetensors"):
        CheckpointReader(bad)


@pytest.mark.parametrize("content", [b"", b"abc", b"\x00" * 64, bytes(range(256)) * 8,
                                     struct.pack("<Q", 12) + b"not json!!!!"])
def test_garbage_file_is_a_checkpoint_error_naming_the_file(tmp_path, content):
    bad = tmp_path / "garbage.safetensors"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match="garbage.safetensors"):
        CheckpointReader(bad)


def test_missing_file_and_foreign_file(tmp_path):
    with pytest.raises(CheckpointError, match="nope.safetensors"):
        CheckpointReader(tmp_path / "nope.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    w = SafetensorsStreamWriter(foreign, [("x", (2,), torch.float32)], {"format": "other"})
    w.write("x", torch.ones(2))
    w.close()
    with pytest.raises(CheckpointError, match=f"foreign.safetensors.*{CONFIG_KEY}"):
        CheckpointReader(foreign)


def test_directory_with_missing_shard_names_the_shard(tmp_path):
    model, _ = model_and_tokens()
    out = save_model(model, tmp_path / "m", max_shard_bytes=20_000)
    victim = sorted(out.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        CheckpointReader(out)


def test_directory_without_config_is_an_error(tmp_path):
    model, _ = model_and_tokens()
    out = save_model(model, tmp_path / "m")
    (out / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        CheckpointReader(out)


@pytest.mark.parametrize("damage, message", [
    ("drop", "tensor layers.0.attn.q.weight is missing"),
    ("reshape", r"tensor layers.1.ffn.up.weight has shape \[3, 3\]"),
    ("extra", r"tensor layers.0.extra.weight \[3\] is not part of the config's layout"),
])
def test_load_model_checks_the_layout_naming_file_and_tensor(tmp_path, damage, message):
    cfg = tiny_config()
    state = random_state(cfg)
    if damage == "drop":
        del state["layers.0.attn.q.weight"]
    elif damage == "reshape":
        state["layers.1.ffn.up.weight"] = torch.zeros(3, 3)
    else:
        state["layers.0.extra.weight"] = torch.zeros(3)
    path = save_checkpoint(state, cfg, tmp_path / "damaged.safetensors")
    with pytest.raises(CheckpointError, match=f"damaged.safetensors: .*{message}"):
        load_model(path)


@pytest.mark.parametrize("target", ["bad.safetensors", "bad"])
def test_invalid_stored_config_names_the_file(tmp_path, target):
    cfg = tiny_config()
    state = random_state(cfg)
    bad = dict(cfg.to_dict(), n_heads=5, head_dim=None)  # d_model 32 / 5 heads: inconsistent
    path = tmp_path / target
    if target.endswith(".safetensors"):  # the bad config in the file's metadata
        w = SafetensorsStreamWriter(path, [(k, tuple(v.shape), v.dtype) for k, v in state.items()],
                                    {CONFIG_KEY: json.dumps(bad)})
        for k, v in state.items():
            w.write(k, v)
        w.close()
        where = "bad.safetensors"
    else:  # the bad config in config.json
        save_checkpoint(state, cfg, path)
        body = json.loads((path / "config.json").read_text())
        body[CONFIG_KEY] = bad
        (path / "config.json").write_text(json.dumps(body))
        where = "config.json"
    with pytest.raises(ConfigError, match=f"{where}: d_model"):
        CheckpointReader(path)


def test_unknown_tensor_name_is_an_error(saved):
    with CheckpointReader(saved) as r:
        with pytest.raises(CheckpointError, match="layers.9.ffn.up.weight"):
            r.get("layers.9.ffn.up.weight")


def test_plan_shards_bounds_and_order():
    entries = [(f"t{i}", (10,), torch.float32) for i in range(7)]  # 40 bytes each
    shards = plan_shards(entries, 100)
    assert [len(s) for s in shards] == [2, 2, 2, 1]
    assert [e for s in shards for e in s] == entries
    assert plan_shards(entries, None) == [entries]
    # a tensor larger than the bound gets a shard of its own
    assert [len(s) for s in plan_shards([("big", (100,), torch.float32)] + entries[:2], 100)] == [1, 2]
