"""Registry updates (identity-preserving, departed endpoints) and Lease load accounting."""

from __future__ import annotations

import logging

import pytest
from builders import endpoint

from ext_proc.affinity import Cost, Decision, Mode, Policy, choose
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.load import Lease
from ext_proc.registry import EndpointState, Registry, Role

DEFAULT_CAPACITY = 50_000.0


def ep(
    address: str, group: str = "g1", capacity: float | None = 1000.0, health: str = "HEALTHY"
) -> EndpointSpec:
    """An endpoint declaring 1000 tokens unless told otherwise."""
    return endpoint(address, group, capacity, health)


def cluster(name: str, *endpoints: EndpointSpec, source: str = "test.yaml") -> ClusterEndpoints:
    return ClusterEndpoints(name, tuple(endpoints), source)


def make_registry() -> Registry:
    return Registry("prefill", "decode", DEFAULT_CAPACITY)


def by_address(registry: Registry) -> dict[tuple[Role, str], EndpointState]:
    return {(s.role, s.address): s for s in registry.endpoints()}


def addrs(states: tuple[EndpointState, ...]) -> list[str]:
    return [s.address for s in states]


def load_of(state: EndpointState) -> tuple[int, int]:
    return state.active_tokens, state.active_requests


# --- Registry.update ---------------------------------------------------------------------------


def test_clusters_are_mapped_to_roles_by_name() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.2:2")), cluster("prefill", ep("10.0.0.1:1"))])
    assert addrs(registry.prefills) == ["10.0.0.1:1"]
    assert addrs(registry.decodes) == ["10.0.0.2:2"]
    roles = {s.address: s.role for s in registry.endpoints()}
    assert roles == {"10.0.0.1:1": Role.PREFILL, "10.0.0.2:2": Role.DECODE}


def test_custom_cluster_names_are_honoured() -> None:
    registry = Registry("pf", "dc", DEFAULT_CAPACITY)
    registry.update([cluster("pf", ep("10.0.0.1:1")), cluster("prefill", ep("10.0.0.9:9"))])
    assert addrs(registry.prefills) == ["10.0.0.1:1"]
    assert registry.decodes == ()


def test_other_clusters_are_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    registry = make_registry()
    with caplog.at_level(logging.WARNING, logger="ext_proc.registry"):
        registry.update(
            [cluster("embeddings", ep("10.0.0.5:5"), source="emb.yaml"), cluster("decode", ep("10.0.0.2:2"))]
        )
    assert addrs(registry.endpoints()) == ["10.0.0.2:2"]
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "ignoring EDS cluster 'embeddings' from emb.yaml: neither the prefill nor the decode cluster"
    ]


def test_only_healthy_endpoints_are_candidates_but_all_are_known() -> None:
    registry = make_registry()
    registry.update(
        [
            cluster("prefill", ep("10.0.0.1:1"), ep("10.0.0.3:3", health="DRAINING")),
            cluster("decode", ep("10.0.1.1:1", health="UNKNOWN"), ep("10.0.1.2:2", health="UNHEALTHY")),
        ]
    )
    assert addrs(registry.prefills) == ["10.0.0.1:1"]
    assert addrs(registry.decodes) == ["10.0.1.1:1"]
    assert sorted(addrs(registry.endpoints())) == ["10.0.0.1:1", "10.0.0.3:3", "10.0.1.1:1", "10.0.1.2:2"]
    draining = by_address(registry)[(Role.PREFILL, "10.0.0.3:3")]
    assert (draining.healthy, draining.health_status) == (False, "DRAINING")


def test_spec_fields_are_copied_and_default_capacity_applied() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.1:1", "rack-a", 123.0), ep("10.0.0.2:2", "", None))])
    states = by_address(registry)
    explicit = states[(Role.DECODE, "10.0.0.1:1")]
    assert (explicit.group, explicit.token_capacity) == ("rack-a", 123.0)
    default = states[(Role.DECODE, "10.0.0.2:2")]
    assert (default.group, default.token_capacity) == ("", DEFAULT_CAPACITY)


