"""The exports in the transformers that loads them, at whatever version this environment has.

`make test` runs this file with the pinned transformers; `make test-compat` runs it again (with
test_hf_bam_export.py and test_mixtral_export.py) in one venv per end of the range the exports declare
(converters/hf_bam/schema_bam.py), so every check here holds at both ends:

* HF BAM (remote code): the KV cache under both names transformers has used (`past_key_values`, `cache`),
  an unknown keyword argument refused, cached and uncached generation equal to the runtime, left-padded
  batches equal to each prompt alone, a `save_pretrained` round trip, and the version floor refused in one line.
* Mixtral: cached and uncached generation equal to the runtime, left-padded batches, `save_pretrained`.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bam_surgery.converters.hf_bam import export_hf_bam, schema_bam
from bam_surgery.converters.hf_bam.reader import BamHFReader
from bam_surgery.converters.mixtral import export_mixtral
from bam_surgery.runtime import save_model
from bam_surgery.runtime.checkpoint import CheckpointReader

transformers = pytest.importorskip("transformers")

from test_hf_bam_export import V, load_hf, random_model, runtime_greedy  # noqa: E402
from test_mixtral_export import hf_mixtral, mixture_config  # noqa: E402
from test_mixtral_export import random_model as random_mixtral  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def bam(tmp_path_factory, hf_modules):
    """A BAM expert-KV mixture: runtime model, export folder, loaded HF model."""
    root = tmp_path_factory.mktemp("bam")
    model = random_model("bam_expert_kv", seed=0)
    save_model(model, root / "canonical.safetensors")
    with CheckpointReader(root / "canonical.safetensors") as reader:
        out = export_hf_bam(reader, root / "hf")
    return model, out, load_hf(out)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    cfg = mixture_config()
    model = random_mixtral(cfg, seed=4)
    save_model(model, root / "mix.safetensors")
    with CheckpointReader(root / "mix.safetensors") as reader:
        out = export_mixtral(reader, root / "hf")
    return model, out, hf_mixtral(out)


def _left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[1],), pad), p[0]]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.shape[1]), torch.ones(p.shape[1])]) for p in prompts]).long()
    return ids, mask


def _greedy_both_ways(hf, prompt: torch.Tensor, n: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        cached = hf.generate(prompt, max_new_tokens=n, do_sample=False, use_cache=True, **kw)
        uncached = hf.generate(prompt, max_new_tokens=n, do_sample=False, use_cache=False, **kw)
    return cached[:, prompt.shape[1]:], uncached[:, prompt.shape[1]:]


# ---- HF BAM ---------------------------------------------------------------------------------------------
def test_bam_config_states_the_transformers_range(bam):
    _, out, hf = bam
    body = json.loads((out / "config.json").read_text())
    assert body["transformers_version"] == schema_bam.TRANSFORMERS_MIN
    assert body["bam_transformers"]["requires"] == schema_bam.TRANSFORMERS_RANGE
    # the installed transformers is inside the range (else this stage tests a version the export refuses)
    assert schema_bam.transformers_problem(transformers.__version__) is None


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_bam_takes_the_cache_under_either_name(bam, name):
    model, _, hf = bam
    seq = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(seq).logits
        out = hf(seq[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, seq.shape[1]):
            out = hf(seq[:, t:t + 1], use_cache=True, **{name: out.past_key_values})
            assert out.past_key_values is not None and out.past_key_values.get_seq_length() == t + 1
            steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= TOL


def test_bam_refuses_what_it_would_not_honour(bam):
    _, _, hf = bam
    seq = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with pytest.raises(TypeError, match="unexpected keyword argument.*cache_params"):
            hf(seq, cache_params=None)
        first = hf(seq, use_cache=True)
        cache = first.past_key_values
        with pytest.raises(ValueError, match="one of cache and past_key_values"):
            hf(seq[:, :1], cache=cache, past_key_values=transformers.DynamicCache())
        with pytest.raises(ValueError, match="does not continue the cache"):
            hf(seq[:, :1], past_key_values=cache, cache_position=torch.tensor([0]))
        with pytest.raises(ValueError, match="output_attentions"):
            hf(seq, output_attentions=True)
        # what 4.x generate passes (cache_position) and Trainer passes (num_items_in_batch) is honoured
        out = hf(seq, labels=seq, cache_position=torch.arange(4), num_items_in_batch=torch.tensor(3))
        mean = hf(seq, labels=seq).loss
    assert torch.allclose(out.loss, mean * 3 / 3, atol=1e-6)  # 3 shifted labels over 3 items: the mean itself


def test_bam_cached_and_uncached_generation_equal_the_runtime(bam):
    model, _, hf = bam
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    cached, uncached = _greedy_both_ways(hf, prompt, 6)
    expected = runtime_greedy(model, prompt, 6)
    assert torch.equal(cached, expected) and torch.equal(uncached, expected)


def _each_row_decodes_as_its_prompt_alone(model, hf, ids, mask, prompts) -> None:
    """transformers' greedy decoding of the left-padded batch, with and without its cache, gives each row
    the runtime's greedy continuation of that prompt alone (5 tokens)."""
    cached, uncached = _greedy_both_ways(hf, ids, 5, attention_mask=mask, pad_token_id=0)
    for row, p in enumerate(prompts):
        alone = runtime_greedy(model, p, 5)[0]
        assert torch.equal(cached[row], alone) and torch.equal(uncached[row], alone), row


