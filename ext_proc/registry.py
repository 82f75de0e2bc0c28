"""The current set of endpoints, with their live load, as the router sees it.

Load lives in per-role numpy arrays (struct of arrays) that the registry owns: ``tokens`` and
``requests`` (int64) with one slot per endpoint of the role, healthy endpoints first, so that the
healthy prefix is what :func:`ext_proc.affinity.choose` reads (:attr:`Registry.prefill_pool`,
:attr:`Registry.decode_pool`, views of those arrays). Each endpoint is one mutable
:class:`EndpointState` that knows its slot: the load accounting charges and releases through it,
in place, so routing reads loads without copying anything. The ``tokens`` slot holds the *blended*
load: this replica's in-flight tokens, plus its peer replicas' (``peer_tokens``, which the shared state
of :mod:`ext_proc.shared` sets as their batches arrive; 0 alone), plus the endpoint's ``engine_offset``,
which the engine load signal (:mod:`ext_proc.engine_load`) sets when a scrape lands (0 without one), so a
charge or release stays one in-place addition and the decision reads one number per endpoint. The
``requests`` slot likewise holds this replica's requests plus its peers'.

Each endpoint serves every model, or the names it declares (EDS metadata ``models``, the pod
annotation) or, declaring none, the names its engine lists (``GET /v1/models``, polled with the engine
metrics: :meth:`Registry.set_engine_models`): a declaration wins, as the operator's deliberate word, known
before the first poll. :meth:`Registry.pools_for` gives a model's pools: the role pools themselves while
no endpoint names its models (no cost), else a cached pool of the endpoints serving it per name, its
load copied from the live arrays on each call (O(endpoints), numpy). A model some engine lists with a
``parent`` is a LoRA adapter: :meth:`Registry.lacks` says which endpoints are known to lack it.

Updates from a discovery source keep the same object for an endpoint that stays (same role and
address) and rebuild the arrays with every live value carried over: in-flight accounting survives
any number of EDS changes. An endpoint that leaves while it still has requests in flight keeps its
old arrays (which nothing else reads any more) and is revived, load included, if it comes back
before they finish.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable

import numpy as np
from numpy.typing import NDArray

from ext_proc.affinity import Lacks, Pool
from ext_proc.endpoints import ClusterEndpoints, merge_clusters
from ext_proc.models import ServedModel

log = logging.getLogger(__name__)


class Role(enum.StrEnum):
    """The part an endpoint plays in disaggregated serving."""

    PREFILL = "prefill"
    DECODE = "decode"


class EndpointState:
    """One endpoint of one role: identity, declared capacity and health, and live load.

    Satisfies :class:`ext_proc.affinity.Endpoint` (``address``, ``group``, ``token_capacity`` in
    tokens, ``active_tokens``, ``active_requests``); ``bootstrap_port`` is the SGLang bootstrap port
    its metadata declares, if any, ``metrics_port`` the port of its ``/metrics`` if not the serving port,
    ``kv_events_port`` / ``kv_events_replay_port`` the ports of its KV-cache event publisher and replay
    socket if not the configured ones, ``data_parallel_size`` its number of data-parallel ranks.
    The loads are properties over the endpoint's slot in its role's arrays (a private one-slot pair
    until the registry places it): ``active_tokens`` is the in-flight accounting of every replica (this
    one's, :attr:`own_tokens`, plus its peers', ``peer_tokens``), ``blended_tokens`` what the decision
    reads, ``active_tokens + engine_offset``. ``watch`` (``None``: nobody) is called with the endpoint
    after each of this replica's own charges and releases (the shared state publishes them).
    ``declared_models`` (discovery) and ``engine_models`` (the engine's own list) say which models it
    serves; :attr:`served` is the effective set (``None``: every model), see the module docstring.
    ``lora_adapters``: the LoRA adapters its engine's fresh sample says it holds (engine metrics;
    ``None``: unknown — no fresh sample, or an engine that does not report them).
    """

    __slots__ = (
        "_requests",
        "_slot",
        "_tokens",
        "address",
        "bootstrap_port",
        "data_parallel_size",
        "declared_models",
        "engine_models",
        "engine_offset",
        "group",
        "health_status",
        "healthy",
        "kv_events_port",
        "kv_events_replay_port",
        "lora_adapters",
        "metrics_port",
        "peer_requests",
        "peer_tokens",
        "role",
        "served",
        "token_capacity",
        "watch",
    )

    def __init__(self, role: Role, address: str) -> None:
        self.role = role
        self.address = address
        self.group = ""
        self.token_capacity = 1.0
        self.healthy = False
        self.health_status = "UNKNOWN"
        self.bootstrap_port: int | None = None
        self.metrics_port: int | None = None
        self.kv_events_port: int | None = None
        self.kv_events_replay_port: int | None = None
        self.data_parallel_size = 1
        self.declared_models: tuple[str, ...] | None = None
        self.engine_models: tuple[ServedModel, ...] | None = None
        self.served: frozenset[str] | None = None
        self.engine_offset = 0
        self.lora_adapters: frozenset[str] | None = None
        self.peer_tokens = 0
        self.peer_requests = 0
        self.watch: Callable[[EndpointState], None] | None = None
        self._tokens: NDArray[np.int64] = np.zeros(1, dtype=np.int64)
        self._requests: NDArray[np.int64] = np.zeros(1, dtype=np.int64)
        self._slot = 0

    def models(self) -> tuple[ServedModel, ...] | None:
        """The models it serves with their parents where its engine names them (``None``: every model)."""
        if self.served is None:
            return None
        parents = {m.name: m.parent for m in self.engine_models or ()}
        return tuple(ServedModel(name, parents.get(name)) for name in sorted(self.served))

    def _serve(self) -> None:
        """Recompute :attr:`served`: the declared names, else the engine's, else ``None`` (every model)."""
        if self.declared_models is not None:
            self.served = frozenset(self.declared_models)
        elif self.engine_models is not None:
            self.served = frozenset(m.name for m in self.engine_models)
        else:
            self.served = None

    @property
    def active_tokens(self) -> int:
        """In-flight tokens charged to this endpoint by every gateway replica (this one and its peers)."""
        return int(self._tokens[self._slot]) - self.engine_offset

    @active_tokens.setter
    def active_tokens(self, value: int) -> None:
        """Charge ``value`` tokens in all; the decision then reads ``value`` + :attr:`engine_offset`."""
        self._tokens[self._slot] = value + self.engine_offset

    @property
    def blended_tokens(self) -> int:
        """The load the decision reads, in tokens: :attr:`active_tokens` + :attr:`engine_offset`."""
        return int(self._tokens[self._slot])

    def set_engine_offset(self, offset: int) -> None:
        """Make the decision read ``active_tokens + offset`` (tokens, >= 0) from now on."""
        self._tokens[self._slot] += offset - self.engine_offset
        self.engine_offset = offset

    @property
    def active_requests(self) -> int:
        """In-flight requests routed to this endpoint by every gateway replica."""
        return int(self._requests[self._slot])

    @active_requests.setter
    def active_requests(self, value: int) -> None:
        """Charge ``value`` requests in all."""
        self._requests[self._slot] = value

    @property
    def own_tokens(self) -> int:
        """In-flight tokens this replica charged to the endpoint (what it tells its peers)."""
        return self.active_tokens - self.peer_tokens

    @property
    def own_requests(self) -> int:
        """In-flight requests this replica routed to the endpoint."""
        return self.active_requests - self.peer_requests

    def set_peer_load(self, tokens: int, requests: int) -> None:
        """The peer replicas have ``tokens`` tokens and ``requests`` requests in flight here (>= 0 each)."""
        slot = self._slot
        self._tokens[slot] = self._tokens.item(slot) + tokens - self.peer_tokens
        self._requests[slot] = self._requests.item(slot) + requests - self.peer_requests
        self.peer_tokens, self.peer_requests = tokens, requests

    def charge(self, tokens: int) -> None:
        """One more request of this replica's in flight, of ``tokens`` tokens."""
        slot = self._slot
        self._tokens[slot] = self._tokens.item(slot) + tokens
        self._requests[slot] = self._requests.item(slot) + 1
        if self.watch is not None:
            self.watch(self)

    def release(self, tokens: int) -> None:
        """One request of ``tokens`` tokens fewer in flight (undoes one :meth:`charge`)."""
        slot = self._slot
        self._tokens[slot] = self._tokens.item(slot) - tokens
        self._requests[slot] = self._requests.item(slot) - 1
        if self.watch is not None:
            self.watch(self)

    def _place(self, tokens: NDArray[np.int64], requests: NDArray[np.int64], slot: int) -> None:
        """Copy the live load into ``tokens[slot]`` and ``requests[slot]`` and keep it there from now on."""
        tokens[slot] = self._tokens[self._slot]
        requests[slot] = self._requests[self._slot]
        self._tokens, self._requests, self._slot = tokens, requests, slot


