"""The ``pd-extproc`` command line.

Its subcommands: ``serve``, ``check-config``, ``explain``, ``envoy-bootstrap``, ``sim`` and ``demo``.

``serve`` runs the router, ``check-config`` checks a file, ``explain`` asks a running server which decision
a request would get and why, ``envoy-bootstrap`` prints an Envoy bootstrap listing every pd-extproc
worker or replica behind that Envoy, ``sim`` runs a simulated engine and ``demo`` runs the demo."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path

import yaml

from ext_proc.checks import ConfigError
from ext_proc.config import Config, ConfigSource, as_dict
from ext_proc.discovery import SourceKind
from ext_proc.explain import ask, table
from ext_proc.prefix.settings import PrefixSourceKind
from ext_proc.workers import serve_one, serve_workers


def _load(source: ConfigSource) -> Config | None:
    """The configuration, or ``None`` after printing why it is invalid."""
    try:
        return source.load()
    except ConfigError as exc:
        print(f"pd-extproc: invalid configuration: {exc}", file=sys.stderr)
        return None


_FLAG_KEYS = {
    "listen": "listen",
    "metrics_listen": "metrics_listen",
    "health_listen": "health_listen",
    "discovery": "discovery.source",
    "pool_name": "discovery.inferencepool.name",
    "pool_namespace": "discovery.inferencepool.namespace",
    "affinity_mode": "affinity.mode",
    "affinity_bonus": "affinity.bonus",
    "handoff": "handoff.mode",
    "prefill_via": "handoff.prefill_via",
    "pd_threshold_tokens": "routing.pd_threshold_tokens",
    "serve_eds": "xds.serve_eds",
    "max_inflight_requests": "limits.max_inflight_requests",
    "engine_metrics": "engine_metrics.enabled",
    "engine_metrics_interval": "engine_metrics.interval_seconds",
    "envoy_admin_url": "envoy_health.admin_url",
    "shared_state": "shared_state.kind",
}
"""``serve`` flags (their argparse ``dest``) that set a configuration key to their value, when given
(``None``: not given; the switches' default is ``None`` too)."""


def _flag(dest: str) -> str:
    """The ``serve`` flag of the argparse ``dest``: ``--affinity-mode`` for ``affinity_mode``."""
    return "--" + dest.replace("_", "-")


def _serve(args: argparse.Namespace) -> int:
    given = [flag for flag in _FLAG_KEYS if getattr(args, flag) is not None]
    overrides: dict[str, object] = {_FLAG_KEYS[flag]: getattr(args, flag) for flag in given}
    origins = {_FLAG_KEYS[flag]: _flag(flag) for flag in given}
    if args.eds_file:
        overrides["discovery.eds_files"] = [str(Path(p).resolve()) for p in args.eds_file]  # relative to cwd
        origins["discovery.eds_files"] = _flag("eds_file")
    if args.kubeconfig is not None:
        overrides["discovery.kubernetes.kubeconfig"] = str(Path(args.kubeconfig).resolve())
        origins["discovery.kubernetes.kubeconfig"] = _flag("kubeconfig")
    source = ConfigSource(args.config, overrides, origins=origins)
    config = _load(source)
    if config is None:
        return 2
    if args.workers == 1:
        return serve_one(config, source)
    return serve_workers(config, source, args.workers, args.log_level)


def _workers(value: str) -> int:
    """``--workers``: a whole number from 1 to 64."""
    try:
        workers = int(value)
    except ValueError:
        workers = 0
    if not 1 <= workers <= 64:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of workers from 1 to 64")
    return workers


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the ext_proc routing server")
    serve.add_argument(
        "--config",
        help="YAML configuration file (every key optional); watched: a changed affinity section "
        "(mode, bonus, auto) takes effect at once",
    )
    serve.add_argument("--listen", help="gRPC host:port (config key listen)")
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="worker processes sharing their bookings over NATS (a private nats-server on loopback unless "
        "shared_state.nats.url names one); worker i listens on the listen, metrics_listen and health_listen "
        "ports + i; 1 (default): this process serves alone",
    )
    serve.add_argument(
        "--shared-state",
        choices=["local", "nats"],
        help="local: route on this process's own bookings; nats: share them with the other replicas over "
        "NATS (shared_state.kind; the URL from shared_state.nats.url or PD_EXTPROC_NATS_URL)",
    )
    serve.add_argument("--metrics-listen", help="admin/metrics host:port (config key metrics_listen)")
    serve.add_argument(
        "--health-listen",
        help="host:port of a second, plaintext gRPC port serving only health (GIE's --grpc-health-port); "
        "'' = off (health_listen)",
    )
    serve.add_argument(
        "--eds-file", action="append", help="EDS file to watch; repeatable (discovery.eds_files)"
    )
    serve.add_argument(
        "--discovery",
        help="files | kubernetes | inferencepool: where endpoints come from (discovery.source)",
    )
    serve.add_argument(
        "--kubeconfig",
        help="kubeconfig file for --discovery kubernetes or inferencepool (discovery.kubernetes.kubeconfig)",
    )
    serve.add_argument(
        "--pool-name",
        help="the InferencePool whose pods are the endpoints, for --discovery inferencepool "
        "(discovery.inferencepool.name)",
    )
    serve.add_argument(
        "--pool-namespace",
        help="its namespace; '' = pd-extproc's own (discovery.inferencepool.namespace)",
    )
    serve.add_argument("--affinity-mode", help="off | prefer | strict | auto (affinity.mode)")
    serve.add_argument("--affinity-bonus", type=float, help="prefer-mode slack in [0, 1] (affinity.bonus)")
    serve.add_argument(
        "--handoff", help="sidecar | kv-transfer-params | sglang-bootstrap | vllm-mooncake (handoff.mode)"
    )
    serve.add_argument(
        "--prefill-via",
        help="base URL of Envoy's prefill-leg listener, e.g. http://127.0.0.1:10001; '' = direct "
        "(handoff.prefill_via)",
    )
    serve.add_argument(
        "--pd-threshold-tokens",
        type=int,
        help="prompts below this many tokens go decode-only (routing.pd_threshold_tokens)",
    )
    serve.add_argument(
        "--max-inflight-requests",
        type=int,
        help="requests in flight beyond which new ones get 429 overloaded; 0 = unlimited "
        "(limits.max_inflight_requests)",
    )
    serve.add_argument(
        "--engine-metrics",
        action="store_true",
        default=None,
        help="scrape the engines' /metrics and blend their load into routing (engine_metrics.enabled)",
    )
    serve.add_argument(
        "--engine-metrics-interval",
        type=float,
        help="seconds between scrapes of one engine (engine_metrics.interval_seconds)",
    )
    serve.add_argument(
        "--envoy-admin-url",
        help="poll this Envoy admin's /clusters and leave out the hosts it marks failed, e.g. "
        "http://127.0.0.1:9901; empty = off (envoy_health.admin_url)",
    )
    serve.add_argument(
        "--serve-eds",
        action="store_true",
        default=None,
        help="serve the prefill/decode endpoints to Envoy over ADS, for envoy/envoy-ads.yaml (xds.serve_eds)",
    )
    serve.set_defaults(func=_serve)