def test_same_address_in_both_roles_is_two_endpoints() -> None:
    registry = make_registry()
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.1:1"))])
    assert len(registry.endpoints()) == 2
    assert registry.prefills[0] is not registry.decodes[0]


def test_clusters_of_the_same_name_merge_and_first_entry_of_an_address_wins() -> None:
    registry = make_registry()
    registry.update(
        [
            cluster("decode", ep("10.0.0.1:1", "first")),
            cluster("decode", ep("10.0.0.1:1", "second"), ep("10.0.0.2:2")),
        ]
    )
    assert addrs(registry.decodes) == ["10.0.0.1:1", "10.0.0.2:2"]
    assert registry.decodes[0].group == "first"


def test_update_replaces_the_set() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.1:1"))])
    registry.update([cluster("decode", ep("10.0.0.2:2"))])
    assert addrs(registry.endpoints()) == ["10.0.0.2:2"]


def test_empty_update_clears_everything_idle() -> None:
    registry = make_registry()
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.2:2"))])
    registry.update([])
    assert (registry.prefills, registry.decodes, registry.endpoints()) == ((), (), ())


def test_new_endpoint_starts_idle() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.1:1"))])
    assert load_of(registry.decodes[0]) == (0, 0)


# --- Lease -------------------------------------------------------------------------------------


@pytest.fixture
def pd() -> tuple[Registry, EndpointState, EndpointState]:
    registry = make_registry()
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.2:2"))])
    return registry, registry.prefills[0], registry.decodes[0]


def test_lease_charges_prompt_to_prefill_and_prompt_plus_budget_to_decode(pd) -> None:
    _, prefill, decode = pd
    Lease(prefill, 100, decode, 100 + 256)
    assert load_of(prefill) == (100, 1)
    assert load_of(decode) == (356, 1)


def test_leases_accumulate_and_release_independently(pd) -> None:
    _, prefill, decode = pd
    first = Lease(prefill, 10, decode, 30)
    second = Lease(prefill, 5, decode, 7)
    assert (load_of(prefill), load_of(decode)) == ((15, 2), (37, 2))
    first.release()
    assert (load_of(prefill), load_of(decode)) == ((5, 1), (7, 1))
    second.release()
    assert (load_of(prefill), load_of(decode)) == ((0, 0), (0, 0))


def test_decode_only_lease_charges_only_the_decode(pd) -> None:
    _, prefill, decode = pd
    lease = Lease(None, 100, decode, 120)
    assert load_of(prefill) == (0, 0)
    assert load_of(decode) == (120, 1)
    lease.release_prefill()
    assert load_of(decode) == (120, 1)
    lease.release()
    assert load_of(decode) == (0, 0)


def test_release_prefill_frees_only_the_prefill_and_is_idempotent(pd) -> None:
    _, prefill, decode = pd
    other = Lease(prefill, 3, decode, 4)
    lease = Lease(prefill, 100, decode, 150)
    lease.release_prefill()
    lease.release_prefill()
    assert load_of(prefill) == (3, 1)
    assert load_of(decode) == (154, 2)
    other.release()


def test_release_is_idempotent_and_covers_an_unreleased_prefill(pd) -> None:
    _, prefill, decode = pd
    lease = Lease(prefill, 100, decode, 150)
    lease.release()
    lease.release()
    lease.release_prefill()
    assert (load_of(prefill), load_of(decode)) == ((0, 0), (0, 0))


def test_release_after_prefill_release_does_not_double_free(pd) -> None:
    _, prefill, decode = pd
    keep = Lease(prefill, 7, decode, 9)
    lease = Lease(prefill, 100, decode, 150)
    lease.release_prefill()
    lease.release()
    assert (load_of(prefill), load_of(decode)) == ((7, 1), (9, 1))
    keep.release()


