"""Flow control's asyncio shell (ext_proc/flow/control.py) over a real Admission and the server's metrics:
who goes at once, who waits and in which order, who is refused with what, a client leaving the queue,
and the engines' headroom (a fake scraper's samples)."""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client import generate_latest

from ext_proc.flow.config import FlowControlConfig
from ext_proc.flow.control import FlowControl, Labels, Ticket
from ext_proc.load import Admission
from ext_proc.metrics import Metrics
from ext_proc.outcome import Refused
from ext_proc.request import RequestInfo

INFO = RequestInfo("m", False, 100, 100)
INTERACTIVE, STANDARD, BATCH = Labels("interactive"), Labels("standard"), Labels("batch")


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engines:
    """The scraper's side flow control reads: samples the test sets, a new version on each."""

    def __init__(self) -> None:
        self.version = 0
        self.samples: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}

    def fresh_samples(self) -> dict[str, list[tuple[float, float]]]:
        return self.samples

    def land(self, decode: list[tuple[float, float]]) -> None:
        self.samples = {"prefill": [], "decode": decode}
        self.version += 1


def control(
    limit: int = 1, engines: Engines | None = None, clock: Clock | None = None, **settings: object
) -> tuple[FlowControl, Admission, Metrics]:
    config = dataclasses.replace(FlowControlConfig(enabled=True), **settings)  # type: ignore[arg-type]
    admission = Admission(limit, retry_after_seconds=2)
    metrics = Metrics(list)
    flow = FlowControl(config, admission, metrics, 2, engines, poll_seconds=0.01, clock=clock or Clock())
    return flow, admission, metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def queued(flow: FlowControl, labels: Labels) -> Ticket:
    ticket = flow.arrive(labels, INFO)
    assert isinstance(ticket, Ticket), ticket
    return ticket


async def test_requests_go_at_once_while_there_is_room_and_queue_by_band_when_saturated():
    flow, admission, metrics = control(limit=1)
    assert flow.arrive(STANDARD, INFO) is None and admission.inflight == 1
    standard, interactive = queued(flow, STANDARD), queued(flow, INTERACTIVE)
    waits = [asyncio.ensure_future(flow.wait(t)) for t in (standard, interactive)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waits)
    admission.release()  # the one in flight ends: its slot goes to the best band
    assert await waits[1] is None and not waits[0].done() and admission.inflight == 1
    admission.release()
    assert await waits[0] is None and admission.inflight == 1
    assert sample(metrics, "pd_extproc_flow_requests_total", priority="0", outcome="dispatched") == 2
    assert sample(metrics, "pd_extproc_flow_requests_total", priority="10", outcome="dispatched") == 1
    assert sample(metrics, "pd_extproc_flow_wait_seconds_count", priority="10") == 1


async def test_a_sheddable_request_is_refused_at_once_when_saturated_and_goes_when_not():
    flow, admission, metrics = control(limit=1)
    assert flow.arrive(BATCH, INFO) is None  # room: sheddable or not, it goes
    refused = flow.arrive(BATCH, INFO)
    assert isinstance(refused, Refused)
    assert (refused.status, refused.code, refused.retry_after) == (429, "shed", 2)
    assert sample(metrics, "pd_extproc_rejected_total", reason="shed") == 1
    assert admission.inflight == 1 and len(flow._queue) == 0


async def test_sheddable_requests_leave_the_reserved_room_to_the_others():
    flow, admission, _ = control(limit=3, reserved_requests=1)
    assert flow.arrive(BATCH, INFO) is None and flow.arrive(BATCH, INFO) is None
    refused = flow.arrive(BATCH, INFO)  # one slot left, and it is reserved
    assert isinstance(refused, Refused) and refused.code == "shed"
    assert flow.arrive(INTERACTIVE, INFO) is None and admission.inflight == 3
    engines = Engines()
    flow, admission, _ = control(limit=0, engines=engines, reserved_requests=2)
    engines.land([(2, 0.1)])  # room for 3 more before the queue threshold of 5
    assert flow.arrive(BATCH, INFO) is None
    assert isinstance(flow.arrive(BATCH, INFO), Refused)
    assert flow.arrive(STANDARD, INFO) is None and flow.arrive(STANDARD, INFO) is None
    assert isinstance(flow.arrive(STANDARD, INFO), Ticket)


async def test_a_full_queue_answers_429_and_a_higher_band_displaces_the_newest_lower_one():
    flow, admission, metrics = control(limit=1, max_queued_requests=2)
    assert flow.arrive(STANDARD, INFO) is None
    first, second = queued(flow, STANDARD), queued(flow, STANDARD)
    refused = flow.arrive(STANDARD, INFO)
    assert isinstance(refused, Refused) and (refused.status, refused.code) == (429, "queue_full")
    urgent = queued(flow, INTERACTIVE)
    displaced = await flow.wait(second)
    assert isinstance(displaced, Refused) and (displaced.status, displaced.code) == (429, "queue_full")
    assert sample(metrics, "pd_extproc_flow_requests_total", priority="0", outcome="displaced") == 1
    admission.release()
    assert await flow.wait(urgent) is None
    assert not first.future.done()


async def test_a_request_waiting_longer_than_max_queue_seconds_gets_503_with_retry_after():
    clock = Clock()
    flow, admission, metrics = control(limit=1, clock=clock, max_queue_seconds=0.05)
    assert flow.arrive(STANDARD, INFO) is None
    ticket = queued(flow, STANDARD)
    clock.now = 0.05
    refused = await asyncio.wait_for(flow.wait(ticket), 5)
    assert isinstance(refused, Refused)
    assert (refused.status, refused.code, refused.retry_after) == (503, "queue_timeout", 2)
    assert len(flow._queue) == 0 and admission.inflight == 1
    assert sample(metrics, "pd_extproc_flow_requests_total", priority="0", outcome="timeout") == 1


