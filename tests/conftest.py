"""Shared helpers for the test suite: tiny configs, random canonical states, mixtures built from dense
states, an independent float64 reference forward pass, tiny HF Llama folders and setup.py read with ast.

The reference (`reference_forward`) is written from the semantics in runtime/model.py's contract, not
from its code: RoPE by complex rotation, attention by an explicit masked softmax with a loop over heads,
activations and norms from their formulas. Tests compare the runtime (fp32) against it.

Test files in every folder under tests/ import these helpers with `from conftest import ...` (pytest puts
tests/ on sys.path when it loads this file). A test file imports another only from its own folder
(test_fused.py from test_model.py); helpers used across folders live here.
Shapes: B batch, T time, D d_model, H heads, G kv heads, Dh head dim, E experts, V vocab.
"""
from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bam_surgery.runtime.config import ModelConfig
from bam_surgery.runtime.layout import tensor_shapes
from bam_surgery.runtime.model import Model

# Tiny dims: D 32, 2 layers, V 64, T 8 (head_dim 8 with 4 heads).
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_positions=16)
T_TINY = 8


def tiny_config(**overrides) -> ModelConfig:
    """A tiny ModelConfig; any field can be overridden."""
    return ModelConfig(**{**TINY, **overrides})


def random_state(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A random canonical state dict (names and shapes from runtime.layout), independent of Model's init.

    Matrices ~ N(0, 1/fan_in) so activations stay O(1); norm weights ~ 1 + N(0, 0.1^2) and biases
    ~ N(0, 0.1^2) so that a wrong norm or a dropped bias shows up; routers give O(1) logits.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(cfg).items():
        r = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * r
        elif name.endswith(".bias"):
            t = 0.1 * r
        elif name in ("embed.weight", "pos_embed.weight"):
            t = r
        else:  # [.., out, in] matrices and routers [E, D]
            t = r / math.sqrt(shape[-1])
        state[name] = t.to(dtype)
    return state


def tokens_for(cfg: ModelConfig, seed: int = 0, batch: int = 2, length: int = T_TINY) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Model:
    model = Model(cfg)
    model.load_state_dict(state)
    return model.eval()


# ---- families of dense models and mixtures built from them ------------------------------------
def is_norm_or_embedding(name: str) -> bool:
    return name.startswith(("embed.", "pos_embed.", "lm_head.", "final_norm.")) or "_norm." in name


def is_qk_norm(name: str) -> bool:
    return ".q_norm." in name or ".k_norm." in name


def dense_family(cfg: ModelConfig, n: int, seed: int = 0, share_kv: bool = False,
                 share_attention: bool = False) -> list[dict[str, torch.Tensor]]:
    """n different dense states that share norms and embeddings (as after branching from one seed and
    re-averaging them); optionally also share K,V (shared-KV mixtures) or the whole attention (BTX)."""
    base = random_state(cfg, seed)
    family = [base]
    for j in range(1, n):
        other = random_state(cfg, seed + 101 * j)
        for name in other:
            shared = is_norm_or_embedding(name) and not is_qk_norm(name)  # a QK-norm belongs to its attention
            shared |= share_kv and (".attn.k." in name or ".attn.v." in name or ".attn.k_norm." in name)
            shared |= share_attention and ".attn." in name
            if shared:
                other[name] = base[name].clone()
        family.append(other)
    return family


def mixture_state(mix_cfg: ModelConfig, dense_states: list[dict[str, torch.Tensor]],
                  router_seed: int = 7) -> dict[str, torch.Tensor]:
    """Canonical mixture state: expert e's tensors are dense_states[e]'s; everything that is not an
    expert tensor (norms, embeddings, shared K/V, dense attention) comes from dense_states[0];
    routers are random. Every expert count in mix_cfg must equal len(dense_states) (or 0)."""
    for E in (mix_cfg.ffn_experts, mix_cfg.attn_experts):
        assert E in (0, len(dense_states))
    gen = torch.Generator().manual_seed(router_seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(mix_cfg).items():
        if "_router." in name:  # any router kind's tensors
            out[name] = (torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])).float()
        elif ".attn_experts." in name or ".ffn_experts." in name:
            dense_name = name.replace(".attn_experts.", ".attn.").replace(".ffn_experts.", ".ffn.")
            out[name] = torch.stack([s[dense_name] for s in dense_states])
        else:
            out[name] = dense_states[0][name].clone()
        assert tuple(out[name].shape) == shape, name
    return out