# --- accounting across registry updates --------------------------------------------------------


def test_endpoint_that_stays_keeps_the_same_object_through_group_and_health_changes(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update(
        [
            cluster("prefill", ep("10.0.0.1:1", "g2", 5.0)),
            cluster("decode", ep("10.0.0.2:2", health="DRAINING")),
        ]
    )
    states = by_address(registry)
    assert states[(Role.PREFILL, "10.0.0.1:1")] is prefill
    assert states[(Role.DECODE, "10.0.0.2:2")] is decode
    assert (prefill.group, prefill.token_capacity) == ("g2", 5.0)
    assert decode.healthy is False
    assert registry.decodes == ()
    assert load_of(decode) == (90, 1)
    registry.update([cluster("prefill", ep("10.0.0.1:1", "g3")), cluster("decode", ep("10.0.0.2:2"))])
    assert registry.decodes == (decode,)
    lease.release()
    assert (load_of(prefill), load_of(decode)) == ((0, 0), (0, 0))


def test_removed_endpoint_in_flight_stays_visible_until_released(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    assert registry.decodes == ()
    assert decode in registry.endpoints()
    assert load_of(decode) == (90, 1)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])  # still in flight: still kept
    assert decode in registry.endpoints()
    lease.release()
    assert load_of(decode) == (0, 0)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    assert decode not in registry.endpoints()
    assert addrs(registry.endpoints()) == ["10.0.0.1:1"]


def test_removed_idle_endpoint_disappears_at_once(pd) -> None:
    registry, _, decode = pd
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    assert decode not in registry.endpoints()


