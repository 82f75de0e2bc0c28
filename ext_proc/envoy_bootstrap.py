"""``pd-extproc envoy-bootstrap``: an Envoy bootstrap listing every pd-extproc behind it.

The shipped bootstraps (``envoy/envoy.yaml``, ``envoy/envoy-ads.yaml``) list one pd-extproc, on
``127.0.0.1:9002``. :func:`with_extproc_workers` lists ``N`` instead, on the ports after it (``serve
--workers N``, or replicas started on those ports, as docker-compose.yml's two are), and with more than
one it adds a gRPC health check of each (pd-extproc's ``readiness`` service, every second): Envoy then
sends no ext_proc stream to one that is down or not ready, while the others route. Pure but for
:func:`main`'s file and stdout.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

CLUSTER = "pd_extproc"
HEALTH_CHECK = {
    "timeout": "1s",
    "interval": "1s",
    "unhealthy_threshold": 2,
    "healthy_threshold": 1,
    "no_traffic_interval": "1s",
    "grpc_health_check": {"service_name": "readiness"},
}
"""The ext_proc cluster's health check with several pd-extprocs: ``readiness`` is SERVING once a
pd-extproc holds its endpoints (docs/operations.md "gRPC health"); two failed checks a second apart take
one out, one passed check brings it back."""


class BootstrapError(ValueError):
    """The bootstrap has no ``pd_extproc`` cluster with one endpoint to start from."""


def with_extproc_workers(bootstrap: dict, workers: int) -> dict:
    """``bootstrap`` with its ``pd_extproc`` cluster listing ``workers`` endpoints.

    ``bootstrap`` itself is not changed. The endpoints: its first endpoint's host on that port and the
    ``workers - 1`` after it, health-checked when more than one."""
    if workers < 1:
        raise BootstrapError(f"{workers} workers: at least 1")
    config = copy.deepcopy(bootstrap)
    clusters = (config.get("static_resources") or {}).get("clusters") or []
    cluster = next((c for c in clusters if c.get("name") == CLUSTER), None)
    try:
        group = cluster["load_assignment"]["endpoints"][0]  # type: ignore[index]
        first = group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        host, port = first["address"], int(first["port_value"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BootstrapError(f"no {CLUSTER} cluster with a socket address to start from ({exc})") from None
    if port + workers - 1 > 65535:
        raise BootstrapError(f"{workers} workers from port {port} go past 65535")
    group["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port + i}}}}
        for i in range(workers)
    ]
    if workers > 1:
        cluster["health_checks"] = [dict(HEALTH_CHECK)]  # type: ignore[index]
    return config


def main(path: str, workers: int) -> int:
    """Print the bootstrap at ``path`` with ``workers`` ext_proc endpoints; 2 (with why) when it cannot."""
    try:
        bootstrap = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        print(yaml.safe_dump(with_extproc_workers(bootstrap, workers), sort_keys=False), end="")
    except (OSError, yaml.YAMLError, BootstrapError, AttributeError) as exc:
        print(f"pd-extproc envoy-bootstrap: {path}: {exc}", file=sys.stderr)
        return 2
    return 0
