"""Unit tests of the simulator's models (no HTTP): timing, scheduler, shared link, KV, parsing."""

from __future__ import annotations

import asyncio
import json

import pytest
from builders import endpoint

from ext_proc.discovery.eds import write_eds_file
from sim.clock import SimClock
from sim.config import EngineConfig, KvConfig, TimingConfig
from sim.engine import ABORTED, FINISHED, PULLING, RUNNING, WAITING, Engine, Scheduler, Sequence
from sim.kv import CROSS_GROUP, SAME_GROUP, GroupMap, KvTransferModel, SharedLink
from sim.protocol import RequestError, parse_generate, token_text

# --- timing and KV formulas -------------------------------------------------------------------


def test_timing_grows_with_tokens_and_batch() -> None:
    t = TimingConfig()
    assert t.prefill_ms(0, 0) == 0.0
    assert t.prefill_ms(2000, 1) > t.prefill_ms(1000, 1) > t.prefill_ms(100, 1)
    assert t.prefill_ms(1000, 4) > t.prefill_ms(1000, 1)
    assert t.decode_ms(0) == 0.0
    assert t.decode_ms(64) > t.decode_ms(8) > t.decode_ms(1) >= t.decode_step_ms
    assert 10.0 <= t.decode_ms(1) <= 20.0  # demo-sized defaults


@pytest.mark.parametrize(
    "bad", [{"max_batch": 0}, {"time_scale": 0.0}, {"time_scale": float("inf")}, {"decode_step_ms": -1.0}]
)
def test_timing_rejects_invalid(bad: dict) -> None:
    with pytest.raises(ValueError):
        TimingConfig(**bad)


def test_kv_transfer_formula() -> None:
    kv = KvConfig()
    assert kv.kv_bytes_per_token == 128 * 1024
    # 1000 tokens = 131 072 000 bytes: 1.31 ms at 100 GB/s, 13.1 ms at 10 GB/s, plus 1 ms base.
    assert kv.unloaded_transfer_ms(1000, same_group=True) == pytest.approx(1.0 + 1.31072)
    assert kv.unloaded_transfer_ms(1000, same_group=False) == pytest.approx(1.0 + 13.1072)
    with pytest.raises(ValueError):
        KvConfig(cross_group_gbps=0.0)
    with pytest.raises(ValueError):
        EngineConfig(role="router")  # type: ignore[arg-type]


# --- shared link (pure processor-sharing bookkeeping, explicit model times) --------------------


def test_shared_link_alone_and_concurrent() -> None:
    link = SharedLink(1000.0)
    a = link.start(1000, now=0.0)
    assert link.next_finish() == pytest.approx(1.0)
    b = link.start(1000, now=0.0)
    assert link.next_finish() == pytest.approx(2.0)  # each gets half the bandwidth
    assert link.advance(1.9) == []
    done = link.advance(2.5)
    assert set(done) == {a, b}
    assert a.finish == pytest.approx(2.0) and b.finish == pytest.approx(2.0)
    assert link.active == 0


def test_shared_link_staggered_flows_are_exact() -> None:
    link = SharedLink(1000.0)
    a = link.start(1000, now=0.0)
    b = link.start(1000, now=0.5)  # a has 500 bytes left, then both run at 500 B/s
    done = link.advance(10.0)  # one late wake-up still yields exact finish times
    assert [f.finish for f in done] == [pytest.approx(1.5), pytest.approx(2.0)]
    assert done == [a, b]
    assert (a.finish - a.start, b.finish - b.start) == (pytest.approx(1.5), pytest.approx(1.5))


def test_shared_link_speeds_up_when_a_flow_leaves() -> None:
    link = SharedLink(100.0)
    small = link.start(50, now=0.0)
    big = link.start(300, now=0.0)
    link.advance(1.0)  # both at 50 B/s: small done at t=1, big has 250 left, alone at 100 B/s
    assert small.finish == pytest.approx(1.0)
    assert link.next_finish() == pytest.approx(3.5)
    link.advance(3.5)
    assert big.finish == pytest.approx(3.5)
    assert link.start(0, now=4.0).finish == 4.0  # empty transfer finishes at once


async def test_shared_link_concurrent_transfers_take_longer() -> None:
    clock = SimClock(time_scale=1e-3)  # 1 model second = 1 wall ms
    link = SharedLink(1e9, clock)
    alone = await link.transfer(1e9)  # 1 model second alone
    assert alone == pytest.approx(1.0, rel=0.05)
    both = await asyncio.gather(link.transfer(1e9), link.transfer(1e9))
    assert all(d > 1.5 * alone for d in both)  # computed model durations, ~2 s each
    three = await asyncio.gather(*(link.transfer(1e9) for _ in range(3)))
    assert all(d > max(both) for d in three)


