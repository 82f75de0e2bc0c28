"""The gateway's cost against prompt length: in process, through Envoy, and SGLang's ``smg`` beside it.

Three measurements, each at the trace's prompt lengths (``../shared/traces/``: mean 12k tokens, p99
85k; here 1k, 12k and 100k tokens of text, 4 characters a token: 4 KB, 48 KB and 400 KB bodies):

* ``in_process``: pd-extproc's :class:`~ext_proc.router.Router` as ``bench/prefix_peers.py``'s
  ``PdExtproc`` drives it (8 endpoints, 4 prefill and 4 decode in 2 groups, ``auto``, one chat message
  per request, every prompt new from its first block: the index records every block), with and
  without the prefix index: ``route_body`` per request on the JSON bytes Envoy would hand over (the
  client's encoding is timed apart), median and p99 in µs, and the process CPU time per request; plus
  the slowest of two 16 MiB bodies (the largest Envoy buffers) with the index on.
* ``gateway``: per prompt length, the same requests side by side, rotating targets request by request
  (machine noise hits all alike): the decode backend ``direct``; Envoy ``without_filter``; Envoy with
  the bare Python ext_proc floor (``bench/bare_extproc.py``); Envoy + pd-extproc without the index,
  with it (both the ``sidecar`` handoff: pd-extproc only routes), and with ``--handoff
  sglang-bootstrap`` (pd-extproc also sends the prefill leg, as ``smg`` does); and ``smg`` (PD mode,
  its default policy) on the same two fast backends (``bench/fast_backend.py``: one the prefill, one
  the decode). Latency p50/p99 at concurrency 1 and what each adds over ``direct``; then per target a
  closed loop at ``--concurrency`` for ``--seconds``: requests/s and CPU per request of the router
  process (pd-extproc, the bare processor or ``smg``) and of Envoy, from /proc over the whole window.
* ``largest_body``: a 16 MiB body's latency through Envoy without the filter and with pd-extproc.
* ``interference``: a short request's latency (about 250 tokens), sequentially, through each of
  ``direct``, Envoy without the filter, Envoy + the bare Python ext_proc floor and Envoy + pd-extproc
  (index on; and its ``_before``) in turn: alone, then while ``--long-streams`` closed loops send
  streamed 100k-token requests through one of those gateways. Through the long requests' own gateway
  it shares their Envoy and router (through the floor's: what any Python ext_proc's one event loop
  makes it wait); through the others, only the machine (what its own contention adds).

``smg`` is installed from PyPI into a cache virtual environment (``~/.cache/pd-extproc-bench/smg``) on
first use: it is not a dependency of the package. ``--baseline DIR`` also runs every pd-extproc target
from the source tree ``DIR`` (e.g. ``git worktree add DIR main``), as ``<target>_before``, in the same
rotations and closed loops and beside the short request: a change's before and after in one run.
Run: ``python -m bench.prompt_cost [--requests N] [--seconds S] [--baseline DIR] [--json FILE] [--png FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import aiohttp

from bench.common import (
    closed_loop,
    cpu_seconds,
    first_line,
    spawn_python,
    start_envoy,
    summary_ms,
    timed_post,
    write_json,
)
from bench.prefix_peers import Endpoint, PdExtproc
from ext_proc.affinity import Mode, Policy
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from ext_proc.prefix.settings import PrefixSettings
from sim.gateway import (
    Gateway,
    free_port,
    start_router_process,
    terminate,
    wait_router_ready,
)
from sim.report import percentile

PROMPT_TOKENS = {"1k": 1_000, "12k": 12_000, "100k": 100_000}
"""The prompt lengths measured, in tokens (4 characters of text each)."""
BIG_BODY_BYTES = 16 * 1024 * 1024
"""The largest body measured: Envoy's buffer limit in the shipped bootstrap."""
SHORT_TOKENS = 250
SMG_VERSION = "1.13.*"
SMG_VENV = Path.home() / ".cache" / "pd-extproc-bench" / "smg"
ENDPOINTS = [
    Endpoint(f"10.0.{g}.{i}:8000", role, f"g{g}", 200_000.0)
    for g in (0, 1)
    for i, role in enumerate(("prefill", "prefill", "decode", "decode"))
]
"""8 endpoints of 200k tokens of KV each: 2 prefill and 2 decode in each of 2 groups."""
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "engines", "share")