class Registry:
    """The current endpoints by role, with their live load.

    ``prefills``/``decodes`` hold only the healthy ones (candidates), in EDS order;
    ``prefill_pool``/``decode_pool`` are the same endpoints with their live load arrays.

    Not thread-safe: owned by the server's event loop.
    """

    def __init__(self, prefill_cluster: str, decode_cluster: str, default_token_capacity: float) -> None:
        self._roles = {prefill_cluster: Role.PREFILL, decode_cluster: Role.DECODE}
        self._default_capacity = default_token_capacity
        self._current: dict[tuple[Role, str], EndpointState] = {}
        self._departed: dict[tuple[Role, str], EndpointState] = {}
        self.prefill_pool: Pool[EndpointState] = Pool.of(())
        self.decode_pool: Pool[EndpointState] = Pool.of(())
        self._watch: Callable[[EndpointState], None] | None = None
        self._named: frozenset[str] = frozenset()
        self._any_model = True
        self._adapters: frozenset[str] = frozenset()
        self._restricted = False
        self._by_model: dict[str, _ModelPools] = {}

    def watch(self, callback: Callable[[EndpointState], None] | None) -> None:
        """Call ``callback`` after each own charge and release of any endpoint, present or to come."""
        self._watch = callback
        for state in self.endpoints():
            state.watch = callback

    def update(self, clusters: Iterable[ClusterEndpoints]) -> None:
        """Replace the endpoint set with ``clusters``; clusters with other names are ignored (logged).

        Several clusters with the same name are merged; an address listed twice for one role
        keeps its first entry.
        """
        fresh: dict[tuple[Role, str], EndpointState] = {}
        for cluster in merge_clusters(clusters).values():
            role = self._roles.get(cluster.cluster_name)
            if role is None:
                log.warning(
                    "ignoring EDS cluster %r from %s: neither the prefill nor the decode cluster",
                    cluster.cluster_name,
                    cluster.source,
                )
                continue
            for spec in cluster.endpoints:
                key = (role, spec.address)
                state = (
                    self._current.get(key)
                    or self._departed.pop(key, None)
                    or EndpointState(role, spec.address)
                )
                state.watch = self._watch
                state.group = spec.group
                state.token_capacity = spec.token_capacity or self._default_capacity
                state.healthy = spec.healthy
                state.health_status = spec.health_status
                state.bootstrap_port = spec.bootstrap_port
                state.metrics_port = spec.metrics_port
                state.kv_events_port = spec.kv_events_port
                state.kv_events_replay_port = spec.kv_events_replay_port
                state.data_parallel_size = spec.data_parallel_size
                state.declared_models = spec.models
                state._serve()
                fresh[key] = state
        for key, state in self._current.items():
            if key not in fresh and state.own_requests:
                self._departed[key] = state
        self._departed = {k: s for k, s in self._departed.items() if s.own_requests}
        self._current = fresh
        self.prefill_pool = _place(s for s in fresh.values() if s.role is Role.PREFILL)
        self.decode_pool = _place(s for s in fresh.values() if s.role is Role.DECODE)
        self._index_models()

    def set_engine_models(self, address: str, models: tuple[ServedModel, ...]) -> None:
        """Note that the engine at ``address`` lists ``models`` (``GET /v1/models``).

        Its endpoints (every role) serve them unless they declare their own."""
        changed = False
        for role in Role:
            state = self._current.get((role, address))
            if state is not None and state.engine_models != models:
                state.engine_models = models
                state._serve()
                changed = True
        if changed:
            self._index_models()

    def _index_models(self) -> None:
        """Note which names the known decodes serve, and forget the per-model pools."""
        decodes = [s for s in self._current.values() if s.role is Role.DECODE]
        self._named = frozenset(name for s in decodes if s.served is not None for name in s.served)
        self._any_model = any(s.served is None for s in decodes)
        listed = (m for s in self._current.values() for m in s.engine_models or ())
        self._adapters = frozenset(m.name for m in listed if m.parent is not None)
        self._restricted = any(s.served is not None for s in self._current.values())
        self._by_model = {}

    def pools_for(self, model: str | None) -> tuple[Pool[EndpointState], Pool[EndpointState]] | None:
        """The (prefill, decode) pools of the healthy endpoints serving ``model`` (``None``: any model).

        ``None`` when no known decode, healthy or not, serves it (the request's model is unknown).

        A cached pool's load is copied from the live arrays on each call: read it before the next call."""
        if model is None or not self._restricted:
            return self.prefill_pool, self.decode_pool
        key = model if model in self._named else ""  # "": served only by the endpoints serving every model
        if not key and not self._any_model:
            return None
        pools = self._by_model.get(key)
        if pools is None:
            pools = self._by_model[key] = _ModelPools(self.prefill_pool, self.decode_pool, key)
        return pools.fresh()

    def is_adapter(self, model: str | None) -> bool:
        """Whether ``model`` is a LoRA adapter: an engine lists it with a ``parent``."""
        return model in self._adapters

    def lacks(
        self, model: str | None, prefills: Pool[EndpointState], decodes: Pool[EndpointState]
    ) -> Lacks | None:
        """Which endpoints of ``prefills`` and ``decodes`` are known to lack the LoRA adapter ``model``.

        ``None`` unless ``model`` is an adapter (an engine lists it with a ``parent``); else per pool
        position, true where the endpoint's fresh engine sample lists its adapters without ``model``
        (:attr:`EndpointState.lora_adapters`; unknown counts as holding it). O(endpoints) Python."""
        if model is None or not self.is_adapter(model):
            return None
        return Lacks(_lacking(prefills, model), _lacking(decodes, model))

    def model_label(self, model: str | None) -> str:
        """``model`` as a metric label, of bounded cardinality.

        Itself when a known decode names it, else ``""`` (no model, or one only the endpoints serving
        every model serve): bounded by what discovery and the engines name, never by what clients send."""
        return model if model is not None and model in self._named else ""

    def served_models(self) -> tuple[ServedModel, ...] | None:
        """Every model a known decode names (``GET /v1/models``).

        With its parent where an engine names it; ``None`` when no decode names its models (each serves
        every model: only the engines know)."""
        if not self._named:
            return None
        models: dict[str, ServedModel] = {}
        for state in self._current.values():
            if state.role is Role.DECODE:
                for model in state.models() or ():
                    known = models.get(model.name)
                    if known is None or known.parent is None:  # a parent named by any engine is kept
                        models[model.name] = model
        return tuple(models.values())

    @property
    def prefills(self) -> tuple[EndpointState, ...]:
        """The healthy prefill endpoints (the prefill pool's endpoints)."""
        return self.prefill_pool.endpoints

    @property
    def decodes(self) -> tuple[EndpointState, ...]:
        """The healthy decode endpoints (the decode pool's endpoints)."""
        return self.decode_pool.endpoints

    def decode(self, address: str) -> EndpointState | None:
        """The known decode endpoint at ``address`` (``ip:port``), healthy or not, or ``None``."""
        return self._current.get((Role.DECODE, address))

    def find(self, role: str, address: str) -> EndpointState | None:
        """The endpoint of ``role`` at ``address`` that requests may still be charged to.

        The known endpoint of ``role`` (``prefill``, ``decode``) at ``address``, healthy or not, or a
        departed one with requests of this replica's still in flight; ``None`` if neither."""
        key = (Role(role), address)
        return self._current.get(key) or self._departed.get(key)

    def endpoints(self) -> tuple[EndpointState, ...]:
        """Every known endpoint, healthy or not, plus departed ones that still have requests in flight."""
        return (*self._current.values(), *self._departed.values())


