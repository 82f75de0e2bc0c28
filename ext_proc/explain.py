"""``/debug/explain`` and ``pd-extproc explain``: the decision a running server would take now, and why.

:func:`explain_body` runs :meth:`~ext_proc.router.Router.explain` on a request body (parsed, and put in
token ids when the gateway tokenizes its path, as a routed request is) and returns the report as JSON
data: the request's cost, the decision, each candidate endpoint's load, credited prefix hit and term in
the rule of the mode, and the least-cost pairs (:mod:`ext_proc.affinity.explain`). Nothing is booked:
no charge, no prefix placement, nothing told to the peers, no decision counted. :func:`table` prints
such a report for a person. Costs are in the rule's units: utilisation (``off``, ``prefer``,
``strict``, and decode-only) or seconds (``auto``), on the rule's 1e-9 grid.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable

from aiohttp import web

from ext_proc.affinity.decide import SCALE
from ext_proc.affinity.explain import PairCost
from ext_proc.affinity.model import NoPair
from ext_proc.choreography import BODY_LIMIT_BYTES
from ext_proc.outcome import RequestMeta
from ext_proc.request import RequestError
from ext_proc.router import Explained, Router

EXPLAIN_BODY_LIMIT_BYTES = BODY_LIMIT_BYTES
"""The largest body ``/debug/explain`` reads: what the gateway itself buffers."""
MAX_PAIRS = 1000
"""The most pairs a report lists (``limit``)."""
DEFAULT_PATH = "/v1/chat/completions"


def error(code: str, message: str) -> dict[str, object]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


async def explain_body(router: Router, raw: bytes, path: str, limit: int) -> tuple[int, dict[str, object]]:
    """``(HTTP status, report or error)`` for the request body ``raw`` sent to ``path``.

    400 ``invalid_request`` when the body is not a request the router can parse (its reason)."""
    try:
        request = router.parse(raw, RequestMeta(path))
    except RequestError as exc:
        return 400, error("invalid_request", f"the request body cannot be routed: {exc}")
    tokens = await router.prompt_tokens(request) if router.wants_tokens(request) else None
    return 200, report(
        router.explain(request, tokens, limit), path, router.policy.mode.value, tokens is not None
    )


def handler(router: Router) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``POST /debug/explain`` handler over ``router``.

    The body is the request's JSON, at most :data:`EXPLAIN_BODY_LIMIT_BYTES` (413
    ``request_too_large``; its length must be stated); query ``path`` (default
    :data:`DEFAULT_PATH`: it decides whether the request is disaggregated) and ``limit`` (pairs listed,
    1 to :data:`MAX_PAIRS`, default 10), else 400 ``invalid_parameter``."""

    async def explain(request: web.Request) -> web.Response:
        path = request.query.get("path", DEFAULT_PATH)
        limit = request.query.get("limit", "10")
        if not path.startswith("/"):
            return web.json_response(
                error("invalid_parameter", f"path {path!r} must start with /"), status=400
            )
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAIRS:
            message = f"limit {limit!r} must be an integer in 1..{MAX_PAIRS}"
            return web.json_response(error("invalid_parameter", message), status=400)
        size = request.content_length
        if size is None or size > EXPLAIN_BODY_LIMIT_BYTES:
            message = f"the body must state its length and be at most {EXPLAIN_BODY_LIMIT_BYTES} bytes"
            return web.json_response(error("request_too_large", message), status=413)
        status, data = await explain_body(router, await request.read(), path, int(limit))
        return web.json_response(data, status=status)

    return explain


def _units(ticks: int | None) -> float | None:
    return None if ticks is None else ticks / SCALE


