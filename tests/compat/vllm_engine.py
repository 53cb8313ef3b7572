"""One process, one vLLM engine at a time, several models in sequence: `python vllm_engine.py JOBS.json OUT.json`.

vLLM's start-up on a CPU is mostly the import of vllm and the first engine's set-up; the engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so each further model costs only its own loading and KV cache. JOBS.json
is a list of {"name", "dir", "max_model_len", "new", "prompts": [token ids, ...], "text": a text prompt or null,
optionally "tensor_parallel_size" (its ranks in worker processes, each bound to its share of the cores)};
OUT.json gets, per name, the greedy tokens and each chosen token's logprob of every prompt (all prompts batched in
one generate call), the text prompt's tokens, the engine's start-up and generation seconds, or the error's first
line when the engine refused the model. Used by tests/compat/test_vllm.py; the __main__ guard is vLLM's CPU rule.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time


def serve(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    tp = job.get("tensor_parallel_size", 1)
    parallel = {}
    if tp > 1:  # one worker process per rank, each bound to its share of this process's cores
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cores[r * len(cores) // tp:(r + 1) * len(cores) // tp])) for r in range(tp))
        parallel = dict(tensor_parallel_size=tp, distributed_executor_backend="mp")
    llm = LLM(job["dir"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"], seed=0,
              skip_tokenizer_init=job.get("text") is None, max_num_seqs=8, disable_log_stats=True, **parallel)
    ready = time.monotonic()
    params = SamplingParams(temperature=0, max_tokens=job["new"], logprobs=0, ignore_eos=True,
                            detokenize=job.get("text") is not None, skip_special_tokens=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    out = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
           "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                        for o in outputs]}
    if job.get("text") is not None:
        text = llm.generate([job["text"]], params, use_tqdm=False)[0].outputs[0]
        out |= {"text_tokens": list(text.token_ids), "text": text.text}
    out |= {"start_s": round(ready - started, 1), "generate_s": round(time.monotonic() - ready, 1)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return out


def main(jobs_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    jobs, results = json.loads(open(jobs_path).read()), {}
    for job in jobs:
        try:
            results[job["name"]] = serve(job)
        except Exception as e:  # the engine's refusal, reported per model; the next model still runs
            results[job["name"]] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(job["name"], json.dumps(results[job["name"]])[:300], flush=True)
        with open(out_path, "w") as f:  # after every model: a crash still leaves the results so far
            json.dump(results, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(*sys.argv[1:])
