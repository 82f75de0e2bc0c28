"""What a real vLLM 0.32 decode does when it cannot load the KV cache its prefill leg announced.

Three real engines from :mod:`rig` (NixlConnector, the tiny Llama, CPU): a prefill, a decode with
vLLM's default ``kv_load_failure_policy: fail`` and a decode with ``recompute``; both decodes
shake hands with the prefill first (a warm-up transfer each). The requests go straight to the
engines (no gateway): this measures the engines, which the gateway's handling is then built on.

Cases, each non-streaming and streaming, on both decodes:

- ``ok``: the decode of a fresh prefill leg's ``kv_transfer_params`` (the KV moves);
- ``second_pull``: those same params again, on the other decode (a second decode pulling blocks
  the first one has read, after which the prefill frees them): whether anything notices;
- ``decode_only``: a prompt without params (the decode prefills it itself);
- ``prefill_died``: legs answered, then the prefill is killed (SIGKILL of its process group),
  then their params go to the decodes: the pull from a dead peer;
- ``handshake_timeout``: params naming an engine the decode has never met, whose side channel
  accepts the TCP connection and never answers (a prefill too loaded to answer, issue 20.2's
  first-request failure): vLLM's handshake gives up after its fixed 5 s;
- ``handshake_refused``: the same, nothing listening on that port.

Each row: HTTP status, seconds to the status line and to the end, what the body (or the first
streamed event) says, and the decode's ``vllm:request_success_total{finished_reason=error}``,
``vllm:nixl_num_failed_transfers_total`` and ``prompt_tokens_by_source`` deltas.

Run: ``python -m bench.vllm_kv_failure [--prompt-tokens N] [--repeats R] [--json FILE]`` (needs
``make vllm-env`` and about 8 GiB of free memory; 3-5 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from bench.common import write_json
from rig.cluster import check_memory, prefill_leg, transfer
from rig.engine import MODEL_NAME, Engine, EngineSpec, start_engine
from rig.model import prompt, write_tiny_llama
from rig.venv import VllmUnavailable, venv_python
from sim.gateway import free_port

WATCHED = (
    "vllm:request_success_total{finished_reason=error}",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}",
    "vllm:prompt_tokens_by_source_total{source=local_compute}",
)


async def leg(session: aiohttp.ClientSession, prefill: Engine, text: str) -> dict:
    """A prefill leg as pd-extproc sends it; its ``kv_transfer_params``."""
    params = await prefill_leg(session, prefill, text)
    assert params is not None, f"the prefill leg on {prefill.address} failed"
    return params


async def decode(
    session: aiohttp.ClientSession, engine: Engine, text: str, params: dict | None, stream: bool
) -> dict:
    """One decode request; what came back and when (seconds from the send)."""
    body: dict[str, object] = {"model": MODEL_NAME, "prompt": text, "max_tokens": 8, "temperature": 0}
    if stream:
        body["stream"] = True
    if params is not None:
        body["kv_transfer_params"] = params
    before = await engine.metrics(session)
    started = time.perf_counter()
    async with session.post(f"{engine.url}/v1/completions", json=body) as response:
        status_s = time.perf_counter() - started
        raw = await response.read()
    total_s = time.perf_counter() - started
    after = await engine.metrics(session)
    text_out = raw.decode(errors="replace")
    if stream:
        events = [line[6:] for line in text_out.splitlines() if line.startswith("data: ")]
        said = events[0] if events else ""
        pieces = [json.loads(e) for e in events if e != "[DONE]"]
        generated = "".join(p["choices"][0]["text"] for p in pieces if p.get("choices"))
    else:
        said = text_out
        generated = json.loads(raw)["choices"][0]["text"] if response.status == 200 else ""
    return {
        "status": response.status,
        "status_s": round(status_s, 3),
        "total_s": round(total_s, 3),
        "text": generated,
        "says": said[:300],
        **{name: after.get(name, 0.0) - before.get(name, 0.0) for name in WATCHED},
    }


def silent_peer() -> socket.socket:
    """A loopback TCP listener that accepts connections (the kernel does) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def stranger(params: dict, port: int) -> dict:
    """``params`` naming an engine the decode has never met, on ``port``."""
    return {**params, "remote_engine_id": str(uuid.uuid4()), "remote_port": port}


