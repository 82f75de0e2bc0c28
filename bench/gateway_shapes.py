"""Handoffs and fail-open behind the gateways that run an InferencePool, with the real Envoy.

Measured with the real Envoy 1.40 in each gateway's shape (``tests/deploy/gateway_shapes/``, the stack of
:mod:`standins.shapes`: ``pd-extproc serve`` over TLS, scripted prefills, echo decodes).

1. **Prefill legs** (issue 16 item 8). These gateways set no ``max_message_timeout`` (kgateway's
   ``message_timeout`` is 5 s), so the ``override_message_timeout`` pd-extproc sends before a
   ``kv-transfer-params`` prefill leg may be refused. Per shape, handoff (``kv-transfer-params``,
   ``sglang-bootstrap``; the leg goes direct, ``handoff.prefill_via: ""``) and prefill duration (1 s,
   10 s by default): one non-streaming chat request; the client's status, error code and seconds, who
   served it, pd-extproc's prefill-leg outcomes and Envoy's ext_proc counters
   (``override_message_timeout_received`` / ``_ignored``, ``message_timeouts``, ``streams_failed``).
   In ``sglang-bootstrap`` the decode answers only once the prefill's time has passed (the client's
   ``x-test-delay-ms``), as an SGLang decode waits for the KV.
2. **Fail-open** (item 9). Per shape with its FailOpen setting as the gateway generates it (Istio and
   kgateway: the route's ``failure_mode_allow: true``; the GIE reference has no setting, so the filter's
   ``failure_mode_allow`` is turned on by hand; AI Gateway always fails closed, so it runs as generated):
   chat POSTs and ``GET /v1/models`` while pd-extproc is down (its address refuses connections) and
   while the picker cluster has no endpoint (GIE's conformance test makes the EPP Service so), with who
   served them (prefills are in the pool); and one request whose body is sent in two chunks with
   pd-extproc killed (SIGKILL) between them.

Run: ``flock /tmp/bench.lock python -m bench.gateway_shapes [--legs 1,10] [--requests 10] [--json F]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import write_json
from standins.metrics import by_outcome
from standins.shapes import EXT_PROC_TYPE, SHAPES, RenderedShape, ShapeStack, nodes, shape_stack

HANDOFFS = ("kv-transfer-params", "sglang-bootstrap")
ENVOY_COUNTERS = ("override_message_timeout_received", "override_message_timeout_ignored", "message_timeouts")
ENVOY_COUNTERS += ("streams_failed", "failure_mode_allowed")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "tell me about KV caches"}], "max_tokens": 4}


async def _envoy_counters(session: aiohttp.ClientSession, stack: ShapeStack) -> dict[str, int]:
    """Envoy's ext_proc counters of :data:`ENVOY_COUNTERS`, summed over its ext_proc filters."""
    async with session.get(f"{stack.gateway.admin_url}/stats?filter=ext_proc") as response:
        lines = (await response.text()).splitlines()
    totals = dict.fromkeys(ENVOY_COUNTERS, 0)
    for line in lines:
        name, _, value = line.partition(": ")
        suffix = name.rpartition(".")[2]
        if suffix in totals and value.isdigit():
            totals[suffix] += int(value)
    return totals


def _who(stack: ShapeStack) -> str:
    """Which engines served the requests since the last :meth:`ShapeStack.clear`."""
    decodes = len(stack.served())
    legs = stack.misrouted()
    return f"{decodes} decode / {legs} prefill"


async def _request(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> tuple[int, str, float]:
    """POST :data:`CHAT`: status, error code (``-`` for none) and seconds."""
    start = time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers) as response:
        text = await response.text()
    code = "-"
    with contextlib.suppress(ValueError, KeyError, TypeError):
        code = json.loads(text)["error"]["code"]
    if response.status >= 400 and code == "-":
        code = repr(text[:40])
    return response.status, code, time.monotonic() - start


