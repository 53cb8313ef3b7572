"""The application layer holds the use cases, and the commands are declarations of them (issue 37):

- cli/ reaches below app/ (imports runtime, converters, train, surgery or pipeline) at most MAX_CLI_REACHES times,
  counted as import statements (function-level ones included); 47 before generate, train, eval and routing-stats
  became app functions, 14 after;
- a merge option is declared once: at most MAX_FFN_TOP_K_FILES package files declare `ffn_top_k` / `--ffn-top-k`
  (the model config's field and the merge option's, surgery/options.py: count-params takes the merge's);
- the use cases take one Reporter, no callbacks.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("runtime", "converters", "train", "surgery", "app", "pipeline", "cli")
BELOW_APP = ("runtime", "converters", "train", "surgery", "pipeline")
MAX_CLI_REACHES = 20
MAX_FFN_TOP_K_FILES = 2


def cli_reaches(root: Path = ROOT) -> list[str]:
    """`file:line module` for every import in cli/ of a layer below app/."""
    out = []
    for path in sorted((root / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "bam_surgery" and len(parts) > 1 and parts[1] in BELOW_APP:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {module}")
    return out


def declares(source: str, name: str, flag: str) -> bool:
    """Whether a module declares option `name`: a class field of that name, a function parameter of that name, or
    the flag `flag` as a call's argument (click.option, a declared field)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                                                  and s.target.id == name for s in node.body):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            if any(arg.arg == name for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]):
                return True
        if isinstance(node, ast.Call) and any(isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                                              and arg.value.split("/")[0] == flag for arg in node.args):
            return True
    return False


def test_cli_reaches_below_app_at_most_20_times():
    reaches = cli_reaches()
    assert len(reaches) <= MAX_CLI_REACHES, (f"cli/ imports the layers below app/ {len(reaches)} times (at most "
                                             f"{MAX_CLI_REACHES}): move the work into an app function:\n"
                                             + "\n".join(reaches))


def test_ffn_top_k_is_declared_by_the_model_config_and_the_merge_options_alone():
    files = [str(p.relative_to(ROOT)) for layer in PACKAGE for p in sorted((ROOT / layer).rglob("*.py"))
             if declares(p.read_text(encoding="utf-8"), "ffn_top_k", "--ffn-top-k")]
    assert sorted(files) == ["runtime/config.py", "surgery/options.py"]
    assert len(files) <= MAX_FFN_TOP_K_FILES


def test_the_checks_find_what_they_count(tmp_path):
    assert declares("def f(x, *, ffn_top_k=None): pass", "ffn_top_k", "--ffn-top-k")
    assert declares("class C:\n    ffn_top_k: int = 1\n", "ffn_top_k", "--ffn-top-k")
    assert declares("click.option('--ffn-top-k', type=int)", "ffn_top_k", "--ffn-top-k")
    assert not declares("cfg.replace(ffn_top_k=2)\nprint(cfg.ffn_top_k)", "ffn_top_k", "--ffn-top-k")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "x.py").write_text("from bam_surgery.app.merge import merge\n"
                                           "from bam_surgery.runtime.errors import UserError\n"
                                           "def f():\n    import bam_surgery.train.loop\n")
    assert [r.split(" ")[1] for r in cli_reaches(tmp_path)] == ["bam_surgery.runtime.errors",
                                                                 "bam_surgery.train.loop"]


def test_use_cases_take_a_reporter_not_callbacks():
    from bam_surgery.app import exports, generate, merge, train

    for fn in (merge.merge, exports.convert, exports.export, generate.generate, train.train, train.evaluate,
               train.routing_stats):
        params = inspect.signature(fn).parameters
        assert "reporter" in params, fn.__name__
        callbacks = [n for n, p in params.items() if "Callable" in str(p.annotation) or n in ("warn", "log")
                     or n.startswith("on_")]
        assert not callbacks, f"{fn.__name__}: {callbacks}"
