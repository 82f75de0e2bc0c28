"""The gateway shapes as files: each is a valid Envoy 1.40 bootstrap as committed, and
:func:`shapes.render_shape` changes nothing in it but addresses and the pool's endpoints."""

from __future__ import annotations

import copy

import pytest
import yaml

from sim.gateway import validate_envoy
from standins.shapes import SHAPES, SHAPES_DIR, nodes, render_shape

SERVERS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]
LOCAL_ONLY = ("socket_address", "lb_endpoints", "x-gateway-destination-endpoint-subset")
"""What a local run rebinds: every address, the pool's endpoint list and kgateway's subset list."""


def _skeleton(config: dict) -> dict:
    """``config`` without the keys of :data:`LOCAL_ONLY`."""
    skeleton = copy.deepcopy(config)
    for node in nodes(skeleton):
        if isinstance(node, dict):
            for key in LOCAL_ONLY:
                node.pop(key, None)
    return skeleton


@pytest.mark.parametrize("shape", SHAPES)
def test_the_shape_file_is_a_valid_envoy_bootstrap(shape):
    path = SHAPES_DIR / f"{shape}.yaml"
    result = validate_envoy(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert path.read_text().startswith("# Gateway shape: ")  # the header naming its sources


@pytest.mark.parametrize("shape", SHAPES)
def test_rendering_changes_only_addresses_and_the_pool(shape):
    original = yaml.safe_load((SHAPES_DIR / f"{shape}.yaml").read_text())
    rendered = render_shape(shape, 9999, SERVERS)
    config = rendered.config
    assert _skeleton(config) == _skeleton(original)
    sockets = [n["socket_address"] for n in nodes(config) if isinstance(n, dict) and "socket_address" in n]
    assert {s["address"] for s in sockets} == {"127.0.0.1"}
    own = [
        config["admin"]["address"],
        *(entry["address"] for entry in config["static_resources"]["listeners"]),
    ]
    ports = [a["socket_address"]["port_value"] for a in own]
    assert len(set(ports)) == len(ports) and rendered.listen_port in ports and rendered.admin_port == ports[0]
    pickers = {
        n["envoy_grpc"]["cluster_name"] for n in nodes(config) if isinstance(n, dict) and "envoy_grpc" in n
    }
    for cluster in config["static_resources"]["clusters"]:
        members = [
            f"{n['socket_address']['address']}:{n['socket_address']['port_value']}"
            for n in nodes(cluster.get("load_assignment", {}))
            if isinstance(n, dict) and "socket_address" in n
        ]
        if cluster["name"] in pickers:
            assert members == ["127.0.0.1:9999"]
        elif members and members != [f"127.0.0.1:{rendered.admin_port}"]:
            assert members == SERVERS
            metadata = [e.get("metadata") for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
            if metadata[0]:  # kgateway: each endpoint's subset key is its own address
                assert [
                    m["filter_metadata"]["envoy.lb"]["x-gateway-destination-endpoint"] for m in metadata
                ] == SERVERS
    hints = [
        n["x-gateway-destination-endpoint-subset"]
        for n in nodes(config)
        if isinstance(n, dict) and "x-gateway-destination-endpoint-subset" in n
    ]
    assert all(hint == SERVERS for hint in hints)
