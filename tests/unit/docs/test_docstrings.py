"""Every public module, class and function starts its docstring with a one-line summary.

The rule (PEP 257's summary line): a docstring exists, its first line says what the thing is or does,
and a blank line follows it when more comes. Public: a module whose file name does not start with
``_`` (``__init__.py`` counts), and a class, function or method whose name does not start with ``_``,
at a module's top level or in a public class's body. Checked over the source (an AST walk: nothing
imported).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("ext_proc", "sim", "rig", "bench", "demo", "standins")
"""The packages held to the rule: every package the project ships (pyproject.toml's packages)."""

Definition = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def public_definitions(tree: ast.Module, module_public: bool) -> Iterator[tuple[str, Definition]]:
    """``tree`` itself when ``module_public``, then its public classes, functions and methods by name."""
    if module_public:
        yield "module", tree

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, Definition]]:
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name.startswith("_"):
                    continue
                yield f"{prefix}{node.name} (line {node.lineno})", node
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, f"{prefix}{node.name}.")

    yield from walk(tree.body, "")


def summary_problem(node: Definition) -> str | None:
    """Why ``node``'s docstring does not start with a one-line summary; ``None`` when it does."""
    doc = ast.get_docstring(node, clean=False)
    if doc is None:
        return "no docstring"
    lines = doc.split("\n")
    if not lines[0].strip():
        return "the docstring's first line is empty"
    if len(lines) > 1 and lines[1].strip():
        return f"the summary runs onto a second line: {lines[0].strip()[:70]!r}"
    return None


def problems(package: str) -> list[str]:
    """Every definition of ``package`` that breaks the rule, as ``path: name: why``."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_public = path.name == "__init__.py" or not path.name.startswith("_")
        for name, node in public_definitions(tree, module_public):
            problem = summary_problem(node)
            if problem is not None:
                found.append(f"{path.relative_to(ROOT)}: {name}: {problem}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_docstring_starts_with_a_one_line_summary(package: str) -> None:
    assert problems(package) == []


def test_the_rule_finds_what_breaks_it() -> None:
    tree = ast.parse(
        '"""A module.\nwrapped."""\n'
        "def f():\n    pass\n"
        'class C:\n    """C."""\n    def m(self):\n        """\n        Late."""\n'
        "    def _private(self):\n        pass\n"
        'def g():\n    """One line.\n\n    Then more."""\n'
    )
    found = {name.split(" ")[0]: summary_problem(node) for name, node in public_definitions(tree, True)}
    assert found == {
        "module": "the summary runs onto a second line: 'A module.'",
        "f": "no docstring",
        "C": None,
        "C.m": "the docstring's first line is empty",
        "g": None,
    }