def _tokenizer_problem(config: Config) -> str | None:
    """Why ``affinity.prefix.tokenizer`` does not load; ``None`` when it does or none is used."""
    from ext_proc.tokenize.folder import (  # the tokenizer libraries: when used
        TokenizerLoadError,
        check_folder,
    )

    prefix = config.affinity.prefix
    if not (prefix.enabled and prefix.tokenizer):
        return None
    try:
        check_folder(prefix.tokenizer)
    except TokenizerLoadError as exc:
        return (
            f"affinity.prefix.tokenizer: {exc} on this machine (serve would run with no tokenizer: every "
            "text prompt routed on its text and counted in "
            'pd_extproc_tokenize_fallbacks_total{reason="no_tokenizer"})'
        )
    return None


def _block_size_note(config: Config) -> str | None:
    """What ``affinity.prefix.block_tokens`` means with the ``kv-events`` source; ``None`` with another."""
    prefix = config.affinity.prefix
    if not (prefix.enabled and prefix.source == PrefixSourceKind.KV_EVENTS):
        return None
    return (
        f"affinity.prefix.block_tokens ({prefix.block_tokens}) is the kv-events index's block size only "
        "until the engines' events give theirs: the first size heard is the pool's, and an engine whose "
        "events are of another is named in serve's log and in /healthz (kv_events.unusable)"
    )


def _missing_eds_files(config: Config) -> list[str]:
    """The ``discovery.eds_files`` that are not files on this machine, when they are the source."""
    discovery = config.discovery
    if discovery.source is not SourceKind.FILES:
        return []
    return [path for path in discovery.eds_files if not Path(path).is_file()]


