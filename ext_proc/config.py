"""The server's configuration: one typed, validated object built from YAML, env and flags.

Precedence, lowest first: built-in defaults < YAML file < environment < command-line flags.
Every key is optional. Errors raise :class:`ConfigError` naming the key and what it accepts;
the CLI turns that into exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import re
import types
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ext_proc.affinity import AutoModel, Mode, Policy
from ext_proc.discovery import SourceKind
from ext_proc.discovery.pods import (
    PRESETS,
    PodRules,
    Preset,
    RoleScheme,
    is_label_key,
    is_label_value,
    is_object_name,
)
from ext_proc.engine_load import EngineKind
from ext_proc.handoff import FailurePolicy, HandoffMode
from ext_proc.handoff.base import UNSUPPORTED_HANDOFFS
from ext_proc.prefix import PrefixSettings
from ext_proc.request import MAX_OUTPUT_BUDGET

ENV_AFFINITY_MODE = "PD_EXTPROC_AFFINITY_MODE"
ENV_AFFINITY_BONUS = "PD_EXTPROC_AFFINITY_BONUS"
ENV_HANDOFF = "PD_EXTPROC_HANDOFF"
MAX_PREFILL_TIMEOUT = 1795.0
"""Upper bound of ``handoff.prefill_timeout_seconds`` (seconds): Envoy caps ``max_message_timeout`` at one
hour, and the kv-transfer-params handoff asks Envoy to wait 2 x this + 5 s (a leg and its retry)."""
MAX_RETRY_AFTER = 3600
"""Upper bound of ``limits.retry_after_seconds`` (seconds)."""
MAX_NO_ENVOY_DELAY = 60.0
"""Upper bound of ``xds.no_envoy_delay_seconds`` (seconds)."""
MIN_SCRAPE_INTERVAL = 0.01
"""Lower bound of ``engine_metrics.interval_seconds`` (seconds)."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the allowed values."""


@dataclass(frozen=True)
class KubernetesConfig:
    """Pods as endpoints (``discovery.source: kubernetes``; docs/deploy/kubernetes.md).

    ``kubeconfig``: a kubeconfig file (relative to the config file's folder); ``""`` = ``$KUBECONFIG``,
    else the in-cluster service account. ``namespaces``: empty = the server's own (in-cluster) or the
    kubeconfig context's. The role and port keys left ``""`` take the ``preset``'s value
    (:meth:`scheme`); a port is a container port name or a number.
    """

    kubeconfig: str = ""
    namespaces: tuple[str, ...] = ()
    preset: Preset = Preset.INFERNEX
    role_label: str = ""
    prefill_role: str = ""
    decode_role: str = ""
    both_role: str = ""
    prefill_port: str | int = ""
    decode_port: str | int = ""
    group_label: str = "openfuyao.com/pdGroupID"
    capacity_annotation: str = "pd-extproc/token-capacity"
    bootstrap_port_annotation: str = "pd-extproc/bootstrap-port"
    metrics_port_annotation: str = "pd-extproc/metrics-port"

    def scheme(self) -> RoleScheme:
        """The preset's role scheme with each role and port key that is set here in its place."""
        preset = PRESETS[self.preset]
        names = [f.name for f in dataclasses.fields(RoleScheme)]
        return dataclasses.replace(preset, **{n: getattr(self, n) for n in names if getattr(self, n) != ""})