def test_bam_left_padded_batch_equals_each_prompt_alone(bam):
    model, _, hf = bam
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (1, n), generator=gen) for n in (3, 8, 5)]
    ids, mask = _left_padded(prompts)
    _each_row_decodes_as_its_prompt_alone(model, hf, ids, mask, prompts)


def test_bam_save_pretrained_round_trip(bam, tmp_path):
    model, out, hf = bam
    hf.save_pretrained(tmp_path / "resaved")
    again = load_hf(tmp_path / "resaved")
    seq = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(again(seq).logits, hf(seq).logits)
    # and bam-surgery reads the resaved folder back to the same canonical tensors
    with BamHFReader(tmp_path / "resaved") as reader, CheckpointReader(out.parent / "canonical.safetensors") as ours:
        assert reader.config == ours.config
        assert sorted(reader.names()) == sorted(ours.names())
        for name in ours.names():
            assert torch.equal(reader.get(name), ours.get(name)), name


@pytest.mark.slow
def test_bam_refuses_a_transformers_below_the_floor_in_one_line(bam, tmp_path):
    """The real load path, in a fresh process whose transformers says it is older than the floor."""
    _, out, _ = bam
    code = ("import sys, transformers\n"
            "transformers.__version__ = '4.56.2'\n"
            "from transformers import AutoConfig\n"
            "try:\n"
            f"    AutoConfig.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
            "except ImportError as e:\n"
            "    print(e); sys.exit(3)\n")
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stdout.strip()
    assert "\n" not in line and schema_bam.TRANSFORMERS_RANGE in line and "installed: 4.56.2" in line


def test_version_floor_parsing():
    assert schema_bam.version_tuple("5.24.0") == (5, 24, 0)
    assert schema_bam.version_tuple("4.57.0.dev0") == (4, 57, 0)
    assert schema_bam.version_tuple("5.0.0rc1") == (5, 0, 0)
    assert schema_bam.transformers_problem(schema_bam.TRANSFORMERS_MIN) is None
    assert schema_bam.transformers_problem("4.57.5") is not None
    assert schema_bam.transformers_problem("4.9.0") is not None and schema_bam.transformers_problem("10.0") is None


# ---- Mixtral --------------------------------------------------------------------------------------------
def test_mixtral_cached_and_uncached_generation_equal_the_runtime(mixtral):
    model, _, hf = mixtral
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(8))
    cached, uncached = _greedy_both_ways(hf, prompt, 6, pad_token_id=0)
    expected = runtime_greedy(model, prompt, 6)
    assert torch.equal(cached, expected) and torch.equal(uncached, expected)


def test_mixtral_left_padded_batch_equals_each_prompt_alone(mixtral):
    model, _, hf = mixtral
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, model.config.vocab_size, (1, n), generator=gen) for n in (4, 9)]
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits
    width = ids.shape[1]
    for row, p in enumerate(prompts):
        with torch.no_grad():
            assert (logits[row, width - p.shape[1]:] - model(p).logits[0]).abs().max().item() <= TOL
    _each_row_decodes_as_its_prompt_alone(model, hf, ids, mask, prompts)


def test_mixtral_save_pretrained_round_trip(mixtral, tmp_path):
    _, _, hf = mixtral
    hf.save_pretrained(tmp_path / "resaved")
    again = hf_mixtral(tmp_path / "resaved")
    theirs, ours = again.state_dict(), hf.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    x = torch.randint(0, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        # the same weights; the logits agree to float rounding (bit-equal at 5.x, 2.4e-7 apart at 4.57.6)
        assert (again(x).logits - hf(x).logits).abs().max().item() <= 1e-5
