"""A gRPC ADS client that speaks state-of-the-world EDS as Envoy does, for tests that drive pd-extproc's
ADS service by hand (ACK, NACK, stale nonces, resource names)."""

from __future__ import annotations

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from ext_proc.discovery.eds import CLA_TYPE_URL, parse_cluster_load_assignment
from ext_proc.endpoints import EndpointSpec


class Envoy:
    """One ADS stream, as Envoy drives it."""

    def __init__(self, channel: grpc.aio.Channel, node: str = "envoy-1") -> None:
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
        self.node = node
        self.last: discovery_pb2.DiscoveryResponse | None = None

    async def request(
        self,
        names: tuple[str, ...] = (),
        answer: discovery_pb2.DiscoveryResponse | None = None,
        error: str | None = None,
        type_url: str = CLA_TYPE_URL,
    ) -> None:
        """Subscribe to ``names``; with ``answer``, ACK it (NACK with ``error``)."""
        request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names)
        if answer is None:
            request.node.id = self.node
        else:
            request.version_info, request.response_nonce = answer.version_info, answer.nonce
        if error is not None:
            request.error_detail.message = error
        await self.call.write(request)

    async def read(self) -> discovery_pb2.DiscoveryResponse:
        response = await self.call.read()
        assert response is not grpc.aio.EOF
        self.last = response
        return response


def clusters(response: discovery_pb2.DiscoveryResponse) -> dict[str, list[EndpointSpec]]:
    """Cluster name → endpoints, decoded as pd-extproc reads EDS."""
    result = {}
    for resource in response.resources:
        assert resource.type_url == CLA_TYPE_URL
        cla = endpoint_pb2.ClusterLoadAssignment()
        resource.Unpack(cla)
        result[cla.cluster_name] = list(parse_cluster_load_assignment(cla, "pd", "ads").endpoints)
    return result