async def measure_legs(shape: str, legs: list[float], folder: Path) -> list[dict]:
    """Part 1 for one shape: every handoff and prefill duration."""
    rows = []
    async with shape_stack(shape, folder) as stack, aiohttp.ClientSession() as session:
        for handoff in HANDOFFS:
            await stack.picker({"handoff.mode": handoff})
            for seconds in legs:
                for prefill in stack.prefills:
                    prefill.delay = seconds
                stack.clear()
                envoy_before = await _envoy_counters(session, stack)
                legs_before = await by_outcome(session, stack.admin_url, "pd_extproc_prefill_leg_total")
                headers = (
                    {"x-test-delay-ms": str(int(seconds * 1000))} if handoff == "sglang-bootstrap" else {}
                )
                status, code, took = await _request(session, stack.url, headers)
                await asyncio.sleep(0.5)  # Envoy counts a stream when it ends
                envoy_after = await _envoy_counters(session, stack)
                legs_after = await by_outcome(session, stack.admin_url, "pd_extproc_prefill_leg_total")
                rows.append(
                    {
                        "shape": shape,
                        "handoff": handoff,
                        "prefill_s": seconds,
                        "status": status,
                        "code": code,
                        "seconds": round(took, 2),
                        "served": _who(stack),
                        "legs": {
                            k: v - legs_before.get(k, 0)
                            for k, v in legs_after.items()
                            if v != legs_before.get(k, 0)
                        },
                        "envoy": {
                            k: envoy_after[k] - envoy_before[k]
                            for k in ENVOY_COUNTERS
                            if envoy_after[k] != envoy_before[k]
                        },
                    }
                )
    return rows


FAIL_OPEN = {"istio": "route", "kgateway": "route", "gie-standalone": "filter", "ai-gateway": None}
"""Where each gateway's FailOpen lives: the route's ``failure_mode_allow`` override (Istio, kgateway set
it from the InferencePool's ``failureMode``), the filter's own (the GIE reference has no setting: the one
edit that does it), none (AI Gateway's filter is always ``failure_mode_allow: false``)."""


def fail_open(rendered: RenderedShape, _prefills: list[str], _decodes: list[str]) -> None:
    """Turn on FailOpen where :data:`FAIL_OPEN` says the shape has it."""
    where = FAIL_OPEN[rendered.shape]
    for node in nodes(rendered.config):
        if not isinstance(node, dict):
            continue
        if where == "route" and "failure_mode_allow" in node.get("overrides", {}):
            node["overrides"]["failure_mode_allow"] = True
        elif where == "filter" and node.get("@type") == EXT_PROC_TYPE:
            node["failure_mode_allow"] = True


async def _split_body_request(port: int, stack: ShapeStack) -> str:
    """POST :data:`CHAT` in two chunks with pd-extproc SIGKILLed between them; the status line."""
    body = json.dumps(CHAT).encode()
    half = len(body) // 2
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    writer.write(head.encode() + b"%x\r\n%s\r\n" % (half, body[:half]))
    await writer.drain()
    await asyncio.sleep(1.0)  # Envoy has passed the first chunk to pd-extproc
    assert stack.router is not None
    stack.router.kill()
    stack.router.wait()
    stack.router = None
    await asyncio.sleep(0.5)
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - half, body[half:]))
    await writer.drain()
    try:
        status = (await asyncio.wait_for(reader.readline(), 30)).decode().strip() or "connection closed"
    except (TimeoutError, ConnectionError) as exc:
        status = f"no answer ({type(exc).__name__})"
    writer.close()
    return status


def _without_picker(rendered: RenderedShape, prefills: list[str], decodes: list[str]) -> None:
    """:func:`fail_open`, and the picker clusters emptied: what GIE's conformance test
    EppUnAvailableFailOpen makes of the EPP (a Service without endpoints)."""
    fail_open(rendered, prefills, decodes)
    pickers = {
        n["envoy_grpc"]["cluster_name"]
        for n in nodes(rendered.config)
        if isinstance(n, dict) and "envoy_grpc" in n
    }
    for cluster in rendered.config["static_resources"]["clusters"]:
        if cluster["name"] in pickers:
            cluster["load_assignment"]["endpoints"] = []


