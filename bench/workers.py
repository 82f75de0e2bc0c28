"""``pd-extproc serve --workers N`` on one host: requests/s, the sharing's CPU, short requests beside long.

The servers are the real command (``pd-extproc serve``, its workers and their private nats-server), each
started under ``taskset -c --server-cores`` (the workers and nats-server inherit it); this process, the
load, pins itself to ``--client-cores``. The load speaks the ext_proc gRPC protocol to the workers
directly, as Envoy does: per request one stream, the request headers and the buffered body (answered
with the routing), then the end of the stream (the booking released); streams are spread over a
cluster's worker ports round robin, as Envoy spreads them over the ``pd_extproc`` cluster's endpoints.
The messages are encoded once; answers are checked for the routing header, not parsed. The endpoints
are 2 prefills and 2 decodes (one group, never contacted: pd-extproc only routes, handoff ``sidecar``).

* ``throughput``: clusters ``local1`` (``serve``: one process, ``shared_state`` local, today's
  ``serve``), ``nats1`` (one process sharing over a nats-server with no peer: the cost of publishing),
  ``local2`` (two ``serve`` processes on consecutive ports, each routing alone: two processes' cost
  without the sharing), ``workers2`` and ``workers4`` (``serve --workers 2`` and ``4``), and the same
  with ``shared_state.batch_seconds`` 0.005 (``_batch5ms``: fewer, larger messages) all run at
  once; windows of ``--seconds`` closed loop at ``--concurrency`` streams in flight rotate over them
  for ``--rounds`` rounds. Per cluster, the medians over the rounds of: completed requests/s, the CPU
  time per request of its workers (``/proc``, over the window), of its nats-server and of this client.
* ``short_beside_long``: clusters ``local1`` and ``workers2`` again, with the prefix index on
  (``affinity.prefix``, the default 16-token blocks and 2,048 blocks at most: what prompt_cost.py's
  interference ran), taking turns round by round: a ~250-token chat request's time to its routing
  answer, sequentially (``--short`` requests), alone and while ``--long-streams`` closed loops send
  100k-token chat requests (400 KB bodies, each prompt new: the index records every block, and with
  two workers shares every placement). Median over the rounds of p50/p99 (ms).

Run: ``python -m bench.workers [--rounds R] [--seconds S] [--server-cores 0,1] [--client-cores 0,1]
[--json FILE]`` (under ``flock /tmp/bench.lock``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.common import closed_loop, cpu_seconds, summary_ms, write_json
from bench.prompt_cost import PROMPT_TOKENS, SHORT_TOKENS, chat_body
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from ext_proc.workers import PrivateNats, find_nats_server, start_private_nats
from sim.gateway import free_port, wait_router_ready

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ROUTED = b"x-gateway-destination-endpoint"
"""Every routing answer names the decode under this key (the body answer's ``envoy.lb`` metadata)."""
THROUGHPUT_BODY = chat_body(225, 0)
"""The throughput runs' request: a ~900-character chat message (bench/overhead.py's size), decode-only."""


def _headers() -> bytes:
    request = pb.ProcessingRequest()
    for key, value in ((":path", b"/v1/chat/completions"), (":method", b"POST")):
        request.request_headers.headers.headers.add(key=key, raw_value=value)
    request.request_headers.headers.headers.add(key="content-type", raw_value=b"application/json")
    return request.SerializeToString()


def _body(raw: bytes) -> bytes:
    request = pb.ProcessingRequest()
    request.request_body.body, request.request_body.end_of_stream = raw, True
    return request.SerializeToString()


HEADERS = _headers()


@dataclass
class Cluster:
    """One ``pd-extproc serve`` (its workers and nats-server): ports, pids, and the client's channels."""

    name: str
    processes: list[subprocess.Popen]
    grpc_ports: list[int]
    admin_ports: list[int]
    nats: PrivateNats | None = None
    """The nats-server this benchmark started for the cluster (one ``serve`` sharing, no peer)."""
    workers: list[int] = field(default_factory=list)
    nats_pid: int | None = None
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    calls: list[Callable] = field(default_factory=list)
    sent: int = 0

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of its workers and of its nats-server."""
        nats = cpu_seconds(self.nats_pid) if self.nats_pid else 0.0
        return sum(cpu_seconds(pid) for pid in self.workers), nats

    async def exchange(self, body: bytes) -> float:
        """One request over the next worker's port (round robin): seconds to its routing answer.

        ``RuntimeError`` when it was not routed or the stream failed."""
        self.sent += 1
        call = self.calls[self.sent % len(self.calls)]()
        try:
            started = time.perf_counter()
            await call.write(HEADERS)
            await call.read()
            await call.write(body)
            answer = await call.read()
            routed = time.perf_counter() - started
            await call.done_writing()
            await call.read()
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"{self.name}: {exc.code()}") from None
        if not isinstance(answer, bytes) or ROUTED not in answer:
            raise RuntimeError(f"{self.name}: not routed: {answer!r:.200}")
        return routed


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid``: pid → command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid and stat[0] != "Z":
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _config(workdir: Path, name: str, prefix: bool, shared: dict | None) -> Path:
    """A configuration file: the EDS files of 2 prefills and 2 decodes; the prefix index if ``prefix``."""
    eds = [workdir / "prefill.yaml", workdir / "decode.yaml"]
    for path, role in zip(eds, ("prefill", "decode"), strict=True):
        specs = [
            EndpointSpec(f"10.0.{role == 'decode':d}.{i}:8000", "g", 200_000.0, True, "HEALTHY")
            for i in (1, 2)
        ]
        write_eds_file(path, role, specs)
    config: dict = {
        "discovery": {"source": "files", "eds_files": [str(p) for p in eds]},
        "affinity": {"mode": "auto", "prefix": {"enabled": prefix}},
    }
    if shared:
        config["shared_state"] = shared
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SERVE, NATS, SEPARATE = "serve", "nats", "separate"
"""How a cluster runs: ``serve --workers N``; one ``serve`` sharing over a nats-server of the benchmark's
(no peer); N ``serve`` processes on consecutive ports, each routing alone (kind local: N processes'
cost without the sharing)."""


def _serve(
    workdir: Path, name: str, cores: str, config: Path, workers: int, port: int, admin: int
) -> subprocess.Popen:
    command = [
        "taskset", "-c", cores, sys.executable, "-m", "ext_proc.cli", "--log-level", "WARNING", "serve",
        "--workers", str(workers), "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{admin}",
    ]  # fmt: skip
    with (workdir / f"{name}-{port}.log").open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class Spec:
    """A cluster to start: its name, its routing processes and the shared state's batching.

    How the processes run: :data:`SERVE` …; ``batch_seconds`` ``None``: the default."""

    name: str
    workers: int
    how: str
    batch_seconds: float | None = None


def start_cluster(workdir: Path, spec: Spec, cores: str, prefix: bool) -> Cluster:
    """Start ``spec``'s routing processes, every one under ``taskset -c cores``."""
    name, workers, how = spec.name, spec.workers, spec.how
    nats = None
    shared: dict | None = None
    if spec.batch_seconds is not None:
        shared = {"batch_seconds": spec.batch_seconds}
    if how == NATS:
        binary = find_nats_server()
        assert binary is not None, "no nats-server binary"
        nats = start_private_nats(binary)
        os.sched_setaffinity(nats.process.pid, _cores(cores))
        shared = (shared or {}) | {"kind": "nats", "nats": {"url": nats.url, "token": nats.token}}
    config = _config(workdir, name, prefix, shared)
    grpc_port, admin_port = free_port(), free_port()  # each the first of 8 free ports
    ports = [grpc_port + i for i in range(workers)]
    admins = [admin_port + i for i in range(workers)]
    if how == SEPARATE:
        processes = [
            _serve(workdir, name, cores, config, 1, p, a) for p, a in zip(ports, admins, strict=True)
        ]
    else:
        processes = [_serve(workdir, name, cores, config, workers, grpc_port, admin_port)]
    return Cluster(name, processes, ports, admins, nats)


async def ready(cluster: Cluster) -> None:
    """Wait until every worker answers, then find the pids and open the channels."""
    for i, port in enumerate(cluster.admin_ports):
        await wait_router_ready(cluster.processes[i % len(cluster.processes)], port, timeout=120)
    if len(cluster.processes) == len(cluster.grpc_ports):  # one process a worker
        cluster.workers = [process.pid for process in cluster.processes]
        cluster.nats_pid = cluster.nats.process.pid if cluster.nats is not None else None
    else:
        children = _children(cluster.processes[0].pid)
        cluster.workers = [pid for pid, cmd in children.items() if "ext_proc.workers" in cmd]
        cluster.nats_pid = next(pid for pid, cmd in children.items() if "nats-server" in cmd)
        assert len(cluster.workers) == len(cluster.grpc_ports), children
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    cluster.channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=options) for p in cluster.grpc_ports
    ]
    cluster.calls = [channel.stream_stream(METHOD) for channel in cluster.channels]