async def run(prompt_tokens: int, repeats: int) -> dict:
    """Run every case ``repeats`` times on real vLLM engines, prompts of ``prompt_tokens``.

    Returns the rows and their summary."""
    python = venv_python()
    if python is None:
        raise VllmUnavailable("vLLM for CPU is not installed: run `make vllm-env`")
    check_memory(3)
    workdir = Path(tempfile.mkdtemp(prefix="pd-vllm-kvfail-"))
    model = write_tiny_llama(workdir / "model")
    specs = {
        "prefill": EngineSpec("prefill", "a", free_port(), free_port()),
        "fail": EngineSpec("decode", "a", free_port(), free_port(), "fail"),
        "recompute": EngineSpec("decode", "a", free_port(), free_port(), "recompute"),
    }
    engines = {name: start_engine(python, model, spec, workdir) for name, spec in specs.items()}
    rows: list[dict] = []
    try:
        await asyncio.gather(*(e.wait_ready() for e in engines.values()))
        prefill = engines["prefill"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for name in ("fail", "recompute"):
                assert await transfer(session, prefill, engines[name]), f"warm-up to {name} failed"
            texts = [prompt(prompt_tokens, seed) for seed in range(100)]
            seed = iter(texts)

            async def case(kind: str, policy: str, stream: bool, params: dict | None, text: str) -> None:
                row = await decode(session, engines[policy], text, params, stream)
                rows.append({"case": kind, "policy": policy, "stream": stream, **row})
                print(json.dumps(rows[-1]), flush=True)

            for _ in range(repeats):
                for policy in ("fail", "recompute"):
                    for stream in (False, True):
                        text = next(seed)
                        params = await leg(session, prefill, text)
                        await case("ok", policy, stream, params, text)
                        other = "recompute" if policy == "fail" else "fail"
                        await case("second_pull", other, stream, params, text)
                        rows[-1]["same_text_as_first"] = rows[-1]["text"] == rows[-2]["text"]
                        await case("decode_only", policy, stream, None, next(seed))
            peer = silent_peer()
            refused = free_port()
            template = await leg(session, prefill, texts[0])
            for _ in range(repeats):
                for policy in ("fail", "recompute"):
                    for stream in (False, True):
                        await case(
                            "handshake_timeout",
                            policy,
                            stream,
                            stranger(template, peer.getsockname()[1]),
                            next(seed),
                        )
                        await case(
                            "handshake_refused", policy, stream, stranger(template, refused), next(seed)
                        )
            pending = []
            for _ in range(repeats):
                for policy in ("fail", "recompute"):
                    for stream in (False, True):
                        text = next(seed)
                        pending.append((policy, stream, text, await leg(session, prefill, text)))
            prefill.kill()
            for policy, stream, text, params in pending:
                await case("prefill_died", policy, stream, params, text)
            peer.close()
    finally:
        for engine in engines.values():
            engine.stop()
    return {"prompt_tokens": prompt_tokens, "repeats": repeats, "rows": rows, "summary": summarise(rows)}


def summarise(rows: list[dict]) -> list[dict]:
    """Per (case, policy, stream): statuses seen, median seconds to the status line and to the end."""
    groups: dict[tuple[str, str, bool], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["policy"], row["stream"]), []).append(row)
    return [
        {
            "case": case,
            "policy": policy,
            "stream": stream,
            "statuses": sorted({r["status"] for r in listed}),
            "status_s_median": statistics.median(r["status_s"] for r in listed),
            "total_s_median": statistics.median(r["total_s"] for r in listed),
            "errors_counted": sum(r["vllm:request_success_total{finished_reason=error}"] for r in listed),
            "says": listed[0]["says"][:120],
        }
        for (case, policy, stream), listed in groups.items()
    ]


def main() -> int:
    """Run the benchmark from the command line; print the rows (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows and the summary to this JSON file")
    args = parser.parse_args()
    try:
        result = asyncio.run(run(args.prompt_tokens, args.repeats))
    except VllmUnavailable as exc:
        print(f"vllm_kv_failure: {exc}", file=sys.stderr)
        return 1
    print(f"\n{'case':<18}{'policy':<11}{'stream':<8}{'status':<12}{'to status s':>12}{'to end s':>10}  says")
    for s in result["summary"]:
        print(
            f"{s['case']:<18}{s['policy']:<11}{s['stream']!s:<8}{','.join(map(str, s['statuses'])):<12}"
            f"{s['status_s_median']:>12.2f}{s['total_s_median']:>10.2f}  {s['says'][:70]}"
        )
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