@dataclass(frozen=True)
class InferencePoolConfig:
    """The InferencePool whose pods are the endpoints (``discovery.source: inferencepool``;
    docs/deploy/kubernetes.md "Discovery from an InferencePool"), as GIE's endpoint picker names it
    (``--pool-name``, ``--pool-namespace``).

    ``name``: the ``inference.networking.k8s.io/v1`` InferencePool's name, required with that source.
    ``namespace``: its namespace, which is also its pods'; ``""`` = the server's own (in-cluster) or
    the kubeconfig context's, as for ``discovery.kubernetes.namespaces``.
    """

    name: str = ""
    namespace: str = ""


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where endpoints come from: ``source`` files (the EDS files ``eds_files``), kubernetes (pods,
    ``kubernetes``) or inferencepool (the pods an InferencePool selects, ``inferencepool``, with the
    pod rules and API access of ``kubernetes``). Relative ``eds_files`` (and ``kubernetes.kubeconfig``)
    resolve against the folder of the config file's path as given (symlinks not followed: see
    :func:`load_config`)."""

    eds_files: tuple[str, ...] = ()
    prefill_cluster: str = "prefill"
    decode_cluster: str = "decode"
    metadata_namespace: str = "pd"
    poll_interval_seconds: float = 0.25
    source: SourceKind = SourceKind.FILES
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    inferencepool: InferencePoolConfig = field(default_factory=InferencePoolConfig)

    def pod_rules(self) -> PodRules:
        """How the ``kubernetes`` and ``inferencepool`` sources read a pod (``kubernetes``'s keys)."""
        kubernetes = self.kubernetes
        return PodRules(
            kubernetes.scheme(),
            kubernetes.group_label,
            kubernetes.capacity_annotation,
            kubernetes.bootstrap_port_annotation,
            self.prefill_cluster,
            self.decode_cluster,
            kubernetes.metrics_port_annotation,
        )


@dataclass(frozen=True)
class AutoConfig:
    """The ``auto`` mode's delay model (docs/routing.md "Affinity modes"; :mod:`ext_proc.affinity.auto`).

    KV cache per prompt token: ``kv_bytes_per_token`` bytes, or when it is 0 (the default) the model
    shape's ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes`` (K and V per layer; defaults:
    Llama-3-8B in bf16, 131072 bytes). ``same_group_gbps`` / ``cross_group_gbps``: KV transfer
    bandwidth within a ``pdGroupID`` group / across groups, GB/s (10^9 bytes/s), cross <= same.
    ``base_latency_ms``: fixed cost of one transfer. ``wait_scale_ms``: the wait model's service time,
    ms (about one decode step at half batch): a decode at utilisation u waits ``wait_scale_ms * u`` while
    it has room (u <= 0.8), plus ``wait_scale_ms * (u - 0.8) / (1 - u)`` above (see ``affinity.auto``).
    ``prefill_ms_per_token``: prefill compute per prompt token, ms (the prefill's queue and its compute
    on the uncached tokens are priced with it).
    """

    kv_bytes_per_token: int = 0
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    same_group_gbps: float = 100.0
    cross_group_gbps: float = 10.0
    base_latency_ms: float = 1.0
    wait_scale_ms: float = 15.0
    prefill_ms_per_token: float = 0.05

    def bytes_per_token(self) -> int:
        """KV bytes per prompt token: ``kv_bytes_per_token``, or the model shape's when that is 0."""
        shape = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
        return self.kv_bytes_per_token or shape

    def model(self) -> AutoModel:
        """The pure decision's view of these keys."""
        return AutoModel(
            self.bytes_per_token(),
            self.same_group_gbps,
            self.cross_group_gbps,
            self.base_latency_ms,
            self.wait_scale_ms,
            self.prefill_ms_per_token,
        )


@dataclass(frozen=True)
class PrefixConfig:
    """Prefix-cache aware routing (docs/routing.md "Prefix-cache aware routing"; :mod:`ext_proc.prefix`).

    ``enabled``: keep the prefix index and route by it. ``block_tokens``: tokens per hashed block
    (token ids as they are; text in chunks of 4 characters a token). ``max_blocks``: the most blocks of
    one prompt hashed. ``weight``: in ``off``, ``prefer`` and ``strict``, what a prompt held whole in an
    endpoint's cache is worth in utilisation units (``auto`` prices hits in seconds instead).
    ``self_correct``: size each endpoint's index from its engine's ``vllm:prefix_cache_queries`` /
    ``_hits`` too (with ``engine_metrics.enabled``).
    """

    enabled: bool = False
    block_tokens: int = 16
    max_blocks: int = 2048
    weight: float = 0.1
    self_correct: bool = True

    def settings(self) -> PrefixSettings | None:
        """The prefix tracker's settings, ``None`` when disabled."""
        if not self.enabled:
            return None
        return PrefixSettings(self.block_tokens, self.max_blocks, self.self_correct)


@dataclass(frozen=True)
class AffinityConfig:
    """``mode``: off | prefer | strict | auto. ``bonus``: utilisation slack in [0, 1] for ``prefer``.
    ``auto``: the time model of ``auto``. ``prefix``: prefix-cache aware routing. The whole section
    applies live (:mod:`ext_proc.reload`)."""

    mode: Mode = Mode.PREFER
    bonus: float = 0.3
    auto: AutoConfig = field(default_factory=AutoConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)

    def policy(self, fallback_count: int) -> Policy:
        """The decision's policy for this section, with ``fallback_count`` (``routing.fallback_count``)."""
        weight = self.prefix.weight if self.prefix.enabled else 0.0
        return Policy(self.mode, self.bonus, fallback_count, self.auto.model(), weight)


@dataclass(frozen=True)
class LoadConfig:
    """Defaults for load accounting, in tokens."""

    default_max_tokens: int = 256
    default_token_capacity: float = 100_000.0


@dataclass(frozen=True)
class RoutingConfig:
    """What the answer to Envoy looks like, and which requests are disaggregated.

    ``pd_threshold_tokens``: prompts estimated below it are routed decode-only (the decode engine
    prefills them itself); 0 disaggregates every prompt. The default, 512, comes from
    ``bench/handoff.py`` (docs/handoffs.md "Conditional disaggregation").
    """

    fallback_count: int = 2
    destination_header: str = "x-gateway-destination-endpoint"
    prefill_header: str = "x-prefiller-host-port"
    pd_threshold_tokens: int = 512


@dataclass(frozen=True)
class HandoffConfig:
    """How the engines receive a disaggregated request (see docs/handoffs.md "Handoff modes").

    ``prefill_via``: base URL of the Envoy listener that forwards prefill legs (``""``: connect to
    the prefill endpoint directly). ``prefill_timeout_seconds`` bounds one prefill leg.
    ``default_bootstrap_port``: bootstrap port (SGLang's, or vLLM Mooncake's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``)
    of a prefill without ``bootstrap_port`` metadata.
    ``eject_failed_prefill_seconds``: after a prefill leg fails (not a 4xx), that prefill is no candidate
    for this long (seconds; 0 = never ejected; see ``ext_proc/ejection.py``).
    ``watch_streamed_answers``: with the BUFFERED phases, the engine handoffs have Envoy send a
    streamed answer chunk by chunk to tell a decode's failed KV pull (docs/handoffs.md "KV-load failure
    after a successful leg"); ``False`` spares that per-chunk cost (a failed pull then streams the
    engine's own error).
    """

    mode: HandoffMode = HandoffMode.SIDECAR
    prefill_via: str = ""
    prefill_timeout_seconds: float = 120.0
    on_prefill_failure: FailurePolicy = FailurePolicy.DECODE_ONLY
    default_bootstrap_port: int = 8998
    eject_failed_prefill_seconds: float = 5.0
    watch_streamed_answers: bool = True


@dataclass(frozen=True)
class XdsConfig:
    """pd-extproc as Envoy's EDS server (see docs/deploy/envoy.md "EDS from pd-extproc").

    ``serve_eds``: serve the prefill and decode clusters' endpoints over ADS on the gRPC port
    (``listen``), for ``envoy/envoy-ads.yaml``; an endpoint becomes pickable only once every
    subscribed Envoy has ACKed a version holding it healthy. ``no_envoy_delay_seconds``: while no
    Envoy subscribes to its cluster, it becomes pickable this long after it was published instead.
    """

    serve_eds: bool = False
    no_envoy_delay_seconds: float = 2.0


@dataclass(frozen=True)
class AdminConfig:
    """The admin HTTP endpoint on ``metrics_listen``.

    ``debug_endpoints``: serve ``/debug/endpoints`` (every endpoint's address, health and live
    load); ``False`` answers it 404. ``/metrics`` and ``/healthz`` are always served.
    """

    debug_endpoints: bool = True


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gRPC port (``listen``; docs/operations.md "TLS between Envoy and pd-extproc").

    ``cert_file`` and ``key_file`` (PEM; both or neither): pd-extproc's certificate chain and key;
    ``""`` serves plaintext. ``client_ca_file`` (PEM): with it, every client must present a
    certificate signed by one of its CAs (mutual TLS). Relative paths resolve like ``eds_files``.
    """

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""


@dataclass(frozen=True)
class LimitsConfig:
    """Admission control (docs/operations.md "Overload").

    ``max_inflight_requests``: the most requests this server has routed and not yet seen end (their
    ext_proc stream open) at once; beyond it a request is answered 429 ``overloaded`` at once. 0 (the
    default) = unlimited, as before the key existed: the right limit depends on the cluster's
    capacity, so it is the operator's to set. ``retry_after_seconds``: the ``Retry-After`` of that 429.
    """

    max_inflight_requests: int = 0
    retry_after_seconds: int = 1


@dataclass(frozen=True)
class EngineMetricsConfig:
    """The engine load signal (docs/routing.md "Engine load signal"): every pickable engine's Prometheus page,
    scraped and blended into the load the decision reads.

    ``enabled``: scrape at all (off: local accounting alone, as before the section existed).
    ``interval_seconds``: time between scrapes of one engine. ``timeout_seconds``: bound of one
    scrape. ``stale_after_intervals``: a sample older than this many intervals counts as unknown
    (local accounting alone). ``engine``: the engines' metric names (``auto``: vLLM's, which the
    simulator uses, or SGLang's, whichever the page has). ``path`` and ``port`` (0: the endpoint's
    ``metrics_port`` metadata, else its serving port) locate the page; ``max_bytes`` caps what is read
    of it. ``queue_weight`` scales the queue term; ``queued_request_tokens`` is what one queued request
    counts (tokens) when the gateway has no request in flight to take the mean of.
    """

    enabled: bool = False
    interval_seconds: float = 0.25
    timeout_seconds: float = 1.0
    stale_after_intervals: int = 4
    engine: EngineKind = EngineKind.AUTO
    path: str = "/metrics"
    port: int = 0
    max_bytes: int = 4 * 1024 * 1024
    queue_weight: float = 0.0
    queued_request_tokens: int = 2048

    @property
    def stale_after_seconds(self) -> float:
        """Age (seconds) beyond which a sample counts as unknown."""
        return self.stale_after_intervals * self.interval_seconds


@dataclass(frozen=True)
class EnvoyHealthConfig:
    """Envoy's own view of endpoint health (docs/operations.md "Decode ejection"): its admin
    ``/clusters``, polled.

    ``admin_url``: the base URL of the admin of the Envoy this server answers (``""``: off; the chart
    sets ``http://127.0.0.1:9901``, its Envoy's loopback admin in the same pod). Every
    ``interval_seconds`` one GET bounded by ``timeout_seconds``; a host Envoy marks as failed (outlier
    ejection, active health check, EDS unhealthy) is left out of the candidates until Envoy takes it back.
    """

    admin_url: str = ""
    interval_seconds: float = 1.0
    timeout_seconds: float = 1.0


@dataclass(frozen=True)
class Config:
    """The whole configuration. ``listen``/``metrics_listen`` are ``host:port``; the admin endpoint
    (``metrics_listen``) listens on loopback unless configured otherwise. ``health_listen``: ``""``
    (off), or the ``host:port`` of a second, plaintext gRPC port serving only the health service
    (GIE's endpoint picker has one, ``--grpc-health-port``, 9003); ``listen`` serves health either way."""

    listen: str = "0.0.0.0:9002"
    metrics_listen: str = "127.0.0.1:9090"
    health_listen: str = ""
    admin: AdminConfig = field(default_factory=AdminConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    xds: XdsConfig = field(default_factory=XdsConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    engine_metrics: EngineMetricsConfig = field(default_factory=EngineMetricsConfig)
    envoy_health: EnvoyHealthConfig = field(default_factory=EnvoyHealthConfig)


_CHOICES = (Mode, HandoffMode, FailurePolicy, SourceKind, Preset, EngineKind)
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")
"""Kubernetes name syntax: a namespace (DNS label), a container port name (IANA service name,
which also needs a letter); label keys and values and object names: ``ext_proc.discovery.pods``."""


def _allowed(tp: object) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_allowed(member) for member in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, _CHOICES):
        return "one of " + ", ".join(m.value for m in tp)
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(
        tp,  # type: ignore[call-overload]
        "a list of strings",
    )


def _coerce(key: str, tp: object, value: object) -> object:
    """Convert a YAML/env/flag value to the field type ``tp`` or raise ConfigError naming ``key``."""
    if isinstance(tp, types.UnionType):
        for member in typing.get_args(tp):
            with contextlib.suppress(ConfigError):
                return _coerce(key, member, value)
        raise ConfigError(f"{key}: {value!r} is not allowed; use {_allowed(tp)}")
    if tp is HandoffMode and value in UNSUPPORTED_HANDOFFS:
        raise ConfigError(f"{key}: {value!r} is not supported: {UNSUPPORTED_HANDOFFS[str(value)]}")
    if isinstance(tp, type) and issubclass(tp, _CHOICES):
        try:
            return tp(value)
        except ValueError:
            hint = " (YAML reads an unquoted off, on, yes or no as a boolean: quote it)"
            hint = hint if isinstance(value, bool) else ""
            raise ConfigError(f"{key}: {value!r} is not allowed; use {_allowed(tp)}{hint}") from None
    if tp is bool and isinstance(value, bool):
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is int and type(value) is int:
        return value
    if tp is str and isinstance(value, str):
        return value
    is_str_list = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    if typing.get_origin(tp) is tuple and is_str_list:
        return tuple(value)  # type: ignore[arg-type]
    raise ConfigError(f"{key}: {value!r} is not allowed; use {_allowed(tp)}")


def _build(cls: type, data: Mapping[str, object], prefix: str) -> object:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; allowed keys here: {', '.join(sorted(names))}")
    values: dict[str, object] = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, {} if value is None else value, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            values[name] = _coerce(prefix + name, tp, value)
    return cls(**values)


def _check_host_port(key: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        off = " (or an empty string: off)" if key == "health_listen" else ""
        raise ConfigError(f"{key}: {value!r} is not allowed; use host:port, e.g. 0.0.0.0:9002{off}")


def validate(config: Config) -> Config:
    """Check value ranges that types alone do not capture; return ``config`` unchanged."""
    _check_host_port("listen", config.listen)
    _check_host_port("metrics_listen", config.metrics_listen)
    if config.health_listen:
        _check_host_port("health_listen", config.health_listen)
    if not 0.0 <= config.affinity.bonus <= 1.0:
        raise ConfigError(f"affinity.bonus: {config.affinity.bonus} is not allowed; use a number in [0, 1]")
    if config.load.default_max_tokens < 0:
        raise ConfigError("load.default_max_tokens: must be an integer >= 0")
    if config.load.default_max_tokens > MAX_OUTPUT_BUDGET:
        raise ConfigError(f"load.default_max_tokens: must be at most {MAX_OUTPUT_BUDGET}")
    if not config.load.default_token_capacity > 0:
        raise ConfigError("load.default_token_capacity: must be a number > 0")
    if not 0 <= config.routing.fallback_count <= 16:
        raise ConfigError("routing.fallback_count: must be an integer in [0, 16]")
    if not config.discovery.poll_interval_seconds > 0:
        raise ConfigError("discovery.poll_interval_seconds: must be a number > 0")
    for key in ("destination_header", "prefill_header"):
        name = getattr(config.routing, key)
        if not name or name != name.lower() or any(c.isspace() or c == ":" for c in name):
            raise ConfigError(f"routing.{key}: {name!r} is not allowed; use a lower-case HTTP header name")
    if config.routing.destination_header == config.routing.prefill_header:
        raise ConfigError("routing.destination_header and routing.prefill_header must differ")
    if config.discovery.prefill_cluster == config.discovery.decode_cluster:
        raise ConfigError("discovery.prefill_cluster and discovery.decode_cluster must differ")
    if config.routing.pd_threshold_tokens < 0:
        raise ConfigError("routing.pd_threshold_tokens: must be an integer >= 0")
    if config.limits.max_inflight_requests < 0:
        raise ConfigError("limits.max_inflight_requests: must be an integer >= 0 (0 = unlimited)")
    if not 1 <= config.limits.retry_after_seconds <= MAX_RETRY_AFTER:
        raise ConfigError(f"limits.retry_after_seconds: must be an integer in [1, {MAX_RETRY_AFTER}]")
    _check_auto(config.affinity.auto)
    _check_prefix(config.affinity.prefix)
    _check_handoff(config.handoff)
    _check_engine_metrics(config.engine_metrics)
    _check_envoy_health(config.envoy_health)
    _check_tls(config.tls)
    _check_kubernetes(config.discovery.kubernetes)
    _check_inferencepool(config.discovery)
    if not 0 <= config.xds.no_envoy_delay_seconds <= MAX_NO_ENVOY_DELAY:
        raise ConfigError(f"xds.no_envoy_delay_seconds: must be a number in [0, {MAX_NO_ENVOY_DELAY:g}]")
    return config


MAX_KV_BYTES_PER_TOKEN = 1 << 30
"""Upper bound of ``affinity.auto.kv_bytes_per_token`` and of the shape's product (1 GiB a token)."""


def _check_auto(auto: AutoConfig) -> None:
    key = "affinity.auto"
    if not 0 <= auto.kv_bytes_per_token <= MAX_KV_BYTES_PER_TOKEN:
        raise ConfigError(
            f"{key}.kv_bytes_per_token: must be an integer in [0, {MAX_KV_BYTES_PER_TOKEN}] "
            "(0 = from num_layers, num_kv_heads, head_dim and dtype_bytes)"
        )
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
        if not 1 <= getattr(auto, name) <= 65536:
            raise ConfigError(f"{key}.{name}: must be an integer in [1, 65536]")
    if auto.bytes_per_token() > MAX_KV_BYTES_PER_TOKEN:
        raise ConfigError(f"{key}: the model shape gives more than {MAX_KV_BYTES_PER_TOKEN} KV bytes a token")
    for name in ("same_group_gbps", "cross_group_gbps"):
        if not 1e-3 <= getattr(auto, name) <= 1e6:
            raise ConfigError(f"{key}.{name}: must be a number in [0.001, 1000000] (GB/s)")
    if auto.cross_group_gbps > auto.same_group_gbps:
        raise ConfigError(
            f"{key}.cross_group_gbps ({auto.cross_group_gbps:g}) must not exceed same_group_gbps "
            f"({auto.same_group_gbps:g}): a group's own fabric is the fast one"
        )
    for name in ("base_latency_ms", "wait_scale_ms", "prefill_ms_per_token"):
        if not 0 <= getattr(auto, name) <= 1e6:
            raise ConfigError(f"{key}.{name}: must be a number in [0, 1000000] (ms)")


MAX_PREFIX_BLOCKS = 1 << 16
"""Upper bound of ``affinity.prefix.max_blocks`` (65,536 blocks: a million tokens at 16)."""


def _check_prefix(prefix: PrefixConfig) -> None:
    key = "affinity.prefix"
    if not 1 <= prefix.block_tokens <= 4096:
        raise ConfigError(f"{key}.block_tokens: must be an integer in [1, 4096]")
    if not 1 <= prefix.max_blocks <= MAX_PREFIX_BLOCKS:
        raise ConfigError(f"{key}.max_blocks: must be an integer in [1, {MAX_PREFIX_BLOCKS}]")
    if not 0 <= prefix.weight <= 100:
        raise ConfigError(f"{key}.weight: must be a number in [0, 100] (utilisation units)")


def _check_handoff(handoff: HandoffConfig) -> None:
    via = urllib.parse.urlsplit(handoff.prefill_via)
    if handoff.prefill_via and not (
        via.scheme in ("http", "https") and via.hostname and not via.path.strip("/") and not via.query
    ):
        raise ConfigError(
            f"handoff.prefill_via: {handoff.prefill_via!r} is not allowed; use a base URL such as "
            "http://127.0.0.1:10001 (no path), or an empty string to connect to prefills directly"
        )
    if not 0 < handoff.prefill_timeout_seconds <= MAX_PREFILL_TIMEOUT:
        raise ConfigError(
            f"handoff.prefill_timeout_seconds: must be a number in (0, {MAX_PREFILL_TIMEOUT:g}]"
        )
    if not 0 < handoff.default_bootstrap_port <= 65535:
        raise ConfigError("handoff.default_bootstrap_port: must be a port in 1..65535")
    if not 0 <= handoff.eject_failed_prefill_seconds <= MAX_PREFILL_TIMEOUT:
        raise ConfigError(
            f"handoff.eject_failed_prefill_seconds: must be a number in [0, {MAX_PREFILL_TIMEOUT:g}]"
        )


def _check_engine_metrics(engine: EngineMetricsConfig) -> None:
    key = "engine_metrics"
    if not MIN_SCRAPE_INTERVAL <= engine.interval_seconds <= 60:
        raise ConfigError(f"{key}.interval_seconds: must be a number in [{MIN_SCRAPE_INTERVAL}, 60]")
    if not 0 < engine.timeout_seconds <= 60:
        raise ConfigError(f"{key}.timeout_seconds: must be a number in (0, 60]")
    if not 1 <= engine.stale_after_intervals <= 1000:
        raise ConfigError(f"{key}.stale_after_intervals: must be an integer in [1, 1000]")
    if not engine.path.startswith("/") or any(c.isspace() for c in engine.path):
        raise ConfigError(
            f"{key}.path: {engine.path!r} is not allowed; use an absolute URL path such as /metrics"
        )
    if not 0 <= engine.port <= 65535:
        raise ConfigError(f"{key}.port: must be 0 (metadata or serving port) or a port in 1..65535")
    if not 1024 <= engine.max_bytes <= 256 * 1024 * 1024:
        raise ConfigError(f"{key}.max_bytes: must be an integer in [1024, 268435456]")
    if not 0 <= engine.queue_weight <= 100:
        raise ConfigError(f"{key}.queue_weight: must be a number in [0, 100]")
    if not 0 <= engine.queued_request_tokens <= MAX_OUTPUT_BUDGET:
        raise ConfigError(f"{key}.queued_request_tokens: must be an integer in [0, {MAX_OUTPUT_BUDGET}]")


def _check_envoy_health(health: EnvoyHealthConfig) -> None:
    key = "envoy_health"
    if health.admin_url and not re.fullmatch(r"https?://[^\s/]+", health.admin_url):
        raise ConfigError(
            f"{key}.admin_url: {health.admin_url!r} is not a base URL such as http://127.0.0.1:9901 "
            "(empty: off)"
        )
    if not 0.05 <= health.interval_seconds <= 60:
        raise ConfigError(f"{key}.interval_seconds: must be a number in [0.05, 60]")
    if not 0 < health.timeout_seconds <= 60:
        raise ConfigError(f"{key}.timeout_seconds: must be a number in (0, 60]")


def _check_tls(tls: TlsConfig) -> None:
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ConfigError("tls.cert_file and tls.key_file: set both (TLS) or neither (plaintext)")
    if tls.client_ca_file and not tls.cert_file:
        raise ConfigError("tls.client_ca_file: needs tls.cert_file and tls.key_file (mutual TLS is TLS)")


def _check_kubernetes(kubernetes: KubernetesConfig) -> None:
    key = "discovery.kubernetes"
    for index, namespace in enumerate(kubernetes.namespaces):
        if not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(f"{key}.namespaces: {namespace!r} is not allowed; use namespace names")
        if namespace in kubernetes.namespaces[:index]:
            raise ConfigError(f"{key}.namespaces: {namespace!r} is listed twice")
    scheme = kubernetes.scheme()
    keys = {
        "role_label": scheme.role_label,
        "group_label": kubernetes.group_label,
        "capacity_annotation": kubernetes.capacity_annotation,
        "bootstrap_port_annotation": kubernetes.bootstrap_port_annotation,
        "metrics_port_annotation": kubernetes.metrics_port_annotation,
    }
    for name, value in keys.items():
        if not is_label_key(value):
            raise ConfigError(
                f"{key}.{name}: {value!r} is not allowed; use a Kubernetes label or annotation key "
                "such as example.com/name"
            )
    roles = [scheme.prefill_role, scheme.decode_role, scheme.both_role]
    for name, value in zip(("prefill_role", "decode_role", "both_role"), roles, strict=True):
        if not is_label_value(value):
            raise ConfigError(f"{key}.{name}: {value!r} is not allowed; use a Kubernetes label value")
    if len(set(roles)) < 3:
        values = ", ".join(map(repr, roles))
        raise ConfigError(f"{key}.prefill_role, decode_role and both_role must differ (they are {values})")
    for name in ("prefill_port", "decode_port"):
        port = getattr(scheme, name)
        if isinstance(port, int) and not 0 < port <= 65535:
            raise ConfigError(f"{key}.{name}: {port} is not allowed; use a port in 1..65535")
        if isinstance(port, str) and not (_PORT_NAME.fullmatch(port) and re.search("[a-z]", port)):
            raise ConfigError(
                f"{key}.{name}: {port!r} is not allowed; use a container port name (lower-case letters, "
                "digits and '-', at most 15, at least one letter) or a port number"
            )


def _check_inferencepool(discovery: DiscoveryConfig) -> None:
    key = "discovery.inferencepool"
    pool = discovery.inferencepool
    if discovery.source is SourceKind.INFERENCEPOOL and not pool.name:
        raise ConfigError(
            f"{key}.name: required with discovery.source inferencepool: the name of the InferencePool "
            "whose pods are the endpoints (flag --pool-name)"
        )
    if pool.name and not is_object_name(pool.name):
        raise ConfigError(
            f"{key}.name: {pool.name!r} is not allowed; use a Kubernetes object name (lower-case letters, "
            "digits, '-' and '.', at most 253)"
        )
    if pool.namespace and not _NAMESPACE.fullmatch(pool.namespace):
        raise ConfigError(
            f"{key}.namespace: {pool.namespace!r} is not allowed; use a namespace name, or an empty "
            "string for the server's own"
        )


def load_config(
    path: str | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the configuration: defaults < YAML ``path`` < ``environ`` < ``overrides``.

    ``overrides`` maps dotted keys (``"affinity.mode"``) to values, as the CLI flags give them.
    Relative ``discovery.eds_files`` (and ``discovery.kubernetes.kubeconfig`` and the ``tls`` files)
    resolve against the folder ``path`` names, lexically (symlinks not followed): a Kubernetes
    ConfigMap mount links ``config.yaml`` to ``..data/config.yaml`` and swaps ``..data`` on every
    update, so the folder the link leads to disappears.
    """
    data: dict[str, object] = {}
    base = Path.cwd()
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot read: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
        data = loaded or {}
        base = Path(os.path.abspath(path)).parent
    env = os.environ if environ is None else environ
    layered: dict[str, object] = {}
    if ENV_AFFINITY_MODE in env:
        layered["affinity.mode"] = env[ENV_AFFINITY_MODE]
    if ENV_AFFINITY_BONUS in env:
        try:
            layered["affinity.bonus"] = float(env[ENV_AFFINITY_BONUS])
        except ValueError:
            bad = env[ENV_AFFINITY_BONUS]
            raise ConfigError(
                f"{ENV_AFFINITY_BONUS} (affinity.bonus): {bad!r} is not a number in [0, 1]"
            ) from None
    if ENV_HANDOFF in env:
        layered["handoff.mode"] = env[ENV_HANDOFF]
    layered.update(overrides or {})
    for dotted, value in layered.items():
        *sections, key = dotted.split(".")
        target = data
        for depth, section in enumerate(sections):
            node = target.get(section)
            if node is None:  # absent, or an empty YAML section
                node = target[section] = {}
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(sections[: depth + 1])}: expected a mapping")
            target = node
        target[key] = value
    config = typing.cast(Config, _build(Config, data, ""))
    discovery = config.discovery
    kubeconfig = discovery.kubernetes.kubeconfig

    def resolve(name: str) -> str:
        return os.path.normpath(base / name) if name else ""

    tls = config.tls
    tls = TlsConfig(resolve(tls.cert_file), resolve(tls.key_file), resolve(tls.client_ca_file))
    discovery = dataclasses.replace(
        discovery,
        eds_files=tuple(os.path.normpath(base / f) for f in discovery.eds_files),
        kubernetes=dataclasses.replace(discovery.kubernetes, kubeconfig=resolve(kubeconfig)),
    )
    return validate(dataclasses.replace(config, discovery=discovery, tls=tls))


def as_dict(config: Config) -> dict[str, object]:
    """``config`` as plain YAML data (choices as their names, lists as lists), keys in file order:
    what ``pd-extproc check-config`` prints, and what :func:`load_config` reads back unchanged."""

    def plain(value: object) -> object:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    return typing.cast(dict[str, object], plain(config))


@dataclass(frozen=True)
class ConfigSource:
    """Where a configuration comes from, to load it again when its file changes: the file, the
    environment and the flags keep their precedence on every load (see :func:`load_config`)."""

    path: str | None = None
    overrides: Mapping[str, object] = field(default_factory=dict)
    environ: Mapping[str, str] | None = None

    def load(self) -> Config:
        """Read and validate the configuration now; raises :class:`ConfigError`."""
        return load_config(self.path, self.overrides, self.environ)