async def test_kv_pull_same_vs_cross_group(tmp_path) -> None:
    eds = tmp_path / "eds.json"
    write_eds_file(
        eds,
        "prefill",
        [
            endpoint("10.0.0.1:8000", "g1"),
            endpoint("10.0.0.2:8000", "g2"),
        ],
    )
    clock = SimClock(time_scale=1e-3)
    kv = KvConfig()
    model = KvTransferModel(kv, "g1", GroupMap([eds]), SharedLink(kv.cross_group_gbps * 1e9, clock), clock)
    same = await model.pull("10.0.0.1:8000", 1000)
    cross = await model.pull("10.0.0.2:8000", 1000)
    unknown = await model.pull("10.9.9.9:8000", 1000)
    assert (same.kind, same.prefill_group) == (SAME_GROUP, "g1")
    assert (cross.kind, cross.prefill_group) == (CROSS_GROUP, "g2")
    assert (unknown.kind, unknown.prefill_group) == (CROSS_GROUP, None)
    assert same.model_ms == pytest.approx(kv.unloaded_transfer_ms(1000, same_group=True))
    assert cross.model_ms == pytest.approx(kv.unloaded_transfer_ms(1000, same_group=False), rel=0.05)
    assert cross.model_ms > 5 * same.model_ms


def test_group_map_reloads_and_keeps_last_good(tmp_path) -> None:
    eds = tmp_path / "eds.json"
    groups = GroupMap([eds, tmp_path / "missing.json"])
    assert groups.lookup("10.0.0.1:8000") is None
    write_eds_file(eds, "c", [endpoint("10.0.0.1:8000", "g1")])
    assert groups.lookup("10.0.0.1:8000") == "g1"
    write_eds_file(eds, "c", [endpoint("10.0.0.1:8000", "g7")])
    assert groups.lookup("10.0.0.1:8000") == "g7"
    eds.write_text("{not json")
    assert groups.lookup("10.0.0.1:8000") == "g7"


# --- scheduler (pure) -------------------------------------------------------------------------


def _seq(prompt: int, out: int, pull: bool = False) -> Sequence:
    async def _pull(tokens: int):  # never awaited by the pure scheduler
        raise AssertionError

    return Sequence("r", prompt, out, out, arrival=0.0, pull=_pull if pull else None)


def test_scheduler_queues_beyond_max_batch() -> None:
    s = Scheduler(TimingConfig(max_batch=2))
    seqs = [_seq(10, 2) for _ in range(3)]
    for q in seqs:
        s.add(q)
    assert s.admit(0.0) == seqs[:2]
    assert (len(s.running), s.num_waiting, seqs[2].state) == (2, 1, WAITING)
    plan = s.plan()
    assert plan is not None and len(plan.prefill) == 2 and not plan.decode
    assert s.apply(plan, 0.1) == seqs[:2]  # prefill done -> first token
    assert seqs[0].first_token_at == 0.1 and seqs[0].generated == 1
    plan = s.plan()
    assert plan is not None and plan.decode == seqs[:2] and not plan.prefill
    s.apply(plan, 0.2)
    assert seqs[0].state == FINISHED and seqs[0].finish_reason == "length"
    assert s.used_blocks == 0
    assert s.admit(0.2) == [seqs[2]] and s.num_waiting == 0


def test_scheduler_waits_for_kv_capacity() -> None:
    s = Scheduler(TimingConfig(kv_capacity_tokens=64, block_size=16))  # 4 blocks
    first, second = _seq(40, 8), _seq(20, 4)  # 3 blocks, 2 blocks
    s.add(first)
    s.add(second)
    assert s.admit(0.0) == [first]
    assert s.num_waiting == 1 and s.kv_usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        s.add(_seq(60, 10))  # can never fit
    s.abort(first)
    assert first.state == ABORTED and s.used_blocks == 0
    assert s.admit(0.0) == [second]


def test_scheduler_chunked_prefill_and_step_time() -> None:
    t = TimingConfig(max_num_batched_tokens=100)
    s = Scheduler(t)
    decoding, long = _seq(0, 5), _seq(250, 5)
    s.add(decoding)
    s.add(long)
    s.admit(0.0)
    plan = s.plan()
    assert plan is not None
    assert plan.decode == [decoding] and plan.prefill == [(long, 99)]  # budget minus one decode token
    assert plan.duration_s == pytest.approx((t.decode_ms(1) + t.prefill_ms(99, 1)) / 1e3)
    s.apply(plan, 1.0)
    assert long.prefilled == 99 and long.generated == 0 and decoding.generated == 1