def report(explained: Explained, path: str, mode: str, tokenized: bool) -> dict[str, object]:
    """The JSON report of ``explained`` (a request to ``path`` under affinity ``mode``)."""
    cost, prefills, decodes, hits, why = explained
    names = ([e.address for e in prefills.endpoints], [e.address for e in decodes.endpoints])
    decision = why.decision
    if isinstance(decision, NoPair):
        chosen: dict[str, object] = {"error": {"code": decision.reason.value, "message": decision.message}}
    else:
        chosen = {
            "prefill": None if decision.prefill is None else decision.prefill.address,
            "decode": decision.decode.address,
            "fallbacks": [e.address for e in decision.fallbacks],
            "locality": decision.locality.value,
            "cost": None if why.chosen is None else _units(why.chosen.cost),
        }
        if decision.estimate is not None:
            chosen["estimate_s"] = decision.estimate._asdict()

    def rows(role: int) -> list[dict[str, object]]:
        pool = (prefills, decodes)[role]
        hit = None if hits is None else hits[role]
        cpu = None if hits is None else hits[role + 2]
        out = []
        for i, endpoint in enumerate(pool.endpoints):
            row: dict[str, object] = {
                "address": endpoint.address,
                "group": endpoint.group,
                "active_tokens": int(pool.tokens[i]),
                "active_requests": int(pool.requests[i]),
                "token_capacity": float(pool.capacity[i]),
                "hit_tokens": None if hit is None else int(hit[i]),
                "cpu_tier_hit_tokens": None if cpu is None else int(cpu[i]),
            }
            if role == 0:
                row["cost"] = _units(why.prefill_keys[i]) if why.prefill_keys else None
            else:
                row["cost_in_group"] = _units(why.decode_keys[i]) if why.decode_keys else None
                row["cost_from_other_groups"] = _units(why.decode_away_keys[i]) if why.decode_keys else None
            out.append(row)
        return out

    def pair(p: PairCost) -> dict[str, object]:
        prefill = None if p.prefill is None else names[0][p.prefill]
        return {
            "prefill": prefill,
            "decode": names[1][p.decode],
            "same_group": p.same_group,
            "cost": _units(p.cost),
        }

    return {
        "path": path,
        "mode": mode,
        "unit": "seconds" if why.seconds else "utilisation",
        "prompt_tokens": cost.prefill_tokens,
        "decode_tokens": cost.decode_tokens,
        "tokenized": tokenized,
        "decision": chosen,
        "prefills": rows(0),
        "decodes": rows(1),
        "pairs": [pair(p) for p in why.pairs],
    }


def _number(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.9f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


def _columns(rows: list[dict[str, object]], keys: tuple[str, ...]) -> list[str]:
    """``rows`` as aligned text columns of ``keys``, a header line first."""
    cells = [list(keys)] + [[_number(row[k]) for k in keys] for row in rows]
    widths = [max(len(line[c]) for line in cells) for c in range(len(keys))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in cells]


def table(data: dict[str, object]) -> str:
    """A person's reading of a report: the decision, then the endpoints and the cheapest pairs."""
    decision = data["decision"]
    assert isinstance(decision, dict)
    tokenized = " (tokenized)" if data["tokenized"] else ""
    lines = [
        f"{data['path']}: {data['prompt_tokens']} prompt tokens{tokenized}, "
        f"{data['decode_tokens']} charged to the decode; affinity {data['mode']}, costs in {data['unit']}",
    ]
    if "error" in decision:
        lines.append(f"decision: none ({decision['error']['code']}): {decision['error']['message']}")
    else:
        fallbacks = ", ".join(decision["fallbacks"]) or "none"
        lines.append(
            f"decision: prefill {decision['prefill'] or '- (decode-only)'} -> decode {decision['decode']} "
            f"({decision['locality']}), cost {_number(decision['cost'])}; fallbacks: {fallbacks}"
        )
        estimate = decision.get("estimate_s")
        if isinstance(estimate, dict):
            lines.append(
                "auto's estimate (s): " + ", ".join(f"{k} {_number(v)}" for k, v in estimate.items())
            )
    endpoint = ("address", "group", "active_tokens", "active_requests", "token_capacity", "hit_tokens")
    for role, extra in (("prefills", ("cost",)), ("decodes", ("cost_in_group", "cost_from_other_groups"))):
        rows = data[role]
        assert isinstance(rows, list)
        if rows:
            lines += ["", f"{role}:", *_columns(rows, (*endpoint, "cpu_tier_hit_tokens", *extra))]
    pairs = data["pairs"]
    assert isinstance(pairs, list)
    if pairs:
        lines += ["", "cheapest pairs:", *_columns(pairs, ("prefill", "decode", "same_group", "cost"))]
    return "\n".join(lines)


def ask(
    admin: str, raw: bytes, path: str, limit: int, timeout: float = 30.0
) -> tuple[int, dict[str, object]]:
    """POST ``raw`` to ``/debug/explain`` of the admin endpoint ``admin``: ``(HTTP status, its JSON)``.

    ``admin`` is ``http://host:port``; ``OSError`` when it cannot be reached or answers no JSON."""
    query = urllib.parse.urlencode({"path": path, "limit": limit})
    url = f"{admin.rstrip('/')}/debug/explain?{query}"
    sent = urllib.request.Request(url, raw, {"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(sent, timeout=timeout) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    try:
        return status, json.loads(body)
    except ValueError:
        raise OSError(f"{url} answered {status} without JSON: {body[:200]!r}") from None
