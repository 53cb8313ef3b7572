"""House rules that a grep can keep (issue 21): the reader protocol is followed, never probed.

Every optional part of a reader has a default on runtime.reader.Reader, so no caller asks
`getattr(reader, ...)` / `hasattr(reader, ...)`; readers are context managers, so one is opened with
`with open_input(...) as reader:` rather than closed in a `finally:` block.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("runtime", "converters", "train", "surgery", "pipeline", "cli")

PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.)?_?\w*reader\b")
# calls that return a Reader: the openers and the reader classes
OPENERS = {"open_checkpoint", "open_input", "import_mixtral", "_open"}


def _sources():
    for layer in PACKAGE:
        yield from sorted((ROOT / layer).rglob("*.py"))


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _opens_a_reader(value: ast.AST) -> bool:
    return isinstance(value, ast.Call) and (_callee(value) in OPENERS or _callee(value).endswith("Reader"))


def reader_closed_in_finally(source: str) -> list[int]:
    """Line numbers of `X.close()` in a `finally:` block where X is a reader: a name assigned from an
    opener or a reader class in the same function, or any name that says it is one."""
    tree = ast.parse(source)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        readers = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and _opens_a_reader(n.value)
                   for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            if not (isinstance(node, ast.Try) and node.finalbody):
                continue
            for stmt in node.finalbody:
                for call in ast.walk(stmt):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "close" and isinstance(call.func.value, ast.Name)
                            and (call.func.value.id in readers or "reader" in call.func.value.id.lower())):
                        found.append(call.lineno)
    return sorted(set(found))


def test_no_reader_is_probed_for_a_part_of_the_protocol():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources()
            for i, line in enumerate(p.read_text().splitlines(), 1) if PROBE.search(line)]
    assert not hits, ("the Reader protocol has a default for every optional part (runtime/reader.py); add a "
                      "missing one there instead of probing:\n" + "\n".join(hits))


def test_no_reader_is_closed_in_a_finally_block():
    hits = [f"{p.relative_to(ROOT)}:{line}" for p in _sources() for line in reader_closed_in_finally(p.read_text())]
    assert not hits, "open readers with `with open_input(...) as reader:` instead:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_look_for():
    assert PROBE.search('files = getattr(reader, "tokenizer_files", None)')
    assert PROBE.search('if hasattr(self.reader, "close"):')
    assert not PROBE.search('getattr(cfg, "final_norm", True)')
    bad = ("def f(spec):\n"
           "    src = open_checkpoint(spec)\n"
           "    try:\n"
           "        return src.config\n"
           "    finally:\n"
           "        src.close()\n")
    assert reader_closed_in_finally(bad) == [6]
    fine = ("def f(spec, bar):\n"
            "    with open_checkpoint(spec) as reader:\n"
            "        try:\n"
            "            return reader.config\n"
            "        finally:\n"
            "            bar.close()\n")
    assert reader_closed_in_finally(fine) == []


# ---- ARCHITECTURE.md's "Where to add things" table names real places ---------------------------------------
def where_to_add_references() -> list[tuple[str, str | None]]:
    """(path, name or None) for every `path` or `path:name` in backticks in the table's rows."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Where to add things", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| to add")]
    assert len(rows) >= 10, "the table is gone"
    refs = []
    for row in rows:
        for token in re.findall(r"`([^`]+)`", row):
            m = re.fullmatch(r"([\w./-]+\.(?:py|md|yaml))(?::(\w+))?", token)
            if m:
                refs.append((m.group(1), m.group(2)))
    return refs


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_where_to_add_names_files_and_names_that_exist():
    refs = where_to_add_references()
    assert len(refs) >= 30
    missing = [f"{path}" + (f":{name}" if name else "") for path, name in refs
               if not (ROOT / path).is_file() or (name is not None and name not in _defined_names(ROOT / path))]
    assert not missing, "ARCHITECTURE.md's 'Where to add things' names what is not there: " + ", ".join(missing)