async def stop(cluster: Cluster) -> None:
    """Close the channels, SIGTERM the processes (SIGKILL after 30 s), stop the benchmark's nats-server."""
    for channel in cluster.channels:
        await channel.close()
    for process in cluster.processes:
        process.terminate()
    for process in cluster.processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if cluster.nats is not None:
        cluster.nats.stop()


def _cores(spec: str) -> set[int]:
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


@contextlib.asynccontextmanager
async def _clusters(
    workdir: Path, specs: list[Spec], cores: str, prefix: bool
) -> AsyncIterator[list[Cluster]]:
    """The clusters of ``specs``, started at once and ready; stopped at the end."""
    clusters = [start_cluster(workdir, spec, cores, prefix) for spec in specs]
    try:
        for cluster in clusters:
            await ready(cluster)
        yield clusters
    finally:
        for cluster in clusters:
            await stop(cluster)


async def _window(cluster: Cluster, concurrency: int, seconds: float) -> dict:
    """A closed loop over ``cluster`` for ``seconds``: requests/s and CPU µs per request."""
    body = _body(THROUGHPUT_BODY)
    workers, nats = cluster.cpu()
    client = time.process_time()
    done, errors, elapsed = await closed_loop(lambda _: cluster.exchange(body), concurrency, seconds)
    client = time.process_time() - client
    workers_after, nats_after = cluster.cpu()
    per = 1e6 / max(done, 1)
    return {
        "requests_per_s": done / elapsed,
        "errors": errors,
        "workers_cpu_us_per_request": (workers_after - workers) * per,
        "nats_cpu_us_per_request": (nats_after - nats) * per,
        "server_cpu_us_per_request": (workers_after - workers + nats_after - nats) * per,
        "client_cpu_us_per_request": client * per,
    }