# ---- independent float64 reference -----------------------------------------------------------
def ref_norm(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if cfg.norm == "layernorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)  # biased variance
        y = (x - mu) / torch.sqrt(var + cfg.norm_eps) * weight
    else:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * (1 + weight if cfg.norm_unit_offset
                                                                             else weight)
    return y + bias if bias is not None else y


def ref_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name in ("gelu_tanh", "geglu_tanh"):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name in ("silu", "swiglu"):
        return x / (1.0 + torch.exp(-x))
    raise AssertionError(name)


def ref_rope(cfg: ModelConfig, x: torch.Tensor, theta: float | None = None) -> torch.Tensor:
    """x [B, T, heads, Dh]: rotate the first rotary_dim dims; pair (a, b) seen as the complex a + ib."""
    rot = cfg.rotary_dim
    T = x.shape[1]
    freqs = torch.tensor([(theta or cfg.rope_theta) ** (-2.0 * i / rot) for i in range(rot // 2)],
                         dtype=torch.float64)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]  # [T, rot/2]
    rotor = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # e^{i t w}
    part = x[..., :rot]
    if cfg.rope_interleaved:  # pairs (0,1), (2,3), ...
        z = torch.complex(part[..., 0::2], part[..., 1::2]) * rotor
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:  # pairs (i, i + rot/2)
        z = torch.complex(part[..., : rot // 2], part[..., rot // 2:]) * rotor
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def _lin(x: torch.Tensor, w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ w[f"{name}.weight"].T
    b = w.get(f"{name}.bias")
    return y + b if b is not None else y


def ref_attention(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """One multi-head attention of layer `layer`; w has q/k/v/o .weight (and .bias) of one dense attention, and
    q_norm/k_norm with a QK-norm; x [B, T, D]. Plain RoPE only (scaled RoPE is held to transformers)."""
    assert cfg.scaled_rope is None
    B, T, _ = x.shape
    H, G, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k = _lin(x, w, "q"), _lin(x, w, "k")
    if cfg.qk_norm != "none":  # per head: over the last Dh values of each head; full: over the whole projection
        per_head = cfg.qk_norm == "head"
        q = ref_norm(cfg, q.reshape(B, T, H, Dh) if per_head else q, w["q_norm.weight"], w.get("q_norm.bias"))
        k = ref_norm(cfg, k.reshape(B, T, G, Dh) if per_head else k, w["k_norm.weight"], w.get("k_norm.bias"))
    q, k = q.reshape(B, T, H, Dh), k.reshape(B, T, G, Dh)
    v = _lin(x, w, "v").reshape(B, T, G, Dh)
    sliding = cfg.attn_window is not None and (cfg.attn_window_layers is None or layer in cfg.attn_window_layers)
    if cfg.position == "rope" and layer not in (cfg.nope_layers or ()):
        theta = cfg.window_rope_theta if sliding else None
        q, k = ref_rope(cfg, q, theta), ref_rope(cfg, k, theta)
    t = torch.arange(T)
    if cfg.attn_temperature is not None:  # queries scaled by position
        q = q * (1 + cfg.attn_temperature * torch.log(1 + torch.floor(t / cfg.attn_temperature_length)))[None, :, None,
                                                                                                          None]
    hidden = t[None, :] > t[:, None]  # the future; and, in a sliding layer, keys window or more slots back
    if sliding:
        hidden |= t[None, :] <= t[:, None] - cfg.attn_window
    heads = []
    for h in range(H):
        g = h // (H // G)  # the kv head this query head reads
        scale = cfg.attn_scale if cfg.attn_scale is not None else 1 / math.sqrt(cfg.attn_scale_dim or Dh)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) * scale  # [B, T, T]
        if cfg.attn_softcap is not None:
            scores = cfg.attn_softcap * torch.tanh(scores / cfg.attn_softcap)
        scores = scores.masked_fill(hidden, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[:, :, g])  # [B, T, Dh]
    return _lin(torch.cat(heads, dim=-1), w, "o")


def ref_ffn(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if cfg.activation in ("swiglu", "geglu_tanh"):
        h = ref_activation(cfg.activation, _lin(x, w, "gate")) * _lin(x, w, "up")
    else:
        h = ref_activation(cfg.activation, _lin(x, w, "up"))
    return _lin(h, w, "down")


def sub(state: dict[str, torch.Tensor], prefix: str, expert: int | None = None) -> dict[str, torch.Tensor]:
    """The tensors under `prefix.` with the prefix removed (expert: take slice [expert])."""
    n = len(prefix) + 1
    return {k[n:]: (v[expert] if expert is not None else v) for k, v in state.items() if k.startswith(prefix + ".")}


def ref_router_logits(cfg: ModelConfig, kind: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Router logits [N, E] of x [N, D], from the formulas in docs/routers.md (w: the router's tensors by
    name under its prefix)."""
    if kind == "linear":
        return x @ w["weight"].T
    if kind == "mlp":
        return ref_activation("gelu", x @ w["hidden.weight"].T + w["hidden.bias"]) @ w["out.weight"].T
    if kind == "attention":
        q = x @ w["query.weight"].T  # [N, R]
        k = w["embeddings.weight"] @ w["key.weight"].T  # [E, R]
        return q @ k.T / math.sqrt(q.shape[-1])
    if kind == "expert_embedding":
        m = w["embeddings.weight"]
        cos = (x @ m.T) / (x.norm(dim=-1, keepdim=True) * m.norm(dim=-1)[None, :])
        return cos / torch.exp(w["log_temperature"])
    raise AssertionError(kind)


def ref_gates(cfg: ModelConfig, logits: torch.Tensor, top_k: int | None):
    """Router logits [N, E] -> (logits, full softmax p, gates [N, E] (top-k, normalized per cfg.gate_norm), idx)."""
    p = torch.softmax(logits, dim=-1)
    if top_k is None:
        return logits, p, p, None
    idx = p.argsort(dim=-1, descending=True)[:, :top_k]
    keep = torch.zeros_like(p).scatter(-1, idx, 1.0)
    gates = p * keep
    if cfg.gate_norm == "topk_softmax":
        gates = gates / gates.sum(-1, keepdim=True)
    return logits, p, gates, idx


def reference_forward(cfg: ModelConfig, state: dict[str, torch.Tensor], tokens: torch.Tensor,
                      attn_gates: torch.Tensor | None = None, ffn_gates: torch.Tensor | None = None):
    """float64 forward of a dense or mixture model. Returns (logits [B, T, V], routers), routers being a
    list of (kind, logits [N, E], p [N, E], top-k indices [N, K] or None). Given gates [E] force routing."""
    s = {k: v.double() for k, v in state.items()}
    B, T = tokens.shape
    x = s["embed.weight"][tokens]
    if cfg.scale_embeddings:
        x = x * math.sqrt(cfg.d_model)
    x = x * cfg.embedding_multiplier
    if cfg.position == "learned":
        x = x + s["pos_embed.weight"][:T][None]
    routers = []

    def norm(prefix, h):
        return ref_norm(cfg, h, s[f"{prefix}.weight"], s.get(f"{prefix}.bias"))

    def mix(kind, n, p, E, top_k, forced, expert_fn):
        if forced is not None:
            gates = forced.double().expand(B * T, E)
        else:
            router_kind = cfg.attn_router_kind if kind == "attn" else cfg.ffn_router_kind
            x_flat = n.reshape(-1, n.shape[-1])
            logits = ref_router_logits(cfg, router_kind, sub(s, f"{p}.{kind}_router"), x_flat)
            logits, probs, gates, idx = ref_gates(cfg, logits, top_k)
            routers.append((kind, logits, probs, idx))
        gates = gates.reshape(B, T, E)
        return sum(gates[..., e, None] * expert_fn(e) for e in range(E))

    def attention(p, n):
        if not cfg.attn_experts:
            return ref_attention(cfg, sub(s, f"{p}.attn"), n, layer)

        def expert(e):
            w = sub(s, f"{p}.attn_experts", e)
            if cfg.kv_mode == "shared":
                w.update(sub(s, f"{p}.attn"))
            return ref_attention(cfg, w, n, layer)
        return mix("attn", n, p, cfg.attn_experts, cfg.attn_top_k, attn_gates, expert)

    def ffn(p, n):
        if not cfg.ffn_experts:
            return ref_ffn(cfg, sub(s, f"{p}.ffn"), n)
        routed = mix("ffn", n, p, cfg.ffn_experts, cfg.ffn_top_k, ffn_gates,
                     lambda e: ref_ffn(cfg, sub(s, f"{p}.ffn_experts", e), n))
        if not cfg.ffn_shared_hidden:
            return routed
        gate = torch.sigmoid(n @ s[f"{p}.ffn_shared_gate.weight"].T)  # [B, T, 1]
        return routed + gate * ref_ffn(cfg, sub(s, f"{p}.ffn_shared"), n)

    r = cfg.residual_multiplier  # each sublayer's output times r as it joins the residual stream
    for i in range(cfg.n_layers):
        p, layer = f"layers.{i}", i
        if cfg.norm_position == "post":  # OLMo 2: the sublayer's output normed, then added
            h = x + r * norm(f"{p}.attn_post_norm", attention(p, x))
            x = h + r * norm(f"{p}.ffn_post_norm", ffn(p, h))
        elif cfg.norm_position == "sandwich":  # Gemma: normed in and out
            h = x + r * norm(f"{p}.attn_post_norm", attention(p, norm(f"{p}.attn_norm", x)))
            x = h + r * norm(f"{p}.ffn_post_norm", ffn(p, norm(f"{p}.ffn_norm", h)))
        elif cfg.block == "sequential":
            h = x + r * attention(p, norm(f"{p}.attn_norm", x))
            x = h + r * ffn(p, norm(f"{p}.ffn_norm", h))
        elif cfg.block == "parallel":
            n = norm(f"{p}.attn_norm", x)
            x = x + r * attention(p, n) + r * ffn(p, n)
        else:
            x = x + r * attention(p, norm(f"{p}.attn_norm", x)) + r * ffn(p, norm(f"{p}.ffn_norm", x))
    x = norm("final_norm", x)
    head = s["embed.weight"] if cfg.tie_embeddings else s["lm_head.weight"]
    logits = x @ head.T
    if "lm_head.bias" in s:
        logits = logits + s["lm_head.bias"]
    logits = logits * cfg.logit_scale
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * torch.tanh(logits / cfg.final_softcap)
    return logits, routers


def load_hf_native(class_name: str, path):
    """transformers' `class_name` (e.g. MixtralForCausalLM) from an export folder, fp32, eager attention; the load
    must report no missing, unexpected or mismatched keys."""
    import transformers

    model, info = getattr(transformers, class_name).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], f"{kind}: {info[kind]}"
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---- the command line, in-process ---------------------------------------------------------------
def run_cli(*args, code: int | None = 0):
    """Run the CLI in-process (arguments str()-ed); assert its exit status (code=None: any, the caller looks)."""
    from click.testing import CliRunner

    from bam_surgery.cli.commands import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    if code is not None:
        assert result.exit_code == code, result.output + (repr(result.exception) if result.exception else "")
    return result


def error_line(result, *needles: str) -> str:
    """The error contract of a refused command: status 2 and exactly one line on stderr,
    `bam-surgery: error: ...`, no traceback; the line holds each of `needles`. Returns the line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("bam-surgery: error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli_error_line(*args) -> str:
    """Run the command; it must fail by the error contract (error_line). Returns the line."""
    return error_line(run_cli(*args, code=2))


def merge(*args, code: int | None = 0):
    """`bam-surgery merge --quiet ARGS` (run_cli)."""
    return run_cli("merge", "--quiet", *args, code=code)


def merge_family(paths, out, *args, code: int | None = 0):
    """merge --seed paths[0] --experts paths[1:] (if any) --out OUT ARGS."""
    experts = ["--experts", ",".join(map(str, paths[1:]))] if len(paths) > 1 else []
    return merge("--seed", paths[0], *experts, "--out", out, *args, code=code)


def seed_and_experts(folder: Path, cfg: ModelConfig, names=("seed", "code", "math")) -> list[Path]:
    """Canonical files folder/NAME.safetensors: a random seed and experts that differ from it a little
    in their matrices (norms and biases shared)."""
    from bam_surgery.runtime.checkpoint import save_checkpoint

    base = random_state(cfg, 0)
    paths = []
    for i, name in enumerate(names):
        state = {k: v + 0.01 * i * torch.randn_like(v) if v.dim() == 2 else v for k, v in base.items()}
        paths.append(save_checkpoint(state, cfg, folder / f"{name}.safetensors"))
    return paths


def train_interrupted_after(monkeypatch, step: int, cfg) -> None:
    """Run train(cfg) as a Ctrl-C right after the metrics line of `step` would stop it: the run must end
    with KeyboardInterrupt, its checkpoints as the interruption left them."""
    from bam_surgery.train import metrics as metrics_module
    from bam_surgery.train import train

    write = metrics_module.MetricsWriter.write

    def write_then_interrupt(self, rec):
        write(self, rec)
        if rec.get("step") == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(metrics_module.MetricsWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(metrics_module.MetricsWriter, "write", write)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-matrix tests: several times faster on a busy 2-core
    machine, and the numbers of runs that record OMP_NUM_THREADS=1 (pipelines) do not depend on load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path_factory, monkeypatch):
    """Every cache of the tool (input digests, tokens, rebuilt files) is under $BAM_SURGERY_CACHE
    (runtime/cache.py), and libraries keep theirs under $XDG_CACHE_HOME: keep the tests' own there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    monkeypatch.setenv("BAM_SURGERY_CACHE", str(tmp_path_factory.getbasetemp() / "bam-surgery-cache"))


# ---- a second user, for real (the caches' trust rule: runtime/cache.py, docs/safety.md) ----------------------------
def other_uid() -> int:
    import pwd
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def as_other_user(action) -> None:
    """Run `action()` in a child process that has become another user (root only), and wait for it."""
    import os
    pid = os.fork()
    if pid == 0:  # the child: drop to the other user, act, leave without running any of the parent's cleanup
        code = 1
        try:
            os.setgroups([])
            os.setgid(other_uid())
            os.setuid(other_uid())
            action()
            code = 0
        except BaseException as e:  # shown in the parent's captured output
            print(f"the second user failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the second user's planting failed"


@pytest.fixture
def public_tmp():
    """A folder both users can reach (pytest's own are private to root)."""
    import os
    import shutil
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="bam-surgery-two-users-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


def shared_folder(public: Path) -> Path:
    """A folder both users may write, sticky as /tmp is, inside `public`."""
    import os
    shared = public / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def plant_entry(entry: Path, files: dict[str, bytes]) -> None:
    """A cache entry written as runtime/cache.py writes one, DIGEST included (the format is public), so only who
    owns it and where it lies can tell it apart from ours."""
    from bam_surgery.runtime import cache
    entry.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (entry / name).write_bytes(data)
    (entry / cache.DIGEST).write_text(cache._digest(files) + "\n")


needs_root = pytest.mark.skipif(__import__("os").geteuid() != 0, reason="acting as a second user needs root "
                                "(os.setuid in a forked child); the same rule runs against \"another\" uid without it")


@pytest.fixture
def tiny():
    """The tiny config factory as a fixture (same as tiny_config)."""
    return tiny_config


@pytest.fixture(scope="module")
def hf_modules(tmp_path_factory):
    """Keep transformers' copies of remote code in a temporary directory, not in the user's HF cache."""
    import transformers.dynamic_module_utils as dmu

    def forget_loaded_remote_code() -> None:
        # transformers imports remote code as the package `transformers_modules` from HF_MODULES_CACHE; one that
        # an earlier test module imported from its own cache would shadow this module's copies
        for name in [n for n in sys.modules if n == "transformers_modules" or n.startswith("transformers_modules.")]:
            del sys.modules[name]

    cache = str(tmp_path_factory.mktemp("hf_modules"))
    forget_loaded_remote_code()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dmu, "HF_MODULES_CACHE", cache)
        mp.setenv("HF_MODULES_CACHE", cache)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(sys, "path", list(sys.path))
        yield cache
    forget_loaded_remote_code()


# ---- setup.py and imports, read with ast (packaging checks) -----------------------------------------
ROOT = Path(__file__).resolve().parents[1]  # the repository


def setup_keyword(name: str):
    """A literal keyword argument of setup() in setup.py, read with ast (setup.py is not run)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == name:
                    return ast.literal_eval(kw.value)
    raise KeyError(name)


def dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def absolute_imports(tree: ast.AST):
    """(import node, module name) for every absolute import in the tree, function-level ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node, node.module


# ---- tiny Hugging Face Llama folders, written with safetensors directly (not through the code under test) --
def llama_hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor name -> shape for a config.json dict `c`."""
    D, F, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * D // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight": (D,),
                   f"{p}.self_attn.q_proj.weight": (D, D), f"{p}.self_attn.k_proj.weight": (kv, D),
                   f"{p}.self_attn.v_proj.weight": (kv, D), f"{p}.self_attn.o_proj.weight": (D, D),
                   f"{p}.mlp.gate_proj.weight": (F, D), f"{p}.mlp.up_proj.weight": (F, D),
                   f"{p}.mlp.down_proj.weight": (D, F)}
    return shapes


# A Llama family in bf16: a seed and two branches (seed + 10% noise on attention and FFN matrices),
# written with safetensors directly (not through the code under test), with tokenizer files.
LLAMA_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def llama_state(seed: int, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    shapes = llama_hf_shapes(LLAMA_HF)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        r = torch.randn(shape, generator=gen, dtype=torch.float32)
        if base is None:
            t = 1.0 + 0.1 * r if len(shape) == 1 else r / math.sqrt(shape[-1])
        elif ".self_attn." in name or ".mlp." in name:
            t = base[name].float() + 0.1 * r / math.sqrt(shape[-1])
        else:
            t = base[name].float()
        out[name] = t.to(torch.bfloat16)
    return out


def write_llama_dir(directory: Path, state: dict[str, torch.Tensor], tokenizer_tag: str) -> None:
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(LLAMA_HF, indent=2))
    vocab = {f"w{i}": i for i in range(LLAMA_HF["vocab_size"])}
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "tag": tokenizer_tag}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                  "transformers_version": "5.23.0"}))


class WrappedReader:
    """A reader (the runtime.reader protocol) that forwards everything to `inner` but `get`, which the test
    subclass defines (to fail on any tensor read, to count reads, ...); `read_into` goes through that `get`."""

    def __init__(self, inner):
        from bam_surgery.runtime.reader import Reader

        assert isinstance(inner, Reader)
        self._r = inner
        self.config, self.metadata, self.path = inner.config, inner.metadata, inner.path
        self.files, self.file_of, self.check_unchanged = inner.files, inner.file_of, inner.check_unchanged

    def names(self):
        return self._r.names()

    def shape(self, name):
        return self._r.shape(name)

    def dtype(self, name):
        return self._r.dtype(name)


# ---- Hugging Face models of the families users branch from --------------------------------------------------
# The families of 2024-25, shrunk from the real configs (their RoPE parameters, GQA, head_dim, ties, norms as
# published; widths and depths tiny). tests/converters/test_hf_import.py, test_hf_families.py and
# tests/surgery/test_merge_families.py use them.
HF_SMALL = dict(vocab_size=100, num_hidden_layers=2)
HF_64 = dict(HF_SMALL, hidden_size=64, intermediate_size=96, num_attention_heads=4)  # most families' tiny shape
HF_32 = dict(HF_SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4)
LLAMA32_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4096,
                short_factor=[1.0 + 0.05 * i for i in range(8)], long_factor=[1.0 + 2.5 * i for i in range(8)])
FAMILY_CASES = {
    "llama3.2": ("LlamaConfig", dict(HF_64, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                     rms_norm_eps=1e-5, max_position_embeddings=131072,
                                     rope_parameters=LLAMA32_ROPE)),
    "llama-linear": ("LlamaConfig", dict(HF_32, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                     factor=4.0))),
    "llama-dynamic": ("LlamaConfig", dict(HF_32, max_position_embeddings=64,
                                          rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    "llama-yarn": ("LlamaConfig", dict(HF_32, max_position_embeddings=131072,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                                            original_max_position_embeddings=32768))),
    "llama-longrope": ("LlamaConfig", dict(HF_SMALL, hidden_size=64, intermediate_size=48, num_attention_heads=4,
                                           max_position_embeddings=131072, rope_parameters=LONGROPE)),
    "qwen3": ("Qwen3Config", dict(HF_64, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                  max_position_embeddings=40960, rope_parameters=dict(rope_type="default",
                                                                                      rope_theta=1000000.0))),
    "qwen3-yarn": ("Qwen3Config", dict(HF_64, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                       max_position_embeddings=131072,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                                                            original_max_position_embeddings=32768))),
    "phi3": ("Phi3Config", dict(HF_64, num_key_value_heads=4, max_position_embeddings=131072,
                                original_max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, rope_parameters={k: v for k, v in LONGROPE.items()
                                                                 if k != "original_max_position_embeddings"})),
    "phi4-mini": ("Phi3Config", dict(HF_64, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                          partial_rotary_factor=0.75))),
    "olmo2": ("Olmo2Config", dict(HF_64, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                                  pad_token_id=0, eos_token_id=2,
                                  rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "smollm3": ("SmolLM3Config", dict(HF_64, num_hidden_layers=4, num_key_value_heads=2, max_position_embeddings=65536,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      rope_parameters=dict(rope_type="default", rope_theta=5000000.0))),
    # sliding windows of 5 tokens, the sequences of the tests run past them: every layer (Mistral v0.1, Phi-3), the
    # layers from max_window_layers on (Qwen2), Gemma 2's every other layer with soft-capping, Gemma 3's local
    # layers with their own RoPE base beside its scaled global one, OLMo 3's three of four
    "mistral-window": ("MistralConfig", dict(HF_32, num_key_value_heads=2, sliding_window=5)),
    "qwen2-window": ("Qwen2Config", dict(HF_32, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1)),
    "phi3-window": ("Phi3Config", dict(HF_64, num_key_value_heads=2, sliding_window=5, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)),
    "gemma2": ("Gemma2Config", dict(HF_64, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(HF_64, num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                        query_pre_attn_scalar=32, sliding_window=5, max_position_embeddings=32768,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0,
                                                                                rope_theta=1000000.0),
                                                         "sliding_attention": dict(rope_type="default",
                                                                                   rope_theta=10000.0)})),
    "olmo3": ("Olmo3Config", dict(HF_64, num_hidden_layers=4, num_key_value_heads=2, sliding_window=5, pad_token_id=0,
                                  eos_token_id=2)),
    # the families of 2026, their real configs' shapes scaled down: Qwen3.5 (Qwen3.5-9B: three Gated DeltaNet layers
    # to one gated attention layer, 2 value heads per key head, head_dim 256 with a quarter rotated, base 10^7);
    # Gemma 4 (E2B / 31B: global layers of twice the head size with one kv head and K = V, proportional RoPE over a
    # quarter, the last layers reading earlier ones' K/V with double-wide MLPs, per-layer inputs, windows of 5 here)
    "qwen3.5": ("Qwen3_5TextConfig", dict(HF_64, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                          linear_value_head_dim=8, max_position_embeddings=262144,
                                          rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                               partial_rotary_factor=0.25))),
    "gemma4": ("Gemma4TextConfig", dict(HF_64, num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                                        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=100, sliding_window=5,
                                        final_logit_softcapping=30.0,
                                        layer_types=["sliding_attention", "full_attention"] * 3)),
    # the families of 2026 read as records: Granite 3's multipliers with Llama 3's RoPE scaling and attention biases;
    # Ministral 3's YaRN and queries scaled by position (original length shrunk to 512: the scale and the RoPE
    # change inside the long-position test); EXAONE 4 with its sliding windows (three layers of four, RoPE only
    # there) and Llama 3's scaling on the global layer's positions, and without windows (RoPE everywhere)
    "granite": ("GraniteConfig", dict(HF_64, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True,
                                      embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                                      logits_scaling=8.0, max_position_embeddings=131072,
                                      rope_parameters=LLAMA32_ROPE)),
    "ministral3": ("Ministral3Config", dict(HF_64, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                                            rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                                                 original_max_position_embeddings=512, beta_fast=32.0,
                                                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                                                 llama_4_scaling_beta=0.1))),
    "exaone4": ("Exaone4Config", dict(HF_64, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                      sliding_window=5, sliding_window_pattern=4, max_position_embeddings=131072,
                                      rope_parameters=LLAMA32_ROPE)),
    "exaone4-global": ("Exaone4Config", dict(HF_64, num_key_value_heads=2, head_dim=16, sliding_window=None,
                                             layer_types=["full_attention"] * 2, tie_word_embeddings=True)),
}


def random_hf_model(cls_name: str, kwargs: dict, seed: int = 0, **overrides):
    """A transformers model of config class `cls_name` with every parameter random (transformers initializes norms
    to 1 and biases to 0; randomized, a dropped or misplaced norm or bias shows up in the logits), fp32, eval. Norm
    weights the class initializes to 0 (the (1 + w) norms of Qwen3.5) move around 0, as in trained checkpoints:
    around 1 they would double every such norm, and Qwen3.5's Gated DeltaNet layers then amplify float32
    rounding past the tests' tolerance."""
    import transformers

    hf_cfg = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn_like(p)
            if p.dim() == 1:
                centre = 1.0 if name.endswith("weight") and not (cls_name == "Qwen3_5TextConfig" and bool((p == 0).all()))\
                    else 0.0
                p.copy_(centre + 0.1 * r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5 if "wte" not in name and "embed" not in name else r)
    return model


def branch_state(state: dict[str, torch.Tensor], keep, seed: int) -> dict[str, torch.Tensor]:
    """A specialist of a canonical dense state: its attention (Gated DeltaNet included) and FFN tensors moved by 10% of
    their spread, but those `keep(name)` holds (the tensors a recipe averages or shares, kept equal to the seed's)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        moved = name.startswith("layers.") and any(f".{m}." in name for m in ("attn", "ffn", "linear")) \
            and not keep(name)
        out[name] = t + 0.1 * t.std() * torch.randn(t.shape, generator=gen) if moved else t.clone()
    return out


def hf_llama_family(root: Path, config: dict, names=("seed", "code", "law", "math")) -> None:
    """Tiny HF Llama folders root/NAME (safetensors + config.json `config`, written directly); the specialists are
    the seed plus a 2% perturbation, as branches are."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    seed = {n: 1 + 0.1 * torch.randn(s, generator=gen) if len(s) == 1 else torch.randn(s, generator=gen) / s[-1] ** 0.5
            for n, s in sorted(llama_hf_shapes(config).items())}
    for i, name in enumerate(names):
        g = torch.Generator().manual_seed(100 + i)
        state = seed if i == 0 else {n: t + 0.02 * t.abs().mean() * torch.randn(t.shape, generator=g)
                                     for n, t in seed.items()}
        (root / name).mkdir()
        save_file(state, str(root / name / "model.safetensors"), metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(config, indent=2))


def export_carries(source) -> dict:
    """save_hf's tokenizer_files and generation as every export carries them from `source` (a reader or a
    checkpoint path): app/exports.py:export_inputs, the one owner."""
    from bam_surgery.app.exports import export_inputs
    from bam_surgery.converters import open_checkpoint

    if isinstance(source, (str, Path)):
        with open_checkpoint(str(source)) as reader:
            return export_carries(reader)
    inputs = export_inputs(source, "hf")
    return dict(tokenizer_files=inputs.files, generation=inputs.generation)


def hf_specialists(root: Path, case: str, names=("seed", "one", "two"), keep=lambda name: False,
                   **overrides) -> list[Path]:
    """HF folders root/NAME of FAMILY_CASES[case] (its config's entries replaced by `overrides`): a random seed
    (random_hf_model) and specialists branched from it (branch_state), each written back in the family's own format
    by the exporter, so every one loads in transformers."""
    from bam_surgery.converters import open_checkpoint
    from bam_surgery.converters.hf import save_hf

    random_hf_model(*FAMILY_CASES[case], **overrides).save_pretrained(root / names[0])
    with open_checkpoint(str(root / names[0])) as seed:
        state = {n: seed.get(n) for n in seed.names()}
        for j, name in enumerate(names[1:], 1):
            save_hf(branch_state(state, keep, 10 * j), root / name, seed.architecture, config=seed.config,
                    **export_carries(seed))
    return [root / n for n in names]


# ---- generated docs (docs/gen_*.py) ---------------------------------------------------------------------------
def doc_generator(name: str):
    """docs/NAME.py loaded as a module (docs/ on sys.path, where the generators import each other from)."""
    import importlib

    docs = str(ROOT / "docs")
    if docs not in sys.path:
        sys.path.insert(0, docs)
    return importlib.import_module(name)


def assert_doc_current(gen) -> None:
    """The generator's DOC holds exactly what its render() writes today, else a failure with the diff's start."""
    import difflib

    want, have = gen.render(), gen.DOC.read_text(encoding="utf-8")
    if have != want:
        diff = difflib.unified_diff(have.splitlines(), want.splitlines(), gen.DOC.name, "today", lineterm="", n=1)
        pytest.fail(f"{gen.DOC.name} is out of date: run {gen.REGENERATE}\n" + "\n".join(list(diff)[:40]),
                    pytrace=False)


# Gemma 3's chat template (what the instruction-tuned Gemma 3 tokenizers ship; the base GGUF carries none): a system
# turn folded into the first user turn, roles alternating (raise_exception), content as text or parts; tests/train/
# test_chat.py and tests/compat/test_real_gemma.py render it against transformers
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


# ---- merge families (tests/app/test_app_merge.py, tests/surgery/test_merge.py) ---------------------------
MERGE_CONFIGS = {  # the merge tests' three block shapes
    # the paper's block: parallel attention + FFN on one shared layernorm, SwiGLU, RoPE
    "parallel": tiny_config(block="parallel", norm="layernorm", activation="swiglu"),
    # Llama-like: sequential block, RMSNorm, SwiGLU, GQA
    "llama": tiny_config(block="sequential", norm="rmsnorm", activation="swiglu", n_kv_heads=2),
    # GPT-2-like: biases everywhere, learned positions, GELU, tied embeddings
    "gpt2": tiny_config(block="sequential", norm="layernorm", norm_bias=True, activation="gelu",
                        position="learned", qkv_bias=True, o_bias=True, ffn_bias=True, tie_embeddings=True),
}


def branched_family(cfg, n: int, seed: int = 0, share_kv: bool = False, share_attention: bool = False,
                    spread: float = 0.1) -> list[dict[str, torch.Tensor]]:
    """n dense states as after continued pre-training from one seed: state 0 is the seed; the others
    move every attention/FFN tensor by `spread` of its scale (relative distance ~0.1, a real branch).
    Norms and embeddings stay shared (what the recipes average), optionally K/V (shared-KV) or the
    whole attention (BTX), so that forcing expert i must reproduce dense model i."""
    base = random_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    family = [base]
    for _ in range(1, n):
        state = {}
        for name, t in base.items():
            shared = is_norm_or_embedding(name)
            shared |= share_kv and (".attn.k." in name or ".attn.v." in name)
            shared |= share_attention and ".attn." in name
            state[name] = t.clone() if shared else t + spread * t.std() * torch.randn(t.shape, generator=gen)
        family.append(state)
    return family


def save_family(tmp_path: Path, cfg, states, names=("seed", "code", "math", "law")) -> list[Path]:
    from bam_surgery.runtime.checkpoint import save_checkpoint

    paths = []
    for name, state in zip(names, states):
        p = tmp_path / f"{name}.safetensors"
        save_checkpoint(state, cfg.replace(name=name), p)
        paths.append(p)
    return paths


def logits(model, tokens, routing=None):
    with torch.no_grad():
        return model(tokens, routing=routing).logits


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def b3(path: Path) -> str:
    """The provenance's digest of a file: BLAKE3 of its bytes, self-describing."""
    import blake3
    return "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".partial")]
