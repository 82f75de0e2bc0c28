"""EDS files: parsing and validation (load_eds_file), rendering, and the polling EdsFileSource."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import types
from pathlib import Path

import pytest
import yaml
from builders import endpoint
from polling import until

from ext_proc.discovery import EdsError, EdsFileSource, eds_watch, load_eds_file
from ext_proc.discovery.eds import (
    cluster_load_assignment,
    parse_cluster_load_assignment,
    render_cla,
    render_eds,
    write_eds_file,
)
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec, merge_clusters
from ext_proc.registry import Registry

CLA = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def lb_endpoint(
    address: str = "10.0.0.1",
    port: int | None = 8000,
    *,
    health: str | None = "HEALTHY",
    metadata: dict[str, object] | None = None,
    namespace: str = "pd",
) -> dict[str, object]:
    socket: dict[str, object] = {"address": address}
    if port is not None:
        socket["port_value"] = port
    entry: dict[str, object] = {"endpoint": {"address": {"socket_address": socket}}}
    if health is not None:
        entry["health_status"] = health
    if metadata is not None:
        entry["metadata"] = {"filter_metadata": {namespace: metadata}}
    return entry


def cla(cluster: str, *lb_endpoints: dict[str, object]) -> dict[str, object]:
    return {"@type": CLA, "cluster_name": cluster, "endpoints": [{"lb_endpoints": list(lb_endpoints)}]}


def response(*resources: dict[str, object]) -> dict[str, object]:
    return {"version_info": "1", "resources": list(resources)}


def write_doc(path: Path, document: object) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(document), encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def spec(
    address: str, group: str = "g1", capacity: float | None = 1000.0, health: str = "HEALTHY"
) -> EndpointSpec:
    """An endpoint declaring 1000 tokens unless told otherwise."""
    return endpoint(address, group, capacity, health)


def eds_error(path: Path, namespace: str = "pd") -> str:
    with pytest.raises(EdsError) as info:
        load_eds_file(path, namespace)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


def addresses(clusters: list[ClusterEndpoints]) -> list[list[str]]:
    return [[e.address for e in c.endpoints] for c in clusters]


# --- load_eds_file -----------------------------------------------------------------------------


YAML_FILE = """\
# a decode cluster, as Envoy reads it
version_info: "7"
resources:
- "@type": type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment
  cluster_name: decode
  endpoints:
  - lb_endpoints:
    - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8201}}}
      health_status: HEALTHY
      metadata: {filter_metadata: {pd: {pdGroupID: rack-a, token_capacity: 200000}}}
  - lb_endpoints:
    - endpoint: {address: {socket_address: {address: 127.0.0.2, port_value: 8202}}}
      metadata: {filter_metadata: {pd: {pdGroupID: rack-b}}}
