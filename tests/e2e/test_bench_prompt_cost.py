"""Smoke tests of the prompt-length cost benchmark (bench/prompt_cost.py) at reduced sizes (never timing)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import prompt_cost


def test_prompt_text_has_the_asked_length_and_a_unique_first_block():
    text = prompt_cost.prompt_text(1000, 7)
    assert len(text) == 4000
    assert text[:64] != prompt_cost.prompt_text(1000, 8)[:64]


def test_in_process_and_gateways_write_every_row_with_a_baseline_beside(tmp_path):
    out = tmp_path / "cost.json"
    root = Path(__file__).resolve().parents[2]  # this tree as its own baseline
    argv = ["--requests", "2", "--seconds", "0.2", "--long-streams", "1", "--no-smg", "--json", str(out)]
    assert prompt_cost.main([*argv, "--baseline", str(root)]) == 0
    results = json.loads(out.read_text())
    assert set(results["in_process"]) == {*prompt_cost.PROMPT_TOKENS, "16MiB"}
    assert results["in_process"]["16MiB"]["body_bytes"] <= prompt_cost.BIG_BODY_BYTES
    for label in prompt_cost.PROMPT_TOKENS:
        row = results["gateway"][label]
        before = {f"{name}_before" for name in prompt_cost.ROUTERS}
        assert {"direct", "without_filter", "bare_ext_proc", *prompt_cost.ROUTERS, *before} <= set(row)
        assert all(row[name]["errors"] == 0 for name in (*prompt_cost.ROUTERS, *before)), row
    short = {"direct", "without_filter", "bare_ext_proc", "pd_extproc_index", "pd_extproc_index_before"}
    assert set(results["interference"]["alone"]) == short
    assert set(results["interference"]["beside"]) == short - {"direct"}
    for through in results["interference"]["beside"].values():
        assert set(through["short"]) == short and through["long_requests"] > 0
    assert results["largest_body"]["pd_extproc_index"]["p50_ms"] > 0
