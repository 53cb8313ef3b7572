"""One process or many (torchrun), DDP or FSDP2, and moving full (unsharded) state in and out.

    torchrun --nproc-per-node 2 -m bam_surgery train ... --strategy ddp|fsdp

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR; the process group is gloo on CPU and
NCCL on CUDA. ddp wraps the model in DistributedDataParallel; fsdp applies FSDP2 `fully_shard` to
every block and then to the root (parameters, gradients and optimizer state sharded across the
processes).

Checkpoints are always the canonical, unsharded format: the full model state and the full optimizer
state are gathered to rank 0 (torch.distributed.checkpoint.state_dict with full_state_dict=True,
cpu_offload=True for FSDP; the module's own state for one process and DDP) and rank 0 writes them.
So a checkpoint from an FSDP run loads in one process, and a run can resume with another strategy
or process count. To resume, every process reads the files; the model is loaded before it is
wrapped (fully_shard shards what is there), the optimizer state after (set_optimizer_state_dict).
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, is_dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .errors import TrainError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    strategy: str = "single"  # single | ddp | fsdp
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainError("device: cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device_choice: str, strategy: str) -> Dist:
    """Join torchrun's process group when WORLD_SIZE > 1 (else a one-process Dist)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if world <= 1:
        return Dist(device=device)
    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, strategy, owns)


def teardown(d: Dist) -> None:
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def on_main(d: Dist, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 only and share its result; a TrainError there is raised on every rank (so
    no process waits forever at the next collective)."""
    if not d.active:
        return fn()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if d.is_main:
        try:
            box[0] = ("ok", fn())
        except TrainError as e:
            box[0] = ("error", str(e))
        except BaseException as e:  # a bug: rank 0 keeps its traceback, the others stop too
            box[0], failure = ("crash", f"{type(e).__name__}: {e}"), e
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if failure is not None:
        raise failure
    if status == "error":
        raise TrainError(value)
    if status == "crash":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def all_sum(d: Dist, t: torch.Tensor) -> torch.Tensor:
    if d.active:
        t = t.to(d.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


# ---- wrapping -----------------------------------------------------------------------------------
def wrap(model: nn.Module, d: Dist) -> nn.Module:
    """The module the training step calls: the model itself, DDP(model) or the model after
    fully_shard (FSDP2 modifies it in place; parameters become DTensors)."""
    if not d.active:
        return model
    if d.strategy == "ddp":
        return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard  # lazy: 0.7 s, for FSDP2 runs only

    mesh = init_device_mesh(d.device.type, (d.world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        block.register_forward_pre_hook(_hand_over_accumulators, prepend=True, with_kwargs=True)
    fully_shard(model, mesh=mesh)
    # the model's output holds views (routing gates); nothing here modifies an output in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*", category=UserWarning)
    # a parameter without a gradient on one process (frozen, or an expert no token reached there)
    # still joins the reduce-scatter with zeros, so every process calls the same collectives
    if hasattr(model, "set_reduce_scatter_unused_params"):
        model.set_reduce_scatter_unused_params(True)
    elif d.world > 1:  # one process cannot disagree with itself about which parameters have gradients
        raise TrainError(f"strategy: fsdp across processes needs a torch whose FSDP2 reduce-scatters unused "
                         f"parameters (FSDPModule.set_reduce_scatter_unused_params; this is torch "
                         f"{torch.__version__}): use --strategy ddp, or torch 2.13 (requirements.txt)")
    return model


class _Opaque:
    """Stands for an argument the blocks write into (the model's ForwardPass, whose `routing` dict
    collects each block's routing records) without being one: FSDP2's pre-forward hook rebuilds lists,
    tuples, dicts and dataclasses among the arguments when they hold tensors that require grad, so a
    block would write into a copy and the model would lose that block's routing (and its auxiliary
    losses). Reads go to the original object."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._target, name, value)

    def __len__(self) -> int:
        return len(self._target)

    def __iter__(self):
        return iter(self._target)


def _hand_over_accumulators(module, args, kwargs):
    """Forward pre-hook, run before FSDP2's: list and dataclass arguments reach the block as _Opaque."""
    def wrap_one(a):
        return _Opaque(a) if isinstance(a, list) or (is_dataclass(a) and not isinstance(a, type)) else a
    return tuple(wrap_one(a) for a in args), {k: wrap_one(v) for k, v in kwargs.items()}


def sync_context(wrapped: nn.Module, d: Dist, sync: bool):
    """Gradient synchronization only on the last micro-batch of an accumulation."""
    if not d.active:
        return nullcontext()
    if d.strategy == "ddp":
        return nullcontext() if sync else wrapped.no_sync()
    return _fsdp_sync(wrapped, sync)


@contextmanager
def _fsdp_sync(model, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. the global grad norm); a plain tensor as is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


# ---- full state -----------------------------------------------------------------------------------
def full_model_state(model: nn.Module, d: Dist) -> dict[str, torch.Tensor] | None:
    """Canonical state on CPU at rank 0 (None elsewhere)."""
    if d.strategy != "fsdp":
        if not d.is_main:
            return None
        # no copy on the CPU: the checkpoint writer streams the live tensors (nothing changes them meanwhile);
        # a copy was the whole model again at every save
        return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    # lazy: torch.distributed.checkpoint costs 1.3 s, needed by FSDP2 runs only
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return None
    if "lm_head_bias" in sd:  # the model's own state_dict names it lm_head.bias
        sd["lm_head.bias"] = sd.pop("lm_head_bias")
    return sd


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, names: list[str], d: Dist
                         ) -> dict[str, dict[str, torch.Tensor]] | None:
    """{param name: {"step", "exp_avg", "exp_avg_sq"}} on CPU at rank 0 (None elsewhere)."""
    if d.strategy != "fsdp":
        if not d.is_main:
            return None
        sd = opt.state_dict()
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        return {names[k]: {s: v.detach().to("cpu") for s, v in sd["state"][i].items()}
                for k, i in enumerate(ids) if i in sd["state"]}
    # lazy: torch.distributed.checkpoint costs 1.3 s, needed by FSDP2 runs only
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return None
    return {name: {s: v.detach().to("cpu") for s, v in st.items()} for name, st in osd["state"].items()}


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, names: list[str],
                         state: dict[str, dict[str, torch.Tensor]], d: Dist) -> None:
    """Put a full optimizer state (as full_optimizer_state returns it) into the optimizer."""
    sd = opt.state_dict()
    if d.strategy != "fsdp":
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        sd["state"] = {i: {s: v.clone() for s, v in state[names[k]].items()}
                       for k, i in enumerate(ids) if names[k] in state}
        opt.load_state_dict(sd)
        return
    # lazy: torch.distributed.checkpoint costs 1.3 s, needed by FSDP2 runs only
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    groups, k = [], 0
    for g in sd["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": names[k:k + n]})
        k += n
    full = {"state": {name: {s: v.clone() for s, v in st.items()} for name, st in state.items()},
            "param_groups": groups}
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))