def test_scheduler_pulled_sequences_count_as_waiting() -> None:
    s = Scheduler(TimingConfig())
    seq = _seq(100, 3, pull=True)
    s.add(seq)
    s.admit(0.0)
    assert seq.state == PULLING and s.num_waiting == 1 and s.plan() is None
    s.kv_loaded(seq)
    assert seq.state == RUNNING and seq.prefilled == 100
    plan = s.plan()
    assert plan is not None and plan.decode == [seq] and not plan.prefill


async def test_engine_runs_requests_and_counts() -> None:
    engine = Engine(EngineConfig(timing=TimingConfig(time_scale=1e-3)))
    await engine.start()
    try:
        seqs = [engine.submit(100, 8, 8), engine.submit(50, 8, 3)]
        for seq in seqs:
            await engine.wait_done(seq)
        assert [s.finish_reason for s in seqs] == ["length", "stop"]
        assert engine.metrics.generation_tokens._value.get() == 11
        assert engine.metrics.prompt_tokens._value.get() == 150
        assert seqs[0].first_token_at - seqs[0].arrival > 0
    finally:
        await engine.stop()


# --- request parsing --------------------------------------------------------------------------

T = TimingConfig()


def _parse(body: object, chat: bool = False):
    return parse_generate(json.dumps(body).encode(), chat, T)


def test_prompt_token_counting() -> None:
    assert _parse({"prompt": "abcdefghi"}).prompt_tokens == 3  # ceil(9 / 4)
    assert _parse({"prompt": ["abcd", "efghi"]}).prompt_tokens == 3  # over all strings
    assert _parse({"prompt": [1, 2, 3, 4, 5]}).prompt_tokens == 5
    assert _parse({"prompt": [[1, 2], [3, 4, 5]]}).prompt_tokens == 5
    parts = [{"type": "text", "text": "efgh"}, {"type": "image_url", "image_url": {"url": "x"}}]
    chat = {"messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": parts}]}
    assert _parse(chat, chat=True).prompt_tokens == 2


def test_output_budget_and_options() -> None:
    assert _parse({"prompt": "x"}).max_tokens == T.default_max_tokens
    assert _parse({"prompt": "x", "max_tokens": 7}).max_tokens == 7
    req = _parse({"prompt": "x", "max_tokens": 7, "max_completion_tokens": 3, "sim_output_tokens": 2})
    assert (req.max_tokens, req.output_tokens) == (3, 2)
    req = _parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.include_usage
    assert not _parse({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 3},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": "3"},
        {"prompt": "x", "n": 2},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "stream_options": []},
        {"prompt": "x", "kv_transfer_params": "y"},
        {"prompt": [1, "a"]},
        {"prompt": "x", "max_tokens": 40000},
        ["not", "an", "object"],
    ],
)
def test_invalid_requests(body: object) -> None:
    with pytest.raises(RequestError):
        _parse(body)


def test_invalid_chat_and_json() -> None:
    with pytest.raises(RequestError):
        _parse({"messages": []}, chat=True)
    with pytest.raises(RequestError):
        _parse({"messages": "hi"}, chat=True)
    with pytest.raises(RequestError):
        parse_generate(b"{oops", False, T)


def test_token_text_is_four_chars_per_token() -> None:
    assert len(token_text(0, 10)) == 40
    assert token_text(0, 3) + token_text(3, 5) == token_text(0, 5)


async def test_engine_abort_cancels_kv_pull_and_frees_the_link() -> None:
    engine = Engine(EngineConfig(role="decode", group="g1", timing=TimingConfig(time_scale=1e-3)))
    link = engine.kv.link
    await engine.start()
    try:
        hours = 10**9  # tokens: hours of transfer
        seq = engine.submit(1000, 4, 4, pull=lambda tokens: engine.kv.pull("10.0.0.9:1", hours))
        while link.active == 0:
            await asyncio.sleep(0.001)
        assert seq.state == PULLING and engine.scheduler.num_waiting == 1
        engine.abort(seq)
        await asyncio.sleep(0.01)
        assert link.active == 0 and engine.scheduler.num_waiting == 0 and engine.scheduler.used_blocks == 0
        assert seq.state == ABORTED
    finally:
        await engine.stop()