"""


def test_yaml_file_is_parsed_with_group_capacity_and_health(tmp_path: Path) -> None:
    path = tmp_path / "decode.yaml"
    path.write_text(YAML_FILE, encoding="utf-8")
    assert load_eds_file(path) == ClusterEndpoints(
        "decode",
        (
            EndpointSpec("127.0.0.1:8201", "rack-a", 200000.0, True, "HEALTHY"),
            EndpointSpec("127.0.0.2:8202", "rack-b", None, True, "UNKNOWN"),
        ),
        str(path),
    )


def test_json_file_is_parsed(tmp_path: Path) -> None:
    document = response(
        cla("prefill", lb_endpoint("10.0.0.9", 9000, metadata={"pdGroupID": "g9", "token_capacity": 12.5}))
    )
    path = write_doc(tmp_path / "prefill.json", document)
    result = load_eds_file(str(path))
    assert result.cluster_name == "prefill"
    assert result.source == str(path)
    assert result.endpoints == (EndpointSpec("10.0.0.9:9000", "g9", 12.5, True, "HEALTHY"),)


def test_camel_case_json_field_names_are_accepted(tmp_path: Path) -> None:
    document = {
        "versionInfo": "1",
        "resources": [
            {
                "@type": CLA,
                "clusterName": "decode",
                "endpoints": [
                    {
                        "lbEndpoints": [
                            {
                                "endpoint": {
                                    "address": {"socketAddress": {"address": "1.2.3.4", "portValue": 5}}
                                },
                                "healthStatus": "HEALTHY",
                            }
                        ]
                    }
                ],
            }
        ],
    }
    path = write_doc(tmp_path / "decode.json", document)
    assert load_eds_file(path).endpoints == (EndpointSpec("1.2.3.4:5", "", None, True, "HEALTHY"),)


def test_missing_metadata_gives_empty_group_and_no_capacity(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(metadata=None))))
    (endpoint,) = load_eds_file(path).endpoints
    assert (endpoint.group, endpoint.token_capacity) == ("", None)


def test_metadata_in_another_namespace_is_ignored(tmp_path: Path) -> None:
    entry = lb_endpoint(metadata={"pdGroupID": "other", "token_capacity": 5}, namespace="elsewhere")
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", entry)))
    (endpoint,) = load_eds_file(path).endpoints
    assert (endpoint.group, endpoint.token_capacity) == ("", None)


def test_custom_metadata_namespace_is_read(tmp_path: Path) -> None:
    entry = lb_endpoint(metadata={"pdGroupID": "acme-1", "token_capacity": 7}, namespace="acme")
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", entry)))
    (endpoint,) = load_eds_file(path, namespace="acme").endpoints
    assert (endpoint.group, endpoint.token_capacity) == ("acme-1", 7.0)
    (default_ns,) = load_eds_file(path).endpoints
    assert default_ns.group == ""


def test_token_capacity_without_group_is_read(tmp_path: Path) -> None:
    path = write_doc(
        tmp_path / "d.yaml", response(cla("decode", lb_endpoint(metadata={"token_capacity": 3})))
    )
    (endpoint,) = load_eds_file(path).endpoints
    assert (endpoint.group, endpoint.token_capacity) == ("", 3.0)


@pytest.mark.parametrize(
    ("health", "healthy", "name"),
    [
        ("HEALTHY", True, "HEALTHY"),
        ("UNKNOWN", True, "UNKNOWN"),
        (None, True, "UNKNOWN"),
        ("UNHEALTHY", False, "UNHEALTHY"),
        ("DRAINING", False, "DRAINING"),
        ("TIMEOUT", False, "TIMEOUT"),
        ("DEGRADED", False, "DEGRADED"),
    ],
)
def test_health_status_decides_candidacy(
    tmp_path: Path, health: str | None, healthy: bool, name: str
) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(health=health))))
    (endpoint,) = load_eds_file(path).endpoints
    assert (endpoint.healthy, endpoint.health_status) == (healthy, name)


def test_ipv6_address_is_bracketed(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint("::1", 8000))))
    assert [e.address for e in load_eds_file(path).endpoints] == ["[::1]:8000"]


def test_endpoints_keep_file_order_across_localities(tmp_path: Path) -> None:
    document = response(cla("decode", lb_endpoint("10.0.0.3"), lb_endpoint("10.0.0.1")))
    document["resources"][0]["endpoints"].append({"lb_endpoints": [lb_endpoint("10.0.0.2")]})  # type: ignore[index]
    path = write_doc(tmp_path / "d.yaml", document)
    assert [e.address for e in load_eds_file(path).endpoints] == [
        "10.0.0.3:8000",
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    ]


def test_cluster_without_endpoints_is_valid_and_empty(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response({"@type": CLA, "cluster_name": "decode"}))
    assert load_eds_file(path).endpoints == ()


# --- load_eds_file errors ----------------------------------------------------------------------


def test_two_resources_are_rejected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("prefill"), cla("decode")))
    assert eds_error(path).endswith(
        "a path-based EDS file must hold exactly one ClusterLoadAssignment, found 2 resources"
    )


def test_zero_resources_are_rejected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response())
    assert "exactly one ClusterLoadAssignment, found 0 resources" in eds_error(path)


def test_resource_of_wrong_type_is_rejected(tmp_path: Path) -> None:
    address = "type.googleapis.com/envoy.config.core.v3.Address"
    document = response({"@type": address, "socket_address": {"address": "1.2.3.4", "port_value": 1}})
    path = write_doc(tmp_path / "d.yaml", document)
    assert eds_error(path) == f"{path}: resource type is {address!r}, expected {CLA!r}"


def test_resource_of_unknown_type_is_rejected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response({"@type": "type.googleapis.com/no.such.Type"}))
    message = eds_error(path)
    assert "not a valid DiscoveryResponse" in message
    assert "no.such.Type" in message


def test_unknown_field_is_rejected_and_named(tmp_path: Path) -> None:
    resource = cla("decode", lb_endpoint())
    resource["load_balancing_weight"] = 3
    path = write_doc(tmp_path / "d.yaml", response(resource))
    message = eds_error(path)
    assert "not a valid DiscoveryResponse" in message
    assert "load_balancing_weight" in message


def test_invalid_health_status_is_rejected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(health="SLEEPY"))))
    message = eds_error(path)
    assert "not a valid DiscoveryResponse" in message
    assert "SLEEPY" in message


def test_invalid_yaml_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("resources: [unclosed\n", encoding="utf-8")
    assert eds_error(path).startswith(f"{path}: not valid YAML/JSON: ")


def test_invalid_json_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('{"resources": [', encoding="utf-8")
    assert eds_error(path).startswith(f"{path}: not valid YAML/JSON: ")


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("hello\n", "str"), ("", "NoneType")])
def test_document_that_is_not_a_mapping_is_rejected(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(text, encoding="utf-8")
    assert eds_error(path) == f"{path}: expected a DiscoveryResponse mapping, got {kind}"


def test_missing_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    assert eds_error(path).startswith(f"{path}: cannot read: ")


def test_non_utf8_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_bytes(b"version_info: \xff\xfe\n")
    assert eds_error(path).startswith(f"{path}: cannot read: ")


def test_cluster_without_name_is_rejected(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response({"@type": CLA, "endpoints": []}))
    assert eds_error(path) == f"{path}: ClusterLoadAssignment has no cluster_name"


@pytest.mark.parametrize("group", [7, True, ["a"], None])
def test_group_that_is_not_a_string_is_rejected(tmp_path: Path, group: object) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(metadata={"pdGroupID": group}))))
    assert eds_error(path) == (
        f"{path}: endpoints[0].lb_endpoints[0]: metadata pd.pdGroupID must be a string"
    )


@pytest.mark.parametrize("capacity", [0, -5, "1000", True, None, float("inf")])
def test_token_capacity_must_be_a_positive_number(tmp_path: Path, capacity: object) -> None:
    entries = [lb_endpoint("10.0.0.1"), lb_endpoint("10.0.0.2", metadata={"token_capacity": capacity})]
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", *entries)))
    assert eds_error(path) == (
        f"{path}: endpoints[0].lb_endpoints[1]: metadata pd.token_capacity must be a finite number > 0"
    )


def test_bootstrap_and_metrics_ports_are_read_and_written_back(tmp_path: Path) -> None:
    metadata = {"pdGroupID": "g", "bootstrap_port": 8998, "metrics_port": 9100, "kv_events_port": 5600}
    path = write_doc(
        tmp_path / "p.yaml", response(cla("prefill", lb_endpoint("10.0.0.1", 30000, metadata=metadata)))
    )
    spec = EndpointSpec("10.0.0.1:30000", "g", None, True, "HEALTHY", 8998, 9100, 5600)
    assert load_eds_file(path).endpoints == (spec,)
    write_eds_file(tmp_path / "again.json", "prefill", [spec])
    assert load_eds_file(tmp_path / "again.json").endpoints == (spec,)


def test_kv_events_replay_port_and_data_parallel_size_are_read_and_written_back(tmp_path: Path) -> None:
    metadata = {"kv_events_port": 5600, "kv_events_replay_port": 5700, "data_parallel_size": 4}
    path = write_doc(
        tmp_path / "p.yaml", response(cla("prefill", lb_endpoint("10.0.0.1", 30000, metadata=metadata)))
    )
    spec = EndpointSpec("10.0.0.1:30000", "", None, True, "HEALTHY", None, None, 5600, 5700, 4)
    assert load_eds_file(path).endpoints == (spec,)
    write_eds_file(tmp_path / "again.json", "prefill", [spec])
    assert load_eds_file(tmp_path / "again.json").endpoints == (spec,)
    assert "data_parallel_size" not in json.dumps(
        render_cla("p", [dataclasses.replace(spec, data_parallel_size=1)])
    )


@pytest.mark.parametrize("size", [0, 1025, 2.5, "2", True, None])
def test_data_parallel_size_must_be_a_rank_count(tmp_path: Path, size: object) -> None:
    entry = lb_endpoint(metadata={"data_parallel_size": size})
    path = write_doc(tmp_path / "d.yaml", response(cla("prefill", entry)))
    assert eds_error(path) == (
        f"{path}: endpoints[0].lb_endpoints[0]: metadata pd.data_parallel_size must be an integer in 1..1024"
    )


@pytest.mark.parametrize("key", ["bootstrap_port", "metrics_port", "kv_events_port", "kv_events_replay_port"])
@pytest.mark.parametrize("port", [0, 65536, 8998.5, "8998", True, None])
def test_ports_must_be_integer_ports(tmp_path: Path, key: str, port: object) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("prefill", lb_endpoint(metadata={key: port}))))
    assert eds_error(path) == (
        f"{path}: endpoints[0].lb_endpoints[0]: metadata pd.{key} must be an integer port in 1..65535"
    )


def test_error_names_the_custom_namespace(tmp_path: Path) -> None:
    entry = lb_endpoint(metadata={"token_capacity": 0}, namespace="acme")
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", entry)))
    assert eds_error(path, "acme").endswith("metadata acme.token_capacity must be a finite number > 0")


def test_duplicate_address_is_rejected_with_its_position(tmp_path: Path) -> None:
    document = response(cla("decode", lb_endpoint("10.0.0.1", 80), lb_endpoint("10.0.0.2", 80)))
    document["resources"][0]["endpoints"].append({"lb_endpoints": [lb_endpoint("10.0.0.1", 80)]})  # type: ignore[index]
    path = write_doc(tmp_path / "d.yaml", document)
    assert eds_error(path) == f"{path}: endpoints[1].lb_endpoints[0]: duplicate endpoint 10.0.0.1:80"


def test_same_ip_on_different_ports_is_not_a_duplicate(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(port=1), lb_endpoint(port=2))))
    assert len(load_eds_file(path).endpoints) == 2


@pytest.mark.parametrize(("address", "port"), [("10.0.0.1", None), ("10.0.0.1", 0), ("", 8000)])
def test_address_without_ip_or_port_is_rejected(tmp_path: Path, address: str, port: int | None) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(address, port))))
    assert eds_error(path) == (
        f"{path}: endpoints[0].lb_endpoints[0]: "
        "endpoint.address.socket_address needs both address and port_value"
    )


# --- render_eds / write_eds_file ---------------------------------------------------------------


def test_write_then_load_round_trips_every_field(tmp_path: Path) -> None:
    specs = [
        spec("10.0.0.1:8000", "g1", 1000.0),
        spec("10.0.0.2:8001", "", None, "UNKNOWN"),
        spec("[::1]:9000", "g2", 2.5, "DRAINING"),
        spec("10.0.0.4:8003", "g2", 10.0, "UNHEALTHY"),
    ]
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", specs)
    assert load_eds_file(path) == ClusterEndpoints("decode", tuple(specs), str(path))
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file must be renamed away"


def test_rendered_document_round_trips_through_yaml_with_custom_namespace(tmp_path: Path) -> None:
    specs = [spec("10.1.1.1:1", "a", 5.0), spec("10.1.1.2:2", "b", None)]
    document = render_eds("prefill", specs, namespace="acme")
    assert document["resources"][0]["@type"] == CLA
    path = write_doc(tmp_path / "prefill.yaml", document)
    assert load_eds_file(path, "acme").endpoints == tuple(specs)


def test_the_protobuf_assignment_round_trips_every_field_with_custom_namespace() -> None:
    events = dataclasses.replace(spec("10.1.1.2:3", "a"), kv_events_replay_port=5558, data_parallel_size=2)
    specs = (spec("10.1.1.1:1", "a", 5.0), spec("[::1]:2", "", None, "DRAINING"), events)
    cluster = ClusterEndpoints("decode", specs, "ads")
    cla = cluster_load_assignment(cluster, "acme")
    assert parse_cluster_load_assignment(cla, "acme", "ads") == cluster


def test_merge_clusters_joins_same_named_clusters_and_keeps_an_address_first_entry() -> None:
    first, again, other = spec("10.0.0.1:1", "a"), spec("10.0.0.1:1", "b"), spec("10.0.0.2:2", "b")
    merged = merge_clusters(
        [
            ClusterEndpoints("decode", (first,), "one.yaml"),
            ClusterEndpoints("prefill", (other,), "p.yaml"),
            ClusterEndpoints("decode", (again, other), "two.yaml"),
        ]
    )
    assert merged == {
        "decode": ClusterEndpoints("decode", (first, other), "one.yaml, two.yaml"),
        "prefill": ClusterEndpoints("prefill", (other,), "p.yaml"),
    }


def test_write_eds_file_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "decode.yaml"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    write_eds_file(path, "decode", [spec("10.0.0.2:2"), spec("10.0.0.3:3")])
    assert [e.address for e in load_eds_file(path).endpoints] == ["10.0.0.2:2", "10.0.0.3:3"]


# --- EdsFileSource -----------------------------------------------------------------------------


class Published:
    """A publish callback that records every call."""

    def __init__(self) -> None:
        self.calls: list[list[ClusterEndpoints]] = []

    def __call__(self, clusters: list[ClusterEndpoints]) -> None:
        self.calls.append(list(clusters))

    @property
    def last(self) -> list[ClusterEndpoints]:
        return self.calls[-1]


def source_for(*paths: Path, interval: float = 0.25) -> tuple[EdsFileSource, Published]:
    published = Published()
    return EdsFileSource([str(p) for p in paths], "pd", published, interval), published


def rewrite_in_place(path: Path, cluster: str, specs: list[EndpointSpec], mtime_ns: int) -> None:
    """Overwrite the same inode with a document of the same size (rendered as ``write_eds_file``
    does) and set its mtime to ``mtime_ns``."""
    before = path.stat()
    with path.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(render_eds(cluster, specs), indent=1))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)


def test_first_poll_publishes_every_file_in_path_order(tmp_path: Path) -> None:
    decode = tmp_path / "decode.json"
    prefill = tmp_path / "prefill.json"
    write_eds_file(decode, "decode", [spec("10.0.0.2:2")])
    write_eds_file(prefill, "prefill", [spec("10.0.0.1:1")])
    source, published = source_for(prefill, decode)
    assert source.poll() is True
    assert [[c.cluster_name for c in call] for call in published.calls] == [["prefill", "decode"]]
    assert addresses(published.last) == [["10.0.0.1:1"], ["10.0.0.2:2"]]


def test_poll_without_changes_publishes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    source, published = source_for(path)
    source.poll()
    assert source.poll() is False
    assert len(published.calls) == 1


def test_atomic_rename_is_picked_up_by_next_poll(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    source, published = source_for(path)
    source.poll()
    temp = tmp_path / "decode.json.new"
    temp.write_text(json.dumps(render_eds("decode", [spec("10.0.0.1:1"), spec("10.0.0.9:9")])))
    os.replace(temp, path)
    assert source.poll() is True
    assert addresses(published.last) == [["10.0.0.1:1", "10.0.0.9:9"]]


def test_in_place_rewrite_is_picked_up_by_next_poll(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1", "g1")])
    source, published = source_for(path)
    source.poll()
    rewrite_in_place(path, "decode", [spec("10.0.0.1:1", "g2")], path.stat().st_mtime_ns + 10**9)
    assert source.poll() is True
    assert published.last[0].endpoints[0].group == "g2"


def test_same_size_rewrite_within_one_mtime_tick_is_picked_up(tmp_path: Path) -> None:
    """Inode, size and mtime all unchanged, as for two writes within one timestamp tick: the
    recent mtime makes the watcher compare the content."""
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1", "g1")])
    source, published = source_for(path)
    source.poll()
    before = os.stat(path)
    rewrite_in_place(path, "decode", [spec("10.0.0.1:1", "g2")], before.st_mtime_ns)
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
    assert source.poll() is True
    assert published.last[0].endpoints[0].group == "g2"
    assert source.poll() is False  # the same content again is not a change


def test_a_recent_file_is_hashed_until_its_mtime_is_one_tick_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    mtime = path.stat().st_mtime_ns
    clock = [mtime + 10**8]
    monkeypatch.setattr(eds_watch, "time", types.SimpleNamespace(time_ns=lambda: clock[0]))
    reads: list[str] = []
    read = eds_watch.read_eds_file
    monkeypatch.setattr(eds_watch, "read_eds_file", lambda p: reads.append(p) or read(p))
    source, published = source_for(path)
    source.poll()
    source.poll()
    assert len(reads) == 2  # read while the mtime was recent: the next poll compares the content
    clock[0] = mtime + eds_watch.MTIME_TICK_NS
    source.poll()  # verified a tick after the mtime: any later write moves the mtime
    source.poll()
    source.poll()
    assert len(reads) == 3
    assert len(published.calls) == 1


def test_an_old_unchanged_file_costs_one_stat_per_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(hour_ago, hour_ago))
    reads: list[str] = []
    read = eds_watch.read_eds_file
    monkeypatch.setattr(eds_watch, "read_eds_file", lambda p: reads.append(p) or read(p))
    source, _ = source_for(path)
    for _ in range(4):
        source.poll()
    assert len(reads) == 1


def test_only_the_changed_file_is_reloaded_but_all_are_published(tmp_path: Path) -> None:
    prefill = tmp_path / "prefill.json"
    decode = tmp_path / "decode.json"
    write_eds_file(prefill, "prefill", [spec("10.0.0.1:1")])
    write_eds_file(decode, "decode", [spec("10.0.0.2:2")])
    source, published = source_for(prefill, decode)
    source.poll()
    first_prefill = published.last[0]
    write_eds_file(decode, "decode", [spec("10.0.0.3:3")])
    assert source.poll() is True
    assert published.last[0] is first_prefill
    assert addresses(published.last) == [["10.0.0.1:1"], ["10.0.0.3:3"]]


def test_invalid_replacement_is_rejected_and_last_good_set_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    source, published = source_for(path)
    source.poll()
    good = published.last
    bad = response(cla("decode"), cla("decode"))
    temp = tmp_path / "decode.json.new"
    temp.write_text(json.dumps(bad))
    os.replace(temp, path)
    with caplog.at_level(logging.ERROR, logger="ext_proc.discovery.eds_watch"):
        assert source.poll() is False
    assert published.calls == [good]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"rejected EDS file update: {path}: a path-based EDS file must hold exactly one "
        "ClusterLoadAssignment, found 2 resources (keeping the last good version)"
    ]
    # the bad version is not retried on every poll, and a later good version is taken again
    caplog.clear()
    assert source.poll() is False
    assert not caplog.records
    write_eds_file(path, "decode", [spec("10.0.0.5:5")])
    assert source.poll() is True
    assert addresses(published.last) == [["10.0.0.5:5"]]


def test_invalid_file_does_not_hide_the_other_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prefill = tmp_path / "prefill.yaml"
    prefill.write_text("not: [valid\n")
    decode = tmp_path / "decode.json"
    write_eds_file(decode, "decode", [spec("10.0.0.2:2")])
    source, published = source_for(prefill, decode)
    with caplog.at_level(logging.ERROR, logger="ext_proc.discovery.eds_watch"):
        assert source.poll() is True
    assert [c.cluster_name for c in published.last] == ["decode"]
    assert any(
        str(prefill) in r.getMessage() and "no endpoints from it yet" in r.getMessage()
        for r in caplog.records
    )


def test_deleted_file_keeps_its_last_good_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    source, published = source_for(path)
    source.poll()
    path.unlink()
    with caplog.at_level(logging.ERROR, logger="ext_proc.discovery.eds_watch"):
        assert source.poll() is False
    assert len(published.calls) == 1
    assert any("cannot read" in r.getMessage() for r in caplog.records)


def test_file_missing_at_start_is_loaded_when_it_appears(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "later.json"
    source, published = source_for(path)
    with caplog.at_level(logging.ERROR, logger="ext_proc.discovery.eds_watch"):
        assert source.poll() is False
    assert published.calls == []
    assert any("cannot read" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert source.poll() is False  # still missing: not retried noisily
    assert not caplog.records
    write_eds_file(path, "decode", [spec("10.0.0.7:7")])
    assert source.poll() is True
    assert addresses(published.last) == [["10.0.0.7:7"]]


async def test_run_picks_up_a_change(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    seen: list[list[ClusterEndpoints]] = []
    source = EdsFileSource([str(path)], "pd", seen.append, interval=0.02)
    source.poll()
    task = asyncio.create_task(source.run())
    try:
        write_eds_file(path, "decode", [spec("10.0.0.2:2")])
        await until(lambda: len(seen) == 2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [addresses(clusters) for clusters in seen] == [[["10.0.0.1:1"]], [["10.0.0.2:2"]]]


async def test_run_survives_a_failing_publish_callback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The watcher outlives a publish that raises, and the registry ends up holding the file's
    endpoints: the unapplied version is retried, and a later write is published."""
    path = tmp_path / "decode.json"
    write_eds_file(path, "decode", [spec("10.0.0.1:1")])
    registry = Registry("prefill", "decode", 1000.0)
    calls: list[list[ClusterEndpoints]] = []

    def publish(clusters: list[ClusterEndpoints]) -> None:
        calls.append(clusters)
        if len(calls) == 1:
            raise RuntimeError("registry exploded")
        registry.update(clusters)

    def decodes() -> list[str]:
        return [e.address for e in registry.decodes]

    source = EdsFileSource([str(path)], "pd", publish, interval=0.02)
    task = asyncio.create_task(source.run())
    try:
        with caplog.at_level(logging.ERROR, logger="ext_proc.discovery.eds_watch"):
            await until(lambda: decodes() == ["10.0.0.1:1"])  # the unchanged file, published again
            write_eds_file(path, "decode", [spec("10.0.0.2:2")])
            await until(lambda: decodes() == ["10.0.0.2:2"])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert any("EDS watcher failed while polling" in r.getMessage() for r in caplog.records)
    assert [addresses(c) for c in calls] == [[["10.0.0.1:1"]], [["10.0.0.1:1"]], [["10.0.0.2:2"]]]


