"""Which attention kernels vLLM for CPU runs for the rig's engines, asked of vLLM itself.

vLLM 0.32 for CPU picks its attention ISA in ``vllm/v1/attention/backends/cpu_attn.py``
``_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)``: ``amx`` when the CPU has AMX tiles
(``torch.cpu._is_amx_tile_supported()``), the dtype is bfloat16 and the block size a multiple of 32;
otherwise ``vec`` on x86 (``vec16`` for a head size that is a multiple of 16 but not 32), ``neon`` on
Arm. :func:`probe_attention` runs that function in the vLLM environment's Python with the rig's
dtype (:data:`rig.model.DTYPE`), block size (:data:`rig.engine.BLOCK_TOKENS`), head dim and the KV
cache dtype the engines have (``auto``: the model's), so the test output says which kernels ran.
``_get_attn_isa`` is vLLM's private function: when it cannot be asked (another vLLM, no
environment) the answer says why instead, and nothing fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from rig.engine import BLOCK_TOKENS
from rig.model import DTYPE, HEAD_DIM

PROBE = """
import json, sys
import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
dtype, block_size, head_size = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(json.dumps({
    "isa": _get_attn_isa(dtype, block_size, head_size, "auto"),
    "amx_tiles": torch.cpu._is_amx_tile_supported(),
}))
"""
"""What the environment's Python runs (``python -c PROBE dtype block_size head_size``): one JSON line."""
PROBE_TIMEOUT_SECONDS = 120.0
"""Bound on the probe: importing vLLM takes about 10 s of a core, longer beside starting engines."""


@dataclass(frozen=True, slots=True)
class AttentionPath:
    """The engines' ``dtype`` and the attention ISA vLLM picks for it.

    ``isa``; ``amx_tiles``: whether the CPU has AMX tiles. Both are ``None`` when vLLM could not be
    asked, and ``problem`` then says why."""

    dtype: str
    isa: str | None
    amx_tiles: bool | None
    problem: str | None = None

    def describe(self) -> str:
        """One line for the test output, e.g. ``dtype float32, attention ISA vec (AMX tiles: no)``."""
        if self.isa is None:
            return f"dtype {self.dtype}, attention ISA unknown ({self.problem})"
        return (
            f"dtype {self.dtype}, attention ISA {self.isa} (AMX tiles: {'yes' if self.amx_tiles else 'no'})"
        )


async def probe_attention(
    python: Path, dtype: str = DTYPE, timeout: float = PROBE_TIMEOUT_SECONDS
) -> AttentionPath:
    """Ask vLLM which attention ISA an engine of ``dtype`` runs.

    ``_get_attn_isa`` in ``python`` (the vLLM environment's), with the rig's block size and head dim.
    Never raises for vLLM's sake: a failure (the process did not start, failed, timed out or printed no
    answer) is an :class:`AttentionPath` whose ``problem`` says what happened. Cancelled, it kills the
    process it started."""

    def unknown(problem: str) -> AttentionPath:
        return AttentionPath(dtype, None, None, problem)

    argv = ("-c", PROBE, dtype, str(BLOCK_TOKENS), str(HEAD_DIM))
    try:
        process = await asyncio.create_subprocess_exec(
            str(python),
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        return unknown(f"cannot run {python}: {exc}")
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        return unknown(f"vLLM's _get_attn_isa did not answer within {timeout:.0f} s")
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    lines = out.decode(errors="replace").strip().splitlines()
    if process.returncode != 0 or not lines:
        said = err.decode(errors="replace").strip().splitlines() or ["no output"]
        return unknown(f"asking vLLM's _get_attn_isa failed (exit {process.returncode}): {said[-1]}")
    try:
        answer = json.loads(lines[-1])
        return AttentionPath(dtype, str(answer["isa"]), bool(answer["amx_tiles"]))
    except (ValueError, KeyError, TypeError) as exc:
        return unknown(f"vLLM's _get_attn_isa answered {lines[-1]!r}: {exc}")
