"""Gateway overhead: what pd-extproc adds to the same Envoy route, measured side by side.

Three gateways front one fast backend, all with the shipped bootstrap: ``without_filter`` (the
route without ext_proc), ``bare_ext_proc`` (a Python grpc.aio processor answering every message
unchanged: the floor of any Python ext_proc) and ``pd_extproc``. Requests rotate between them,
so machine noise hits all alike. Reported:

* latency p50/p99 per gateway at each concurrency, and what pd-extproc adds over no filter;
* pd-extproc CPU time per routed request (from /proc; the server runs in its own process). /proc
  counts in 10 ms clock ticks, so the side-by-side figure is coarse for small ``--requests``; the
  one measured over the max-throughput window is the precise one;
* maximum sustained routed requests/s (closed loop, high concurrency) and its error count;
* pd-extproc resident memory with 1,000 streams in flight, and that all their load is released;
* the body modes side by side: the same pd-extproc behind the shipped ext_proc phases (BUFFERED) and
  behind the Gateway API Inference Extension gateways' (FULL_DUPLEX_STREAMED both ways, every header
  and trailer phase: ``sim.gateway.FULL_DUPLEX_MODES``), each against the route without the
  filter, for 1 KB, 64 KB and 1 MB bodies: added latency p50 and pd-extproc CPU per request, and the
  ratio of the two modes' added latency.

Run: ``python -m bench.overhead [--requests N] [--body-requests N] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import (
    closed_loop,
    cpu_seconds,
    first_line,
    rss_mib,
    spawn_python,
    start_envoy,
    summary_ms,
    timed_post,
    write_json,
)
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.gateway import (
    Gateway,
    free_port,
    start_router_process,
    terminate,
    wait_router_ready,
)

BODY = {"model": "bench", "messages": [{"role": "user", "content": "x" * 900}], "max_tokens": 32}


BODY_SIZES = {"1KB": 1_000, "64KB": 64_000, "1MB": 1_000_000}
BODY_MODE_GATEWAYS = ("bare_buffered", "bare_full_duplex", "buffered", "full_duplex")
"""The request body sizes of the body-mode comparison, in bytes (approximately: the JSON around the
prompt adds a few dozen)."""


async def _side_by_side(urls: dict[str, str], requests: int, concurrency: int, server_pid: int) -> dict:
    """``requests`` per gateway in rounds of ``concurrency`` parallel requests, rotating gateways."""
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    connector = aiohttp.TCPConnector(limit=0)
    cpu = 0.0
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(max(1, requests // concurrency)):
            for name, url in urls.items():
                before = cpu_seconds(server_pid) if name == "pd_extproc" else 0.0
                batch = await asyncio.gather(*(timed_post(session, url, BODY) for _ in range(concurrency)))
                if name == "pd_extproc":
                    cpu += cpu_seconds(server_pid) - before
                latencies[name].extend(batch)
    result = {name: summary_ms(values) for name, values in latencies.items()}
    result["added_p50_ms"] = result["pd_extproc"]["p50_ms"] - result["without_filter"]["p50_ms"]
    result["added_p99_ms"] = result["pd_extproc"]["p99_ms"] - result["without_filter"]["p99_ms"]
    result["pd_extproc_cpu_us_per_request"] = cpu / len(latencies["pd_extproc"]) * 1e6
    return result


async def _max_throughput(url: str, concurrency: int, seconds: float, server_pid: int | None) -> dict:
    """Closed loop at ``concurrency`` for ``seconds``: completed requests/s and errors.

    With ``server_pid``, also the CPU time that process spent per completed request (µs): over a
    whole window of many requests, so /proc's clock-tick granularity (10 ms) does not matter.
    """
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        cpu_before = cpu_seconds(server_pid) if server_pid else 0.0
        done, errors, elapsed = await closed_loop(
            lambda _: timed_post(session, url, BODY), concurrency, seconds
        )
        cpu = cpu_seconds(server_pid) - cpu_before if server_pid else 0.0
    result = {"concurrency": concurrency, "requests_per_s": done / elapsed, "errors": errors}
    if server_pid:
        result["cpu_us_per_request"] = cpu / max(done, 1) * 1e6
    return result


async def _in_flight_memory(url: str, admin_port: int, server_pid: int, streams: int) -> dict:
    """Hold ``streams`` streaming requests open at once; pd-extproc RSS then, and load after."""
    rss_idle = rss_mib(server_pid)
    body = {**BODY, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def hold() -> int:
            async with session.post(url, json=body, headers={"x-hold-ms": "4000"}) as response:
                await response.read()
                return response.status

        tasks = [asyncio.create_task(hold()) for _ in range(streams)]
        in_flight, deadline = 0, time.monotonic() + 30
        while in_flight < streams and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            async with session.get(f"http://127.0.0.1:{admin_port}/debug/endpoints") as response:
                rows = await response.json()
            in_flight = max((r["active_requests"] for r in rows if r["role"] == "decode"), default=0)
        rss_loaded = rss_mib(server_pid)
        statuses = await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)
        async with session.get(f"http://127.0.0.1:{admin_port}/debug/endpoints") as response:
            left = sum(r["active_tokens"] + r["active_requests"] for r in await response.json())
    return {
        "streams": streams,
        "in_flight_seen": in_flight,
        "ok": sum(s == 200 for s in statuses),
        "rss_idle_mib": rss_idle,
        "rss_in_flight_mib": rss_loaded,
        "load_left_after": left,
    }


async def _body_modes(urls: dict[str, str], requests: int, server_pid: int) -> dict:
    """Per body size, ``requests`` sequential requests per gateway (``without_filter``; the bare
    Python processor and pd-extproc, each ``buffered`` and ``full_duplex``), rotating gateways request
    by request; the latency, the added latency p50 of each, pd-extproc's CPU per request (µs), and the
    FDS / BUFFERED ratio of the added p50, for pd-extproc and for the bare processor (Python gRPC's
    own cost of the mode's extra messages)."""
    results: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for label, size in BODY_SIZES.items():
            body = {**BODY, "messages": [{"role": "user", "content": "x" * size}]}
            latencies: dict[str, list[float]] = {name: [] for name in urls}
            cpu = dict.fromkeys(urls, 0.0)
            for _ in range(requests):
                for name, url in urls.items():
                    before = cpu_seconds(server_pid)
                    latencies[name].append(await timed_post(session, url, body))
                    cpu[name] += cpu_seconds(server_pid) - before
            row = {name: summary_ms(values) for name, values in latencies.items()}
            base = row["without_filter"]["p50_ms"]
            for name in BODY_MODE_GATEWAYS:
                row[name]["added_p50_ms"] = row[name]["p50_ms"] - base
            for mode in ("buffered", "full_duplex"):
                row[mode]["cpu_us_per_request"] = cpu[mode] / requests * 1e6
            for prefix in ("", "bare_"):
                added = row[f"{prefix}buffered"]["added_p50_ms"]
                ratio = row[f"{prefix}full_duplex"]["added_p50_ms"] / added if added > 0 else None
                row[f"{prefix}fds_over_buffered_added_p50"] = ratio
            results[label] = row
    return results


async def measure(
    requests: int, concurrencies: list[int], throughput_seconds: float, streams: int, body_requests: int
) -> dict:
    """Start the gateways, run every measurement, stop everything; return the results."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-bench-overhead-"))
    backend = spawn_python(["-m", "bench.fast_backend"])
    bare = spawn_python(["-m", "bench.bare_extproc"])
    processes = [backend, bare]
    gateways: list[Gateway] = []
    try:
        address = f"127.0.0.1:{first_line(backend)}"
        bare_port = int(first_line(bare))
        eds = [str(workdir / "prefill.json"), str(workdir / "decode.json")]
        write_eds_file(eds[0], "prefill", [EndpointSpec(address, "g", None, True, "HEALTHY")])
        write_eds_file(eds[1], "decode", [EndpointSpec(address, "g", None, True, "HEALTHY")])
        grpc_port, admin_port = free_port(), free_port()
        server = start_router_process(grpc_port, admin_port, eds, workdir / "pd-extproc.log")
        processes.append(server)
        await wait_router_ready(server, admin_port)
        urls = {}
        for name, extproc in (
            ("without_filter", None),
            ("bare_ext_proc", bare_port),
            ("pd_extproc", grpc_port),
            ("full_duplex", grpc_port),
            ("bare_full_duplex", bare_port),
        ):
            # The bare processor names no decode: Envoy's fallback policy picks (fail open).
            full_duplex = name.endswith("full_duplex")
            gateways.append(
                await start_envoy(eds, extproc, fail_open=name.startswith("bare_"), full_duplex=full_duplex)
            )
            urls[name] = f"{gateways[-1].url}/v1/chat/completions"
        modes = {
            "without_filter": urls["without_filter"],
            "bare_buffered": urls["bare_ext_proc"],
            "bare_full_duplex": urls.pop("bare_full_duplex"),
            "buffered": urls["pd_extproc"],
            "full_duplex": urls.pop("full_duplex"),
        }
        await _side_by_side(urls, 200, 1, server.pid)  # warm-up
        results: dict = {"body_bytes": len(str(BODY)), "latency": {}}
        for concurrency in concurrencies:
            results["latency"][str(concurrency)] = await _side_by_side(
                urls, requests, concurrency, server.pid
            )
        results["max_throughput"] = {
            "without_filter": await _max_throughput(urls["without_filter"], 64, throughput_seconds, None),
            "pd_extproc": await _max_throughput(urls["pd_extproc"], 64, throughput_seconds, server.pid),
        }
        results["in_flight"] = await _in_flight_memory(urls["pd_extproc"], admin_port, server.pid, streams)
        results["body_modes"] = await _body_modes(modes, body_requests, server.pid)
        return results
    finally:
        for gateway in gateways:
            gateway.stop()
        terminate(*processes)


def _print(results: dict) -> None:
    print(f"{'concurrency':<12}{'gateway':<16}{'p50 ms':>9}{'p99 ms':>9}")
    for concurrency, row in results["latency"].items():
        for name in ("without_filter", "bare_ext_proc", "pd_extproc"):
            print(f"{concurrency:<12}{name:<16}{row[name]['p50_ms']:>9.3f}{row[name]['p99_ms']:>9.3f}")
        added = f"p50 {row['added_p50_ms']:.3f} ms, p99 {row['added_p99_ms']:.3f} ms"
        print(
            f"{'':<12}added by pd-extproc: {added}, CPU {row['pd_extproc_cpu_us_per_request']:.0f} us/request"
        )
    for name, row in results["max_throughput"].items():
        cpu = f", CPU {row['cpu_us_per_request']:.0f} us/request" if "cpu_us_per_request" in row else ""
        print(
            f"max sustained ({name}, {row['concurrency']} in flight): {row['requests_per_s']:.0f} req/s, "
            f"{row['errors']} errors{cpu}"
        )
    row = results["in_flight"]
    rss = f"{row['rss_idle_mib']:.0f} -> {row['rss_in_flight_mib']:.0f} MiB"
    print(
        f"{row['in_flight_seen']}/{row['streams']} streams in flight: pd-extproc RSS {rss}; "
        f"{row['ok']} completed; load left after: {row['load_left_after']}"
    )
    print(f"\n{'body':<7}{'gateway':<18}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'CPU us/req':>12}")
    for label, row in results["body_modes"].items():
        for name in ("without_filter", *BODY_MODE_GATEWAYS):
            cells = row[name]
            added = f"{cells['added_p50_ms']:>11.3f}" if "added_p50_ms" in cells else ""
            cpu = f"{cells['cpu_us_per_request']:>12.0f}" if "cpu_us_per_request" in cells else ""
            print(f"{label:<7}{name:<18}{cells['p50_ms']:>9.3f}{cells['p99_ms']:>9.3f}{added}{cpu}")
        for prefix, who in (("", "pd-extproc"), ("bare_", "bare processor")):
            ratio = row[f"{prefix}fds_over_buffered_added_p50"]
            shown = "n/a" if ratio is None else f"{ratio:.2f}x"
            print(f"{'':<7}{who}: FULL_DUPLEX_STREAMED / BUFFERED added p50 {shown}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per gateway and concurrency")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated concurrencies (default 1,16)")
    parser.add_argument(
        "--throughput-seconds", type=float, default=5.0, help="length of the max-throughput runs"
    )
    parser.add_argument(
        "--streams", type=int, default=1000, help="streams held in flight for the memory check"
    )
    parser.add_argument(
        "--body-requests", type=int, default=300, help="requests per gateway and body size (body modes)"
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    results = asyncio.run(
        measure(args.requests, concurrencies, args.throughput_seconds, args.streams, args.body_requests)
    )
    _print(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
