"""The server's configuration: one typed, validated object built from YAML, env and flags.

- Precedence, lowest first: built-in defaults < YAML file < environment < command-line flags.
- Every key is optional. Errors raise :class:`~ext_proc.checks.ConfigError` naming the key and what it
  accepts (after the environment variable or flag that set it, when one did); the CLI turns that into
  exit code 2.
- Each section's dataclass and its ``check()`` live in a leaf beside the code that reads it:
  ``discovery/config.py``; ``affinity_config.py`` (``affinity``), with ``affinity/config.py`` and
  ``prefix/config.py``; ``handoff/config.py``; ``handoff/routing.py``; ``engine_load/config.py``;
  ``xds/config.py``; ``load.py`` (``load``, ``limits``); ``tls.py``; ``admin_config.py``;
  ``envoy_health_config.py``; ``shared/config.py``; ``tracing_config.py``; ``flow/config.py``.
- Importing it loads no compiled index, gRPC, HTTP client, tokenizer library or ZeroMQ (an import
  contract in pyproject.toml, and tests/unit/config/test_import_weight.py at run time).

This module holds the aggregate, the loading and the checks of the top-level keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ext_proc.admin_config import AdminConfig
from ext_proc.affinity_config import AffinityConfig
from ext_proc.checks import ConfigError
from ext_proc.discovery.config import DiscoveryConfig
from ext_proc.engine_load.config import EngineMetricsConfig
from ext_proc.envoy_health_config import EnvoyHealthConfig
from ext_proc.flow.config import FlowControlConfig
from ext_proc.handoff.base import UNSUPPORTED_HANDOFFS, HandoffMode
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.routing import RoutingConfig
from ext_proc.load import LimitsConfig, LoadConfig
from ext_proc.shared.config import SharedStateConfig
from ext_proc.tls import TlsConfig
from ext_proc.tracing_config import TracingConfig
from ext_proc.xds.config import XdsConfig

ENV_AFFINITY_MODE = "PD_EXTPROC_AFFINITY_MODE"
ENV_AFFINITY_BONUS = "PD_EXTPROC_AFFINITY_BONUS"
ENV_HANDOFF = "PD_EXTPROC_HANDOFF"
ENV_NATS_URL = "PD_EXTPROC_NATS_URL"
ENV_NATS_TOKEN = "PD_EXTPROC_NATS_TOKEN"
"""``shared_state.nats.url`` and ``.token`` from the environment: credentials from a Kubernetes Secret, never
in the configuration file (a ConfigMap)."""


@dataclass(frozen=True)
class Config:
    """The whole configuration: listen addresses and every section.

    ``listen``/``metrics_listen`` are ``host:port``; the admin endpoint (``metrics_listen``) listens
    on loopback unless configured otherwise. ``health_listen``: ``""`` (off), or the ``host:port`` of
    a second, plaintext gRPC port serving only the health service (GIE's endpoint picker has one,
    ``--grpc-health-port``, 9003); ``listen`` serves health either way."""

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
    shared_state: SharedStateConfig = field(default_factory=SharedStateConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)


def _allowed(tp: object) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_allowed(member) for member in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.value for m in tp)
    if typing.get_origin(tp) is dict:
        return "a mapping of names to integers"
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
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
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
    is_int_map = isinstance(value, Mapping) and all(
        isinstance(k, str) and type(v) is int for k, v in value.items()
    )
    if typing.get_origin(tp) is dict and is_int_map:
        return dict(value)  # type: ignore[arg-type]
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
    """Raise :class:`ConfigError` unless ``value`` is ``host:port`` with a port in 0..65535 (0: any)."""
    host, sep, port = value.rpartition(":")
    if sep and host and port.isdigit() and int(port) > 65535:
        raise ConfigError(
            f"{key}: {value!r} is not allowed: port {port} is out of range; use a port in 0..65535"
        )
    if not sep or not host or not port.isdigit():
        off = " (or an empty string: off)" if key == "health_listen" else ""
        raise ConfigError(f"{key}: {value!r} is not allowed; use host:port, e.g. 0.0.0.0:9002{off}")


def validate(config: Config) -> Config:
    """Check value ranges that types alone do not capture; return ``config`` unchanged.

    The listen addresses are checked here, then each section's own ``check()`` (the first error
    found is raised)."""
    _check_host_port("listen", config.listen)
    _check_host_port("metrics_listen", config.metrics_listen)
    if config.health_listen:
        _check_host_port("health_listen", config.health_listen)
    config.affinity.check()
    config.load.check()
    config.routing.check()
    config.discovery.check()
    config.limits.check()
    config.handoff.check()
    config.engine_metrics.check()
    config.envoy_health.check()
    config.tls.check()
    config.xds.check()
    config.shared_state.check()
    config.tracing.check()
    config.flow_control.check()
    return config


ENV_KEYS = {
    ENV_AFFINITY_MODE: "affinity.mode",
    ENV_AFFINITY_BONUS: "affinity.bonus",
    ENV_HANDOFF: "handoff.mode",
    ENV_NATS_URL: "shared_state.nats.url",
    ENV_NATS_TOKEN: "shared_state.nats.token",
}
"""The environment variables read, and the key each sets."""


def _named(exc: ConfigError, origins: Mapping[str, str]) -> ConfigError:
    """``exc``, its key preceded by the variable or flag that set it (``PD_EXTPROC_AFFINITY_MODE
    (affinity.mode): …``) when ``origins`` has one for the key its message starts with."""
    key, colon, rest = str(exc).partition(":")
    return ConfigError(f"{origins[key]} ({key}){colon}{rest}") if colon and key in origins else exc


def load_config(
    path: str | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    origins: Mapping[str, str] | None = None,
) -> Config:
    """Build the configuration: defaults < YAML ``path`` < ``environ`` < ``overrides``.

    ``overrides`` maps dotted keys (``"affinity.mode"``) to values, as the CLI flags give them;
    ``origins`` maps some of them to where they came from (the flag, ``--affinity-mode``). An error
    about a key set by a variable of :data:`ENV_KEYS` or an override with an origin names that
    variable or flag first, then the key.
    Relative ``discovery.eds_files`` (and ``discovery.kubernetes.kubeconfig``, the ``tls`` files and
    those of ``shared_state.nats``)
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
    named: dict[str, str] = {}
    for variable, dotted in ENV_KEYS.items():
        if variable in env:
            layered[dotted], named[dotted] = env[variable], variable
    if ENV_AFFINITY_BONUS in env:  # a number as YAML gives one; else refused naming the variable
        with contextlib.suppress(ValueError):
            layered["affinity.bonus"] = float(env[ENV_AFFINITY_BONUS])
    for dotted, value in (overrides or {}).items():
        layered[dotted] = value
        named.pop(dotted, None)
        if origins and dotted in origins:
            named[dotted] = origins[dotted]
    try:
        return _layered(data, layered, base)
    except ConfigError as exc:
        raise _named(exc, named) from None


