"""A stand-in for a vLLM engine's API server whose decode dies on its first KV load, as vLLM for CPU's
bfloat16 decode does on a CPU with AMX (issue 33): ``tests/e2e/test_rig.py`` starts it through
:func:`rig.engine.start_engine` in place of the vLLM environment's Python.

Run with an engine's arguments (``-m vllm.entrypoints.openai.api_server --port P
--kv-transfer-config {...} ...``), it reads ``--port`` and the ``kv_role`` of ``--kv-transfer-config``
and serves on 127.0.0.1: ``GET /health`` answers 200; ``POST /v1/completions`` on a prefill
(``kv_producer``) answers 200 with ``kv_transfer_params``; on a decode (``kv_consumer``) it dies as
the environment's ``STANDIN_DEATH`` says:

- ``sigill``: the process kills itself with SIGILL before answering (core dumps off);
- ``worker``: it logs vLLM's line for a worker killed by SIGILL and answers 500 ``EngineCore
  encountered an issue``, as vLLM's API server does once its engine core is dead;
- ``drop-once``: it does not die: it closes its first decode's connection without an answer (as a
  restarted engine once did at load), then decodes.

Standard library only; it logs to stdout as vLLM does (the rig sends that to the engine's log).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORKER_DIED = (
    "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly (exit code: -4), "
    "shutting down executor."
)
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "code": 500,
    }
}


def option(name: str) -> str:
    """The value after ``name`` on the command line."""
    return sys.argv[sys.argv.index(name) + 1]


class Handler(BaseHTTPRequestHandler):
    """The engine's two endpoints, as its role and ``STANDIN_DEATH`` say."""

    role = json.loads(option("--kv-transfer-config"))["kv_role"]
    death = os.environ["STANDIN_DEATH"]
    dropped = False

    def answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.answer(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/completions":
            self.answer(404, {})
        elif self.role == "kv_producer":
            params = {"remote_block_ids": [[0]], "remote_engine_id": "standin", "remote_request_id": "r"}
            self.answer(200, {"choices": [{"text": "w1"}], "kv_transfer_params": params})
        elif self.death == "drop-once":
            if not Handler.dropped:
                Handler.dropped = True
                self.close_connection = True
                return
            self.answer(200, {"choices": [{"text": "w2"}]})
        elif self.death == "sigill":
            print("INFO loading the KV of a remote prefill", flush=True)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.kill(os.getpid(), signal.SIGILL)
        else:
            print(WORKER_DIED, flush=True)
            self.answer(500, ENGINE_DEAD)

    def log_message(self, format: str, *args: object) -> None:
        print(f"INFO {self.address_string()} {format % args}", flush=True)


def main() -> None:
    """Serve until killed."""
    server = ThreadingHTTPServer(("127.0.0.1", int(option("--port"))), Handler)
    print(f"INFO stand-in {Handler.role} engine serving on port {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