def _medians(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]} | {"rounds": rows}


async def throughput(clusters: list[Cluster], rounds: int, seconds: float, concurrency: int) -> dict:
    """Windows rotating over ``clusters`` (a warm-up window each first); the medians per cluster."""
    for cluster in clusters:
        await _window(cluster, concurrency, min(seconds, 1.0))
    rows: dict[str, list[dict]] = {c.name: [] for c in clusters}
    for round_ in range(rounds):
        for cluster in clusters if round_ % 2 == 0 else clusters[::-1]:
            rows[cluster.name].append(await _window(cluster, concurrency, seconds))
            print(
                f"  round {round_ + 1} {cluster.name}: {rows[cluster.name][-1]['requests_per_s']:.0f} req/s",
                flush=True,
            )
    return {name: _medians(values) for name, values in rows.items()}


async def _short_run(cluster: Cluster, requests: int, long_streams: int) -> dict:
    """``requests`` short requests one after the other, alone or beside ``long_streams`` closed loops of
    100k-token requests; their time to the routing answer (ms) and the long requests sent."""
    short = _body(chat_body(SHORT_TOKENS, 0))
    longs = [_body(chat_body(PROMPT_TOKENS["100k"], serial)) for serial in range(8)]
    stop_ = asyncio.Event()
    sent = 0

    async def long_loop() -> None:
        nonlocal sent
        while not stop_.is_set():
            sent += 1
            await cluster.exchange(longs[sent % len(longs)])

    tasks = [asyncio.create_task(long_loop()) for _ in range(long_streams)]
    await asyncio.sleep(0.3 if tasks else 0)
    times = [await cluster.exchange(short) for _ in range(requests)]
    stop_.set()
    await asyncio.gather(*tasks)
    return summary_ms(times) | {"long_requests": sent}


async def short_beside_long(clusters: list[Cluster], rounds: int, requests: int, long_streams: int) -> dict:
    """Per cluster, the medians over ``rounds`` of the short request's p50/p99 alone and beside."""
    for cluster in clusters:  # warm-up: the index's kernels, the channels
        await _short_run(cluster, 20, long_streams)
    rows: dict[str, dict[str, list[dict]]] = {c.name: {"alone": [], "beside": []} for c in clusters}
    for round_ in range(rounds):
        for cluster in clusters if round_ % 2 == 0 else clusters[::-1]:
            for phase, streams in (("alone", 0), ("beside", long_streams)):
                rows[cluster.name][phase].append(await _short_run(cluster, requests, streams))
            beside = rows[cluster.name]["beside"][-1]
            print(f"  round {round_ + 1} {cluster.name}: beside p99 {beside['p99_ms']:.2f} ms", flush=True)
    return {
        name: {phase: _medians(values) for phase, values in phases.items()} for name, phases in rows.items()
    }


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


