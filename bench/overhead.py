"""Gateway overhead: Envoy + pd-extproc vs the same Envoy route without the ext_proc filter.

Both gateways front the same fast backend and are measured side by side in one run: requests
alternate between them, so machine noise hits both alike. Reports latency p50/p99 per gateway,
the added latency (difference of medians and of p99s), and pd-extproc CPU time per routed
request (from /proc, the server running in its own process).

Run: ``python bench/overhead.py [--requests N] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_seconds, first_line, spawn_python, stop, summary_ms, write_json

from ext_proc.discovery.eds import EndpointSpec, write_eds_file
from ext_proc.gateway import free_port, render_bootstrap, start_gateway

BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "x" * 900}],
    "max_tokens": 32,
}


async def _wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


async def _timed(session: aiohttp.ClientSession, url: str) -> float:
    started = time.perf_counter()
    async with session.post(url, json=BODY) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
    return time.perf_counter() - started


async def measure(requests: int, warmup: int) -> dict:
    """Run the side-by-side measurement; return the results as a dict."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-bench-overhead-"))
    backend = spawn_python([str(Path(__file__).with_name("fast_backend.py"))])
    processes = [backend]
    gateways = []
    try:
        address = f"127.0.0.1:{first_line(backend)}"
        write_eds_file(
            workdir / "prefill.json", "prefill", [EndpointSpec(address, "g", None, True, "HEALTHY")]
        )
        write_eds_file(workdir / "decode.json", "decode", [EndpointSpec(address, "g", None, True, "HEALTHY")])
        grpc_port, admin_port = free_port(), free_port()
        server = spawn_python(
            [
                "-m",
                "ext_proc.cli",
                "--log-level",
                "WARNING",
                "serve",
                "--listen",
                f"127.0.0.1:{grpc_port}",
                "--metrics-listen",
                f"127.0.0.1:{admin_port}",
                "--eds-file",
                str(workdir / "prefill.json"),
                "--eds-file",
                str(workdir / "decode.json"),
            ]
        )
        processes.append(server)
        await _wait_http(f"http://127.0.0.1:{admin_port}/healthz")
        urls = {}
        for name, extproc in (("with_ext_proc", grpc_port), ("without_filter", None)):
            listen, admin = free_port(), free_port()
            bootstrap = render_bootstrap(
                listen_port=listen,
                admin_port=admin,
                extproc_port=extproc,
                decode_eds_path=str(workdir / "decode.json"),
            )
            gateways.append(await start_gateway(bootstrap, listen, admin))
            urls[name] = f"{gateways[-1].url}/v1/chat/completions"
        latencies: dict[str, list[float]] = {name: [] for name in urls}
        connector = aiohttp.TCPConnector(limit=4)
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(warmup):
                for url in urls.values():
                    await _timed(session, url)
            cpu_before = cpu_seconds(server.pid)
            for _ in range(requests):
                for name, url in urls.items():
                    latencies[name].append(await _timed(session, url))
            cpu_after = cpu_seconds(server.pid)
        with_filter = summary_ms(latencies["with_ext_proc"])
        without = summary_ms(latencies["without_filter"])
        return {
            "requests_per_gateway": requests,
            "body_bytes": len(str(BODY)),
            "with_ext_proc": with_filter,
            "without_filter": without,
            "added_p50_ms": with_filter["p50_ms"] - without["p50_ms"],
            "added_p99_ms": with_filter["p99_ms"] - without["p99_ms"],
            "ext_proc_cpu_us_per_request": (cpu_after - cpu_before) / requests * 1e6,
        }
    finally:
        for gateway in gateways:
            gateway.stop()
        stop(*processes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per gateway (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="warm-up requests per gateway (default 200)")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.requests, args.warmup))
    print(f"{'gateway':<16}{'p50 ms':>10}{'p99 ms':>10}")
    for name in ("without_filter", "with_ext_proc"):
        print(f"{name:<16}{result[name]['p50_ms']:>10.3f}{result[name]['p99_ms']:>10.3f}")
    print(
        f"added by ext_proc: p50 {result['added_p50_ms']:.3f} ms, p99 {result['added_p99_ms']:.3f} ms; "
        f"pd-extproc CPU {result['ext_proc_cpu_us_per_request']:.0f} us/request"
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
