"""What watching a KV handoff's streamed answer costs: per chunk, pd-extproc CPU and added latency.

In the shipped BUFFERED phases the engine handoffs ask Envoy for a streamed answer's body chunk by
chunk (docs/handoffs.md "KV-load failure after a successful leg"): every chunk then crosses pd-extproc. This
measures that with the real Envoy and pd-extproc as a process, over one backend process acting as a
prefill (its leg answer carries ``kv_transfer_params``) and a decode streaming ``N`` chunks with a
pause between two (``--gap-ms``, so that each chunk reaches Envoy on its own, as tokens do). The same
streams go through pd-extproc in ``kv-transfer-params`` mode (watched) and in ``sidecar`` mode (the
same route, nothing watched), for a short and a long stream: the slope between the two lengths is the
per-chunk time and pd-extproc CPU, so the prefill leg and everything per request cancel out; the
watched mode's slope minus the sidecar's is what the watch adds per chunk.

Run: ``python -m bench.kv_stream_watch [--streams S] [--short N] [--long N] [--gap-ms G] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.common import cpu_seconds, first_line, spawn_python, write_json
from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.gateway import terminate
from sim.stack import Replica

CHUNK = b'data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":" ok"}]}\n\n'
LEG = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}).encode()


async def _serve_backend(gap: float) -> None:
    """Prefill on one port, decode on another (``gap`` seconds between two chunks, so that each
    reaches Envoy on its own, as tokens do); prints ``prefill_port decode_port``."""

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=LEG, content_type="application/json")

    async def decode(request: web.Request) -> web.StreamResponse:
        chunks = int(json.loads(await request.read())["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(CHUNK)
            await asyncio.sleep(gap)
        await response.write(b"data: [DONE]\n\n")
        return response

    ports = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(runner.addresses[0][1])
    print(*ports, flush=True)
    await asyncio.Event().wait()


async def _streams(url: str, count: int, chunks: int) -> float:
    """Send ``count`` streams of ``chunks`` chunks one after another; the median seconds each."""
    body = {"model": "m", "prompt": "x", "max_tokens": chunks, "stream": True}
    seconds = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                received = await response.read()
            assert received.count(b"data: ") == chunks + 1, received[-200:]
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


async def _measure(mode: str, eds: list[str], workdir: Path, args: argparse.Namespace) -> dict:
    replica = Replica()
    try:
        via = f"http://127.0.0.1:{replica.prefill_leg_port}"
        await replica.start_server(
            eds,
            workdir / f"{mode}.log",
            ("--handoff", mode, "--prefill-via", via, "--pd-threshold-tokens", "0"),
        )
        await replica.start_gateway(Path(eds[0]), Path(eds[1]), extproc=True)
        assert replica.server is not None and replica.gateway is not None
        url, pid = replica.gateway.url, replica.server.pid
        await _streams(url, 3, args.short)  # warm-up
        row: dict[str, float] = {}
        for name, chunks in (("short", args.short), ("long", args.long)):
            before = cpu_seconds(pid)
            row[f"{name}_seconds"] = await _streams(url, args.streams, chunks)
            row[f"{name}_cpu_seconds"] = (cpu_seconds(pid) - before) / args.streams
        extra = args.long - args.short
        row["per_chunk_latency_us"] = (row["long_seconds"] - row["short_seconds"]) / extra * 1e6
        row["per_chunk_cpu_us"] = (row["long_cpu_seconds"] - row["short_cpu_seconds"]) / extra * 1e6
        return row
    finally:
        replica.stop()


async def _main(args: argparse.Namespace) -> dict:
    backend = spawn_python(["-m", "bench.kv_stream_watch", "--backend", "--gap-ms", str(args.gap_ms)])
    try:
        prefill_port, decode_port = map(int, first_line(backend).split())
        workdir = Path(tempfile.mkdtemp(prefix="kv-stream-watch-"))
        eds = [str(workdir / "prefill.json"), str(workdir / "decode.json")]
        write_eds_file(
            eds[0], "prefill", [EndpointSpec(f"127.0.0.1:{prefill_port}", "g", None, True, "HEALTHY")]
        )
        write_eds_file(
            eds[1], "decode", [EndpointSpec(f"127.0.0.1:{decode_port}", "g", None, True, "HEALTHY")]
        )
        return {mode: await _measure(mode, eds, workdir, args) for mode in ("sidecar", "kv-transfer-params")}
    finally:
        terminate(backend)


def main() -> int:
    """Run the benchmark from the command line; print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=20, help="streams per length and mode")
    parser.add_argument("--short", type=int, default=10, help="chunks of the short streams")
    parser.add_argument("--long", type=int, default=200, help="chunks of the long streams")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="the decode's pause between chunks, ms")
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args()
    if args.backend:
        asyncio.run(_serve_backend(args.gap_ms / 1000))
        return 0
    result = asyncio.run(_main(args))
    for mode, row in result.items():
        print(
            f"{mode:<20} per chunk: {row['per_chunk_latency_us']:8.1f} us (the decode's {args.gap_ms:g} ms "
            f"gap included), {row['per_chunk_cpu_us']:6.1f} us pd-extproc CPU"
        )
    watched, plain = result["kv-transfer-params"], result["sidecar"]
    added = watched["per_chunk_latency_us"] - plain["per_chunk_latency_us"]
    cpu = watched["per_chunk_cpu_us"] - plain["per_chunk_cpu_us"]
    result["watch_per_chunk"] = {"latency_us": added, "cpu_us": cpu}
    print(
        f"watching a KV handoff's stream adds per chunk: {added:.1f} us latency, {cpu:.1f} us pd-extproc CPU"
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
