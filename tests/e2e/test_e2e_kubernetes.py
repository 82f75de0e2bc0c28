"""The Kubernetes path end to end: engine pods in a (stand-in) API server, pd-extproc watching them
through the real client library and serving their endpoints to the real Envoy over ADS
(``envoy/envoy-ads.yaml``). Pods added, made unready, relabelled and deleted change where requests
land within 1 s, and no request is ever sent to an address the router does not know.

No Kubernetes API server can run here: ``fake_kube_api.FakeKubeApi`` speaks its list/watch wire format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from e2e_harness import gateway_over
from test_e2e_xds import assert_moved_in_time, backends, envoy_endpoints, timed_changes, watched

from standins.fake_kube_api import FakeKubeApi
from standins.kube_objects import pod

NS = "engines"


def engine(name: str, role: str, group: str, address: str, **kwargs) -> dict:
    """A pod of one engine serving on ``address`` (``ip:port``, its container port named as InferNex does)."""
    ip, _, port = address.rpartition(":")
    return pod(name, role, ip, group=group, namespace=NS, ports={f"{role}-port": int(port)}, **kwargs)


async def test_pods_added_unready_relabelled_and_deleted_move_requests_within_a_second(
    tmp_path: Path,
) -> None:
    api = FakeKubeApi()
    await api.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig(NS))
    settings = {
        "discovery.source": "kubernetes",
        "discovery.kubernetes.kubeconfig": str(kubeconfig),
        "discovery.kubernetes.namespaces": [NS],
        "affinity.mode": "strict",
    }
    try:
        async with backends(6) as (pa, pb, pc, d1, d2, d3):
            for name, role, group, backend in (
                ("prefill-a", "prefill", "a", pa),
                ("prefill-b", "prefill", "b", pb),
                ("decode-1", "decode", "a", d1),
                ("decode-2", "decode", "b", d2),
            ):
                api.put(engine(name, role, group, backend.address))
            async with (
                gateway_over(tmp_path, [], [], settings, ads=True) as g,
                watched(g) as watch,
            ):

                def put(*pods: dict) -> Callable[[], None]:
                    def change() -> None:
                        for one in pods:
                            api.put(one)

                    return change

                def delete(*names: str) -> Callable[[], None]:
                    def change() -> None:
                        for name in names:
                            api.delete(NS, name)

                    return change

                timings = await timed_changes(
                    watch,
                    [
                        (
                            "added",
                            put(
                                engine("decode-3", "decode", "a", d3.address),
                                engine("prefill-c", "prefill", "b", pc.address),
                            ),
                            lambda batch: (
                                any(x.served == d3.address for x in batch)
                                and any(x.prefill == pc.address for x in batch)
                            ),
                        ),
                        (
                            "unready",
                            put(engine("decode-1", "decode", "a", d1.address, ready="False")),
                            lambda batch: all(x.served != d1.address for x in batch),
                        ),
                        (
                            "ready again",
                            put(engine("decode-1", "decode", "a", d1.address)),
                            lambda batch: any(x.served == d1.address for x in batch),
                        ),
                        (
                            "relabelled",
                            put(engine("decode-3", "decode", "b", d3.address)),
                            lambda batch: (
                                any(x.served == d3.address and x.prefill != pa.address for x in batch)
                                and all(x.served == d1.address for x in batch if x.prefill == pa.address)
                            ),
                        ),
                        (
                            "deleted",
                            delete("decode-2", "prefill-c"),
                            lambda batch: all(
                                x.served != d2.address and x.prefill != pc.address for x in batch
                            ),
                        ),
                    ],
                )

                held = await envoy_endpoints(watch)
                assert {e.address for e in held["decode"]} == {d1.address, d3.address}
                assert {e.address for e in held["prefill"]} == {pa.address, pb.address}
                assert {e.group for e in held["decode"] if e.address == d3.address} == {"b"}
            assert watch.violations == [], watch.violations
            assert_moved_in_time(timings)
    finally:
        await api.stop()
