"""The shape of the code: the longest functions and the largest modules of the package.

    .venv/bin/python -m benchmarks.code_shape [--top 10]

Counts lines from `def` to the function's last line (docstring included, decorators not), over the
layer folders that install as bam_surgery (runtime, converters, train, surgery, pipeline, cli).
tests/project/test_code_shape.py holds every function outside tests/ and benchmarks/ to MAX_FUNCTION_LINES.
Together with the `duplicates` tool (`duplicates --min-lines 6` and `--min-lines 4`) it measures how much of the code
has one place.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "converters", "train", "surgery", "pipeline", "cli")
MAX_FUNCTION_LINES = 60


def python_files() -> list[Path]:
    return sorted(f for layer in LAYERS for f in (ROOT / layer).rglob("*.py"))


def functions(file: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in the file."""
    tree = ast.parse(file.read_text(), str(file))
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="How many functions and modules to list.")
    top = parser.parse_args().top
    rows = [(n, f"{f.relative_to(ROOT)}:{name}") for f in python_files() for n, name in functions(f)]
    print("longest functions (lines)")
    for n, where in sorted(rows, reverse=True)[:top]:
        print(f"  {n:4d}  {where}")
    sizes = [(len(f.read_text().splitlines()), str(f.relative_to(ROOT))) for f in python_files()]
    print("largest modules (lines)")
    for n, where in sorted(sizes, reverse=True)[:top]:
        print(f"  {n:4d}  {where}")


if __name__ == "__main__":
    main()
