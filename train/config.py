"""One dataclass, `TrainConfig`, for every knob of a training run; YAML in, resolved YAML out.

    cfg = TrainConfig.from_yaml("train.yaml", overrides={"steps": 200})
    cfg = TrainConfig(init="mix.safetensors", data="code=data/code:0.5,law=data/law:0.5", out="run")

Each field carries its help sentence (field metadata "help"): the CLI builds its flags from them
and docs/training.md documents every one (a test keeps the two in step). Fields left None are
resolved when the run starts (from the model config and the world size) and written resolved to
RUN/config.yaml, which `--resume` reads back.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from bam_surgery.converters.yamlfile import read_yaml, shown
from bam_surgery.runtime.config import PRESETS, preset_trainable
from bam_surgery.runtime.errors import printable

from .errors import TrainError

Schedule = Literal["cosine", "constant"]
Precision = Literal["auto", "fp32", "bf16"]
Device = Literal["auto", "cpu", "cuda"]
Strategy = Literal["ddp", "fsdp"]
StateDtype = Literal["fp32", "bf16"]
Compile = Literal["auto", "on", "off"]
SCHEDULES, PRECISIONS = get_args(Schedule), get_args(Precision)
DEVICES, STRATEGIES = get_args(Device), get_args(Strategy)
STATE_DTYPES, COMPILES = get_args(StateDtype), get_args(Compile)
CHOICES = {"schedule": SCHEDULES, "precision": PRECISIONS, "device": DEVICES, "strategy": STRATEGIES,
           "optimizer_state": STATE_DTYPES, "compile": COMPILES}

# Fields that may change when a run is resumed: they do not change the numbers of the steps already
# taken (extending `steps` moves the cosine's end, which the user asks for by changing it; another
# strategy, device or process count keeps the global batch, batch_tokens).
RESUMABLE = ("steps", "save_every", "keep_last", "eval_every", "eval_tokens", "eval_batch", "progress", "plot",
             "peak_tflops", "token_cache", "strategy", "device", "activation_checkpointing", "compile",
             "final_optimizer_state")


def knob(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def knob_list(default: list[str], help: str) -> Any:
    return field(default_factory=lambda: list(default), metadata={"help": help})


@dataclass
class TrainConfig:
    # ---- where the model comes from ------------------------------------------------------
    init: str | None = knob(None, "Checkpoint to start from: any the tool reads (canonical, Hugging Face folder or hub "
                                  "id, GGUF, our exports) or a run folder (its latest checkpoint).")
    preset: str | None = knob(None, "Start from random weights with this preset's architecture (tiny, paper-small, "
                                    "paper-large) instead of --init.")
    model_config: str | None = knob(None, "Start from random weights with the ModelConfig in this JSON or YAML file "
                                          "instead of --init.")
    init_std: float = knob(0.02, "Standard deviation of the random init (normal) of matrices, for --preset and "
                                 "--model-config.")
    # ---- data ----------------------------------------------------------------------------
    data: str = knob("", "Training data: comma-separated domains NAME=SOURCE[:WEIGHT] (see docs/training.md); "
                         "weights are normalized, default equal.")
    eval_data: str | None = knob(None, "Held-out data for the periodic evaluation, same syntax as --data. Default: "
                                       "the held-out split (val*) of each training source that has one.")
    text_field: str = knob("text", "Field (JSONL) or column (Parquet, datasets) that holds the document text.")
    tokenizer: str | None = knob(None, "Tokenizer: a tokenizer.json file, a directory holding one, or 'bytes' (the "
                                       "byte-level tokenizer). Default: the checkpoint's own, else bytes for "
                                       "vocabularies of at most 512 tokens.")
    eos_id: int | None = knob(None, "Token id put between documents. Default: the tokenizer's end-of-text token "
                                    "(<|endoftext|>, <|end_of_text|>, <eos> or </s>; an instruct model's declared "
                                    "eos is its chat end-of-turn, not used), else its declared eos (0 for bytes).")
    token_cache: str | None = knob(None, "Folder of the tokenized-data cache. Default: $BAM_SURGERY_CACHE/tokens, "
                                         "else ~/.cache/bam-surgery/tokens.")
    seq_len: int | None = knob(None, "Tokens per training sequence. Default: the model's max_positions.")
    # ---- batch ---------------------------------------------------------------------------
    micro_batch: int = knob(8, "Sequences per forward pass on each process.")
    batch_tokens: int | None = knob(None, "Tokens per optimizer step over all processes (the paper: 1M); reached "
                                          "by gradient accumulation. Default: one micro-batch per process.")
    # ---- optimization --------------------------------------------------------------------
    steps: int = knob(1000, "Optimizer steps to train for (the schedule ends here).")
    lr: float = knob(1.2e-4, "Peak learning rate (the paper, Appendix B.2: 1.2e-4).")
    min_lr_ratio: float = knob(0.1, "The cosine ends at this fraction of the peak (the paper: a tenth).")
    warmup_steps: int = knob(1500, "Linear warm-up from 0 to the peak over this many steps (the paper: 1500).")
    schedule: Schedule = knob("cosine", "After warm-up: cosine (decay to min_lr_ratio * lr at the last step) "
                                        "or constant.", choices=SCHEDULES)
    weight_decay: float = knob(0.1, "AdamW weight decay (the paper: 0.1); matrices only unless the two switches "
                                    "below say otherwise.")
    decay_embeddings: bool = knob(False, "Also decay the token and position embeddings.")
    decay_norms_and_biases: bool = knob(False, "Also decay norm weights and biases.")
    adam_beta1: float = knob(0.9, "AdamW beta1.")
    adam_beta2: float = knob(0.95, "AdamW beta2.")
    adam_eps: float = knob(1e-8, "AdamW epsilon.")
    grad_clip: float = knob(1.0, "Clip the global gradient norm to this value (0: no clipping).")
    optimizer_state: StateDtype = knob("fp32", "AdamW's two moments per trainable parameter in fp32 (8 bytes) or "
                                               "bf16 (4 bytes; the update is still computed in fp32 and the moments "
                                               "rounded stochastically: loss curves within 2% of fp32's, "
                                               "docs/training.md).", choices=STATE_DTYPES)
    lb_coef: float | None = knob(None, "alpha, the load-balancing loss weight (default: the model config's, "
                                       "0.01 for merges).")
    z_coef: float | None = knob(None, "beta, the router z-loss weight (default: the model config's, 0.001 for "
                                      "merges).")
    trainable: list[str] = knob_list(["*"], "Which parameters train: patterns over canonical names (fnmatch) or "
                                            "group names (routers, ffn_experts, attention_experts, attention, ffn, "
                                            "embeddings, norms), applied in order; a leading ! freezes. Default: every "
                                            "parameter, or with --preset the preset's own patterns (some-64 ... "
                                            "freeze their experts).")
    # ---- hardware ------------------------------------------------------------------------
    precision: Precision = knob("auto", "auto: bf16 autocast on CUDA, fp32 on CPU; fp32; bf16 (autocast, fp32 "
                                        "weights and optimizer).", choices=PRECISIONS)
    device: Device = knob("auto", "auto (CUDA when available), cpu or cuda.", choices=DEVICES)
    strategy: Strategy = knob("ddp", "Under torchrun: ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard "
                                      "per block).", choices=STRATEGIES)
    peak_tflops: float | None = knob(None, "Peak TFLOP/s of one device for the MFU estimate. Default: known GPUs "
                                           "in bf16 (H100, H200, A100, ...); none on CPU.")
    compile: Compile = knob("auto", "torch.compile each block of the model (compiled once, used by every layer): "
                                    "auto: on CUDA; on; off.", choices=COMPILES)
    activation_checkpointing: bool = knob(False, "Keep only each block's input during the forward pass and run the "
                                                 "block again in the backward pass: activation memory falls to one "
                                                 "block's, for about a third more compute; the same loss and "
                                                 "gradients.")
    # ---- the run -------------------------------------------------------------------------
    out: str = knob("", "Run folder: checkpoints, metrics.jsonl, config.yaml, plots. Must not exist unless "
                        "--resume.")
    seed: int = knob(0, "Seed of the random init, the domain sampling and the sequence order.")
    save_every: int = knob(1000, "Write a checkpoint every N steps (0: only at the end).")
    keep_last: int = knob(3, "Keep the newest K checkpoints (the final one is always kept).")
    final_optimizer_state: bool = knob(True, "Write the optimizer state into the final checkpoint too (needed to "
                                             "train the run further with --resume --steps N; with fp32 state it is "
                                             "twice the size of the weights).")
    eval_every: int = knob(0, "Evaluate on the held-out data every N steps (0: only at the end; -1: never).")
    eval_tokens: int = knob(262144, "Held-out tokens evaluated per domain (0: all).")
    eval_batch: int | None = knob(None, "Sequences per forward pass when evaluating. Default: micro_batch.")
    progress: bool = knob(True, "Show a progress bar (step, loss, tokens/s) on a terminal.")
    plot: bool = knob(True, "Draw the loss, learning-rate and eval curves (PNG) into the run folder at the end.")

    def __post_init__(self) -> None:
        self.check_types()

    # -- validation ------------------------------------------------------------------------
    def check_types(self, where: str = "config") -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            annotation = "str" if f.name in CHOICES else str(f.type)  # a Literal alias: a string from its table
            if not _type_ok(annotation, v):
                raise TrainError(f"{where}: {f.name}: expected {annotation}, got {shown(v)}")
            if f.name in CHOICES and v not in CHOICES[f.name]:
                raise TrainError(f"{where}: {f.name}: {shown(v)} is not one of {', '.join(CHOICES[f.name])}")

    def validate(self) -> None:
        """Value checks that do not need the model (the run calls it before reading anything)."""
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise TrainError(f"{name}: {msg}")

        sources = [n for n in ("init", "preset", "model_config") if getattr(self, n)]
        need(len(sources) == 1, "init", "give exactly one of --init CKPT, --preset NAME, --model-config FILE"
             + (f" (got {', '.join('--' + s.replace('_', '-') for s in sources)})" if sources else ""))
        need(bool(self.data.strip()), "data", "no training data: give --data NAME=SOURCE[:WEIGHT],...")
        need(bool(self.out), "out", "no run folder: give --out RUN")
        for name in ("micro_batch", "steps"):
            need(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("seq_len", "batch_tokens", "eval_batch"):
            v = getattr(self, name)
            need(v is None or v > 0, name, f"must be > 0, got {v}")
        for name in ("warmup_steps", "save_every", "eval_tokens"):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(self.eval_every >= -1, "eval_every", f"must be >= -1 (-1: never), got {self.eval_every}")
        need(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")
        need(math.isfinite(self.lr) and self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        need(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam_beta1/adam_beta2", "must be in [0, 1)")
        need(self.adam_eps > 0, "adam_eps", "must be > 0")
        need(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        for name in ("lb_coef", "z_coef"):
            v = getattr(self, name)
            need(v is None or v >= 0, name, f"must be >= 0, got {v}")
        need(self.init_std > 0, "init_std", "must be > 0")
        need(0 <= self.seed <= MAX_SEED, "seed", f"must be an integer from 0 to {MAX_SEED}, got {self.seed}")
        self._check_bounds(need)
        need(bool(self.trainable), "trainable", "no patterns: give at least one (e.g. '*')")
        need(self.peak_tflops is None or self.peak_tflops > 0, "peak_tflops", "must be > 0")

    def _check_bounds(self, need) -> None:
        """Every number knob finite and within MAX_KNOB (or its own bound in KNOB_BOUNDS), checked before any work:
        --lr 1e300 overflowed inside torch, --z-coef inf trained to a NaN loss, a huge --batch-tokens ran out of
        memory after two minutes."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            bound = KNOB_BOUNDS.get(f.name, MAX_KNOB)
            need(math.isfinite(v) and abs(v) <= bound, f.name, f"must be finite and at most {bound:,}, got {v}")

    # -- (de)serialization -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "TrainConfig":
        if not isinstance(d, dict):
            raise TrainError(f"{where}: expected a mapping of training knobs, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                name = printable(str(key)[:80])  # a key read from a file: shown cut short
                close = difflib.get_close_matches(name.replace("-", "_"), known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else " (docs/training.md lists every knob)"
                raise TrainError(f"{where}: {name}: unknown training knob{hint}")
        d = dict(d)
        if isinstance(d.get("trainable"), str):
            d["trainable"] = split_patterns(d["trainable"])
        elif d.get("trainable") is None and isinstance(d.get("preset"), str) and d["preset"] in PRESETS:
            # not given: the preset's own patterns (the SoME presets freeze their experts)
            d["trainable"] = preset_trainable(d["preset"])
        for f in dataclasses.fields(cls):
            v = d.get(f.name)
            if str(f.type).startswith("float") and not isinstance(v, bool):
                if isinstance(v, int):
                    d[f.name] = float(v)
                elif isinstance(v, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
                    try:
                        d[f.name] = float(v)
                    except ValueError:
                        pass
        try:
            cfg = cls(**d)
        except TrainError as e:
            raise TrainError(f"{where}: {str(e).removeprefix('config: ')}") from None
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        path = Path(path)
        try:
            body = read_yaml(path, error=TrainError)  # bounded: converters/yamlfile.py
        except FileNotFoundError:
            raise TrainError(f"{path}: config file not found") from None
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise TrainError(f"{path}: expected a mapping of training knobs, got {type(body).__name__}")
        return cls.from_dict({**body, **(overrides or {})}, where=str(path))


MAX_SEED = 2**63 - 1  # what torch and numpy both take
MAX_KNOB = 2**53  # any number knob: past it a float loses whole numbers (and no run needs one)
# own bounds; micro_batch and eval_batch are checked against the memory instead (runtime/memory.py:check_fits)
KNOB_BOUNDS = {"lr": 10.0, "batch_tokens": 1 << 31, "seq_len": 1 << 24,
               "lb_coef": 1e6, "z_coef": 1e6, "init_std": 1e3, "adam_eps": 1.0, "grad_clip": 1e12,
               "weight_decay": 1e3, "peak_tflops": 1e9}


def split_patterns(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _type_ok(annotation: str, value: Any) -> bool:
    checks = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "None": lambda v: v is None,
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    }
    return any(checks[t.strip()](value) for t in annotation.split("|"))


def knob_help() -> dict[str, str]:
    """Field name -> help sentence, for the CLI and the docs check."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
