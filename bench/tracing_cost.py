"""What tracing costs a request: tracing off, on at sampling ratio 0, and on at ratio 1, side by side.

One pd-extproc :class:`~ext_proc.router.Router` (8 endpoints: 4 prefill and 4 decode in 2 pdGroupID
groups, ``prefer``, the ``sidecar`` handoff) serves three ways: without tracing, and with
:class:`~ext_proc.tracing.Tracing` at ``sampling_ratio`` 0 and 1, both exporting over OTLP gRPC to a real
collector (``python -m standins.otlp``) in a process of its own, so the exporter thread's work (batching,
encoding, sending) is this process's and the collector's is not. Each request is what Envoy sends: the
request headers (a dozen, no caller ``traceparent``), a 1 KB chat body, the response headers; the stream
then closes (the span ends there). Two levels:

* ``stream``: the ext_proc state machine alone (:class:`~ext_proc.stream.Streams`), each message parsed
  from its wire bytes and each answer serialised, no gRPC: the routing work in process;
* ``server``: the real gRPC ext_proc server (``start_grpc``) in this process, three of them on three
  loopback ports, driven by a gRPC client in a child process (this script's ``--client``, ``--concurrency``
  streams at once): everything the pd-extproc process spends on a request, the gRPC stream included.

Every round times a batch of ``--batch`` requests of each configuration, in a rotating order, so machine
noise hits all alike. Reported per level: the median over rounds of the wall time per request (µs; the
exporter thread's share included: it holds the GIL while it encodes) and of this process's CPU time per
request (all its threads), each ratio to tracing off; and the spans the collector received (every
ratio-1 request must arrive: a dropped span would understate the cost).

``--baseline DIR`` then runs the ``stream`` level with tracing off here and in the source tree ``DIR`` (a
checkout of the commit before tracing, or of main) in two fresh processes at once: what "off costs
nothing" means.

Run: ``python -m bench.tracing_cost [--rounds N] [--batch N] [--baseline DIR] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from ext_proc.app import build_router
from ext_proc.config import load_config
from ext_proc.endpoints import ClusterEndpoints, EndpointSpec
from ext_proc.health import Health
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry
from ext_proc.router import Router
from ext_proc.server import start_grpc
from ext_proc.stream import Streams

if TYPE_CHECKING:
    from ext_proc.tracing import Tracing
from sim.gateway import free_port

BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "x" * 900}], "max_tokens": 32}
).encode()
HEADERS = (
    (":authority", "gateway.local:10000"),
    (":path", "/v1/chat/completions"),
    (":method", "POST"),
    (":scheme", "http"),
    ("content-type", "application/json"),
    ("content-length", str(len(BODY))),
    ("user-agent", "bench/1.0"),
    ("accept", "application/json"),
    ("authorization", "Bearer k"),
    ("x-forwarded-proto", "http"),
    ("x-request-id", "5a0b3c1e-0c3b-4c36-9a0e-2f3c8d1b7e21"),
    ("x-envoy-expected-rq-timeout-ms", "600000"),
)
CONFIGS = ("off", "ratio_0", "ratio_1")
Wire = tuple[bytes, bytes, bytes]


def _wire() -> Wire:
    """The request headers, body and response headers messages as Envoy sends them (BUFFERED)."""
    headers = pb.ProcessingRequest()
    for key, value in HEADERS:
        headers.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    body = pb.ProcessingRequest()
    body.request_body.body, body.request_body.end_of_stream = BODY, True
    response = pb.ProcessingRequest()
    response.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    return headers.SerializeToString(), body.SerializeToString(), response.SerializeToString()


def _router() -> Router:
    """The router over 4 prefills and 4 decodes in groups ``a`` and ``b``."""
    config = load_config(None, {"affinity.mode": "prefer"}, environ={})
    registry = Registry("prefill", "decode", config.load.default_token_capacity)
    specs = {
        role: tuple(
            EndpointSpec(f"10.0.{n}.{i}:8000", "ab"[i % 2], 65536.0, True, "HEALTHY") for i in range(4)
        )
        for n, role in enumerate(("prefill", "decode"))
    }
    registry.update([ClusterEndpoints(role, endpoints, "bench") for role, endpoints in specs.items()])
    metrics = Metrics(registry.endpoints)
    return build_router(config, registry, metrics, LiveParts(config.affinity.prefix.settings(), metrics))


def _stream_batch(streams: Streams, wire: Wire, n: int) -> None:
    """``n`` requests through ``streams``, each parsed from and answered in wire bytes."""
    parse = pb.ProcessingRequest.FromString
    for _ in range(n):
        stream = streams.open()
        for raw in wire:
            for answer in stream.answer(parse(raw)):
                answer.SerializeToString()
        stream.close()


async def _rounds(rounds: int, batch: int, run: Callable[[str, int], object]) -> dict[str, dict[str, float]]:
    """Median wall and CPU µs per request of ``await run(config, batch)`` (or a plain call) per
    configuration, ``rounds`` times each in a rotating order after one warm-up batch each."""
    for name in CONFIGS:
        result = run(name, batch)
        if asyncio.iscoroutine(result):
            await result
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    cpu: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for r in range(rounds):
        for name in CONFIGS[r % 3 :] + CONFIGS[: r % 3]:
            started, started_cpu = time.perf_counter(), time.process_time()
            result = run(name, batch)
            if asyncio.iscoroutine(result):
                await result
            wall[name].append((time.perf_counter() - started) / batch * 1e6)
            cpu[name].append((time.process_time() - started_cpu) / batch * 1e6)
    wall_us = {name: statistics.median(wall[name]) for name in CONFIGS}
    cpu_us = {name: statistics.median(cpu[name]) for name in CONFIGS}
    return {
        "median_wall_us_per_request": wall_us,
        "median_cpu_us_per_request": cpu_us,
        "wall_ratio_to_off": {name: wall_us[name] / wall_us["off"] for name in CONFIGS},
        "cpu_ratio_to_off": {name: cpu_us[name] / cpu_us["off"] for name in CONFIGS},
    }


async def _client_streams(stub: pb_grpc.ExternalProcessorStub, wire: Wire, n: int, concurrency: int) -> None:
    """``n`` ext_proc streams, ``concurrency`` at once, each the three messages and their answers."""
    messages = [pb.ProcessingRequest.FromString(raw) for raw in wire]

    async def one() -> None:
        call = stub.Process()
        await call.write(messages[0])
        await call.write(messages[1])
        await call.read()  # the headers answer (BUFFERED: after the body)
        await call.read()  # the body answer
        await call.write(messages[2])
        await call.read()
        await call.done_writing()
        await call.code()

    async def worker(share: int) -> None:
        for _ in range(share):
            await one()

    shares = [n // concurrency + (1 if i < n % concurrency else 0) for i in range(concurrency)]
    await asyncio.gather(*(worker(share) for share in shares))


async def client(concurrency: int) -> None:
    """The child process: for each line ``port n`` on stdin, send ``n`` streams there, then print ``ok``."""
    wire = _wire()
    channels: dict[int, pb_grpc.ExternalProcessorStub] = {}
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        port, n = (int(x) for x in line.split())
        if port not in channels:
            channels[port] = pb_grpc.ExternalProcessorStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        await _client_streams(channels[port], wire, n, concurrency)
        print("ok", flush=True)


@contextlib.asynccontextmanager
async def _servers(router: Router, tracings: dict[str, Tracing]) -> AsyncIterator[dict[str, int]]:
    """The three gRPC servers (one per configuration) over ``router``: their ports."""
    health = Health()
    await health.start()
    started = {
        name: await start_grpc(router, "127.0.0.1:0", health, tracing=tracings.get(name)) for name in CONFIGS
    }
    try:
        yield {name: port for name, (_, port) in started.items()}
    finally:
        for server, _ in started.values():
            await server.stop(None)


async def _server_level(
    router: Router, tracings: dict[str, Tracing], rounds: int, batch: int, concurrency: int
) -> dict:
    """The ``server`` level: three gRPC servers here, the client in a child process."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.tracing_cost", "--client", "--concurrency", str(concurrency)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None
    loop = asyncio.get_running_loop()
    try:
        async with _servers(router, tracings) as ports:

            async def run(name: str, n: int) -> None:
                stdin.write(f"{ports[name]} {n}\n")
                stdin.flush()
                answer = await loop.run_in_executor(None, stdout.readline)
                assert answer.strip() == "ok", answer

            return await _rounds(rounds, batch, run)
    finally:
        stdin.close()
        child.wait()