def test_removed_endpoint_readded_before_release_is_revived_with_its_load(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.2:2", "g7"))])
    assert registry.decodes == (decode,)
    assert decode.group == "g7"
    assert load_of(decode) == (90, 1)
    assert [s for s in registry.endpoints() if s.address == "10.0.0.2:2"] == [decode]  # not listed twice
    lease.release()
    assert load_of(decode) == (0, 0)


def test_removed_endpoint_readded_after_release_and_update_is_a_fresh_object(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    lease.release()
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.2:2"))])
    fresh = registry.decodes[0]
    assert fresh is not decode
    assert load_of(fresh) == (0, 0)


def test_endpoint_moved_to_the_other_role_is_a_different_endpoint(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("decode", ep("10.0.0.1:1"), ep("10.0.0.2:2"))])
    moved = next(s for s in registry.decodes if s.address == "10.0.0.1:1")
    assert moved is not prefill
    assert load_of(moved) == (0, 0)
    assert prefill in registry.endpoints()  # the old prefill role still has a request in flight
    lease.release()
    assert load_of(prefill) == (0, 0)


# --- the load arrays behind the pools ----------------------------------------------------------


def test_pools_hold_the_healthy_endpoints_and_views_of_their_live_load(pd) -> None:
    registry, prefill, decode = pd
    assert registry.prefill_pool.endpoints == registry.prefills == (prefill,)
    assert registry.decode_pool.endpoints == registry.decodes == (decode,)
    assert registry.decode_pool.capacity.tolist() == [1000.0]
    lease = Lease(prefill, 40, decode, 90)
    assert (registry.prefill_pool.tokens.tolist(), registry.prefill_pool.requests.tolist()) == ([40], [1])
    assert (registry.decode_pool.tokens.tolist(), registry.decode_pool.requests.tolist()) == ([90], [1])
    lease.release()
    assert (registry.decode_pool.tokens.tolist(), registry.decode_pool.requests.tolist()) == ([0], [0])


def test_setting_a_load_attribute_writes_the_array(pd) -> None:
    registry, _, decode = pd
    decode.active_tokens, decode.active_requests = 7, 2
    assert (registry.decode_pool.tokens.tolist(), registry.decode_pool.requests.tolist()) == ([7], [2])
    assert load_of(decode) == (7, 2)


def test_unhealthy_endpoints_keep_their_load_outside_the_pools() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.1:1"), ep("10.0.0.2:2"), ep("10.0.0.3:3"))])
    a, b, c = registry.decodes
    leases = [Lease(None, 0, s, t) for s, t in ((a, 10), (b, 20), (c, 30))]
    registry.update(
        [cluster("decode", ep("10.0.0.1:1", health="DRAINING"), ep("10.0.0.2:2"), ep("10.0.0.3:3"))]
    )
    assert registry.decodes == (b, c)
    assert registry.decode_pool.tokens.tolist() == [20, 30]
    assert load_of(a) == (10, 1)
    leases[0].release()
    assert (load_of(a), registry.decode_pool.tokens.tolist()) == ((0, 0), [20, 30])
    registry.update([cluster("decode", ep("10.0.0.1:1"), ep("10.0.0.2:2"), ep("10.0.0.3:3"))])
    assert registry.decode_pool.tokens.tolist() == [0, 20, 30]
    for lease in leases[1:]:
        lease.release()
    assert registry.decode_pool.tokens.tolist() == [0, 0, 0]


def test_updates_carry_live_load_into_the_new_arrays_whatever_the_new_order() -> None:
    registry = make_registry()
    registry.update([cluster("decode", ep("10.0.0.1:1"), ep("10.0.0.2:2"))])
    a, b = registry.decodes
    lease_a, lease_b = Lease(None, 0, a, 11), Lease(None, 0, b, 22)
    registry.update([cluster("decode", ep("10.0.0.3:3"), ep("10.0.0.2:2"), ep("10.0.0.1:1"))])
    new, *_ = registry.decodes
    assert registry.decodes == (new, b, a)
    assert registry.decode_pool.tokens.tolist() == [0, 22, 11]
    assert registry.decode_pool.requests.tolist() == [0, 1, 1]
    lease_a.release()
    assert registry.decode_pool.tokens.tolist() == [0, 22, 0]
    lease_b.release()
    assert registry.decode_pool.tokens.tolist() == [0, 0, 0]


def test_a_departed_endpoint_never_writes_into_the_arrays_of_its_successors(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.9:9"))])
    successor = registry.decodes[0]  # the slot decode had, in the new arrays
    keep = Lease(None, 0, successor, 5)
    lease.release()
    assert (load_of(decode), load_of(successor)) == ((0, 0), (5, 1))
    assert registry.decode_pool.tokens.tolist() == [5]
    keep.release()
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.9:9"))])
    assert decode not in registry.endpoints()


def test_a_revived_endpoint_brings_its_load_back_into_the_pool(pd) -> None:
    registry, prefill, decode = pd
    lease = Lease(prefill, 40, decode, 90)
    registry.update([cluster("prefill", ep("10.0.0.1:1"))])
    assert registry.decode_pool.size == 0
    registry.update([cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.0.2:2"))])
    assert registry.decode_pool.endpoints == (decode,)
    assert (registry.decode_pool.tokens.tolist(), registry.decode_pool.requests.tolist()) == ([90], [1])
    lease.release()
    assert registry.decode_pool.tokens.tolist() == [0]


def test_the_decision_over_the_registry_pools_follows_the_live_load() -> None:
    registry = make_registry()
    registry.update(
        [cluster("prefill", ep("10.0.0.1:1")), cluster("decode", ep("10.0.1.1:1"), ep("10.0.1.2:2"))]
    )
    first, second = registry.decodes
    cost, policy = Cost(10, 100), Policy(Mode.OFF, fallback_count=0)

    def decode_of(tiebreak: int) -> EndpointState:
        result = choose(cost, registry.prefill_pool, registry.decode_pool, policy, tiebreak)
        assert isinstance(result, Decision)
        return result.decode

    lease = Lease(None, 0, first, 500)
    assert [decode_of(t) for t in range(3)] == [second] * 3
    Lease(None, 0, second, 600)
    assert decode_of(0) is first
    lease.release()
    assert decode_of(0) is first