# --- regressions found in review ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "port", "problem"),
    [
        ("10.0.0.1", 70000, "port_value 70000 is out of range 1..65535"),
        ("decode-0.svc", 8000, "address 'decode-0.svc' is not an IP address (EDS endpoints must be)"),
    ],
)
def test_addresses_envoy_would_reject_are_rejected(
    tmp_path: Path, address: str, port: int, problem: str
) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(address, port))))
    assert eds_error(path) == f"{path}: endpoints[0].lb_endpoints[0]: {problem}"


def test_a_publish_that_fails_is_retried_on_the_next_poll(tmp_path: Path) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint())))
    calls: list[list[ClusterEndpoints]] = []

    def flaky(clusters: list[ClusterEndpoints]) -> None:
        calls.append(clusters)
        if len(calls) == 1:
            raise RuntimeError("registry busy")

    source = EdsFileSource([str(path)], "pd", flaky)
    with pytest.raises(RuntimeError):
        source.poll()
    assert source.poll() is True  # the file did not change, but its content was never applied
    assert addresses(calls[-1]) == [["10.0.0.1:8000"]]
    assert source.poll() is False


def test_models_are_read_deduplicated_and_written_back(tmp_path: Path) -> None:
    metadata = {"models": ["llama", "llama-sql", "llama"]}
    path = write_doc(
        tmp_path / "d.yaml", response(cla("decode", lb_endpoint("10.0.0.1", 8000, metadata=metadata)))
    )
    (spec,) = load_eds_file(path).endpoints
    assert spec.models == ("llama", "llama-sql")
    write_eds_file(tmp_path / "again.json", "decode", [spec])
    assert load_eds_file(tmp_path / "again.json").endpoints == (spec,)
    assert "models" not in json.dumps(render_cla("d", [dataclasses.replace(spec, models=None)]))


@pytest.mark.parametrize(
    ("models", "says"),
    [
        ("llama", "must be a list of model names"),
        ([], "must list at least one model"),
        (["llama", 3], "entries must be a string"),
        ([""], "entries must not be empty"),
        (["m" * 513], "513 characters long"),
        ([f"m{i}" for i in range(257)], "lists 257 models; at most 256"),
    ],
)
def test_bad_models_make_the_file_invalid(tmp_path: Path, models: object, says: str) -> None:
    path = write_doc(tmp_path / "d.yaml", response(cla("decode", lb_endpoint(metadata={"models": models}))))
    assert eds_error(path).startswith(f"{path}: endpoints[0].lb_endpoints[0]: metadata pd.models")
    assert says in eds_error(path)
