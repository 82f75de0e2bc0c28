"""The ADS servicer on its own: a real grpc.aio server on a loopback port, driven by a real gRPC client
speaking state-of-the-world EDS as Envoy does (initial request, ACK, NACK, stale nonces, names)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from ads_client import Envoy, clusters
from builders import endpoint
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc
from polling import until
from prometheus_client import generate_latest

from ext_proc.discovery.eds import CLA_TYPE_URL, cluster_load_assignment
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.metrics import Metrics
from ext_proc.xds.ads import AdsServer

DECODE = endpoint("10.0.0.2:8000", "a", 1000.0)
PREFILL = endpoint("10.0.0.1:8000", "a", bootstrap_port=8998)


def assignments(*decodes: EndpointSpec) -> dict[str, endpoint_pb2.ClusterLoadAssignment]:
    """The prefill cluster with PREFILL, the decode cluster with ``decodes``."""
    return {
        "prefill": cluster_load_assignment(ClusterEndpoints("prefill", (PREFILL,), "t")),
        "decode": cluster_load_assignment(ClusterEndpoints("decode", decodes, "t")),
    }


@dataclass
class Served:
    ads: AdsServer
    metrics: Metrics
    port: int
    changes: list[int]

    def metric(self, line: str) -> bool:
        return line in generate_latest(self.metrics.registry).decode()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    metrics = Metrics(lambda: ())
    changes: list[int] = []
    ads = AdsServer(metrics, lambda: changes.append(ads.version))
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Served(ads, metrics, port, changes)
    ads.close()
    await server.stop(0)


@pytest.fixture
async def channel(served: Served) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        yield channel


async def test_nothing_is_sent_before_a_version_then_wildcard_gets_every_cluster(served, channel):
    envoy = Envoy(channel)
    await envoy.request()
    await until(lambda: served.changes == [0])  # subscribed, nothing to send yet
    assert served.ads.publish(assignments(DECODE)) == 1
    response = await envoy.read()
    assert (response.version_info, response.type_url) == ("1", CLA_TYPE_URL)
    assert response.nonce
    assert clusters(response) == {"prefill": [PREFILL], "decode": [DECODE]}


async def test_the_requested_names_select_clusters_and_a_new_name_resends_the_version(served, channel):
    served.ads.publish(assignments(DECODE))
    envoy = Envoy(channel)
    await envoy.request(("decode", "unknown"))
    first = await envoy.read()
    assert clusters(first) == {"decode": [DECODE]}
    await envoy.request(("decode", "prefill"), answer=first)  # ACK, and now prefill too
    second = await envoy.read()
    assert served.ads.acked_version("decode") == 1
    assert served.ads.acked_version("prefill") == 0  # subscribed, but no ACKed response held it
    assert second.version_info == first.version_info == "1"
    assert second.nonce != first.nonce
    assert set(clusters(second)) == {"decode", "prefill"}


async def test_an_ack_records_the_version_of_the_clusters_sent_and_is_not_answered(served, channel):
    served.ads.publish(assignments(DECODE))
    envoy = Envoy(channel)
    await envoy.request(("decode",))
    first = await envoy.read()
    assert served.ads.acked_version("decode") == 0
    assert served.ads.acked_version("prefill") is None  # nobody subscribed to it
    await envoy.request(("decode",), answer=first)
    await until(lambda: served.ads.acked_version("decode") == 1)
    assert served.changes == [1, 1]  # subscription, ACK
    assert served.ads.publish(assignments()) == 2
    pushed = await envoy.read()  # the ACK got no answer of its own: the next response is the push
    assert pushed.version_info == "2"
    assert clusters(pushed) == {"decode": []}
    assert served.metric('pd_extproc_xds_replies_total{result="ack"} 1.0')
    assert served.metric("pd_extproc_xds_responses_total 2.0")
    assert served.metric("pd_extproc_xds_version 2.0")


async def test_a_nack_is_logged_counted_and_not_resent(served, channel, caplog):
    served.ads.publish(assignments(DECODE))
    envoy = Envoy(channel)
    await envoy.request()
    await envoy.request(answer=await envoy.read())
    await until(lambda: served.ads.acked_version("decode") == 1)
    served.ads.publish(assignments())
    rejected = await envoy.read()
    with caplog.at_level(logging.ERROR, logger="ext_proc.xds.ads"):
        await envoy.request(answer=rejected, error="bad endpoint")
        await until(lambda: served.metric('pd_extproc_xds_replies_total{result="nack"} 1.0'))
    assert "envoy-1" in caplog.text and "rejected EDS version 2" in caplog.text
    assert "bad endpoint" in caplog.text
    assert served.ads.acked_version("decode") == 1  # still on the last version it accepted
    served.ads.publish(assignments(DECODE))
    assert (await envoy.read()).version_info == "3"  # version 2 was not sent again


async def test_a_stale_nonce_is_ignored(served, channel):
    served.ads.publish(assignments(DECODE))
    envoy = Envoy(channel)
    await envoy.request()
    old = await envoy.read()
    served.ads.publish(assignments())
    await envoy.request(answer=old)  # crossed with version 2 on the wire
    new = await envoy.read()
    assert new.version_info == "2"
    assert served.ads.acked_version("decode") == 0
    await envoy.request(answer=new)
    await until(lambda: served.ads.acked_version("decode") == 2)


async def test_every_subscribed_stream_gets_each_push_and_acked_version_is_their_lowest(served, channel):
    served.ads.publish(assignments(DECODE))
    one, two = Envoy(channel, "one"), Envoy(channel, "two")
    await one.request()
    await two.request(("decode",))
    await one.request(answer=await one.read())
    await two.read()
    await until(lambda: served.ads.acked_version("prefill") == 1)  # only `one` subscribed to it
    assert served.ads.acked_version("decode") == 0  # `two` has not ACKed
    served.ads.publish(assignments())
    assert (await one.read()).version_info == (await two.read()).version_info == "2"
    await two.request(("decode",), answer=two.last)
    await until(lambda: served.ads.acked_version("decode") == 1)  # `one` still at 1
    two.call.cancel()
    await until(lambda: served.metric("pd_extproc_xds_streams 1.0"))
    one.call.cancel()
    await until(lambda: served.ads.acked_version("decode") is None)
    assert served.metric("pd_extproc_xds_streams 0.0")


async def test_other_resource_types_are_ignored(served, channel, caplog):
    served.ads.publish(assignments(DECODE))
    envoy = Envoy(channel)
    cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    with caplog.at_level(logging.WARNING, logger="ext_proc.xds.ads"):
        await envoy.request(type_url=cds)
        await until(lambda: "only EDS is served" in caplog.text)
    assert served.changes == []
    await envoy.request()
    assert (await envoy.read()).type_url == CLA_TYPE_URL


async def test_close_ends_every_stream(served, channel):
    envoy = Envoy(channel)
    await envoy.request()
    await until(lambda: served.changes == [0])
    served.ads.close()
    assert await envoy.call.read() == grpc.aio.EOF
    assert await envoy.call.code() == grpc.StatusCode.OK