def _check_config(args: argparse.Namespace) -> int:
    """``check-config``: 2 for an invalid configuration (nothing printed but why); else the effective
    configuration on stdout, and 1 when an EDS file it reads is missing here (each named on stderr;
    ``serve`` keeps running without it, warns and polls until it appears), 0 when none is."""
    config = _load(ConfigSource(args.config))
    if config is None:
        return 2
    problem = _tokenizer_problem(config)
    if problem is not None:  # a folder mounted only where pd-extproc runs is not an invalid configuration
        print(f"pd-extproc: warning: {problem}", file=sys.stderr)
    missing = _missing_eds_files(config)
    for path in missing:
        print(
            f"pd-extproc: error: discovery.eds_files: {path}: no such file (serve would start without its "
            "endpoints, warn and poll until it appears)",
            file=sys.stderr,
        )
    verdict = "names an EDS file that is missing here" if missing else "is valid"
    print(f"# {args.config} {verdict}. Effective configuration (defaults and environment applied):")
    note = _block_size_note(config)
    if note is not None:
        print(f"# {note}")
    print(yaml.safe_dump(as_dict(config), sort_keys=False), end="")
    return 1 if missing else 0


def _add_check_config(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser(
        "check-config",
        help="validate and print the effective configuration",
    )
    check.add_argument("--config", required=True, help="YAML configuration file to check")
    check.set_defaults(func=_check_config)


def _explain(args: argparse.Namespace) -> int:
    """``explain``: 0 with the report printed; 1 when the server refuses or cannot be asked (why: stderr)."""
    raw = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    try:
        status, data = ask(args.admin, raw, args.path, args.limit)
    except OSError as exc:
        print(f"pd-extproc: explain: cannot ask {args.admin}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        failure = data.get("error", {})
        message = failure.get("message", data) if isinstance(failure, dict) else failure
        print(f"pd-extproc: explain: {args.admin} answered {status}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else table(data))
    return 0


def _add_explain(subparsers: argparse._SubParsersAction) -> None:
    explain = subparsers.add_parser(
        "explain",
        help="the pair a running server would pick now, and why",
    )
    explain.add_argument("body", nargs="?", default="-", help="the request's JSON body: a file, or - (stdin)")
    explain.add_argument(
        "--admin",
        default="http://127.0.0.1:9090",
        help="the server's admin endpoint (metrics_listen), default http://127.0.0.1:9090",
    )
    explain.add_argument(
        "--path", default="/v1/chat/completions", help="the request's path (decides disaggregation)"
    )
    explain.add_argument("--limit", type=int, default=10, help="the cheapest pairs to list (1-1000)")
    explain.add_argument("--json", action="store_true", help="print the server's JSON report as it is")
    explain.set_defaults(func=_explain)


def _envoy_bootstrap(args: argparse.Namespace) -> int:
    from ext_proc.envoy_bootstrap import main

    return main(args.bootstrap, args.extproc_workers)


def _add_envoy_bootstrap(subparsers: argparse._SubParsersAction) -> None:
    bootstrap = subparsers.add_parser(
        "envoy-bootstrap",
        help="print an Envoy bootstrap listing many pd-extprocs",
    )
    bootstrap.add_argument("bootstrap", help="the bootstrap file, e.g. envoy/envoy.yaml")
    bootstrap.add_argument(
        "--extproc-workers",
        type=_workers,
        default=1,
        help="pd-extprocs on the bootstrap's ext_proc port and the ports after it (several: health-checked)",
    )
    bootstrap.set_defaults(func=_envoy_bootstrap)


_LAZY = {
    "sim": ("sim.cli", "run one simulated vLLM PD engine"),
    "demo": ("demo.cli", "compare affinity modes on a simulated PD cluster"),
}
"""Subcommands of the simulator (module with ``add_parser``, help line): imported only when used,
so ``serve`` never loads the simulator."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser, with every subcommand listed.

    The options of ``sim`` and ``demo`` are only registered (their modules imported) for the one named
    by ``command``, the others accept anything."""
    parser = argparse.ArgumentParser(prog="pd-extproc", description=__doc__)
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_check_config(subparsers)
    _add_explain(subparsers)
    _add_envoy_bootstrap(subparsers)
    for name, (module, help_line) in _LAZY.items():
        if name == command:
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pd-extproc`` console script; returns the exit code."""
    command = build_parser().parse_known_args(argv)[0].command  # imports no simulator module
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
