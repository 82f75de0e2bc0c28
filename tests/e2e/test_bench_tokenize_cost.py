"""Smoke test of bench/tokenize_cost.py at its reduced size (never timing)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import tokenize_cost as cost


def test_the_quick_run_measures_a_12k_chat_with_its_earlier_turn_cached_with_every_encoder(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cost.json"
    assert cost.main(["--quick", "--reps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the fast encoders loaded for the trained BPE and answered tokenizers' ids
    assert result["ids_equal"] == {"fastokens": True, "tiktoken": True}
    for encoder in ("fastokens", "tiktoken", "tokenizers"):
        measured = result[encoder]
        assert measured["prompt_tokens"]["min"] >= cost.PROMPT_TOKENS
        assert 0 < measured["seen_tokens"]["min"] <= measured["seen_tokens"]["max"] <= cost.SEEN_TOKENS * 1.01
        assert measured["cached_tokens"] == measured["seen_tokens"]  # the earlier turn came from the cache
        for path in cost.PATHS:
            assert 0 < measured[path]["p50_ms"] <= measured[path]["p90_ms"]
