"""The training run: set-up, the step loop, evaluation and checkpoints, top to bottom.

    from bam_surgery.train import TrainConfig, train
    result = train(TrainConfig(init="mix.safetensors", data="code=data/domains/code,law=data/domains/law",
                               out="run", steps=200, warmup_steps=20, lr=3e-4))

One optimizer step: the learning rate of update n (optim.lr_at); the step's G global sequences
(packing.MixtureSampler); on each process its micro-batches, each a forward pass with targets and
loss = NLL + alpha * L_LB + beta * L_z (the model's terms, summed over routers), backward of
loss / accumulation, gradients synchronized on the last micro-batch only; the global gradient norm
clipped; AdamW; then model.after_step(): routers whose state moves by rules (key stores) update it from
the step's routing, summed over every micro-batch and process (runtime/key_store.py). Every step writes a
metrics line; evaluation and checkpoints at their intervals
and at the end.

torch's global generator is forked for the run (the caller's state comes back afterwards) and seeded from
cfg.seed, so a run's draws from it, and the state each checkpoint saves, depend on its config alone; resume
restores the saved state.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import tqdm  # called as tqdm.tqdm, so that tests can replace the bar class

from bam_surgery import __version__
from bam_surgery.converters import open_checkpoint
from bam_surgery.converters.yamlfile import read_yaml
from bam_surgery.runtime import CheckpointReader, Model, ModelConfig, check_layout, preset
from bam_surgery.runtime.atomic import (DISCARDED, EXCHANGING, LOCK, PARTIAL_SUFFIX, REPLACED, remove_created_folders,
                                        write_text_atomic)
from bam_surgery.runtime.config import PRESETS, ConfigError
from bam_surgery.runtime.errors import OutputError
from bam_surgery.runtime.locks import lock_file, unlock_file
from bam_surgery.runtime.jsonfile import read_json
from bam_surgery.runtime.layout import tensor_shapes

from . import distributed as dist_
from .card import model_card
from .checkpoints import (CHECKPOINTS, TRAINER_FILE, latest_checkpoint, prune_checkpoints, read_run_checkpoint,
                          read_run_info, resolve_checkpoint, save_run_checkpoint, step_dir_name)
from .config import RESUMABLE, TrainConfig
from .data import Domain, file_sha256, has_split, open_source, parse_data_spec
from .errors import TrainError
from .evaluation import evaluate_streams, reduce_routing
from .host_memory import keep_freed_pages
from .memory import available_memory, check_training_memory, estimate_training_memory, resident_bytes
from .metrics import MetricsWriter, RoutingAccumulator, entropy_bits, flops_per_token, peak_flops, truncate_metrics
from .optim import apply_trainable, build_optimizer, compile_blocks, lr_at, select_trainable, set_lr
from .packing import MixtureSampler, micro_batches
from .plot import PLOTS, plot_files, plot_run
from .progress import ProgressLines
from .provenance import PROVENANCE_KEY, TOKENIZER_KEY, chain, dumps, expert_names, read_provenance
from .tokenize import BYTES, MODEL_SIDE_FILES, resolve_tokenizer, token_cache_folder, token_cache_note, tokenize_source

Log = Callable[[str], None]
RUN_LOCK = ".bam-surgery.lock"  # RUN/.bam-surgery.lock: held by the run writing RUN (runtime/locks.py)
START_FILES = ("config.yaml", "run.json", "metrics.jsonl")  # what a fresh run writes before its first checkpoint


@dataclass
class TrainResult:
    run: Path
    steps: int
    tokens: int
    checkpoint: Path | None  # the final checkpoint
    loss: float | None  # the last step's training loss
    eval: dict[str, Any] | None  # the last evaluation ({"step", "domains": {...}})


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(cfg: TrainConfig, resume: bool = False, log: Log | None = None) -> TrainResult:
    """Run (or, with resume=True, continue) the training run cfg.out. Under torchrun every process
    calls this with the same config."""
    log = log or _stderr
    d = dist_.setup(cfg.device, cfg.strategy)
    try:
        with _run_lock(Path(cfg.out), resume, d), _forked_rng(d.device):
            result = _Run(cfg, resume, d, log if d.is_main else (lambda _m: None)).run()
        # every rank tears its process group down together, after rank 0 has written and unlocked: a rank that
        # leaves while another still finishes made gloo abort the other once ("terminate called without an
        # active exception", FSDP on a loaded machine)
        dist_.barrier(d)
        return result
    finally:
        dist_.teardown(d)


@contextmanager
def _run_lock(run: Path, resume: bool, d: dist_.Dist):
    """Hold RUN's lock for the whole run (rank 0 holds it for every process): a second train into the same
    --out, fresh or --resume, fails at once in one line. A fresh run creates RUN (and missing parents) to
    hold it, and removes them again if it fails before writing anything there."""
    held: list[tuple[int, list[Path]]] = []

    def acquire() -> None:
        if run.exists() and not run.is_dir() or resume and not run.is_dir():
            return  # nothing to lock: the run refuses this --out itself
        created = [p for p in (run, *run.parents) if not p.exists()]
        try:
            run.mkdir(parents=True, exist_ok=True)
            held.append((lock_file(run / RUN_LOCK, run), created))
        except (OSError, OutputError) as e:
            remove_created_folders(created)
            raise TrainError(f"--out {str(e) if isinstance(e, OutputError) else f'{run}: {e.strerror}'}") from None

    dist_.on_main(d, acquire)
    try:
        yield
    finally:
        for fd, created in held:
            unlock_file(fd, run / RUN_LOCK)
            remove_created_folders(created)


def killed_start(run: Path) -> list[Path] | None:
    """What a fresh run stopped (kill -9) before its first checkpoint left in RUN, to remove: its START_FILES
    (and write_text_atomic's `.NAME.*.partial` files), a first checkpoint's work folder in checkpoints/; None
    unless RUN holds nothing else (beside its lock and checkpoints/), as real files, no checkpoint, and a
    run.json of this tool. Never anything the tool did not write."""
    if run.is_symlink() or not (run / "run.json").is_file() or (run / "run.json").is_symlink():
        return None
    try:
        info = read_json(run / "run.json", expect=dict, error=TrainError)
    except TrainError:
        return None
    if not isinstance(info.get("tool"), dict) or info["tool"].get("name") != "bam-surgery":
        return None
    left: list[Path] = []
    for p in run.iterdir():
        if p.name == RUN_LOCK:
            continue
        if p.name == CHECKPOINTS and p.is_dir() and not p.is_symlink():
            for c in p.iterdir():  # only a first checkpoint's work folder (runtime/atomic.py), no checkpoint
                if not (c.is_dir() and not c.is_symlink() and c.name.startswith(".step-")
                        and c.name.endswith(PARTIAL_SUFFIX)):
                    return None
                if any(n not in (LOCK, c.name[1:-len(PARTIAL_SUFFIX)], REPLACED, DISCARDED, EXCHANGING)
                       for n in os.listdir(c)):
                    return None
                left.append(c)
            continue
        partial = any(p.name.startswith(f".{n}.") and p.name.endswith(".partial") for n in START_FILES)
        if p.is_symlink() or not p.is_file() or not (p.name in START_FILES or partial):
            return None
        left.append(p)
    return left


def _forked_rng(device: torch.device):
    """The run seeds torch's global generator (CPU, and its own CUDA device); the caller's states are
    restored when it ends."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.random.fork_rng(devices=[index], device_type="cuda")
    return torch.random.fork_rng(devices=[])


def load_run_config(run: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """RUN/config.yaml with overrides; only the RESUMABLE knobs may differ from the saved run."""
    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise TrainError(f"{run}: not a run folder (no config.yaml); nothing to resume")
    saved = TrainConfig.from_yaml(path)
    changes = {k: v for k, v in (overrides or {}).items() if v != getattr(saved, k)}
    bad = [k for k in changes if k not in RESUMABLE and k != "out"]
    if bad:
        raise TrainError(f"--resume: {bad[0]} differs from the run's ({getattr(saved, bad[0])!r} in {path}, "
                         f"{changes[bad[0]]!r} given); a resumed run keeps its settings except "
                         f"{', '.join(RESUMABLE)}")
    return saved.replace(**changes)


class _Run:
    """One training run's state; `run()` is the whole of it, in order."""

    def __init__(self, cfg: TrainConfig, resume: bool, d: dist_.Dist, log: Log):
        self.cfg, self.resume, self.d, self._out = cfg, resume, d, log
        self.dir = Path(cfg.out)
        self._held: list[str] | None = []  # set-up messages wait until set-up succeeded

    def log(self, msg: str) -> None:
        """Messages of the set-up are printed once it has succeeded, so bad input shows one error line."""
        if self._held is None:
            self._out(msg)
        else:
            self._held.append(msg)

    def _release_log(self) -> None:
        held, self._held = self._held or [], None
        for msg in held:
            self._out(msg)

    # ---- set-up -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg = self.cfg
        cfg.validate()
        torch.manual_seed(cfg.seed)  # inside train's fork; a resumed run sets the saved state later
        if self.resume:
            self._check_resume_config()
            self._load_resume_point()
        else:
            self._check_fresh_out()
            self._load_init()
        if self.cfg.plot:  # the end-of-training plot's rule, checked before any compute is spent
            plot_files(self.dir, list(PLOTS), "--plot", "move it, or pass --no-plot (nothing was changed)")
        self._setup_tokenizer()
        self._setup_model()
        self._setup_data()
        self._setup_batching()
        try:
            if not self.resume:
                dist_.on_main(self.d, self._create_run_folder)
            self._setup_optimizer()
            if self.resume:
                self._restore_trainer_state()
            self._release_log()
            return self._loop()
        except BaseException:
            if not self.resume and self.d.is_main:
                self._remove_unresumable_start()
            raise

    def _check_resume_config(self) -> None:
        """The saved config, with the given one's RESUMABLE changes; knobs left None or at their
        default take the saved (resolved) value; any other difference is an error."""
        defaults = TrainConfig().to_dict()
        given = {k: v for k, v in self.cfg.to_dict().items() if v is not None and v != defaults[k] and k != "out"}
        self.cfg = load_run_config(self.dir, given).replace(out=self.cfg.out)

    def _check_fresh_out(self) -> None:
        if self.dir.exists() and self.dir.is_dir() and killed_start(self.dir) is not None:
            dist_.on_main(self.d, self._settle_killed_start)
        if self.dir.exists() and (not self.dir.is_dir() or any(p.name != RUN_LOCK for p in self.dir.iterdir())):
            what = "run folder" if (self.dir / "config.yaml").is_file() else "path"
            raise TrainError(f"--out {self.dir}: {what} exists; pass --resume to continue that run, or choose "
                             "a new --out (nothing was changed)")
        dist_.barrier(self.d)  # every process checked before rank 0 creates the folder

    def _settle_killed_start(self) -> None:
        """Remove what a fresh run killed before its first checkpoint left in RUN (killed_start): the files it
        wrote, nothing else (this run holds RUN's lock, so that run is dead)."""
        left = killed_start(self.dir) or []
        for p in left:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        remove_created_folders([self.dir / CHECKPOINTS])
        self.log(f"note: removed {', '.join(p.name for p in left)} from {self.dir}, left by a run stopped before "
                 "its first checkpoint; starting it again")

    def _load_resume_point(self) -> None:
        ckpt = latest_checkpoint(self.dir)
        if ckpt is None and killed_start(self.dir) is not None:
            raise TrainError(f"--resume: {self.dir} has no checkpoint yet (its run stopped before the first one), so "
                             f"there is nothing to resume; run the same command without --resume, with --out "
                             f"{self.dir}: it removes what that run left there and starts again")
        if ckpt is None:
            raise TrainError(f"--resume: {self.dir} has no checkpoint yet; start it again without --resume "
                             "in a new --out")
        self.resume_dir = ckpt
        (self.state, self.model_config, meta, self.trainer_tensors,
         self.trainer_meta) = read_run_checkpoint(ckpt)
        done = self.trainer_meta.get("step")
        if isinstance(done, int) and done >= self.cfg.steps:
            raise TrainError(f"--resume: {self.dir} has finished its {self.cfg.steps} steps ({ckpt.name}); pass "
                             f"--steps N with N > {done} to train it further")
        self.run_info = read_run_info(self.dir / "run.json")
        self.provenance_in = self.run_info["init"].get("provenance")
        self.experts = self.run_info["experts"]
        with CheckpointReader(ckpt) as reader:  # for the tokenizer the checkpoint carries
            self.init_reader = reader

    def _load_init(self) -> None:
        cfg = self.cfg
        self.init_reader = None
        if cfg.init:
            spec = resolve_checkpoint(cfg.init)
            with open_checkpoint(spec) as reader:
                if isinstance(reader, CheckpointReader):
                    check_layout(reader)
                self.model_config = reader.config
                self.state = {n: reader.get(n) for n in reader.names()}
                self.init_desc = {"spec": cfg.init, "resolved": spec, "files": [
                    {"name": Path(f).name, "sha256": file_sha256(Path(f))} for f in reader.files()]}
                self.provenance_in = read_provenance(reader.metadata)
            self.init_reader = reader  # closed; still tells where its tokenizer is
        else:
            if cfg.preset:
                if cfg.preset not in PRESETS:
                    raise TrainError(f"--preset {cfg.preset}: unknown preset; choose one of {', '.join(PRESETS)}")
                self.model_config = preset(cfg.preset)
                self.init_desc = {"spec": f"preset:{cfg.preset}", "random_init": {"std": cfg.init_std,
                                                                                  "seed": cfg.seed}}
            else:
                self.model_config = _read_model_config(Path(cfg.model_config))
                self.init_desc = {"spec": f"config:{cfg.model_config}", "config": self.model_config.to_dict(),
                                  "random_init": {"std": cfg.init_std, "seed": cfg.seed}}
            self.state = None
            self.provenance_in = None
        self.experts = expert_names(self.provenance_in, self.model_config)

    def _setup_tokenizer(self) -> None:
        cfg = self.cfg
        # a resumed run keeps the document separator it started with (run.json), whatever rule chose it
        kept = self.run_info["tokenizer"].get("eos_id") if self.resume and cfg.eos_id is None else None
        self.tok = resolve_tokenizer(cfg.tokenizer, self.init_reader, self.model_config.vocab_size,
                                     cfg.eos_id if kept is None else kept)
        if kept is not None:
            self.tok.eos_reason = self.run_info["tokenizer"].get("eos_reason") or f"id {kept}: the run's own"
        # each checkpoint carries the tokenizer's files, and the init checkpoint's chat template and generation
        # config where the tokenizer's folder has none (the byte tokenizer, --tokenizer from elsewhere)
        names = {f.name for f in self.tok.files}
        own = self.init_reader.tokenizer_files() if self.init_reader is not None else []
        self.carried = [*self.tok.files, *(f for f in own if f.name in MODEL_SIDE_FILES and f.name not in names)]
        if self.resume and self.tok.fingerprint != self.run_info["tokenizer"]["fingerprint"]:
            raise TrainError(f"--resume: the tokenizer ({self.tok.name}) is not the one the run used "
                             f"({self.run_info['tokenizer']['name']})")

    def _setup_model(self) -> None:
        cfg, mcfg = self.cfg, self.model_config
        self.seq_len = cfg.seq_len or mcfg.max_positions
        if self.seq_len > mcfg.max_positions:
            raise TrainError(f"seq_len {self.seq_len} exceeds the model's max_positions ({mcfg.max_positions})")
        self.alpha = mcfg.lb_coef if cfg.lb_coef is None else cfg.lb_coef
        self.beta = mcfg.z_coef if cfg.z_coef is None else cfg.z_coef
        self._plan_memory()
        if self.state is None:
            model = Model(mcfg)
            model.reset_parameters(std=cfg.init_std, seed=cfg.seed)
        else:
            with torch.device("meta"):
                model = Model(mcfg)
            try:
                model.load_state_dict(self.state, assign=True)
            except RuntimeError as e:
                raise TrainError(f"{cfg.init}: its tensors do not fit its config "
                                 f"({' '.join(str(e).split())[:300]})") from None
            self.state = None
        if self.d.device.type == "cpu":  # a step's large tensors reuse the last step's pages (train/host_memory.py)
            keep_freed_pages()
        # fp32 master weights (and optimizer state) whatever the checkpoint's dtype; autocast does bf16
        self.model = model.float().to(self.d.device).train()
        self.model.activation_checkpointing = cfg.activation_checkpointing
        # one process, a tied head: the input embeddings' gradient added into the head's row by row (blocks.py)
        self.model.embedding_grad_rows = mcfg.tie_embeddings and self.d.world == 1
        self.trainable = apply_trainable(self.model, cfg.trainable)

    def _plan_memory(self) -> None:
        """The estimated peak (train/memory.py), logged before the first step; a run that cannot fit in the
        memory available is refused now, naming the option that fits, instead of being killed mid-step."""
        cfg, mcfg, d = self.cfg, self.model_config, self.d
        names = list(tensor_shapes(mcfg))
        trainable = select_trainable(names, cfg.trainable)
        bf16 = self._precision() == "bf16"
        held = sum(t.numel() * t.element_size() for t in self.state.values()) if self.state else 0
        process = max(0, resident_bytes() - held) if d.device.type == "cpu" else 0
        batch_tokens = cfg.batch_tokens or cfg.micro_batch * self.seq_len * d.world

        def plan_for(changes: dict):
            c = cfg.replace(**changes)
            return estimate_training_memory(mcfg, micro_batch=c.micro_batch, seq_len=self.seq_len,
                                            trainable=trainable, bf16=bf16, optimizer_state=c.optimizer_state,
                                            checkpointing=c.activation_checkpointing, device=d.device,
                                            world=d.world, strategy=d.strategy, process=process)

        plan = plan_for({})
        available = available_memory(d.device)
        params = sum(math.prod(s) for s in tensor_shapes(mcfg).values())
        check_training_memory(plan, available, cfg.replace(batch_tokens=batch_tokens), plan_for,
                              f"training this model ({params:,} parameters) with micro_batch {cfg.micro_batch} x "
                              f"seq_len {self.seq_len}")
        self.memory_line = plan.line(available)  # logged with the first step's line

    def _precision(self) -> str:
        """bf16 (autocast over fp32 weights) or fp32: --precision, auto being bf16 on CUDA."""
        p = self.cfg.precision
        return "bf16" if p == "bf16" or (p == "auto" and self.d.device.type == "cuda") else "fp32"

    def _tokenized(self, domains: list[Domain], split: str) -> list:
        """Token files of each domain's split: rank 0 tokenizes (or finds the cache), then the others open them
        (each verifies the entry; a cache not trusted: each tokenizes its own private copy)."""
        cache = token_cache_folder(self.cfg.token_cache)
        sources = [open_source(dom, split, self.cfg.text_field) for dom in domains]
        mine: list = []  # rank 0's, kept rather than verified again

        def prepare() -> None:
            note = token_cache_note(cache)
            if note:
                self.log(f"note: {note}")
            for s in sources:
                mine.append(tf := tokenize_source(s, self.tok, cache))
                self.log(f"data: {s.describe()}: {len(tf):,} tokens, {tf.documents:,} documents")

        dist_.on_main(self.d, prepare)
        return sources, mine or [tokenize_source(s, self.tok, cache) for s in sources]

    def _setup_data(self) -> None:
        cfg = self.cfg
        self.domains = parse_data_spec(cfg.data)
        self.sources, files = self._tokenized(self.domains, "train")
        for dom, tf in zip(self.domains, files):
            if len(tf) <= self.seq_len:
                raise TrainError(f"--data {dom.name}={dom.source}: {len(tf)} tokens, fewer than one sequence of "
                                 f"seq_len + 1 = {self.seq_len + 1}")
        self.sampler = MixtureSampler([tf.tokens for tf in files], [dom.weight for dom in self.domains],
                                      self.seq_len, cfg.seed, self.tok.bos_id)
        if cfg.eval_every < 0:
            eval_domains = []
        elif cfg.eval_data:
            eval_domains = parse_data_spec(cfg.eval_data, "--eval-data")
        else:
            eval_domains = [dom for dom in self.domains if has_split(dom, "val")]
            skipped = [dom.name for dom in self.domains if dom not in eval_domains]
            if skipped:
                self.log(f"eval: no held-out split for {', '.join(skipped)} (give --eval-data to evaluate them)")
        self.eval_sources, eval_files = self._tokenized(eval_domains, "val") if eval_domains else ([], [])
        self.eval_streams = {dom.name: tf.tokens for dom, tf in zip(eval_domains, eval_files)}

    def _setup_batching(self) -> None:
        cfg, d = self.cfg, self.d
        per_micro = cfg.micro_batch * self.seq_len * d.world
        batch_tokens = cfg.batch_tokens or per_micro
        if batch_tokens % per_micro:
            raise TrainError(f"batch_tokens {batch_tokens} is not a multiple of micro_batch * seq_len * processes = "
                             f"{cfg.micro_batch} * {self.seq_len} * {d.world} = {per_micro}")
        self.accum = batch_tokens // per_micro
        self.global_seqs = self.accum * cfg.micro_batch * d.world
        self.tokens_per_step = self.global_seqs * self.seq_len
        self.cfg = cfg.replace(seq_len=self.seq_len, batch_tokens=batch_tokens, lb_coef=self.alpha, z_coef=self.beta)
        if self.cfg.warmup_steps > self.cfg.steps:
            self.log(f"note: warmup_steps {self.cfg.warmup_steps} > steps {self.cfg.steps}: the learning rate "
                     f"reaches {lr_at(self.cfg.steps, self.cfg):.3g}, never the peak {self.cfg.lr:.3g}")

    def _create_run_folder(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # run.json first: it is what marks the folder as this tool's, so a run killed before config.yaml lands
        # is still one the next train --out recognises and settles
        write_text_atomic(self.dir / "run.json", json.dumps(self._run_info(), indent=1, sort_keys=True))
        write_text_atomic(self.dir / "config.yaml", self.cfg.to_yaml())

    def _remove_unresumable_start(self) -> None:
        """A fresh run that fails (a full disk, an error, Ctrl-C) before its first checkpoint removes the files
        it wrote into RUN, which it found empty: with no checkpoint they cannot be resumed, and they would block
        the next `train --out` on the same path (RUN itself goes with the run's lock, _run_lock). Once a
        checkpoint exists RUN is kept, for --resume."""
        if latest_checkpoint(self.dir) is not None:
            return
        for name in START_FILES:
            try:
                (self.dir / name).unlink()
            except FileNotFoundError:
                pass
        remove_created_folders([self.dir / CHECKPOINTS])

    def _run_info(self) -> dict[str, Any]:
        def data(domains, sources):
            return [{"domain": dom.name, "source": dom.source, "weight": dom.weight, "split": s.split,
                     "files": s.hashes()} for dom, s in zip(domains, sources)]

        self.run_info = {
            "tool": {"name": "bam-surgery", "version": __version__},
            "init": {**self.init_desc, "provenance": self.provenance_in},
            "model": self.model_config.to_dict(),
            "experts": self.experts,
            "tokenizer": {"name": self.tok.name, "fingerprint": self.tok.fingerprint, "eos_id": self.tok.eos_id,
                          "eos_reason": self.tok.eos_reason, "vocab_size": self.tok.vocab_size},
            "data": data(self.domains, self.sources),
            "eval_data": data([Domain(s.name, s.spec, 0.0) for s in self.eval_sources], self.eval_sources),
            "seq_len": self.seq_len, "world_size": self.d.world, "strategy": self.d.strategy,
            "accumulation": self.accum, "tokens_per_step": self.tokens_per_step,
        }
        return self.run_info

    def _setup_optimizer(self) -> None:
        if self.cfg.compile == "on" or (self.cfg.compile == "auto" and self.d.device.type == "cuda"):
            compile_blocks(self.model)
        self.wrapped = dist_.wrap(self.model, self.d)
        # torch's fused AdamW, except over FSDP2's sharded parameters (DTensors)
        self.opt, self.opt_names = build_optimizer(self.model, self.cfg, fused=self.d.strategy != "fsdp"
                                                   or not self.d.active)
        self.start_step, self.tokens_seen, self.elapsed = 0, 0, 0.0

    def _restore_trainer_state(self) -> None:
        meta, tensors = self.trainer_meta, self.trainer_tensors
        where = self.resume_dir / TRAINER_FILE
        if meta.get("optimizer_params") != self.opt_names:
            raise TrainError(f"cannot resume from {self.resume_dir}: {where} holds optimizer state for other "
                             "parameters (were the trainable patterns changed?)")
        if meta.get("optimizer_state") == "not saved":
            raise TrainError(f"cannot resume from {self.resume_dir}: it was written without the optimizer state "
                             f"(final_optimizer_state false); start a new run from it with --init {self.resume_dir}")
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            if key.startswith("optim."):
                name, _, slot = key[len("optim."):].rpartition(".")
                state.setdefault(name, {})[slot] = t
        missing = [n for n in self.opt_names if n not in state and meta["step"] > 0]
        if missing:
            raise TrainError(f"cannot resume from {self.resume_dir}: {where} has no optimizer state for {missing[0]}")
        dist_.load_optimizer_state(self.model, self.opt, self.opt_names, state, self.d)
        self.sampler.load_state(meta["sampler"])
        if "rng.torch" in tensors:
            torch.set_rng_state(tensors["rng.torch"])
        self.start_step, self.tokens_seen, self.elapsed = meta["step"], meta["tokens"], meta.get("elapsed_s", 0.0)
        if self.d.is_main:
            truncate_metrics(self.dir / "metrics.jsonl", self.start_step)
        self.log(f"resuming {self.dir} at step {self.start_step} ({self.resume_dir.name})")

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self) -> TrainResult:
        cfg, d = self.cfg, self.d
        flops_tok = flops_per_token(self.model_config, self.seq_len)
        precision = self._precision()
        peak = peak_flops(d.device, precision, cfg.peak_tflops)
        metrics = MetricsWriter(self.dir / "metrics.jsonl", enabled=d.is_main)
        bar = tqdm.tqdm(total=cfg.steps, initial=self.start_step, unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and d.is_main and sys.stderr.isatty()))
        out = self._out
        if not bar.disable:
            self._out = _above_bar(tqdm.tqdm, out)
        # no terminal to draw the bar on: a line now and then (train/progress.py)
        ticker = ProgressLines("step", cfg.steps, self.log, enabled=bar.disable and cfg.progress and d.is_main)
        params = [p for p in self.model.parameters() if p.requires_grad]
        last_loss, last_eval, final = None, None, None
        self.log(self.memory_line)
        self.log(f"training {cfg.steps - self.start_step} steps from step {self.start_step}: "
                 f"{self.global_seqs} sequences x {self.seq_len} tokens per step "
                 f"({self.accum} micro-batches of {cfg.micro_batch} on each of {d.world} process(es))")
        try:
            for n in range(self.start_step + 1, cfg.steps + 1):
                t0 = time.perf_counter()
                lr = lr_at(n, cfg)
                set_lr(self.opt, lr)
                rec, racc, data_s = self._step(params, precision)
                step_s = time.perf_counter() - t0
                self.elapsed += step_s
                self.tokens_seen += self.tokens_per_step
                tps = self.tokens_per_step / step_s
                rec = {"kind": "train", "step": n, **rec}
                rec.update(tokens=self.tokens_seen, lr=lr, tokens_per_s=round(tps, 1),
                           mfu=round(flops_tok * tps / (peak * d.world), 5) if peak else None,
                           step_s=round(step_s, 4), data_s=round(data_s, 5),
                           router_entropy={name: round(entropy_bits(a), 5)
                                           for name, a in racc.assignments().items()})
                metrics.write(rec)
                last_loss = rec["loss"]
                bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)  # shown by update
                bar.update(1)
                ticker.tick(n, f"loss {rec['loss']:.4f}, {tps:,.0f} tokens/s")
                if self.eval_streams and ((cfg.eval_every > 0 and n % cfg.eval_every == 0) or n == cfg.steps):
                    last_eval = self._evaluate(n)
                    metrics.write(last_eval)
                if (cfg.save_every and n % cfg.save_every == 0) or n == cfg.steps:
                    path = self._save(n, last_loss, last_eval)
                    if n == cfg.steps:
                        final = path
        finally:
            bar.close()
            self._out = out
            metrics.close()
        if d.is_main and cfg.plot:
            self.log("plots: " + ", ".join(str(p) for p in plot_run(self.dir)))
        return TrainResult(self.dir, cfg.steps, self.tokens_seen, final or latest_checkpoint(self.dir), last_loss,
                           last_eval)

    def _step(self, params: list[torch.Tensor], precision: str) -> tuple[dict[str, Any], RoutingAccumulator, float]:
        """Forward/backward over this process's micro-batches, then clip and update."""
        d, dev = self.d, self.d.device
        samples = self.sampler.draw(self.global_seqs)
        mbs = micro_batches(samples, self.cfg.micro_batch, d.world, d.rank)
        sums = torch.zeros(4, dtype=torch.float64, device=dev)  # loss, nll, lb, z: sums of micro-batch means
        racc = RoutingAccumulator()
        data_s = 0.0
        for a, mb in enumerate(mbs):
            t = time.perf_counter()
            batch = self.sampler.batch(mb)
            inputs = batch.inputs.to(dev, non_blocking=True)
            targets = batch.targets.to(dev, non_blocking=True)
            data_s += time.perf_counter() - t
            with dist_.sync_context(self.wrapped, d, a == len(mbs) - 1):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    out = self.wrapped(inputs, targets=targets, return_logits=False)  # the chunked loss head
                    loss = out.nll + self.alpha * out.lb_loss + self.beta * out.z_loss
                (loss / self.accum).backward()
            sums += torch.stack([loss.detach(), out.nll.detach(), out.lb_loss.detach(),
                                 out.z_loss.detach()]).double()  # stays on the device: no sync per micro-batch
            racc.add(out.routing)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.model.after_step()  # routers with rule-based state (runtime/routers.py) update it here
        # the step's numbers are read once it is queued whole: one wait for the device per step, at its end
        grad_norm = float(dist_.local_value(norm))
        sums = dist_.all_sum(d, sums).cpu() / (self.accum * d.world)
        racc = reduce_routing(racc, d)
        rec = {"loss": float(sums[0]), "nll": float(sums[1]), "lb_loss": float(sums[2]), "z_loss": float(sums[3]),
               "grad_norm": grad_norm}
        return rec, racc, data_s

    def _evaluate(self, step: int) -> dict[str, Any]:
        res = evaluate_streams(self.model, self.eval_streams, self.seq_len,
                               self.cfg.eval_batch or self.cfg.micro_batch, self.cfg.eval_tokens, self.d.device,
                               self.cfg.precision, None, self.experts, self.d, bos_id=self.tok.bos_id)
        shown = ", ".join(f"{n} {r.loss:.4f}" for n, r in res.items())
        self.log(f"eval step {step}: loss {shown}")
        return {"kind": "eval", "step": step, "domains": {n: {"tokens": r.tokens, "loss": r.loss,
                                                              "perplexity": r.perplexity, "routing": r.routing_summary}
                                                          for n, r in res.items()}}

    # ---- checkpoints ----------------------------------------------------------------------------
    def _save(self, step: int, loss: float | None, last_eval: dict | None) -> Path | None:
        d = self.d
        model_state = dist_.full_model_state(self.model, d)
        # a finished run's final checkpoint may leave the optimizer state out (--no-final-optimizer-state)
        with_optim = self.cfg.final_optimizer_state or step < self.cfg.steps
        optim_state = dist_.full_optimizer_state(self.model, self.opt, self.opt_names, d) if with_optim else {}
        path = None
        if d.is_main:
            record = {"tool": self.run_info["tool"], "init": {k: v for k, v in self.run_info["init"].items()
                                                              if k != "provenance"},
                      "config": self.cfg.to_dict(), "data": self.run_info["data"],
                      "tokenizer": self.run_info["tokenizer"], "steps": step, "tokens": self.tokens_seen,
                      "world_size": d.world, "strategy": d.strategy}
            prov = chain(self.provenance_in, record, self.experts)
            metadata = {PROVENANCE_KEY: dumps(prov)}
            if self.tok.name == BYTES:
                metadata[TOKENIZER_KEY] = BYTES
            tensors = {f"optim.{name}.{slot}": t for name, st in optim_state.items() for slot, t in st.items()}
            tensors["rng.torch"] = torch.get_rng_state()
            meta = {"step": step, "tokens": self.tokens_seen, "sampler": self.sampler.state(),
                    "optimizer_params": self.opt_names, "world_size": d.world, "strategy": d.strategy}
            if not with_optim:
                meta["optimizer_state"] = "not saved"
            rel = f"{self.dir}/checkpoints/{step_dir_name(step)}"
            card = model_card(self.model_config, self.run_info, step, self.tokens_seen, loss, last_eval,
                              self.experts, rel)
            path = save_run_checkpoint(self.dir, step, model_state, self.model_config, metadata, tensors, meta,
                                       self.carried, card, elapsed_s=self.elapsed)
            prune_checkpoints(self.dir, self.cfg.keep_last, protect={self.cfg.steps})
        dist_.barrier(d)
        return path


def _above_bar(tqdm, log: Log) -> Log:
    """log, for lines printed while the progress bar is drawn: the bar is cleared, the line printed, the
    bar drawn again below it (tqdm.write's way), so no line lands on the bar."""
    def write(msg: str) -> None:
        with tqdm.external_write_mode(file=sys.stderr):
            log(msg)
    return write


def _read_model_config(path: Path) -> ModelConfig:
    where = f"--model-config {path}"
    if not path.exists():
        raise TrainError(f"{where}: file not found")
    # JSON as JSON: YAML 1.1 would read 1e-05 (no dot) as a string; both bounded (runtime/jsonfile.py,
    # converters/yamlfile.py)
    body = read_json(path, error=TrainError) if path.suffix == ".json" else read_yaml(path, where, error=TrainError)
    if isinstance(body, dict) and "bam_config" in body:  # a canonical directory's config.json
        body = body["bam_config"]
    try:
        return ModelConfig.from_dict(body if isinstance(body, dict) else {})
    except (ConfigError, TypeError) as e:
        raise TrainError(f"--model-config {path}: {e}") from None
