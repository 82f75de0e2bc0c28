"""A test stuck in a compiled loop (numba, ``nogil``, as the prefix index's) ends at its timeout.

pytest-timeout's signal method cannot interrupt it (a Python signal handler runs between bytecodes,
never inside compiled code), so ``make test`` would hang forever; the thread method of pyproject.toml
dumps the stacks and ends the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"

STUCK = '''
import numba
import numpy as np
import pytest


@numba.njit("int64(int64[:])", nogil=True)  # compiled when collected, not within the timeout
def probe(table):
    """A linear probe for an empty slot in a table that has none: it never ends."""
    i = 0
    while table[i] != 0:
        i = (i + 1) & (len(table) - 1)
    return i


@pytest.mark.timeout(1)
def test_stuck():
    probe(np.ones(4, np.int64))
'''


def test_a_test_stuck_in_a_nogil_compiled_loop_ends_at_its_timeout(tmp_path: Path) -> None:
    (tmp_path / "test_stuck.py").write_text(STUCK)
    command = [sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir", str(tmp_path)]
    command += ["-p", "no:cacheprovider", str(tmp_path / "test_stuck.py")]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the stuck test was not interrupted at its 1 s timeout") from None
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "+ Timeout +" in out and "probe(np.ones(4, np.int64))" in out  # and the stack where it hung