def _layered(data: dict[str, object], layered: Mapping[str, object], base: Path) -> Config:
    """The validated configuration of the YAML ``data`` with the ``layered`` dotted keys set over it,
    relative paths resolved against ``base``; raises :class:`ConfigError` naming the key."""
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
    nats = config.shared_state.nats
    nats = dataclasses.replace(
        nats,
        creds_file=resolve(nats.creds_file),
        tls=dataclasses.replace(
            nats.tls, ca=resolve(nats.tls.ca), cert=resolve(nats.tls.cert), key=resolve(nats.tls.key)
        ),
    )
    shared_state = dataclasses.replace(config.shared_state, nats=nats)
    return validate(dataclasses.replace(config, discovery=discovery, tls=tls, shared_state=shared_state))


def as_dict(config: Config) -> dict[str, object]:
    """``config`` as plain YAML data, keys in file order.

    Choices appear as their names, lists as lists: what ``pd-extproc check-config`` prints, and what
    :func:`load_config` reads back unchanged."""

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
    """Where a configuration comes from, to load it again when its file changes.

    The file, the environment and the flags keep their precedence on every load (see
    :func:`load_config`)."""

    path: str | None = None
    overrides: Mapping[str, object] = field(default_factory=dict)
    environ: Mapping[str, str] | None = None
    origins: Mapping[str, str] = field(default_factory=dict)

    def load(self) -> Config:
        """Read and validate the configuration now; raises :class:`ConfigError`."""
        return load_config(self.path, self.overrides, self.environ, self.origins)