def _received(collector: subprocess.Popen, expected: int, deadline: float = 60.0) -> int:
    """The spans the collector reports once it has ``expected`` of them (or its count at ``deadline``)."""
    count, end = 0, time.monotonic() + deadline
    assert collector.stdout is not None
    while count < expected and time.monotonic() < end:
        line = collector.stdout.readline()
        if line.startswith("spans received:"):
            count = int(line.split(":")[1])
    return count


def _stream_off(rounds: int, batch: int) -> float:
    """Median CPU µs per request of the ``stream`` level without tracing (what ``--baseline`` runs)."""
    streams, wire = Streams(_router()), _wire()
    _stream_batch(streams, wire, batch)
    samples = []
    for _ in range(rounds):
        started = time.process_time()
        _stream_batch(streams, wire, batch)
        samples.append((time.process_time() - started) / batch * 1e6)
    return statistics.median(samples)


def baseline(tree: str, rounds: int, batch: int) -> dict[str, float]:
    """Tracing off here and in the source tree ``tree`` (e.g. a worktree of the commit before tracing).

    The same ``stream`` harness runs in two fresh processes at once, so machine noise hits both alike
    (not in this process: its traced rounds, servers and exporter threads would weigh on its side)."""
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, "--stream-off", "--rounds", str(rounds), "--batch", str(batch)]
    here_tree = str(Path(__file__).resolve().parents[1])
    children = [
        subprocess.Popen(
            command, cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE, text=True
        )
        for root in (here_tree, tree)
    ]
    here, there = (float(child.communicate()[0].split()[-1]) for child in children)
    return {"off_us": here, "baseline_off_us": there, "ratio": here / there}


