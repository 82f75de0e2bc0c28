"""The ``sim`` subcommand: run one simulated engine until SIGINT/SIGTERM.

``add_parser(subparsers)`` registers it on the ``pd-extproc`` CLI; ``python -m sim`` runs
:func:`main`, the same options without a subcommand. ``--profile`` names the engine profile
(:mod:`sim.profiles`) whose costs are the defaults; one ``--option`` exists per field of
:class:`~sim.config.TimingConfig` and :class:`~sim.config.KvConfig` (``--decode-step-ms`` ...), each
overriding the profile's value when given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys

from sim.config import (
    DEFAULT_MODEL,
    KV_EVENT_ENCODINGS,
    KV_EVENT_HASH_FORMS,
    ROLES,
    EngineConfig,
    KvConfig,
    KvEventsConfig,
    TimingConfig,
)
from sim.profiles import DEFAULT_PROFILE, load_profile, profile_names

log = logging.getLogger(__name__)
_MODELS: dict[type, str] = {
    TimingConfig: "timing model (durations in model ms, see --time-scale)",
    KvConfig: "KV transfer model and handoff timeouts (model s)",
}


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=ROLES, help="engine role")
    parser.add_argument("--group", required=True, help="this engine's pdGroupID")
    parser.add_argument("--host", default="127.0.0.1", help="listen host (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8000, help="listen port, 0 = ephemeral (default %(default)s)"
    )
    parser.add_argument("--advertise-host", help="host reported to peers and in headers (default: --host)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="served model name (default %(default)s)")
    parser.add_argument(
        "--eds-file", action="append", default=[], help="EDS file giving engines' groups; repeatable"
    )
    parser.add_argument("--eds-namespace", default="pd", help="EDS metadata namespace (default %(default)s)")
    parser.add_argument(
        "--prefill-timeout-s", type=float, default=300.0, help="sidecar prefill call timeout (s)"
    )
    parser.add_argument("--shutdown-timeout-s", type=float, default=5.0, help="drain time on shutdown (s)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=profile_names(),
        help="engine profile giving the defaults of the options below (default %(default)s)",
    )
    events = parser.add_argument_group("KV-cache events (vLLM's --kv-events-config; needs prefix caching)")
    events.add_argument(
        "--kv-events-port",
        type=int,
        help="publish KV-cache events on this port, 0 = ephemeral (default: none)",
    )
    events.add_argument(
        "--kv-events-replay-port", type=int, help="the replay socket's port, 0 = ephemeral (default: none)"
    )
    events.add_argument(
        "--kv-events-encoding",
        default="array",
        choices=KV_EVENT_ENCODINGS,
        help="array: vLLM 0.32's tagged arrays; map: newer vLLM's maps; mixed: map events in an array "
        "batch (default %(default)s)",
    )
    events.add_argument(
        "--kv-events-hashes",
        default="int",
        choices=KV_EVENT_HASH_FORMS,
        help="block hashes as 64-bit unsigned integers or 32 bytes (default %(default)s)",
    )
    for model, title in _MODELS.items():
        group = parser.add_argument_group(title)
        for f in dataclasses.fields(model):
            kind = {"action": argparse.BooleanOptionalAction} if isinstance(f.default, bool) else {}
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                **(kind or {"type": type(f.default)}),
                help=f"{f.metadata['help']} (default: the profile's; {DEFAULT_PROFILE} {f.default})",
            )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``sim`` subcommand; its handler (``args.func``) returns the exit code."""
    parser = subparsers.add_parser("sim", help="run one simulated vLLM PD engine", description=__doc__)
    _add_options(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of parsed options.

    The profile's costs, overridden by the options given; raises ``ValueError`` if invalid."""
    profile = load_profile(args.profile)
    models = [
        dataclasses.replace(
            base,
            **{
                f.name: getattr(args, f.name)
                for f in dataclasses.fields(base)
                if getattr(args, f.name) is not None
            },
        )
        for base in (profile.timing, profile.kv)
    ]
    return EngineConfig(
        role=args.role,
        group=args.group,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        model=args.model,
        eds_files=tuple(args.eds_file),
        eds_namespace=args.eds_namespace,
        timing=models[0],
        kv=models[1],
        prefill_timeout_s=args.prefill_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        access_log=args.access_log,
        kv_events=None
        if args.kv_events_port is None
        else KvEventsConfig(
            args.kv_events_port, args.kv_events_replay_port, args.kv_events_encoding, args.kv_events_hashes
        ),
    )


async def serve(config: EngineConfig) -> None:
    """Run one engine until SIGINT or SIGTERM, then shut it down gracefully."""
    from sim.server import start_engine

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    running = await start_engine(config)
    log.info("sim engine %s role=%s group=%r listening", running.address, config.role, config.group)
    try:
        await stop.wait()
    finally:
        log.info("sim engine %s shutting down", running.address)
        await running.stop()


def run(args: argparse.Namespace) -> int:
    """Handler of the ``sim`` subcommand: 0 after a clean shutdown, 2 bad options, 1 cannot start."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"sim: invalid options: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"sim: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sim``: the ``sim`` options plus ``--log-level``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    _add_options(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
