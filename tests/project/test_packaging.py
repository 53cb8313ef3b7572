"""What `pip install bam-surgery` gives a user: every third-party package the code imports is declared, one
version string, and a missing optional package is one error line, not a traceback.

The wheel itself is built, installed into a fresh venv and run from another directory by
tests/compat/test_wheel.py (make test-compat: it installs torch and the rest, so it is kept out of `make test`).
"""
from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

import bam_surgery
from conftest import absolute_imports, cli_error_line, dist_name, setup_keyword

ROOT = Path(__file__).resolve().parents[2]


def _setup_layers() -> tuple[str, ...]:
    """setup.py's LAYERS (the folders mapped into bam_surgery), read with ast."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LAYERS":
            return ast.literal_eval(node.value)
    raise KeyError("LAYERS")


LAYERS = ("bam_surgery", *_setup_layers())
# remote code shipped into HF BAM exports: it runs in the user's transformers, never imported by the tool itself
REMOTE_CODE = {Path("converters/hf_bam/configuration_bam.py"), Path("converters/hf_bam/modeling_bam.py")}
# the vLLM plugin: its module-level imports of vllm are in model.py, which only vLLM imports (the plugin names it as
# a string), and the entry point imports vllm and transformers inside the function vLLM calls; these two packages
# are the client's, never bam-surgery's dependencies
CLIENT_CODE = {Path("converters/vllm_bam/__init__.py"): {"vllm", "transformers"},
               Path("converters/vllm_bam/model.py"): {"vllm"}}


def third_party_imports() -> dict[str, list[str]]:
    """top-level module -> where it is imported, over every module of the package but the remote code."""
    found: dict[str, list[str]] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in REMOTE_CODE:
                continue
            for node, name in absolute_imports(ast.parse(path.read_text(encoding="utf-8"))):
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "bam_surgery" and top not in CLIENT_CODE.get(rel, ()):
                    found.setdefault(top, []).append(f"{rel}:{node.lineno}")
    return found


def test_every_imported_package_is_declared():
    declared = {dist_name(r) for r in setup_keyword("install_requires")}
    provided = metadata.packages_distributions()
    missing = []
    for module, where in sorted(third_party_imports().items()):
        dists = {d.lower().replace("_", "-") for d in provided.get(module, [module])}
        if not dists & declared:
            missing.append(f"{module} ({', '.join(sorted(dists))}) imported at {where[0]}")
    assert not missing, "imported but not in setup.py's install_requires: " + "; ".join(missing)
    # and the list holds nothing the code does not import (a stale entry costs users an install)
    imported = {d.lower().replace("_", "-") for m in third_party_imports() for d in provided.get(m, [m])}
    assert declared <= imported | {"pyarrow", "onnxscript"}, declared - imported  # datasets' and torch.onnx's backends


def test_transformers_is_not_needed_to_write_an_export():
    assert "transformers" not in third_party_imports()
    assert "transformers" not in {dist_name(r) for r in setup_keyword("install_requires")}


def test_one_version_string():
    text = (ROOT / "setup.py").read_text()
    assert "version=VERSION" in text and "0.1.0" not in text
    defined = [str(p.relative_to(ROOT)) for layer in LAYERS for p in (ROOT / layer).rglob("*.py")
               if re.search(r"^__version__\s*=", p.read_text(encoding="utf-8"), re.M)]
    assert defined == ["bam_surgery/__init__.py"], defined
    assert re.fullmatch(r"\d+\.\d+\.\d+", bam_surgery.__version__)


def test_a_missing_optional_package_is_one_line(tmp_path, monkeypatch):
    from conftest import tiny_config

    from bam_surgery.runtime import Model, save_model

    save_model(Model(tiny_config()), tmp_path / "m.safetensors")
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` now raises ModuleNotFoundError
    line = cli_error_line("export-onnx", tmp_path / "m.safetensors", "--out", tmp_path / "onnx")
    assert "'onnx'" in line and "pip install onnx" in line
    assert not (tmp_path / "onnx").exists()


@pytest.mark.parametrize("name, dist", [("yaml.constructor", "PyYAML"), ("onnxruntime", "onnxruntime"),
                                        ("lm_eval", "lm_eval")])
def test_missing_package_names_what_to_install(name, dist):
    from bam_surgery.app.errors import missing_package_message

    assert f"pip install {dist}" in missing_package_message(ModuleNotFoundError("x", name=name))
    assert missing_package_message(ModuleNotFoundError("x", name="bam_surgery.surgery.nothing")) is None


def test_compat_stage_checks_the_declared_range():
    """make test-compat's venvs are the ends of the range the HF BAM export declares; the main pin is inside it."""
    from bam_surgery.converters.hf_bam import schema_bam

    makefile = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^COMPAT_OLDEST := (\S+)$", makefile, re.M).group(1)
    newest = re.search(r"^COMPAT_NEWEST := (\S+)$", makefile, re.M).group(1)
    pinned = re.search(r"^transformers==(\S+)", (ROOT / "requirements-test.txt").read_text(), re.M).group(1)
    assert oldest == schema_bam.TRANSFORMERS_MIN
    assert sorted(schema_bam.TRANSFORMERS_TESTED, key=schema_bam.version_tuple) == \
        sorted({oldest, newest, pinned}, key=schema_bam.version_tuple)
    assert schema_bam.version_tuple(newest) < schema_bam.version_tuple(schema_bam.TRANSFORMERS_BELOW)
    assert "make test-compat" in (ROOT / ".ci" / "run").read_text()