async def measure(rounds: int, batch: int, concurrency: int) -> dict:
    """Both levels side by side; the collector runs in a child process."""
    from ext_proc.tracing import Tracing  # not in a baseline tree (``--stream-off``)
    from ext_proc.tracing_config import TracingConfig

    port = free_port()
    collector = subprocess.Popen(
        [sys.executable, "-m", "standins.otlp", "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert collector.stdout is not None
        collector.stdout.readline()  # it listens
        router, wire = _router(), _wire()
        endpoint = f"http://127.0.0.1:{port}"
        tracings = {
            "ratio_0": Tracing(TracingConfig(endpoint, 0.0)),
            "ratio_1": Tracing(TracingConfig(endpoint, 1.0)),
        }
        streams = {name: Streams(router, tracings.get(name)) for name in CONFIGS}
        stream = await _rounds(rounds, batch, lambda name, n: _stream_batch(streams[name], wire, n))
        server = await _server_level(router, tracings, rounds, batch, concurrency)
        for tracing in tracings.values():
            tracing.shutdown()
        sent = 2 * (rounds + 1) * batch  # the ratio-1 spans of both levels, warm-ups included
        received = _received(collector, sent)
    finally:
        collector.terminate()
        collector.wait()
    return {
        "rounds": rounds,
        "batch": batch,
        "concurrency": concurrency,
        "stream": stream,
        "server": server,
        "spans_sent_at_ratio_1": sent,
        "spans_received": received,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def _print(results: dict) -> None:
    for level in ("stream", "server"):
        numbers = results[level]
        print(f"{level}: {'tracing':<8} {'wall µs/req':>12} {'/ off':>7} {'CPU µs/req':>11} {'/ off':>7}")
        wall, cpu = numbers["median_wall_us_per_request"], numbers["median_cpu_us_per_request"]
        wall_ratio, cpu_ratio = numbers["wall_ratio_to_off"], numbers["cpu_ratio_to_off"]
        for name in CONFIGS:
            print(
                f"{'':<{len(level) + 2}}{name:<8} {wall[name]:>12.1f} {wall_ratio[name]:>7.3f} "
                f"{cpu[name]:>11.1f} {cpu_ratio[name]:>7.3f}"
            )
    print(f"spans at ratio 1: {results['spans_sent_at_ratio_1']} sent, {results['spans_received']} received")


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables and write the JSON (``--client``: be the gRPC client's child process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4, help="streams at once at the server level")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also compare tracing off with the source tree DIR (a checkout before tracing): stream level",
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream-off", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(client(args.concurrency))
        return 0
    if args.stream_off:
        print(_stream_off(args.rounds, args.batch))
        return 0
    results = asyncio.run(measure(args.rounds, args.batch, args.concurrency))
    _print(results)
    if args.baseline:
        results["baseline"] = baseline(args.baseline, args.rounds, args.batch)
        off = results["baseline"]
        here, there = off["off_us"], off["baseline_off_us"]
        print(f"off, stream CPU µs/req: here {here:.1f}, {args.baseline} {there:.1f} ({off['ratio']:.3f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
