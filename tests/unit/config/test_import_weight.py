"""What importing the configuration and the pure tokenizer loads, checked at run time in a fresh process.

The import-linter contracts of pyproject.toml see only import statements: a package's ``__init__``
that re-exports a heavy module, or an import run later, escapes them. These tests import the module in
a new interpreter and read ``sys.modules``; the forbidden libraries are the contract's own list.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
CONFIG_CONTRACT = "the configuration loads no compiled index, gRPC, HTTP client, tokenizer library or ZeroMQ"
TOKENIZER_LIBRARIES = ("tokenizers", "tiktoken", "fastokens")


def contract_forbids(name: str) -> list[str]:
    """The ``forbidden_modules`` of the import-linter contract called ``name``."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = (c for c in contracts if c["name"] == name)
    return list(contract["forbidden_modules"])


def loaded(module: str, candidates: list[str] | tuple[str, ...]) -> list[str]:
    """Which of the top-level ``candidates`` a fresh interpreter holds after ``import module``."""
    code = (
        "import sys\n"
        f"import {module}\n"
        f"print(sorted({{m.partition('.')[0] for m in sys.modules}} & {set(candidates)!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout)


def test_the_configuration_loads_none_of_its_contracts_forbidden_libraries() -> None:
    forbidden = contract_forbids(CONFIG_CONTRACT)
    assert {"numba", "grpc", "aiohttp", "zmq", *TOKENIZER_LIBRARIES} <= set(forbidden)
    assert loaded("ext_proc.config", forbidden) == []


def test_the_pure_tokenizer_loads_no_tokenizer_library() -> None:
    """``prompt`` imports the other pure modules (``base``, ``template``, ``cache``)."""
    assert loaded("ext_proc.tokenize.prompt", TOKENIZER_LIBRARIES) == []


def test_the_check_sees_a_library_that_is_loaded() -> None:
    """The probe itself can fail: the tokenizer's shell loads the libraries the pure part must not."""
    assert loaded("ext_proc.tokenize.folder", TOKENIZER_LIBRARIES) == sorted(TOKENIZER_LIBRARIES)
