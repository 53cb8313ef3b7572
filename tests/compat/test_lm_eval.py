"""lm-evaluation-harness end to end on an HF BAM export, in the transformers lm-eval installs with.

Run by `make test-compat` in the venv of the newest transformers of the declared range, where lm_eval is
installed (requirements-compat-lm-eval.txt); there BAM_COMPAT_STAGE=1 makes a missing lm_eval a failure, not
a skip. Checked: HFLM's three request types against what the model computes directly (loglikelihood and
loglikelihood_rolling against transformers' own forward pass, generate_until against runtime.generate greedy,
with prompts of different lengths batched, so left-padded), and simple_evaluate on a local multiple-choice
task (a JSON file this test writes; no network), whose accuracy equals the one computed here from the logits.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("BAM_COMPAT_STAGE") != "1":
    pytest.importorskip("lm_eval")
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from bam_surgery.converters.hf_bam import export_hf_bam  # noqa: E402
from bam_surgery.runtime import generate, save_model  # noqa: E402
from bam_surgery.runtime.checkpoint import CheckpointReader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "converters"))  # test_hf_bam_export's folder
from test_hf_bam_export import V, load_hf, random_model, save_word_tokenizer  # noqa: E402

EOS = 2


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def export(tmp_path_factory, hf_modules):
    root = tmp_path_factory.mktemp("lm_eval")
    save_word_tokenizer(root / "tok")
    model = random_model("bam_shared_kv", seed=5)
    save_model(model, root / "canonical.safetensors")
    with CheckpointReader(root / "canonical.safetensors") as reader:
        out = export_hf_bam(reader, root / "hf", tokenizer_files=sorted((root / "tok").iterdir()),
                            generation={"eos_token_id": EOS, "pad_token_id": 1})
    lm = HFLM(pretrained=str(out), trust_remote_code=True, dtype="float32", device="cpu", batch_size=2)
    return model, out, load_hf(out), lm, root


def _logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from transformers' forward pass of the export."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_is_what_transformers_computes(export):
    _, _, hf, lm, _ = export
    cases = [([5, 9, 12], [40, 7]), ([33, 4, 18, 22, 61, 3], [11]), ([8], [50, 51, 52])]
    requests = [Instance("loglikelihood", {}, (words(c), " " + words(k)), i) for i, (c, k) in enumerate(cases)]
    got = lm.loglikelihood(requests)
    for (ctx, cont), (ll, greedy) in zip(cases, got):
        lp = _logprobs(hf, ctx + cont)[len(ctx) - 1:]
        assert abs(ll - lp.sum().item()) <= 1e-4
        with torch.no_grad():
            argmax = hf(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].argmax(-1).tolist()
        assert greedy == (argmax == cont)


def test_loglikelihood_rolling_is_what_transformers_computes(export):
    _, _, hf, lm, _ = export
    texts = [[5, 9, 12, 40, 7, 3, 3], [17, 23]]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (words(t),), i)
                                    for i, t in enumerate(texts)])
    for ids, ll in zip(texts, got):
        expected = _logprobs(hf, [EOS] + ids).sum().item()  # rolling windows start from the eot token
        assert abs(ll - expected) <= 1e-4


def test_generate_until_equals_runtime_greedy(export):
    model, _, _, lm, _ = export
    prompts = [[5, 9, 12, 40], [33, 4, 18, 22, 61, 3, 8, 8, 9], [7]]  # batched by two: left-padded
    requests = [Instance("generate_until", {}, (words(p), {"until": ["</s>"], "max_gen_toks": 6, "do_sample": False}), i)
                for i, p in enumerate(prompts)]
    got = lm.generate_until(requests)
    for p, text in zip(prompts, got):
        new = generate(model, torch.tensor([p]), max_new_tokens=6)[0].tolist()
        if EOS in new:  # lm-eval stops at the until string, the eos token's text
            new = new[: new.index(EOS)]
        assert text.split() == [f"w{i}" for i in new], (p, text, new)


def test_simple_evaluate_runs_a_local_task(export):
    _, _, hf, lm, root = export
    gen = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(12):
        ctx = torch.randint(3, V, (5,), generator=gen).tolist()
        choices = [torch.randint(3, V, (2,), generator=gen).tolist() for _ in range(3)]
        docs.append({"context": words(ctx), "choices": [words(c) for c in choices], "label": 0,
                     "ids": ctx, "choice_ids": choices})
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "bam_tiny_mc.yaml").write_text(
        "task: bam_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {root / 'datasets'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "target_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n")
    results = lm_eval.simple_evaluate(model=lm, tasks=["bam_tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
                                      bootstrap_iters=0, log_samples=False)
    acc = results["results"]["bam_tiny_mc"]["acc,none"]
    right = 0
    for d in docs:
        scores = [_logprobs(hf, d["ids"] + c)[len(d["ids"]) - 1:].sum().item() for c in d["choice_ids"]]
        right += max(range(3), key=scores.__getitem__) == d["label"]
    assert acc == pytest.approx(right / len(docs))