async def test_a_client_that_goes_away_leaves_the_queue_at_once():
    flow, admission, metrics = control(limit=1)
    assert flow.arrive(STANDARD, INFO) is None
    leaving, staying = queued(flow, STANDARD), queued(flow, STANDARD)
    waiting = asyncio.ensure_future(flow.wait(leaving))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert len(flow._queue) == 1
    assert sample(metrics, "pd_extproc_flow_requests_total", priority="0", outcome="cancelled") == 1
    admission.release()
    assert await flow.wait(staying) is None and admission.inflight == 1


async def test_a_client_leaving_just_as_it_is_dispatched_gives_its_slot_to_the_next():
    flow, admission, _ = control(limit=1)
    assert flow.arrive(STANDARD, INFO) is None
    first, second = queued(flow, STANDARD), queued(flow, STANDARD)
    waiting = asyncio.ensure_future(flow.wait(first))
    await asyncio.sleep(0)
    admission.release()  # first is dispatched, holding the slot...
    waiting.cancel()  # ...and its client leaves before it runs
    await asyncio.gather(waiting, return_exceptions=True)
    assert await flow.wait(second) is None and admission.inflight == 1


async def test_an_unknown_objective_is_the_default_band_counted_and_never_a_label():
    flow, _, metrics = control(limit=1)
    assert flow.arrive(Labels("no-such-objective", "x" * 5000), INFO) is None
    ticket = queued(flow, Labels("ALSO-UNKNOWN"))
    assert ticket.waiter.priority == 0
    assert sample(metrics, "pd_extproc_flow_unknown_objectives_total") == 2
    exposed = generate_latest(metrics.registry).decode()
    assert "no-such-objective" not in exposed and "ALSO-UNKNOWN" not in exposed and "xxxxx" not in exposed


async def test_the_engines_headroom_bounds_dispatch_between_samples():
    engines = Engines()
    flow, admission, _ = control(limit=0, engines=engines)  # no in-flight limit: the engines alone
    assert flow.arrive(STANDARD, INFO) is None  # nothing known yet: no limit from the engines
    engines.land([(4, 0.1), (5, 0.1)])  # one more fits before the first engine's queue is at 5 too
    assert flow.arrive(STANDARD, INFO) is None
    tickets = [queued(flow, STANDARD) for _ in range(3)]
    engines.land([(3, 0.1), (9, 0.9)])  # two more fit
    waits = [asyncio.ensure_future(flow.wait(t)) for t in tickets]
    done, pending = await asyncio.wait(waits, timeout=1)
    assert len(done) == 2 and len(pending) == 1
    engines.land([(0, 0.1), (0, 0.1)])
    assert await asyncio.wait_for(pending.pop(), 5) is None
    assert admission.inflight == 5


def test_engine_priority_is_the_objectives_negated_only_when_on():
    off, _, _ = control()
    assert off.engine_priority("interactive") is None
    flow, _, metrics = control(engine_priority=True)
    assert [flow.engine_priority(name) for name in ("interactive", "standard", "batch")] == [-10, 0, 1]
    assert flow.engine_priority(None) == 0 and flow.engine_priority("no-such-objective") == 0  # the default's
    assert sample(metrics, "pd_extproc_flow_unknown_objectives_total") == 0  # counted once, on arrival


async def test_describe_shows_each_band_its_flows_bounded_oldest_wait_and_outcomes():
    clock = Clock()
    flow, admission, _ = control(limit=1, clock=clock, max_flows=2)
    assert flow.arrive(STANDARD, INFO) is None
    assert isinstance(flow.arrive(BATCH, INFO), Refused)  # shed
    tickets = [queued(flow, Labels("standard", tenant)) for tenant in ("a", "a", "b", "c", "d")]
    clock.now = 2.5
    tickets.append(queued(flow, Labels("interactive", "x" * 100)))
    clock.now = 3.0
    view = flow.describe()
    bands = {band["priority"]: band for band in view["bands"]}  # type: ignore[union-attr]
    assert [band["priority"] for band in view["bands"]] == [10, 0, -1]  # type: ignore[union-attr]
    assert (view["queued"], view["inflight"], view["max_inflight_requests"]) == (6, 1, 1)
    standard = bands[0]
    assert (standard["objectives"], standard["queued"], standard["flows"]) == (["standard"], 5, 3)
    assert standard["oldest_wait_seconds"] == 3.0
    assert standard["largest_flows"] == [  # "c" and "d" beyond max_flows: one shared flow, no id
        {"fairness_id": None, "queued": 2, "tokens": 400},
        {"fairness_id": "a", "queued": 2, "tokens": 400},
        {"fairness_id": "b", "queued": 1, "tokens": 200},
    ]
    assert standard["outcomes"]["dispatched"] == 1
    interactive = bands[10]
    assert interactive["oldest_wait_seconds"] == 0.5
    assert interactive["largest_flows"] == [{"fairness_id": "x" * 64, "queued": 1, "tokens": 200}]
    assert bands[-1]["outcomes"]["shed"] == 1 and bands[-1]["queued"] == 0
    assert bands[-1]["oldest_wait_seconds"] is None and bands[-1]["largest_flows"] == []
    for ticket in tickets:
        task = asyncio.ensure_future(flow.wait(ticket))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert flow.describe()["queued"] == 0
    admission.release()
    await flow.close()