# ---- every path ARCHITECTURE.md names exists (its narrative too, not only the table) -------------------------
PATH = re.compile(r"(?<![\w./$-])((?:[a-z_][\w-]*/)+[\w.-]+\.(?:py|md|yaml|json|txt|ini))(?::([A-Za-z_][\w.]*))?")


def _defines(path: Path, dotted: str) -> bool:
    """`name` defined at the top of `path`, or `Class.attribute` (a method or field of that class)."""
    first, *rest = dotted.split(".")
    if first not in _defined_names(path):
        return False
    if not rest:
        return True
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == first), None)
    members = {n.name for n in (cls.body if cls else []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    members |= {n.target.id for n in (cls.body if cls else []) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name)}
    return rest[0] in members


def architecture_problems(text: str, root: Path = ROOT) -> list[str]:
    """Every repository path in the text (`layer/file.py`, `layer/file.py:name`, `docs/x.md`) that does not exist
    or does not define the name; placeholders (DIR/, RUN/: upper case) are not paths."""
    problems = []
    for m in PATH.finditer(text):
        path, name = m.group(1), m.group(2)
        name = name.rstrip(".") if name else None
        if not (root / path).exists():
            problems.append(path)
        elif name and path.endswith(".py") and not _defines(root / path, name):
            problems.append(f"{path}:{name}")
    return sorted(set(problems))


def test_architecture_names_only_what_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert len(PATH.findall(text)) >= 150, "the narrative's paths are no longer found"
    problems = architecture_problems(text)
    assert not problems, "ARCHITECTURE.md names what is not there: " + ", ".join(problems)


def test_architecture_check_finds_stale_paths():
    text = ("the input opened (`surgery/open_input.py:open_input`), OUT checked (`runtime/output_path.py:check_output_path`,"
            " `runtime/output_path.py:nothing_here`), `runtime/checkpoint.py:CheckpointReader.tokenizer_files`, "
            "`runtime/checkpoint.py:CheckpointReader.no_method`, written as DIR/stages/STAGE.json and cli/gone.py.")
    assert architecture_problems(text) == ["cli/gone.py", "runtime/checkpoint.py:CheckpointReader.no_method",
                                           "runtime/output_path.py:nothing_here", "surgery/open_input.py"]


# ---- a family is one record: the newer families' names stay out of the code ------------------------------------
# The families of 2024-26 (issue 37): each is a record in converters/hf/families.py, and every table is derived from
# the records, so a family's name appears in the code (not its comments or docstrings) of few package files: the
# records, and a name that is another thing's too (a tokenizer shape, a pre-tokenizer, a real model's package).
NEWER_FAMILIES = ("qwen3", "gemma", "olmo", "smollm", "phi3", "granite", "ministral", "exaone")
MAX_FILES_NAMING_A_FAMILY = 3


def code_text(source: str) -> str:
    """A module's code without its comments and docstrings (string statements), lower-cased."""
    import io
    import tokenize

    out, previous = [], tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                        tokenize.NL):
            previous = tok.type
            continue  # a docstring or another string statement
        if tok.type != tokenize.NL:
            previous = tok.type
        out.append(tok.string)
    return " ".join(out).lower()


def files_naming(name: str) -> list[str]:
    layers = ("runtime", "converters", "train", "surgery", "app", "pipeline", "cli", "bam_surgery")
    return [str(p.relative_to(ROOT)) for layer in layers for p in sorted((ROOT / layer).rglob("*.py"))
            if name in code_text(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("family", NEWER_FAMILIES)
def test_a_newer_family_is_named_in_few_package_files(family):
    files = files_naming(family)
    assert "converters/hf/families.py" in files
    assert len(files) <= MAX_FILES_NAMING_A_FAMILY, (family, files)


def test_code_text_leaves_out_comments_and_docstrings():
    src = '"""gemma here"""\nx = "qwen3"  # olmo\ndef f():\n    """granite"""\n    return 1\n'
    text = code_text(src)
    assert "qwen3" in text and "gemma" not in text and "olmo" not in text and "granite" not in text