async def _unrouted(session: aiohttp.ClientSession, stack: ShapeStack, requests: int) -> dict[str, object]:
    """``requests`` chat POSTs and as many ``GET /v1/models``: the answers by status and code, and who
    served the POSTs (a scripted prefill answers them 200; it has no ``/v1/models``, so a GET that
    reached one is its 404)."""
    stack.clear()
    posts: dict[str, int] = {}
    for _ in range(requests):
        status, code, _ = await _request(session, stack.url, {})
        posts[f"{status} {code}"] = posts.get(f"{status} {code}", 0) + 1
    served = _who(stack)
    gets: dict[str, int] = {}
    for _ in range(requests):
        async with session.get(f"{stack.url}/v1/models") as response:
            gets[str(response.status)] = gets.get(str(response.status), 0) + 1
    return {"post": posts, "post_served": served, "get": gets}


async def measure_fail_open(shape: str, requests: int, folder: Path) -> dict:
    """Part 2 for one shape: fail-open with pd-extproc down, without endpoints, or killed mid-body.

    pd-extproc down means its address refuses connections; killed means SIGKILL between two body chunks."""
    async with shape_stack(shape, folder / "down", fail_open) as stack, aiohttp.ClientSession() as session:
        down = await _unrouted(session, stack, requests)
        await stack.picker()
        mid_body = await _split_body_request(stack.gateway.listen_port, stack)
    async with (
        shape_stack(shape, folder / "empty", _without_picker) as stack,
        aiohttp.ClientSession() as session,
    ):
        empty = await _unrouted(session, stack, requests)
    return {
        "shape": shape,
        "picker_down": down,
        "no_picker_endpoint": empty,
        "killed_after_first_chunk": mid_body,
    }


def _print_legs(rows: list[dict]) -> None:
    print(
        f"{'shape':16} {'handoff':19} {'leg s':>5} {'status':>6} {'code':24} {'s':>6}  {'served':18}  "
        "legs / envoy ext_proc"
    )
    for r in rows:
        print(
            f"{r['shape']:16} {r['handoff']:19} {r['prefill_s']:>5g} {r['status']:>6} {r['code'][:24]:24} "
            f"{r['seconds']:>6.2f}  {r['served']:18}  {r['legs']} {r['envoy']}"
        )


def _print_fail_open(rows: list[dict]) -> None:
    print(f"\n{'shape':16} {'picker':22} {'POST answers':34} {'POST served by':20} GET answers")
    for r in rows:
        for label, key in (("down (refused)", "picker_down"), ("cluster w/o endpoint", "no_picker_endpoint")):
            seen = r[key]
            posts = ", ".join(f"{k} x{v}" for k, v in seen["post"].items())
            gets = ", ".join(f"{k} x{v}" for k, v in seen["get"].items())
            print(f"{r['shape']:16} {label:22} {posts[:34]:34} {seen['post_served']:20} {gets}")
        print(f"{r['shape']:16} {'killed mid-body':22} {r['killed_after_first_chunk']}")


async def run(legs: list[float], requests: int, shapes: list[str]) -> dict:
    """Both parts for every shape in ``shapes``: the prefill-leg rows and the fail-open rows."""
    with tempfile.TemporaryDirectory(prefix="gateway-shapes-") as tmp:
        leg_rows = [
            row for shape in shapes for row in await measure_legs(shape, legs, Path(tmp) / f"legs-{shape}")
        ]
        open_rows = [
            await measure_fail_open(shape, requests, Path(tmp) / f"open-{shape}") for shape in shapes
        ]
    return {"prefill_legs": leg_rows, "fail_open": open_rows}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the tables (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--legs", default="1,10", help="prefill durations to measure, seconds, comma-separated"
    )
    parser.add_argument("--requests", type=int, default=10, help="requests sent while pd-extproc is down")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="shapes to run, comma-separated")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = asyncio.run(
        run([float(s) for s in args.legs.split(",")], args.requests, args.shapes.split(","))
    )
    _print_legs(results["prefill_legs"])
    _print_fail_open(results["fail_open"])
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
