"""The house the package layout keeps: few modules at minigpt's root, package __init__ files that only say
what the package is, no import cycle, short functions, no measured figures in comments, and a light start for
help. Read from the source with ast, so a module that no test imports is held too."""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "minigpt"
MAX_ROOT_MODULES = 5
MAX_FUNCTION_LINES = 60
# a measured time or throughput; a quoted example of what the code prints is not one
MEASURED = re.compile(r"\b[0-9][0-9,.]*\s?(ms|µs|tok/s|tokens/s|GB/s|MB/s|GFLOP/s)\b")
QUOTED = re.compile(r"(?<!\w)'[^'\n]*'(?!\w)")


@functools.cache
def sources() -> tuple[tuple[Path, str, ast.Module], ...]:
    """Every module of minigpt: its path from the repository root, its text and its syntax tree (read once
    for every test here)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found.append((path.relative_to(ROOT), text, ast.parse(text)))
    return tuple(found)


def module_name(path: Path) -> str:
    """minigpt/a/b.py -> minigpt.a.b; minigpt/a/__init__.py -> minigpt.a."""
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_at_most_five_modules_at_the_package_root() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= MAX_ROOT_MODULES, sorted(p.name for p in PACKAGE.glob("*.py"))


def states_the_version(node: ast.stmt) -> bool:
    """`__version__ = "..."`, a string and nothing computed."""
    return (
        isinstance(node, ast.Assign)
        and [ast.unparse(t) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def test_package_init_files_hold_only_their_docstring() -> None:
    """Importing one module of a package runs its __init__: an import there would load the rest of the
    package for every caller. minigpt's own also states the version."""
    for path, _, tree in sources():
        if path.name != "__init__.py":
            continue
        body = tree.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if path.parent == Path("minigpt"):
            body = [node for node in body if not states_the_version(node)]
        assert body == [], f"{path}: {[ast.unparse(n) for n in body]}"


def imported_modules(path: Path, tree: ast.Module, modules: set[str]) -> set[str]:
    """The modules of `modules` that the module at `path` imports anywhere: at the top, inside functions,
    under TYPE_CHECKING. `from a import b` counts a.b where b is a module, else a."""
    name = module_name(path)
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one package up per extra dot
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycle_among_minigpt_modules() -> None:
    trees = {path: tree for path, _, tree in sources()}
    names = {module_name(path) for path in trees}
    graph = {module_name(path): imported_modules(path, tree, names) for path, tree in trees.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        """Depth first; a module met again on the current path closes a cycle."""
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def long_functions() -> Iterator[str]:
    """Every function of minigpt longer than MAX_FUNCTION_LINES, counted from its `def` to its last line."""
    for path, _, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    yield f"{path}:{node.lineno} {node.name} ({lines} lines)"


def test_no_function_over_sixty_lines() -> None:
    assert list(long_functions()) == []


def prose_lines(text: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every comment and docstring line of a module, with its line number."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = node.body[0] if node.body else None
            if (
                isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                for offset, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + offset, line


def test_no_comment_or_docstring_states_a_measured_time_or_throughput() -> None:
    found = [
        f"{path}:{number} {line.strip()}"
        for path, text, tree in sources()
        for number, line in prose_lines(text, tree)
        if MEASURED.search(QUOTED.sub("", line))
    ]
    assert found == []


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_imports_neither_torch_nor_numpy(args: list[str]) -> None:
    """A real `minigpt ... --help` process, every import it makes listed by Python's -X importtime."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "minigpt", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "Usage" in done.stdout, done.stderr[-2000:]
    imported = {
        line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if "import time:" in line
    }
    assert "minigpt.cli.main" in imported  # the listing is there to read
    assert {name.partition(".")[0] for name in imported}.isdisjoint({"torch", "numpy"})
