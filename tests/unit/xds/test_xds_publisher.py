"""The EDS publisher's ordering: Envoy first, then the router. A real ADS server on loopback, a gRPC
client playing Envoy (it ACKs when the test says so), and a real registry as the router's view."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from ads_client import Envoy, clusters
from builders import endpoint
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from extproc_messages import body, headers
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry
from ext_proc.xds.publisher import EdsPublisher

D1, D2, D3 = (endpoint(f"10.0.0.{i}:8000", "a", 1000.0) for i in (1, 2, 3))


def decode(*specs: EndpointSpec) -> list[ClusterEndpoints]:
    return [ClusterEndpoints("decode", specs, "decode.json")]


def unhealthy(spec: EndpointSpec) -> EndpointSpec:
    return endpoint(spec.address, spec.group, spec.token_capacity, "UNHEALTHY")


@dataclass
class Gate:
    publisher: EdsPublisher
    registry: Registry
    metrics: Metrics
    applied: list[tuple[int, list[str], bool]]
    """Per hand-over: the version Envoy was being served, the pickable decodes, settled."""
    channel: grpc.aio.Channel

    def pickable(self) -> list[str]:
        return [s.address for s in self.registry.decodes]

    def envoy(self, node: str = "envoy-1") -> Envoy:
        return Envoy(self.channel, node)

    def acks(self) -> float:
        """The ACKs the ADS server has taken (it settles the publisher as it takes each)."""
        return self.metrics.registry.get_sample_value("pd_extproc_xds_replies_total", {"result": "ack"}) or 0


@asynccontextmanager
async def gate(delay: float) -> AsyncIterator[Gate]:
    """An EdsPublisher for clusters prefill/decode with ``no_envoy_delay`` = ``delay`` seconds."""
    registry = Registry("prefill", "decode", 1000.0)
    metrics = Metrics(registry.endpoints)
    applied: list[tuple[int, list[str], bool]] = []

    def apply(view: list[ClusterEndpoints], settled: bool) -> None:
        registry.update(view)
        applied.append((publisher.ads.version, [s.address for s in registry.decodes], settled))

    publisher = EdsPublisher(("prefill", "decode"), "pd", apply, delay, metrics)
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(publisher.ads, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Gate(publisher, registry, metrics, applied, channel)
    finally:
        publisher.close()
        await server.stop(0)


async def subscribed(g: Gate, *nodes: str) -> list[Envoy]:
    """Envoys ``nodes``, each subscribed to every cluster once this returns.

    ``Envoy.request`` returns when the request is written, before the server has taken it; a version
    published in between would find no subscriber and admit its endpoints after the no-Envoy delay.
    So an empty version 1 is published first: only a subscription the server holds is answered."""
    g.publisher.publish(decode())
    envoys = [g.envoy(node) for node in nodes]
    for envoy in envoys:
        await envoy.request()
        assert clusters(await envoy.read())["decode"] == []
    return envoys


async def acked(g: Gate, *specs: EndpointSpec) -> Envoy:
    """Publish ``specs`` as the decode cluster to a subscribed Envoy that ACKs; return it."""
    envoy = g.envoy()
    await envoy.request()
    g.publisher.publish(decode(*specs))
    await envoy.request(answer=await envoy.read())
    await until(lambda: g.pickable() == [s.address for s in specs if s.healthy])
    return envoy


async def test_without_envoy_a_new_endpoint_becomes_pickable_after_the_delay() -> None:
    async with gate(delay=0.3) as g:
        loop = asyncio.get_running_loop()
        start = loop.time()
        g.publisher.publish(decode(D1))
        assert g.pickable() == []
        assert g.applied[-1][2] is False  # not settled: readiness waits
        assert g.metrics.registry.get_sample_value("pd_extproc_xds_pending_endpoints") == 1
        await until(lambda: g.pickable() == [D1.address])
        assert loop.time() - start >= 0.3
        assert g.applied[-1][2] is True
        assert g.metrics.registry.get_sample_value("pd_extproc_xds_pending_endpoints") == 0


async def test_a_subscribed_envoy_must_ack_before_the_router_may_pick() -> None:
    async with gate(delay=0.05) as g:
        (envoy,) = await subscribed(g, "envoy-1")
        g.publisher.publish(decode(D1))
        response = await envoy.read()
        assert clusters(response)["decode"] == [D1]
        await asyncio.sleep(0.3)  # far past the no-Envoy delay: an Envoy is there, its ACK counts
        assert g.pickable() == []
        await envoy.request(answer=response)
        await until(lambda: g.pickable() == [D1.address])


async def test_an_endpoint_leaves_the_router_before_the_version_without_it_is_published() -> None:
    async with gate(delay=0.05) as g:
        envoy = await acked(g, D1, D2, D3)
        g.applied.clear()
        g.publisher.publish(decode(unhealthy(D1), D3))  # D1 unhealthy, D2 removed
        assert g.applied[0] == (1, [D3.address], True)  # handed over while Envoy still had version 1
        response = await envoy.read()
        assert response.version_info == "2"
        assert clusters(response)["decode"] == [unhealthy(D1), D3]


async def test_new_metadata_of_a_pickable_endpoint_reaches_the_router_at_once() -> None:
    async with gate(delay=0.05) as g:
        await acked(g, D1)
        moved = endpoint(D1.address, "b", 2000.0, bootstrap_port=9000)
        g.publisher.publish(decode(moved))
        (state,) = g.registry.decodes  # no ACK needed: Envoy already has the address
        assert (state.group, state.token_capacity, state.bootstrap_port) == ("b", 2000.0, 9000)
        assert g.applied[-1][2] is True


async def test_a_nack_admits_nothing_until_a_later_version_is_acked() -> None:
    async with gate(delay=0.05) as g:
        envoy = await acked(g, D1)
        g.publisher.publish(decode(D1, D2))
        await envoy.request(answer=await envoy.read(), error="rejected")
        await asyncio.sleep(0.3)
        assert g.pickable() == [D1.address]
        g.publisher.publish(decode(D1, D2, D3))
        await envoy.request(answer=await envoy.read())
        await until(lambda: g.pickable() == [D1.address, D2.address, D3.address])


@pytest.mark.parametrize("gone", [lambda spec: None, unhealthy], ids=["removed", "unhealthy"])
async def test_an_endpoint_back_again_waits_for_the_version_that_brings_it_back(
    gone: Callable[[EndpointSpec], EndpointSpec | None],
) -> None:
    async with gate(delay=0.05) as g:
        envoy = await acked(g, D1, D2)
        g.publisher.publish(decode(D2, *filter(None, [gone(D1)])))
        await envoy.request(answer=await envoy.read())
        await until(lambda: g.publisher.ads.acked_version("decode") == 2)
        assert g.pickable() == [D2.address]
        g.publisher.publish(decode(D1, D2))  # version 3; the ACKed versions 1 had D1 too, 2 had not
        response = await envoy.read()
        await asyncio.sleep(0.3)
        assert g.pickable() == [D2.address]
        await envoy.request(answer=response)
        await until(lambda: sorted(g.pickable()) == [D1.address, D2.address])


async def test_every_subscribed_envoy_must_ack() -> None:
    async with gate(delay=0.05) as g:
        one, two = await subscribed(g, "one", "two")
        g.publisher.publish(decode(D1))
        await one.request(answer=await one.read())
        await until(lambda: g.acks() == 1)  # one ACKed (and the publisher settled), two not yet
        await asyncio.sleep(0.2)  # far past the no-Envoy delay
        assert g.pickable() == []
        await two.request(answer=await two.read())
        await until(lambda: g.pickable() == [D1.address])


async def test_an_envoy_leaving_without_an_ack_lets_waiting_endpoints_in_after_the_delay() -> None:
    async with gate(delay=0.3) as g:
        loop = asyncio.get_running_loop()
        (envoy,) = await subscribed(g, "envoy-1")
        start = loop.time()
        g.publisher.publish(decode(D1))
        await envoy.read()
        envoy.call.cancel()
        await until(lambda: g.pickable() == [D1.address])
        assert loop.time() - start >= 0.3


async def test_envoy_gets_the_sources_prefill_and_decode_clusters_as_the_registry_merges_them() -> None:
    async with gate(delay=0.05) as g:
        envoy = g.envoy()
        await envoy.request()
        regrouped = endpoint(D1.address, "z")
        other = ClusterEndpoints("embeddings", (D3,), "other.json")
        g.publisher.publish(
            [
                ClusterEndpoints("decode", (D1,), "one.json"),
                ClusterEndpoints("decode", (D2, regrouped), "two.json"),
                other,
            ]
        )
        response = await envoy.read()
        assert clusters(response) == {"prefill": [], "decode": [D1, D2]}  # first entry of an address wins
        await envoy.request(answer=response)
        await until(lambda: g.pickable() == [D1.address, D2.address])
        assert [s.group for s in g.registry.decodes] == ["a", "a"]


async def test_the_server_serves_ads_on_its_grpc_port_and_routes_only_to_what_envoy_acked(tmp_path) -> None:
    """Readiness and routing wait for the ACK; ext_proc and ADS share one port."""
    prefill, decode_file = tmp_path / "prefill.json", tmp_path / "decode.json"
    write_eds_file(prefill, "prefill", [endpoint("10.0.0.9:8000", "a")])
    write_eds_file(decode_file, "decode", [D1])
    config = load_config(
        None,
        {
            "listen": "127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "discovery.eds_files": [str(prefill), str(decode_file)],
            "discovery.poll_interval_seconds": 0.05,
            "xds.serve_eds": True,
            "xds.no_envoy_delay_seconds": 30,
        },
        environ={},
    )
    running = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            readiness = health_pb2.HealthCheckRequest(service="readiness")
            extproc = external_processor_pb2_grpc.ExternalProcessorStub(channel)

            async def destination() -> str:
                call = extproc.Process()
                await call.write(headers())
                await call.read()
                await call.write(body())
                answer = await call.read()
                await call.done_writing()
                if answer.HasField("immediate_response"):
                    return json.loads(answer.immediate_response.body)["error"]["code"]
                lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
                return lb["x-gateway-destination-endpoint"].string_value

            assert (await health.Check(readiness)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await destination() == "no_healthy_decode_endpoint"
            envoy = Envoy(channel)
            await envoy.request()
            response = await envoy.read()
            assert clusters(response)["decode"] == [D1]
            assert await destination() == "no_healthy_decode_endpoint"
            await envoy.request(answer=response)

            async def serving() -> bool:
                return (await health.Check(readiness)).status == health_pb2.HealthCheckResponse.SERVING

            await until(serving)
            assert await destination() == D1.address
            write_eds_file(decode_file, "decode", [D2])
            response = await envoy.read()  # D1 already withdrawn from the router when this was sent
            assert clusters(response)["decode"] == [D2]
            assert await destination() == "no_healthy_decode_endpoint"
            await envoy.request(answer=response)
            await until(lambda: [s.address for s in running.router.registry.decodes] == [D2.address])
            assert await destination() == D2.address
    finally:
        await running.stop(grace=0)


async def test_after_close_nothing_reaches_the_router() -> None:
    async with gate(delay=0.2) as g:
        (envoy,) = await subscribed(g, "envoy-1")
        g.publisher.publish(decode(D1))
        await envoy.read()
        g.publisher.close()  # ends the stream, whose end would otherwise admit D1 after the delay
        assert await envoy.call.read() == grpc.aio.EOF
        await asyncio.sleep(0.4)
        assert g.pickable() == []
