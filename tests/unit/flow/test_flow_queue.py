"""Flow control's pure parts (ext_proc/flow/queue.py, classify.py, saturation.py): band order, deficit
round-robin between flows checked against a plain one-quantum-a-turn reference, the bounds (capacity,
displacement, flows tracked), removal, and the band and flow a request's headers give."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ext_proc.flow.classify import MAX_FAIRNESS_ID_CHARS, Objectives, flow_of
from ext_proc.flow.queue import OVERFLOW_FLOW, QUANTUM_TOKENS, FlowQueue, QueueFull, Waiter
from ext_proc.flow.saturation import headroom


def waiter(priority: int = 0, flow: str = "a", cost: int = 100, arrived: float = 0.0) -> Waiter:
    return Waiter(priority, flow, cost, arrived)


def drain(queue: FlowQueue) -> list[Waiter]:
    popped = []
    while (w := queue.pop()) is not None:
        popped.append(w)
    return popped


def reference_drr(flows: dict[str, list[int]]) -> list[tuple[str, int]]:
    """Deficit round-robin as published, one quantum per turn: the (flow, index) service order of one band
    whose flows (in first-arrival order) hold these costs, all queued before the first pop."""
    ring = deque(name for name, costs in flows.items() if costs)
    pending = {name: deque(enumerate(costs)) for name, costs in flows.items()}
    credit = dict.fromkeys(flows, 0)
    order = []
    while ring:
        name = ring.popleft()
        credit[name] += QUANTUM_TOKENS
        while pending[name] and credit[name] >= pending[name][0][1]:
            index, cost = pending[name].popleft()
            credit[name] -= cost
            order.append((name, index))
        if pending[name]:
            ring.append(name)
        else:
            credit[name] = 0
    return order


# --- bands --------------------------------------------------------------------------------------------


def test_the_highest_band_goes_first_whatever_the_arrival_order_and_fifo_within_a_flow():
    queue = FlowQueue(100, 10)
    low1, low2, mid, high = waiter(-1), waiter(-1), waiter(0), waiter(10)
    for w in (low1, low2, mid, high):
        assert queue.push(w) is None
    assert queue.lengths() == {-1: 2, 0: 1, 10: 1}
    assert drain(queue) == [high, mid, low1, low2]
    assert len(queue) == 0 and queue.lengths() == {} and queue.pop() is None


def test_a_later_arrival_of_a_higher_band_overtakes_the_waiting_ones():
    queue = FlowQueue(100, 10)
    standard = [waiter(0, "t") for _ in range(3)]
    for w in standard:
        queue.push(w)
    assert queue.pop() is standard[0]
    urgent = waiter(10, "t")
    queue.push(urgent)
    assert drain(queue) == [urgent, *standard[1:]]


# --- fairness within a band ---------------------------------------------------------------------------


def test_two_flows_alternate_although_one_queued_all_its_requests_first():
    queue = FlowQueue(100, 10)
    early = [waiter(flow="early", cost=QUANTUM_TOKENS) for _ in range(5)]
    late = [waiter(flow="late", cost=QUANTUM_TOKENS) for _ in range(5)]
    for w in early + late:
        queue.push(w)
    assert [w.flow for w in drain(queue)] == ["early", "late"] * 5


def test_fair_shares_are_in_tokens_not_requests():
    queue = FlowQueue(1000, 10)
    for _ in range(100):
        queue.push(waiter(flow="big", cost=4 * QUANTUM_TOKENS))
    for _ in range(400):
        queue.push(waiter(flow="small", cost=QUANTUM_TOKENS))
    served = {"big": 0, "small": 0}
    for _ in range(200):
        w = queue.pop()
        assert w is not None
        served[w.flow] += w.cost
    assert abs(served["big"] - served["small"]) <= 4 * QUANTUM_TOKENS


def test_a_flow_that_empties_forgets_its_credit():
    queue = FlowQueue(100, 10)
    queue.push(waiter(flow="a", cost=1))  # served at once, nearly a whole quantum left
    assert queue.pop() is not None
    big = waiter(flow="a", cost=2 * QUANTUM_TOKENS)
    other = waiter(flow="b", cost=QUANTUM_TOKENS)
    queue.push(big)
    queue.push(other)
    assert drain(queue) == [other, big]  # "a" starts again from nothing: two turns for its 2 quanta


costs = st.integers(min_value=0, max_value=6 * QUANTUM_TOKENS)


@given(st.dictionaries(st.sampled_from("abcdef"), st.lists(costs, min_size=1, max_size=12), min_size=1))
def test_the_service_order_is_deficit_round_robin_with_whole_rounds_skipped_at_once(flows):
    queue = FlowQueue(1000, 10)
    index = {}
    for name, flow_costs in flows.items():
        for i, cost in enumerate(flow_costs):
            w = waiter(flow=name, cost=cost)
            index[id(w)] = (name, i)
            queue.push(w)
    assert [index[id(w)] for w in drain(queue)] == reference_drr(flows)


@given(st.lists(st.tuples(st.sampled_from("abcd"), costs), min_size=1, max_size=80))
def test_backlogged_flows_get_the_same_tokens_within_one_quantum_and_one_request(arrivals):
    queue = FlowQueue(1000, 10)
    backlog: dict[str, int] = {}
    for name, cost in arrivals:
        queue.push(waiter(flow=name, cost=cost))
        backlog[name] = backlog.get(name, 0) + 1
    served = dict.fromkeys(backlog, 0)
    biggest = max(cost for _, cost in arrivals)
    while all(backlog.values()):
        w = queue.pop()
        assert w is not None
        served[w.flow] += w.cost
        backlog[w.flow] -= 1
        if all(backlog.values()):
            assert max(served.values()) - min(served.values()) <= QUANTUM_TOKENS + biggest


# --- bounds -------------------------------------------------------------------------------------------


def test_a_full_queue_makes_room_for_a_higher_band_from_the_heaviest_flow_of_the_lowest():
    queue = FlowQueue(4, 10)
    light, heavy_old, heavy_new, mid = waiter(-1, "l"), waiter(-1, "h"), waiter(-1, "h"), waiter(0)
    for w in (light, heavy_old, heavy_new, mid):
        queue.push(w)
    high = waiter(10)
    assert queue.push(high) is heavy_new  # the newest of the heaviest flow of the lowest band
    assert queue.push(waiter(10)) in (light, heavy_old)
    assert len(queue) == 4


def test_a_full_queue_refuses_an_arrival_that_would_outweigh_every_other_flow_of_its_band():
    queue = FlowQueue(3, 10)
    for w in (waiter(0, "a"), waiter(0, "b"), waiter(5, "c")):
        queue.push(w)
    with pytest.raises(QueueFull):
        queue.push(waiter(0, "a"))  # "a" would hold 200 tokens, "b" 100: it is "a" that is full
    with pytest.raises(QueueFull):
        queue.push(waiter(-1, "z"))  # nothing below -1 to give its place
    assert len(queue) == 3


def test_a_flooding_flow_gives_its_places_to_a_lighter_one_of_the_same_band():
    queue = FlowQueue(4, 10)
    flood = [waiter(0, "flood") for _ in range(4)]
    for w in flood:
        queue.push(w)
    assert queue.push(waiter(0, "light")) is flood[3]
    assert queue.push(waiter(0, "light")) is flood[2]  # flood 200 tokens against light's 200 with it
    with pytest.raises(QueueFull):
        queue.push(waiter(0, "light"))
    assert queue.lengths() == {0: 4} and queue.flow_counts() == {0: 2}


def test_a_band_tracks_at_most_max_flows_flows_and_the_rest_share_one():
    queue = FlowQueue(100, 2)
    named = [waiter(flow=name) for name in ("a", "b")]
    extra = [waiter(flow=name) for name in ("c", "d", "e")]
    for w in named + extra:
        queue.push(w)
    assert [w.flow for w in extra] == [OVERFLOW_FLOW] * 3
    assert queue.flow_counts() == {0: 3}
    queue.push(waiter(flow="a"))  # a tracked flow keeps its own
    other_band = waiter(5, flow="c")
    queue.push(other_band)  # every band has its own bound
    assert other_band.flow == "c"
    popped = drain(queue)
    assert popped[0] is other_band
    assert {w.flow for w in popped} == {"a", "b", OVERFLOW_FLOW, "c"}


def test_the_queue_refuses_nonsense_bounds():
    with pytest.raises(ValueError):
        FlowQueue(0, 1)
    with pytest.raises(ValueError):
        FlowQueue(1, 0)


# --- removal and the oldest ---------------------------------------------------------------------------


def test_a_removed_waiter_is_never_dispatched_and_its_empty_flow_and_band_go():
    queue = FlowQueue(100, 10)
    a1, a2, b1, high = waiter(flow="a"), waiter(flow="a"), waiter(flow="b"), waiter(10, "h")
    for w in (a1, a2, b1, high):
        queue.push(w)
    assert queue.remove(a2) and queue.remove(high)
    assert not queue.remove(high) and not queue.remove(waiter(flow="a")) and not queue.remove(waiter(7))
    assert queue.lengths() == {0: 2} and queue.flow_counts() == {0: 2}
    assert drain(queue) == [a1, b1]


def test_removing_the_flow_whose_turn_it_is_passes_the_turn():
    queue = FlowQueue(100, 10)
    a1, a2 = waiter(flow="a", cost=QUANTUM_TOKENS), waiter(flow="a", cost=QUANTUM_TOKENS)
    b1, b2 = waiter(flow="b", cost=QUANTUM_TOKENS), waiter(flow="b", cost=QUANTUM_TOKENS)
    for w in (a1, a2, b1, b2):
        queue.push(w)
    assert queue.pop() is a1  # a's turn, its quantum spent
    assert queue.remove(a2)
    assert drain(queue) == [b1, b2]


def test_the_oldest_waiter_of_any_band():
    queue = FlowQueue(100, 10)
    assert queue.oldest() is None
    first, second, third = waiter(-1, "x"), waiter(10, "y"), waiter(0, "x")
    for w in (first, second, third):
        queue.push(w)
    assert queue.oldest() is first
    queue.remove(first)
    assert queue.oldest() is second


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.sampled_from([-1, 0, 10]), st.sampled_from("abc"), costs),
            st.tuples(st.just("pop")),
            st.tuples(st.just("remove"), st.integers(min_value=0, max_value=50)),
        ),
        max_size=60,
    )
)
def test_any_mix_of_operations_keeps_the_counts_and_gives_back_each_waiter_once(operations):
    queue = FlowQueue(8, 2)
    queued: list[Waiter] = []
    out: list[Waiter] = []
    for operation in operations:
        if operation[0] == "push":
            w = waiter(operation[1], operation[2], operation[3])
            try:
                displaced = queue.push(w)
            except QueueFull:
                assert len(queue) == 8
                continue
            queued.append(w)
            if displaced is not None:
                assert displaced.priority < w.priority or displaced.flow != w.flow
                queued.remove(displaced)
                out.append(displaced)
        elif operation[0] == "pop":
            w = queue.pop()
            assert (w is None) == (not queued)
            if w is not None:
                assert w.priority == max(x.priority for x in queued)
                queued.remove(w)
                out.append(w)
        elif queued:
            w = queued[operation[1] % len(queued)]
            assert queue.remove(w)
            queued.remove(w)
            out.append(w)
        assert len(queue) == len(queued) <= 8
        assert sum(queue.lengths().values()) == len(queued)
        assert all(count <= 3 for count in queue.flow_counts().values())
    rest = drain(queue)
    assert sorted(map(id, rest)) == sorted(map(id, queued))
    assert len({id(w) for w in out + rest}) == len(out) + len(rest)


# --- classification -----------------------------------------------------------------------------------


def test_an_objective_gives_its_band_and_an_unknown_one_the_default_counted():
    objectives = Objectives({"interactive": 10, "standard": 0, "batch": -1}, 0)
    assert objectives.priority("interactive") == (10, True)
    assert objectives.priority("batch") == (-1, True)
    assert objectives.priority(None) == (0, True)  # none named: the default, nothing wrong
    assert objectives.priority("urgent!!") == (0, False)
    assert objectives.priority("") == (0, False)


def test_a_fairness_id_is_a_bounded_label():
    assert flow_of(None) == ""
    assert flow_of("tenant-a") == "tenant-a"
    long = "x" * 10_000
    assert flow_of(long) == "x" * MAX_FAIRNESS_ID_CHARS


# --- the engines' saturation rule ---------------------------------------------------------------------


def test_headroom_is_what_the_engines_with_room_can_take_before_the_queue_threshold():
    assert headroom([], 5, 0.8) is None  # nothing known
    assert headroom([(0, 0.1), (3, 0.5)], 5, 0.8) == 5 + 2
    assert headroom([(5, 0.1), (9, 0.1)], 5, 0.8) == 0  # every queue at the threshold: saturated
    assert headroom([(0, 0.8), (0, 0.95)], 5, 0.8) == 0  # every KV cache at the threshold: saturated
    assert headroom([(0, 0.8), (4.5, 0.2)], 5, 0.8) == 1
