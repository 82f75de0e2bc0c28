"""Trace readers and prompt synthesis (sim.traces): what a replay sends, and one clear error for a
malformed line, an unknown format or a window past the end."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from ext_proc.request import describe
from sim.prefix import chain
from sim.traces import (
    SAMPLE,
    TRACE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    output_budget,
    prompt_text,
    read_window,
    reuse_bound,
    spread,
)
from sim.workload import trace_plans

HEAD = SAMPLE  # 200 requests


def test_the_mooncake_reader_gives_arrivals_in_seconds_and_the_block_ids() -> None:
    window = read_window(HEAD, None, 0, None)
    assert len(window) == 200
    assert window[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    assert window[10].arrival_s == 3.0 and window[10].prompt_tokens == 13544
    later = read_window(HEAD, "mooncake", 10, 5)
    assert len(later) == 5 and later[0].arrival_s == 0.0  # the window's first request arrives at 0
    assert later[0].blocks == window[10].blocks


def _tokens(text: str) -> int:
    return describe({"messages": [{"role": "user", "content": text}]}, 1).prompt_tokens


def test_prompts_have_exactly_their_tokens_and_share_exactly_their_common_leading_ids() -> None:
    a, b = TraceRequest(0.0, 1500, 10, (7, 8, 9)), TraceRequest(0.0, 1100, 10, (7, 8, 5))
    text_a, text_b = prompt_text(a, 0), prompt_text(b, 1)
    assert (_tokens(text_a), _tokens(text_b)) == (1500, 1100)
    assert prompt_text(a, 5) == text_a  # the text depends on the ids, not on the request's place
    per_block = TRACE_BLOCK_TOKENS // 16
    hashes_a, hashes_b = chain(text_a, 16), chain(text_b, 16)
    common = next(i for i, (x, y) in enumerate(zip(hashes_a, hashes_b, strict=False)) if x != y)
    assert common == 2 * per_block  # ids 7 and 8 shared, not one 16-token block more
    assert not set(hashes_a[common:]) & set(hashes_b[common:])


def test_blocks_the_ids_do_not_cover_are_the_request_own() -> None:
    short = TraceRequest(0.0, 700, 1, (3,))  # 2 blocks of tokens, 1 id
    text = prompt_text(short, 0)
    assert _tokens(text) == 700 and text[: 4 * TRACE_BLOCK_TOKENS] == prompt_text(
        TraceRequest(0, 512, 1, (3,)), 9
    )
    assert prompt_text(short, 1)[4 * TRACE_BLOCK_TOKENS :] != text[4 * TRACE_BLOCK_TOKENS :]


def test_the_azure_reader_takes_iso_times_or_seconds_and_has_no_shared_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,4808,10\n"
        "2023-11-16 18:15:50.9951690,3180,8\n"
    )
    first, second = read_window(trace, None, 0, None)
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens, first.blocks) == (0.0, 4808, 10, ())
    assert second.arrival_s == pytest.approx(4.314579)
    assert prompt_text(first, 0)[:64] != prompt_text(first, 1)[:64]
    numeric = tmp_path / "seconds.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,100,1\n12,200,2\n")
    assert [r.arrival_s for r in read_window(numeric, "azure", 0, 2)] == [0.0, 1.5]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "Expecting property name"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_a_malformed_mooncake_line_is_named(tmp_path: Path, line: str, why: str) -> None:
    trace = tmp_path / "t.jsonl"
    good = HEAD.read_text().splitlines()[:2]
    trace.write_text("\n".join([*good, line, *good]) + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: not a Mooncake trace line: .*{why}"):
        read_window(trace, None, 0, None)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("time,a,b\n1,2,3\n", r"azure\.csv:1: not an Azure trace: the header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,x,3\n", r"azure\.csv:3: .*invalid literal"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n2,5\n", r"azure\.csv:3: .*2 columns"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nyesterday,5,1\n", r"azure\.csv:3: .*isoformat"),
    ],
)
def test_a_malformed_azure_line_is_named(tmp_path: Path, text: str, where: str) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(text)
    with pytest.raises(TraceError, match=where):
        read_window(trace, None, 0, None)


def test_unknown_format_and_windows_past_the_end_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(
        TraceError, match="--format: unknown trace format 'sharegpt'; choose from mooncake, azure"
    ):
        read_window(HEAD, "sharegpt", 0, 1)
    for start, count in ((200, 1), (150, 100), (5000, 1200), (300, None)):
        asked = f"--start {start}" + ("" if count is None else f" --count {count}")
        with pytest.raises(TraceError) as info:
            read_window(HEAD, None, start, count)
        assert str(info.value) == (
            f"{asked}: the window runs past the end of {HEAD}, which holds 200 requests (0-199)"
        )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match=r"which holds 0 requests$"):
        read_window(empty, None, 0, None)
    with pytest.raises(TraceError, match="cannot read the trace"):
        read_window(tmp_path / "missing.jsonl", None, 0, 1)


def test_the_reuse_bound_counts_leading_blocks_seen_before() -> None:
    requests = [
        TraceRequest(0.0, 1024, 1, (1, 2)),
        TraceRequest(1.0, 1500, 1, (1, 2, 3)),  # 1,024 of 1,500 tokens seen
        TraceRequest(2.0, 1024, 1, (1, 2)),  # all seen, but one token is computed: 1,008
        TraceRequest(3.0, 600, 1, (9, 2)),  # nothing: block 2 after 9 is another prefix
    ]
    assert reuse_bound(requests) == pytest.approx((1024 + 1008) / (1024 + 1500 + 1024 + 600))
    assert reuse_bound(read_window(HEAD, None, 0, None)) == pytest.approx(
        0.0593, abs=1e-4
    )  # minutes of reuse later


def test_a_window_as_a_workload_is_sped_up_capped_and_sends_the_synthesised_prompts() -> None:
    window = read_window(HEAD, None, 10, 20)
    plans = trace_plans(window, speed=3.0, max_output=100)
    assert [p.at for p in plans] == [r.arrival_s / 3.0 for r in window]
    assert [p.prompt for p in plans] == [prompt_text(r, i) for i, r in enumerate(window)]
    assert [p.prompt_tokens for p in plans] == [r.prompt_tokens for r in window]
    assert [p.max_tokens for p in plans] == [output_budget(r, 100) for r in window]
    assert output_budget(TraceRequest(0.0, 10, 500), 100) == 100
    assert (
        output_budget(TraceRequest(0.0, 10, 50), 100) == output_budget(TraceRequest(0.0, 10, 50), None) == 50
    )
    assert output_budget(TraceRequest(0.0, 10, 0), None) == 1  # one decode step at least


def test_requests_sharing_a_stamp_are_spread_evenly_up_to_the_next_stamp() -> None:
    stamped = [
        TraceRequest(t, 100 + i, 1) for i, t in enumerate([0.0, 0.0, 0.0, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0])
    ]
    out = spread(stamped)
    assert [r.prompt_tokens for r in out] == [r.prompt_tokens for r in stamped]  # the trace's order kept
    assert [r.arrival_s for r in out] == pytest.approx([0, 1, 2, 3, 4.5, 6, 6.75, 7.5, 8.25])
    assert spread([TraceRequest(5.0, 1, 1)] * 2) == [TraceRequest(5.0, 1, 1)] * 2  # no gap known: at once


def test_the_conversation_trace_head_is_stamped_every_three_seconds_and_spreads_to_distinct_arrivals() -> (
    None
):
    head = read_window(SAMPLE, None, 0, 200)
    stamps = sorted({r.arrival_s for r in head})
    assert len(stamps) < len(head) / 5 and all(2.9 < b - a < 3.1 for a, b in pairwise(stamps))
    arrivals = [r.arrival_s for r in spread(head)]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(head)
