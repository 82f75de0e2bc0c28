"""Value types of the routing decision.

Everything here is plain immutable data: no I/O, no clocks, no gRPC types. The shell passes the
registry's per-role :class:`~ext_proc.affinity.Pool` arrays to :func:`ext_proc.affinity.choose`
and turns the result into headers; tests build pools of :class:`Candidate` values with ``Pool.of``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from ext_proc.affinity.auto import AutoModel


class Mode(enum.StrEnum):
    """How strongly a decode endpoint is kept in the chosen prefill's ``pdGroupID`` group."""

    OFF = "off"
    PREFER = "prefer"
    STRICT = "strict"
    AUTO = "auto"


class Locality(enum.StrEnum):
    """Where the KV cache travels for a decision."""

    SAME_GROUP = "same_group"
    CROSS_GROUP = "cross_group"
    DECODE_ONLY = "decode_only"


class NoPairReason(enum.StrEnum):
    """Why no prefill/decode pair could be chosen. The value is the OpenAI-style error ``code``."""

    NO_DECODE_ENDPOINT = "no_healthy_decode_endpoint"
    NO_SAME_GROUP_DECODE = "no_same_group_decode_endpoint"


class Endpoint(Protocol):
    """An endpoint as a :class:`~ext_proc.affinity.Pool` holds it; any object with these attributes will do.

    The decision itself reads only ``address`` and ``group`` (load comes from the pool's arrays);
    ``Pool.of`` snapshots the load and capacity; ``data_parallel_size`` (the engine's data-parallel
    ranks) is read by the ``kv-events`` prefix source. The server's pools hold its live registry
    entries; tests use :class:`Candidate` values.
    """

    @property
    def address(self) -> str:
        """``ip:port`` (IPv6: ``[ip]:port``): what the endpoint is known and routed by."""
        ...

    @property
    def group(self) -> str:
        """Its ``pdGroupID``: a prefill and a decode of one group share the fast KV fabric."""
        ...

    @property
    def token_capacity(self) -> float:
        """The tokens it holds at full load (its KV cache), > 0."""
        ...

    @property
    def active_tokens(self) -> int:
        """The tokens charged to it now."""
        ...

    @property
    def active_requests(self) -> int:
        """The requests charged to it now."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """Its engine's data-parallel ranks (1 without data parallelism)."""
        ...


E = TypeVar("E", bound=Endpoint)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy endpoint as the decision sees it.

    ``address`` is ``"ip:port"``; ``group`` is the ``pdGroupID`` (``""`` when absent);
    ``token_capacity`` is in tokens and strictly positive; ``active_tokens`` and
    ``active_requests`` are the in-flight load charged to this endpoint for this role;
    ``data_parallel_size`` its engine's data-parallel ranks.
    """

    address: str
    group: str
    token_capacity: float
    active_tokens: int
    active_requests: int
    data_parallel_size: int = 1

    def utilisation(self, cost: int) -> float:
        """``(active_tokens + cost) / token_capacity``: the load after placing ``cost`` tokens."""
        return (self.active_tokens + cost) / self.token_capacity


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request charges, in tokens.

    ``prefill_tokens`` = prompt tokens; ``decode_tokens`` = prompt tokens + output budget.
    """

    prefill_tokens: int
    decode_tokens: int


class Hits(NamedTuple):
    """Prompt tokens each endpoint is estimated to hold in its prefix cache, for one request.

    ``prefill[i]`` belongs to position ``i`` of the prefill pool, ``decode[j]`` to position ``j`` of
    the decode pool; int64, each in [0, ``Cost.prefill_tokens``] (the prefix index guarantees it).
    ``prefill_cpu`` / ``decode_cpu`` (``None``: all in GPU memory): of those, the tokens held only in a
    CPU tier, each in [0, the endpoint's hit]; such a hit is worth less (:class:`Policy`
    ``cpu_tier_weight``; ``auto`` prices loading it at ``AutoModel.cpu_tier_gbps``).
    """

    prefill: NDArray[np.int64]
    decode: NDArray[np.int64]
    prefill_cpu: NDArray[np.int64] | None = None
    decode_cpu: NDArray[np.int64] | None = None


class Lacks(NamedTuple):
    """Which endpoints lack the LoRA adapter a request names, for a request for an adapter.

    ``prefill[i]`` belongs to position ``i`` of the prefill pool, ``decode[j]`` to position ``j`` of the
    decode pool; bool, true where the endpoint reported the adapters it holds (a fresh engine-metrics
    sample) and the request's is not among them: it must load the adapter before it serves the request.
    False where it holds it or did not report (unknown: no preference either way). ``auto`` prices a
    lacking endpoint ``AutoModel.lora_load_ms`` more; the other modes rank it one tick behind
    (docs/routing.md "LoRA adapters")."""

    prefill: NDArray[np.bool_]
    decode: NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Policy:
    """The affinity knobs. ``bonus`` is in utilisation units, within [0, 1] (checked by the config).

    Utilisations and the bonus are compared on a grid of 1e-9, so a decode exactly ``bonus``
    above the best counts as within it whatever the float rounding. ``prefix_weight`` (>= 0, in
    utilisation units, read in ``off``, ``prefer`` and ``strict`` when :class:`Hits` are given): what
    a prompt held whole in an endpoint's prefix cache is worth; a share ``h`` of the prompt held
    lowers that endpoint's score by ``prefix_weight * h``. ``auto``: the time model of ``Mode.AUTO``
    (read in that mode only; it prices cache hits in seconds instead). ``cpu_tier_weight`` (in [0, 1],
    read with ``prefix_weight``): what a prompt token held only in a CPU tier (:class:`Hits`
    ``prefill_cpu`` / ``decode_cpu``) is worth against one held in GPU memory.
    """

    mode: Mode = Mode.PREFER
    bonus: float = 0.3
    fallback_count: int = 2
    auto: AutoModel = field(default_factory=AutoModel)
    prefix_weight: float = 0.0
    cpu_tier_weight: float = 0.5


class Estimate(NamedTuple):
    """Why ``auto`` chose its pair, in seconds (:mod:`ext_proc.affinity.auto`).

    ``prefill_s``: the chosen prefill's queue and compute estimate (its uncached backlog plus this
    prompt's uncached tokens, plus loading its CPU-tier hit); ``transfer_s``: the KV transfer estimate
    from the prefill to the chosen decode (the blocks the decode lacks, plus loading its CPU-tier
    hit); ``wait_s``: the wait estimate at the chosen decode;
    ``margin_s``: the best estimate among decodes of the other locality (cross-group when the choice
    is in the group, in-group when it crossed) minus the chosen one's — the delay the decode choice
    saves, >= 0 up to the 1 ns grid — or ``None`` when every decode has the chosen locality.
    """

    prefill_s: float
    transfer_s: float
    wait_s: float
    margin_s: float | None


class Decision(NamedTuple, Generic[E]):
    """Where one request goes: its prefill, its decode and the decode fallbacks.

    ``prefill`` is ``None`` for decode-only routing; ``estimate`` is set by ``auto`` decisions with a
    prefill (``None`` otherwise).

    The endpoints are the very objects of the pools passed to :func:`~ext_proc.affinity.choose`. A named
    tuple: immutable, and several times cheaper to build than a frozen dataclass.
    """

    prefill: E | None
    decode: E
    fallbacks: tuple[E, ...]
    locality: Locality
    estimate: Estimate | None = None


@dataclass(frozen=True, slots=True)
class NoPair:
    """No pair can serve the request: the router refuses it with a 503.

    The decision found no pair that can serve; ``reason.value`` is the error code of the 503."""

    reason: NoPairReason
    message: str