class _ModelPools:
    """The healthy endpoints of both roles that serve one model, as pools of their own.

    ``key``: the model's name, or ``""`` for a name no endpoint lists (served by the endpoints that
    serve every model). The pools' arrays are copies that :meth:`fresh` refills from the live ones."""

    __slots__ = ("_decode", "_decodes", "_prefill", "_prefills")

    def __init__(self, prefills: Pool[EndpointState], decodes: Pool[EndpointState], key: str) -> None:
        self._prefills, self._prefill = prefills, _serving(prefills, key)
        self._decodes, self._decode = decodes, _serving(decodes, key)

    def fresh(self) -> tuple[Pool[EndpointState], Pool[EndpointState]]:
        """Both pools, their load copied from the live arrays now."""
        for live, (positions, pool) in ((self._prefills, self._prefill), (self._decodes, self._decode)):
            np.take(live.tokens, positions, out=pool.tokens)
            np.take(live.requests, positions, out=pool.requests)
        return self._prefill[1], self._decode[1]


def _lacking(pool: Pool[EndpointState], adapter: str) -> NDArray[np.bool_]:
    """Per position of ``pool``: its endpoint reported its adapters, and ``adapter`` is not among them."""
    held = (s.lora_adapters for s in pool.endpoints)
    return np.fromiter((a is not None and adapter not in a for a in held), dtype=np.bool_, count=pool.size)