async def measure(args: argparse.Namespace) -> dict:
    """Both measurements (module docstring), each over clusters started for it."""
    os.sched_setaffinity(0, _cores(args.client_cores))
    workdir = Path(tempfile.mkdtemp(prefix="pd-bench-workers-"))
    results: dict = {
        "cpus": os.cpu_count(),
        "server_cores": args.server_cores,
        "client_cores": args.client_cores,
        "loadavg_before": _loadavg(),
    }
    print("throughput:", flush=True)
    specs = [Spec("local1", 1, SERVE), Spec("nats1", 1, NATS), Spec("local2", 2, SEPARATE)]
    specs += [Spec(f"workers{n}", n, SERVE) for n in args.workers]
    for batch in args.batches:
        suffix = f"_batch{batch * 1000:g}ms"
        specs.append(Spec(f"nats1{suffix}", 1, NATS, batch))
        specs += [Spec(f"workers{n}{suffix}", n, SERVE, batch) for n in args.workers]
    async with _clusters(workdir, specs, args.server_cores, prefix=False) as clusters:
        results["throughput"] = await throughput(clusters, args.rounds, args.seconds, args.concurrency)
    if not args.short:
        results["loadavg_after"] = _loadavg()
        return results
    print("short beside long:", flush=True)
    specs = [Spec("local1", 1, SERVE), Spec("workers2", 2, SERVE)]
    async with _clusters(workdir, specs, args.server_cores, prefix=True) as clusters:
        results["short_beside_long"] = await short_beside_long(
            clusters, args.rounds, args.short, args.long_streams
        )
    results["loadavg_after"] = _loadavg()
    return results


def _print(results: dict) -> None:
    print(
        f"\nserver cores {results['server_cores']}, client cores {results['client_cores']}; load average "
        f"{results['loadavg_before']} -> {results['loadavg_after']}"
    )
    rows = results["throughput"]
    base = rows["local1"]
    print(
        f"{'cluster':<19}{'req/s':>7}{'x local1':>9}{'workers':>9}{'nats':>6}{'server':>8}{'x local1':>9}"
        f"{'client':>8}   (CPU us per request)"
    )
    for name, row in rows.items():
        server = row["server_cpu_us_per_request"]
        print(
            f"{name:<19}{row['requests_per_s']:>7.0f}{row['requests_per_s'] / base['requests_per_s']:>9.2f}"
            f"{row['workers_cpu_us_per_request']:>9.0f}{row['nats_cpu_us_per_request']:>6.0f}{server:>8.0f}"
            f"{server / base['server_cpu_us_per_request']:>9.2f}{row['client_cpu_us_per_request']:>8.0f}"
        )
    print(
        f"\n{'cluster':<10}{'alone p50':>11}{'alone p99':>11}{'beside p50':>12}{'beside p99':>12}"
        f"{'x alone':>9}"
    )
    for name, row in results.get("short_beside_long", {}).items():
        alone, beside = row["alone"], row["beside"]
        print(
            f"{name:<10}{alone['p50_ms']:>11.2f}{alone['p99_ms']:>11.2f}{beside['p50_ms']:>12.2f}"
            f"{beside['p99_ms']:>12.2f}{beside['p99_ms'] / alone['p99_ms']:>9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rotations over the clusters (medians over them)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one throughput window")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="streams in flight in the throughput windows"
    )
    parser.add_argument(
        "--short", type=int, default=200, help="short requests per run (0: no short-beside-long runs)"
    )
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[2, 4],
        help="the serve --workers N clusters, comma-separated (default 2,4)",
    )
    parser.add_argument(
        "--batches",
        type=lambda text: [float(b) for b in text.split(",") if b],
        default=[0.001],
        help="shared_state.batch_seconds of the extra nats1 and workersN clusters, comma-separated",
    )
    parser.add_argument(
        "--long-streams", type=int, default=2, help="100k-token closed loops beside the short"
    )
    parser.add_argument("--server-cores", default="0,1", help="taskset -c list for the servers (default 0,1)")
    parser.add_argument("--client-cores", default="0,1", help="CPU list this load generator runs on")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args))
    _print(results)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
