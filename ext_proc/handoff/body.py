"""Request bodies for the engines' handoffs: pure functions of the client's body.

The client's fields reach the decode unchanged, except the handoff fields (:data:`HANDOFF_FIELDS`):
whatever a client sent there is removed in every handoff mode, since it could point an engine at
another request's KV cache; the gateway then adds the fields its own handoff sets. When the client
sent none of them, the addition is spliced into the client's own bytes, so the body is not
re-serialised (and with nothing to add, the body is not touched at all).
"""

from __future__ import annotations

import json

KV_TRANSFER_PARAMS = "kv_transfer_params"
PREFILL_REQUEST_PARAMS: dict[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""``kv_transfer_params`` of a prefill leg (vLLM NixlConnector / vllm-ascend MooncakeConnector)."""
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
"""The body fields of SGLang's PD handoff."""
DP_RANK_FIELDS = ("routed_dp_rank", "disagg_prefill_dp_rank")
"""SGLang's data-parallel placement fields (``io_struct.GenerateReqInput``): the rank that serves the
request, and the prefill rank its decode pulls the KV from."""
HANDOFF_FIELDS = (KV_TRANSFER_PARAMS, *BOOTSTRAP_FIELDS, *DP_RANK_FIELDS)
"""Every body field an engine reads as a handoff or placement instruction: never taken from a client."""
_MIN_TOKENS = ("min_tokens", "min_completion_tokens")


def _dumps(body: dict[str, object]) -> bytes:
    """``body`` as compact UTF-8 JSON; when a string holds a lone surrogate (a client's ``"\\ud800"``,
    which UTF-8 cannot encode), with every non-ASCII character escaped instead, as the client sent it."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


def with_fields(
    raw: bytes, body: dict[str, object], fields: dict[str, object], owned: tuple[str, ...]
) -> bytes:
    """The client's body (``raw``, parsed as ``body``) without any of the ``owned`` keys, plus ``fields``.

    ``fields`` keys must be among ``owned``. Every other key keeps its value.
    """
    start = raw.lstrip()[:1]
    if start == b"{" and not any(key in body for key in owned):
        end = raw.rstrip()
        added = _dumps(fields)[1:-1]
        if not added:
            return raw
        return b"".join((memoryview(end)[:-1], b"," if body else b"", added, b"}"))  # one copy of the body
    kept = {key: value for key, value in body.items() if key not in owned}
    kept.update(fields)
    return _dumps(kept)


def without_fields(
    raw: bytes, body: dict[str, object], owned: tuple[str, ...], rewritten: bool = False
) -> bytes | None:
    """The client's body without the ``owned`` keys, or ``None`` when it has none (send it unchanged).

    ``rewritten``: ``raw`` is the gateway's rewrite of the client's body: sent even without those keys."""
    if body.keys().isdisjoint(owned):  # one C loop, not a generator (every routed request asks)
        return raw if rewritten else None
    return with_fields(raw, body, {}, owned)


def prefill_leg_body(body: dict[str, object], params: dict[str, object] = PREFILL_REQUEST_PARAMS) -> bytes:
    """A prefill leg (kv-transfer-params, vllm-mooncake): the client's body asking for one token.

    The client's handoff fields are dropped; ``kv_transfer_params`` is ``params`` (by default, asking
    the prefill to keep the KV cache for a remote decode); ``stream`` false; ``max_tokens`` 1 (and
    ``max_completion_tokens`` 1 when the client set it); ``stream_options`` removed;
    ``min_tokens``/``min_completion_tokens`` at most 1.
    """
    leg = {key: value for key, value in body.items() if key not in HANDOFF_FIELDS}
    leg.pop("stream_options", None)
    leg[KV_TRANSFER_PARAMS] = dict(params)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if body.get("max_completion_tokens") is not None:
        leg["max_completion_tokens"] = 1
    for key in _MIN_TOKENS:
        value = leg.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 1:
            leg[key] = 1
    return _dumps(leg)