def _serving(pool: Pool[EndpointState], key: str) -> tuple[NDArray[np.intp], Pool[EndpointState]]:
    """The positions in ``pool`` of the endpoints serving ``key`` (see :class:`_ModelPools`), and their
    pool."""
    keep = [i for i, s in enumerate(pool.endpoints) if s.served is None or key in s.served]
    positions = np.array(keep, dtype=np.intp)
    endpoints = [pool.endpoints[i] for i in keep]
    load = pool.tokens[positions], pool.requests[positions], pool.capacity[positions]
    return positions, Pool(endpoints, *load)


def _place(states: Iterable[EndpointState]) -> Pool[EndpointState]:
    """New load arrays for the endpoints of one role, healthy ones first, each state moved into its
    slot with its load; the pool of the healthy ones is a view of the arrays' healthy prefix."""
    ordered = sorted(states, key=lambda s: not s.healthy)  # stable: EDS order within each half
    healthy = [s for s in ordered if s.healthy]
    tokens = np.zeros(len(ordered), dtype=np.int64)
    requests = np.zeros(len(ordered), dtype=np.int64)
    for slot, state in enumerate(ordered):
        state._place(tokens, requests, slot)
    capacity = np.array([s.token_capacity for s in healthy], dtype=np.float64)
    return Pool(healthy, tokens[: len(healthy)], requests[: len(healthy)], capacity)