def prompt_text(tokens: int, serial: int) -> str:
    """``4 * tokens`` characters of words, its first block made unique by ``serial``."""
    period = " ".join(_WORDS[(i * 7 + serial) % len(_WORDS)] for i in range(min(tokens, 4096)))
    text = f"{serial:08d} " + period * (4 * tokens // len(period) + 1)
    return text[: 4 * tokens]


def chat_body(tokens: int, serial: int, **extra: object) -> bytes:
    """A chat request of one user message of ``tokens`` tokens, as JSON bytes."""
    message = {"role": "user", "content": prompt_text(tokens, serial)}
    return json.dumps({"model": "bench", "messages": [message], "max_tokens": 32, **extra}).encode()


def _router_cost(
    prefix: PrefixSettings | None, bodies: list[bytes], warmup: int
) -> tuple[list[float], float]:
    """Seconds of ``route_body`` for each of ``bodies`` after ``warmup`` of them (leases released), and
    the process CPU seconds per request over them (on a shared machine, the figure descheduling
    does not inflate)."""
    router = PdExtproc(ENDPOINTS, Policy(Mode.AUTO), prefix)
    times = []
    cpu = 0.0
    for i, raw in enumerate(bodies):
        cpu_before, started = time.process_time(), time.perf_counter()
        placed = router.place_raw(raw)
        elapsed, spent = time.perf_counter() - started, time.process_time() - cpu_before
        placed.release()
        if i >= warmup:
            times.append(elapsed)
            cpu += spent
    return times, cpu / max(len(times), 1)


def in_process(requests: int) -> dict:
    """Per prompt length, ``route_body`` µs per request (median, p99) without and with the index."""
    results: dict = {}
    warmup = min(20, requests)
    for label, tokens in PROMPT_TOKENS.items():
        bodies = [chat_body(tokens, i) for i in range(warmup + requests)]
        started = time.perf_counter()
        for _ in range(requests):
            json.dumps({"model": "bench", "messages": [{"role": "user", "content": "x" * (4 * tokens)}]})
        encode_us = (time.perf_counter() - started) / requests * 1e6
        row: dict = {"tokens": tokens, "body_bytes": len(bodies[0]), "client_encode_us": encode_us}
        for name, prefix in (("without_index", None), ("with_index", PrefixSettings())):
            times, cpu = _router_cost(prefix, bodies, warmup)
            row[name] = {
                "p50_us": statistics.median(times) * 1e6,
                "p99_us": percentile(times, 0.99) * 1e6,
                "cpu_us": cpu * 1e6,
            }
        results[label] = row
    big = [chat_body(BIG_BODY_BYTES // 4 - 40, i) for i in range(3)]
    times, _ = _router_cost(PrefixSettings(), big, 1)
    results["16MiB"] = {"body_bytes": len(big[0]), "with_index": {"max_ms": max(times) * 1e3}}
    return results


def smg_binary() -> Path:
    """The ``smg`` command of the cache virtual environment, installing it from PyPI the first time."""
    command = SMG_VENV / "bin" / "smg"
    if not command.exists():
        venv.create(SMG_VENV, with_pip=True)
        pip = [str(SMG_VENV / "bin" / "pip"), "install", "-q", f"smg=={SMG_VERSION}"]
        subprocess.run(pip, check=True)
    return command


async def start_smg(prefill: str, decode: str, port: int, log: Path) -> subprocess.Popen:
    """``smg launch`` in PD mode before ``prefill`` and ``decode`` (``ip:port``); wait until it routes."""
    command = [str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port)]
    command += [
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
    ]
    command += [
        "--pd-disaggregation",
        "--prefill",
        f"http://{prefill}",
        "8998",
        "--decode",
        f"http://{decode}",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url, body = f"http://127.0.0.1:{port}/v1/chat/completions", chat_body(10, 0)
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"smg exited with code {process.returncode}: see {log}")
            try:
                await timed_post(session, url, body)
                return process
            except (RuntimeError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.25)
    terminate(process)
    raise RuntimeError(f"smg did not route within 60 s: see {log}")


class Target:
    """One way to reach the backends: its URL and the processes whose CPU it costs."""

    def __init__(self, url: str, router_pid: int | None = None, envoy_pid: int | None = None) -> None:
        self.url = url
        self.router_pid = router_pid
        self.envoy_pid = envoy_pid

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the router process and of Envoy (0 for one the target does not have)."""
        return tuple(cpu_seconds(pid) if pid else 0.0 for pid in (self.router_pid, self.envoy_pid))


async def _closed_loop(target: Target, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    """``concurrency`` clients back to back for ``seconds``: requests/s, errors, CPU µs per request."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        before = target.cpu()
        done, errors, elapsed = await closed_loop(
            lambda n: timed_post(session, target.url, bodies[n % len(bodies)]), concurrency, seconds
        )
        after = target.cpu()
    per = max(done, 1)
    return {
        "requests_per_s": done / elapsed,
        "errors": errors,
        "router_cpu_us_per_request": (after[0] - before[0]) / per * 1e6,
        "envoy_cpu_us_per_request": (after[1] - before[1]) / per * 1e6,
    }


async def gateway_costs(targets: dict[str, Target], requests: int, concurrency: int, seconds: float) -> dict:
    """Per prompt length: latency side by side (rotating), then each target's closed loop."""
    results: dict = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for label, tokens in PROMPT_TOKENS.items():
            bodies = [chat_body(tokens, i) for i in range(64)]
            latencies: dict[str, list[float]] = {name: [] for name in targets}
            for i in range(requests + 10):
                for name, target in targets.items():
                    elapsed = await timed_post(session, target.url, bodies[i % len(bodies)])
                    if i >= 10:
                        latencies[name].append(elapsed)
            row: dict = {"tokens": tokens, "body_bytes": len(bodies[0])}
            direct = summary_ms(latencies["direct"])
            for name, values in latencies.items():
                cells = summary_ms(values)
                cells["added_p50_ms"] = cells["p50_ms"] - direct["p50_ms"]
                cells["added_p99_ms"] = cells["p99_ms"] - direct["p99_ms"]
                row[name] = cells
            for name, target in targets.items():
                row[name] |= await _closed_loop(target, bodies, concurrency, seconds)
            results[label] = row
    return results


async def interference(urls: dict[str, str], requests: int, long_streams: int) -> dict:
    """A short request's latency through each of ``urls`` in turn, alone and beside long requests.

    ``alone``: per URL, the short request's latency summary. ``beside``: per gateway of ``urls`` (not
    ``direct``), with 100k-token requests streaming through it in ``long_streams`` closed loops: how
    many were sent, and per URL the short request's latency summary."""
    short = chat_body(SHORT_TOKENS, 0)
    long_bodies = [chat_body(PROMPT_TOKENS["100k"], i, stream=True) for i in range(8)]
    results: dict = {"beside": {}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for through in (None, *(name for name in urls if name != "direct")):
            stop = asyncio.Event()
            sent = 0

            async def long_loop(url: str, stop: asyncio.Event) -> None:
                nonlocal sent
                while not stop.is_set():
                    sent += 1
                    await timed_post(session, url, long_bodies[sent % len(long_bodies)])

            loops = [] if through is None else [long_loop(urls[through], stop) for _ in range(long_streams)]
            tasks = [asyncio.create_task(loop) for loop in loops]
            await asyncio.sleep(0.5 if tasks else 0)
            times: dict[str, list[float]] = {name: [] for name in urls}
            for _ in range(requests):
                for name, url in urls.items():
                    times[name].append(await timed_post(session, url, short))
            stop.set()
            await asyncio.gather(*tasks)
            short_ms = {name: summary_ms(values) for name, values in times.items()}
            if through is None:
                results["alone"] = short_ms
            else:
                results["beside"][through] = {"long_requests": sent, "short": short_ms}
    return results


async def largest_body(urls: dict[str, str], requests: int) -> dict:
    """Latency of a 16 MiB chat body (the largest Envoy buffers) through each of ``urls``, in turns."""
    body = chat_body(BIG_BODY_BYTES // 4 - 40, 0)
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(requests):
            for name, url in urls.items():
                times[name].append(await timed_post(session, url, body))
    return {"body_bytes": len(body)} | {name: summary_ms(values) for name, values in times.items()}


async def _backends(workdir: Path) -> tuple[list[subprocess.Popen], str, str, list[str]]:
    """Two fast backends (prefill, decode) and the EDS files naming them."""
    processes = [spawn_python(["-m", "bench.fast_backend"]) for _ in range(2)]
    prefill, decode = (f"127.0.0.1:{first_line(p)}" for p in processes)
    eds = [str(workdir / "prefill.json"), str(workdir / "decode.json")]
    write_eds_file(eds[0], "prefill", [EndpointSpec(prefill, "g", None, True, "HEALTHY")])
    write_eds_file(eds[1], "decode", [EndpointSpec(decode, "g", None, True, "HEALTHY")])
    return processes, prefill, decode, eds


async def _router(
    workdir: Path, eds: list[str], name: str, config: dict, source: Path | None = None
) -> tuple[subprocess.Popen, int]:
    """A pd-extproc process on ``config`` (YAML keys), of the source tree ``source`` (``None``: this
    one); its gRPC port."""
    path = workdir / f"{name}.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    grpc_port, admin_port = free_port(), free_port()
    process = start_router_process(
        grpc_port, admin_port, eds, workdir / f"{name}.log", ("--config", str(path)), source
    )
    await wait_router_ready(process, admin_port)
    return process, grpc_port


ROUTERS = {
    "pd_extproc": {"affinity": {"mode": "auto"}},
    "pd_extproc_index": {"affinity": {"mode": "auto", "prefix": {"enabled": True}}},
    "pd_extproc_sglang": {"affinity": {"mode": "auto"}, "handoff": {"mode": "sglang-bootstrap"}},
}
"""The pd-extproc processes of the gateway run, by target name: their configuration."""


async def through_gateways(
    requests: int,
    concurrency: int,
    seconds: float,
    with_smg: bool,
    long_streams: int,
    baseline: Path | None = None,
) -> dict:
    """Start the backends, the gateways and ``smg``; measure; stop everything.

    ``baseline``: a source tree whose pd-extproc targets run too, as ``<target>_before``."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-bench-prompt-cost-"))
    processes, prefill, decode, eds = await _backends(workdir)
    gateways: list[Gateway] = []
    try:
        bare = spawn_python(["-m", "bench.bare_extproc"])
        processes.append(bare)
        targets = {"direct": Target(f"http://{decode}/v1/chat/completions")}
        plain = await start_envoy(eds, None)
        gateways.append(plain)
        targets["without_filter"] = Target(f"{plain.url}/v1/chat/completions", None, plain.process.pid)
        floor = await start_envoy(eds, int(first_line(bare)), fail_open=True)
        gateways.append(floor)
        targets["bare_ext_proc"] = Target(f"{floor.url}/v1/chat/completions", bare.pid, floor.process.pid)
        trees = {"": None} if baseline is None else {"": None, "_before": baseline}
        for name, config in ROUTERS.items():
            for suffix, source in trees.items():
                router, port = await _router(workdir, eds, name + suffix, config, source)
                processes.append(router)
                gateway = await start_envoy(eds, port)
                gateways.append(gateway)
                url = f"{gateway.url}/v1/chat/completions"
                targets[name + suffix] = Target(url, router.pid, gateway.process.pid)
        if with_smg:
            port = free_port()
            smg = await start_smg(prefill, decode, port, workdir / "smg.log")
            processes.append(smg)
            targets["smg"] = Target(f"http://127.0.0.1:{port}/v1/chat/completions", smg.pid)
        results = {"gateway": await gateway_costs(targets, requests, concurrency, seconds)}
        indexed = (f"pd_extproc_index{suffix}" for suffix in trees)
        short = ("direct", "without_filter", "bare_ext_proc", *indexed)
        results["interference"] = await interference(
            {name: targets[name].url for name in short}, requests, long_streams
        )
        big = {name: targets[name].url for name in ("without_filter", "pd_extproc", "pd_extproc_index")}
        results["largest_body"] = await largest_body(big, max(2, requests // 20))
        return results
    finally:
        for gateway in gateways:
            gateway.stop()
        terminate(*processes)


def _print(results: dict) -> None:
    if "in_process" in results:
        print(
            f"{'prompt':<8}{'body':>10}{'no index p50/CPU us':>21}{'index p50/CPU us':>18}"
            f"{'index p99 us':>14}"
        )
        for label, row in results["in_process"].items():
            if label == "16MiB":
                print(f"16 MiB body, index on: {row['with_index']['max_ms']:.1f} ms (the slowest of 2)")
                continue
            off, on = row["without_index"], row["with_index"]
            cells = f"{off['p50_us']:>14.0f}/{off['cpu_us']:<6.0f}{on['p50_us']:>11.0f}/{on['cpu_us']:<6.0f}"
            print(f"{label:<8}{row['body_bytes']:>10}{cells}{on['p99_us']:>14.0f}")
    for label, row in results.get("gateway", {}).items():
        print(f"\n{label} tokens ({row['body_bytes']} B)")
        print(
            f"{'target':<26}{'p50 ms':>8}{'p99 ms':>8}{'added p50':>10}{'req/s':>8}"
            f"{'router us':>10}{'envoy us':>9}"
        )
        for name, cells in row.items():
            if isinstance(cells, dict):
                print(
                    f"{name:<26}{cells['p50_ms']:>8.2f}{cells['p99_ms']:>8.2f}{cells['added_p50_ms']:>10.2f}"
                    f"{cells['requests_per_s']:>8.0f}{cells['router_cpu_us_per_request']:>10.0f}"
                    f"{cells['envoy_cpu_us_per_request']:>9.0f}"
                )
    if "largest_body" in results:
        big = results["largest_body"]
        cells = ", ".join(f"{k} p50 {v['p50_ms']:.1f} ms" for k, v in big.items() if isinstance(v, dict))
        print(f"{big['body_bytes']} B body: {cells}")
    if "interference" in results:
        rows = results["interference"]
        phases = {"alone": rows["alone"]} | {f"long via {k}": v["short"] for k, v in rows["beside"].items()}
        print(f"\n{'short request p50 / p99 ms, through':<53}" + "".join(f"{n:>25}" for n in rows["alone"]))
        for phase, cells in phases.items():
            values = "".join(f"{c['p50_ms']:>12.2f} / {c['p99_ms']:<10.2f}" for c in cells.values())
            print(f"{phase:<53}{values}")


def write_png(results: dict, path: str) -> None:
    """Left: in-process µs per request against prompt length; right: added latency p50 through gateways."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = {k: v for k, v in results.get("in_process", {}).items() if k in PROMPT_TOKENS}
    for name in ("without_index", "with_index"):
        left.plot(
            [r["tokens"] for r in rows.values()], [r[name]["p50_us"] for r in rows.values()], "o-", label=name
        )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="route_body µs (median)",
        title="in process",
    )
    left.legend()
    gateway = results.get("gateway", {})
    names = [n for n in next(iter(gateway.values()), {}) if n not in ("tokens", "body_bytes", "direct")]
    for name in names:
        tokens = [r["tokens"] for r in gateway.values()]
        right.plot(tokens, [r[name]["added_p50_ms"] for r in gateway.values()], "o-", label=name)
    right.set(
        xscale="log", xlabel="prompt tokens", ylabel="added latency p50 (ms)", title="through gateways, c=1"
    )
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the table (and write JSON when asked)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per target and prompt length")
    parser.add_argument("--concurrency", type=int, default=16, help="clients of the closed loops")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each closed loop")
    parser.add_argument(
        "--long-streams", type=int, default=2, help="100k-token closed loops beside the short"
    )
    parser.add_argument("--in-process-only", action="store_true", help="skip the gateways")
    parser.add_argument("--no-smg", action="store_true", help="leave SGLang's smg out")
    parser.add_argument(
        "--baseline", type=Path, help="also run the pd-extproc targets of this source tree (_before)"
    )
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--png", help="write a plot (needs matplotlib)")
    args = parser.parse_args(argv)
    results = {"in_process": in_process(args.requests)}
    if not args.in_process_only:
        results |= asyncio.run(
            through_gateways(
                args.requests,
                args.concurrency,
                args.seconds,
                not args.no_smg,
                args.long_streams,
                args.baseline,
            )
        )
    _print(results)
    write_json(args.json, results)
    if args.png:
        write_png(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
