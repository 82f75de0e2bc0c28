"""The simulated engine's priority scheduling (vLLM v1 ``--scheduling-policy priority``)."""

from __future__ import annotations

import pytest

from sim.config import TimingConfig
from sim.engine import FINISHED, RUNNING, WAITING, Scheduler, Sequence
from sim.protocol import RequestError, parse_generate


def _seq(name: str, prompt: int, out: int, priority: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(name, prompt, out, out, arrival=arrival, priority=priority)


def _run_step(s: Scheduler, now: float) -> list[Sequence]:
    plan = s.plan()
    assert plan is not None
    return s.apply(plan, now)


def test_waiting_is_ordered_by_priority_then_arrival() -> None:
    s = Scheduler(TimingConfig(max_batch=1, scheduling_policy="priority"))
    late_urgent, early_batch = _seq("u2", 8, 1, -10, 2.0), _seq("b", 8, 1, 1, 0.0)
    early_urgent = _seq("u1", 8, 1, -10, 1.0)
    for seq in (early_batch, late_urgent, early_urgent):
        s.add(seq)
    assert [q.request_id for q in s.waiting] == ["u1", "u2", "b"]
    assert s.admit(0.0) == [early_urgent]


def test_fcfs_ignores_priority() -> None:
    s = Scheduler(TimingConfig(max_batch=1))
    first, urgent = _seq("first", 8, 1, 5), _seq("urgent", 8, 1, -5, 1.0)
    s.add(first)
    s.add(urgent)
    assert s.admit(0.0) == [first]


def test_no_preemption_to_admit_a_waiting_sequence() -> None:
    """As in vLLM v1: a waiting sequence of higher priority waits for a slot; nothing running is evicted."""
    s = Scheduler(TimingConfig(max_batch=1, scheduling_policy="priority"))
    batch = _seq("batch", 8, 3, priority=1)
    s.add(batch)
    s.admit(0.0)
    urgent = _seq("urgent", 8, 1, priority=-10, arrival=1.0)
    s.add(urgent)
    assert s.admit(1.0) == [] and batch.state == RUNNING and urgent.state == WAITING
    _run_step(s, 1.1)
    assert batch.preemptions == 0 and s.preemptions == 0


def test_missing_block_preempts_the_lowest_priority_and_it_recomputes() -> None:
    # 4 blocks of 4 tokens; each sequence takes 2 at admission (its 6-token prompt), a third once its
    # KV holds 9 tokens (the step that makes its 4th token feeds its 3rd).
    timing = TimingConfig(kv_capacity_tokens=16, block_size=4, scheduling_policy="priority")
    s = Scheduler(timing)
    urgent, batch = _seq("urgent", 6, 5, priority=-10, arrival=1.0), _seq("batch", 6, 5, priority=1)
    s.add(batch)
    s.add(urgent)
    assert s.admit(0.0) == [urgent, batch] and s.used_blocks == 4  # no full reservation: both fit
    for now in (0.1, 0.2, 0.3):  # tokens 1 to 3 of each: 8 tokens in KV at most, 2 blocks
        assert _run_step(s, now) == [urgent, batch]
    # token 4 needs a third block each: none free, so the batch sequence is preempted for the urgent one
    assert _run_step(s, 0.4) == [urgent]
    state = (batch.state, batch.preemptions, batch.resumed, batch.prefilled, batch.kv_blocks)
    assert state == (WAITING, 1, 3, 0, 0)
    assert s.preemptions == 1 and urgent.kv_blocks == 3 and list(s.waiting) == [batch]
    assert s.admit(0.4) == []  # needs 3 blocks (6 prompt + 3 generated), 1 free
    _run_step(s, 0.5)  # urgent's last token
    assert urgent.state == FINISHED and s.used_blocks == 0
    assert s.admit(0.5) == [batch] and batch.kv_blocks == 3
    plan = s.plan()
    assert plan is not None and plan.prefill == [(batch, 9)] and not plan.decode  # prompt + 3 recomputed
    assert s.apply(plan, 0.6) == [batch] and batch.generated == 4  # the recompute yields the 4th token
    _run_step(s, 0.7)
    assert batch.state == FINISHED and batch.generated == 5 and batch.first_token_at == 0.1


def test_the_asking_sequence_is_preempted_when_it_is_the_lowest() -> None:
    timing = TimingConfig(kv_capacity_tokens=16, block_size=4, scheduling_policy="priority")
    s = Scheduler(timing)
    high, low = _seq("high", 6, 5, priority=0), _seq("low", 7, 5, priority=5, arrival=1.0)
    s.add(high)
    s.add(low)
    s.admit(0.0)
    _run_step(s, 0.1)
    _run_step(s, 0.2)  # low: 7 + 1 tokens in KV; high: 6 + 1
    _run_step(s, 0.3)  # low needs a 3rd block first (9 tokens): it is the lowest itself
    assert low.state == WAITING and low.preemptions == 1 and high.state == RUNNING


def test_priority_field_is_parsed_and_validated() -> None:
    timing = TimingConfig()
    assert parse_generate(b'{"prompt": "x", "priority": -3}', False, timing).priority == -3
    assert parse_generate(b'{"prompt": "x"}', False, timing).priority == 0
    for bad in (b'{"prompt": "x", "priority": "1"}', b'{"prompt": "x", "priority": true}'):
        with pytest.raises(RequestError):
            parse_generate(bad, False, timing)


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        TimingConfig(scheduling_policy="lifo")


def test_priority_preempt_evicts_a_much_lower_priority_for_a_waiting_one_and_it_resumes() -> None:
    s = Scheduler(TimingConfig(max_batch=1, scheduling_policy="priority-preempt"))
    batch = _seq("batch", 8, 3, priority=1)
    s.add(batch)
    s.admit(0.0)
    _run_step(s, 0.1)  # the batch sequence's first token
    near = _seq("near", 8, 1, priority=-9, arrival=1.0)  # 10 better: not more than the threshold
    s.add(near)
    assert s.admit(1.0) == [] and batch.state == RUNNING
    s.abort(near)
    urgent = _seq("urgent", 8, 1, priority=-10, arrival=1.0)  # 11 better
    s.add(urgent)
    assert s.admit(1.0) == [urgent]
    assert (batch.state, batch.resumed, batch.preemptions, list(s.waiting)) == (WAITING, 1, 1, [batch])
    _run_step(s, 1.1)
    assert urgent.state == FINISHED
    assert s.admit(1.1) == [batch]
    plan = s.plan()
    assert plan is not None and plan.prefill == [(batch, 9)]  # its prompt and its first token again
