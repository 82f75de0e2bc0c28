"""pdGroups of real vLLM engines, run as a cluster behind the gateway stack of :mod:`sim.stack`.

Each pdGroup is a NixlConnector prefill (``kv_producer``) and decode (``kv_consumer``).

:func:`start_vllm_stack` checks the memory, writes the model, starts every engine at once, waits
for all of them, writes the EDS files (``token_capacity`` = the engine's KV cache in tokens) and
warms every (prefill, decode) pair up (:meth:`VllmCluster.warm_up`) before anything is measured:
vLLM's NIXL handshake, done on a pair's first transfer, gives up after a fixed 5 s, and on a
loaded machine the first transfer of a pair sometimes takes longer; the warm-up retries it
directly (not through the gateway), so the gateway's counters and the engines' transfer counters
start from pairs that have shaken hands. An engine found dead on the way (a decode whose worker
died on its first KV load, say) is an :class:`~rig.engine.EngineError` naming it, why it died and
its log's end (:meth:`~rig.engine.Engine.death`), not a refused connection. Route with
:meth:`sim.stack.Stack.route_with` (handoff ``kv-transfer-params``), exactly as on the simulator.

:func:`start_kv_events_stack` runs engines of role ``both`` instead (no connector: each prefills and
decodes its own requests), each publishing its KV-cache events on ports of its own, which the EDS
files name (``kv_events_port``, ``kv_events_replay_port``): the cluster the ``kv-events`` prefix source
is checked against.

Both say, in :attr:`VllmCluster.attention`, the engines' dtype and the attention kernels vLLM runs for
it on this CPU (:mod:`rig.attention`, asked while the engines start).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from rig.attention import AttentionPath, probe_attention
from rig.engine import BLOCK_TOKENS, KV_CACHE_GIB, MODEL_NAME, Engine, EngineError, EngineSpec, start_engine
from rig.model import KV_BYTES_PER_TOKEN, lora_folder, write_lora_adapter, write_tiny_llama
from rig.venv import VllmUnavailable, venv_python
from sim.cluster_process import EngineInfo, write_cluster_eds
from sim.gateway import free_port
from sim.stack import Stack

ENGINE_MEMORY_BYTES = int(2.6 * 2**30)
"""Memory one engine takes, measured (PSS of its three processes, 1 GiB of KV cache included)."""
KV_TOKENS = KV_CACHE_GIB * 2**30 // KV_BYTES_PER_TOKEN
"""KV cache capacity of one engine in tokens (:data:`rig.model.KV_BYTES_PER_TOKEN`: in the model's
dtype)."""
WARM_UP_ATTEMPTS = 4
WARM_UP_PROMPT = " ".join(["w1"] * 20)
DEATH_GRACE_SECONDS = 3.0
"""How long an engine that stopped answering is given to show it died before the connection's own
error stands."""


def capacity(spec: EngineSpec) -> int:
    """The KV cache of ``spec``'s engine in tokens (what EDS declares as its ``token_capacity``)."""
    return KV_TOKENS if spec.kv_blocks is None else spec.kv_blocks * BLOCK_TOKENS


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def check_memory(engines: int) -> None:
    """Raise :class:`VllmUnavailable` when ``engines`` engines do not fit in the available memory."""
    need, have = engines * ENGINE_MEMORY_BYTES, available_memory()
    if need > have:
        raise VllmUnavailable(
            f"{engines} vLLM engines need about {need / 2**30:.1f} GiB of memory "
            f"({ENGINE_MEMORY_BYTES / 2**30:.1f} GiB each); {have / 2**30:.1f} GiB is available"
        )


@dataclass
class VllmCluster:
    """The running engines, in the shape :class:`sim.stack.Stack` drives.

    ``engines``, ``stop_engine``, ``stop``; ``running`` maps each live engine's address to its
    :class:`~rig.engine.Engine`."""

    engines: list[EngineInfo]
    running: dict[str, Engine]
    workdir: Path
    python: Path
    model: Path
    attention: AttentionPath
    """The engines' dtype and the attention kernels vLLM runs for it here."""
    dead: dict[str, Engine] = field(default_factory=dict)
    warm_up_attempts: dict[tuple[str, str], int] = field(default_factory=dict)
    """Attempts each (prefill, decode) pair's last warm-up took (1 = its first transfer worked)."""

    def engine(self, address: str) -> Engine:
        """The running engine at ``address``."""
        return self.running[address]

    def of_role(self, role: str) -> list[Engine]:
        """The running engines of ``role`` (``prefill`` or ``decode``)."""
        return [e for e in self.running.values() if e.spec.role == role]

    def info(self, address: str) -> EngineInfo:
        """What discovery says of the engine at ``address`` (live or dead)."""
        return next(e for e in self.engines if e.address == address)

    def group_of(self, address: str) -> str:
        """The ``pdGroupID`` of the engine at ``address`` (live or dead)."""
        return self.info(address).group

    def stop_engine(self, address: str) -> None:
        """Kill one engine like a lost node (its process group, at once); EDS is left to the caller."""
        engine = self.running.pop(address)
        engine.kill()
        self.dead[address] = engine

    async def restart(self, addresses: list[str], session: aiohttp.ClientSession) -> None:
        """Start killed engines again, all at once, and warm up their pairs.

        Same ports and roles; new NIXL engine ids."""
        engines = [
            start_engine(self.python, self.model, self.dead.pop(a).spec, self.workdir) for a in addresses
        ]
        self.running.update((e.address, e) for e in engines)
        await asyncio.gather(*(e.wait_ready() for e in engines))
        for address in addresses:
            await self.warm_up(session, only=address)

    def stop(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL)."""
        for engine in self.running.values():
            engine.stop()
        self.dead.update(self.running)
        self.running.clear()

    async def warm_up(
        self, session: aiohttp.ClientSession, only: str | None = None
    ) -> dict[tuple[str, str], int]:
        """One KV transfer for every (prefill, decode) pair; the attempts each took.

        With ``only``: every pair that engine is in; sent straight to the engines. Raises :class:`EngineError`
        when a pair never succeeds, or at once when an engine is dead (see :func:`transfer`)."""
        attempts: dict[tuple[str, str], int] = {}
        for prefill in self.of_role("prefill"):
            for decode in self.of_role("decode"):
                if only is not None and only not in (prefill.address, decode.address):
                    continue
                for attempt in range(1, WARM_UP_ATTEMPTS + 1):
                    if await transfer(session, prefill, decode):
                        attempts[prefill.address, decode.address] = attempt
                        self.warm_up_attempts[prefill.address, decode.address] = attempt
                        break
                else:
                    raise EngineError(
                        f"no KV transfer from {prefill.address} to {decode.address} in "
                        f"{WARM_UP_ATTEMPTS} attempts:\n{decode.log_tail()}"
                    )
        return attempts


async def complete(
    session: aiohttp.ClientSession, engine: Engine, body: dict[str, object], doing: str
) -> dict[str, object] | None:
    """``body`` posted to ``engine``'s ``/v1/completions``.

    The JSON answer, or ``None`` when it did not answer 200 or dropped the connection without dying (a
    freshly restarted engine on a loaded machine once did: the caller's attempts absorb it). Each post
    has a connection of its own (``Connection: close``), so no engine closing an idle keep-alive
    connection can race it. Raises :class:`EngineError` (:meth:`~rig.engine.Engine.death_error`, while
    ``doing``) when the engine is dead: it could not be reached and died (within
    :data:`DEATH_GRACE_SECONDS`), or it answered 500 and its process or log says it died; the
    connection's own error when it could not be reached and did not die."""
    try:
        async with session.post(
            f"{engine.url}/v1/completions", json=body, headers={"Connection": "close"}
        ) as response:
            if response.status == 200:
                answer = await response.json()
                return answer if isinstance(answer, dict) else None
            failed = response.status == 500
    except aiohttp.ClientConnectionError as exc:
        reason = await engine.wait_death(DEATH_GRACE_SECONDS)
        if reason is None:
            if isinstance(exc, aiohttp.ServerDisconnectedError):
                return None
            raise
        raise engine.death_error(reason, doing) from exc
    if failed and (reason := engine.death()) is not None:
        raise engine.death_error(reason, doing)
    return None


async def prefill_leg(session: aiohttp.ClientSession, prefill: Engine, text: str) -> dict[str, object] | None:
    """A prefill leg of ``text`` on ``prefill``, as pd-extproc sends it.

    The answer's ``kv_transfer_params``, or ``None`` when it did not answer 200 with them. Raises
    :class:`EngineError` when the prefill is dead (:func:`complete`)."""
    leg = {
        "model": MODEL_NAME,
        "prompt": text,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    answer = await complete(session, prefill, leg, "a prefill leg")
    params = None if answer is None else answer.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


async def transfer(session: aiohttp.ClientSession, prefill: Engine, decode: Engine) -> bool:
    """A prefill leg and the decode of its ``kv_transfer_params``, as pd-extproc sends them.

    Whether the decode answered 200 with text. Raises :class:`EngineError` when either engine is dead
    (:func:`complete`)."""
    params = await prefill_leg(session, prefill, WARM_UP_PROMPT)
    if params is None:
        return False
    body = {"model": MODEL_NAME, "prompt": WARM_UP_PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    answer = await complete(session, decode, body, f"the decode of a KV transfer from {prefill.spec.name}")
    choices = None if answer is None else answer.get("choices")
    return isinstance(choices, list) and bool(choices) and bool(choices[0].get("text"))


async def start_vllm_cluster(
    groups: list[str],
    workdir: Path,
    kv_load_failure_policy: str = "fail",
    adapters: Mapping[str, tuple[str, ...]] | None = None,
    otlp_traces_endpoint: str | None = None,
) -> VllmCluster:
    """One prefill and one decode engine per pdGroupID of ``groups``, started and waited for.

    ``kv_load_failure_policy`` on the decodes; both engines of group ``g`` serve the LoRA adapters
    ``adapters[g]`` (none when absent); every engine exports its spans to ``otlp_traces_endpoint`` when
    given. Logs under ``workdir``. Raises :class:`~rig.venv.VllmUnavailable` (no environment, too little
    memory) or :class:`~rig.engine.EngineError`; nothing is left running then."""
    specs = [
        EngineSpec(
            role,
            group,
            free_port(),
            free_port(),
            kv_load_failure_policy if role == "decode" else "fail",
            adapters=(adapters or {}).get(group, ()),
            otlp_traces_endpoint=otlp_traces_endpoint,
        )
        for group in groups
        for role in ("prefill", "decode")
    ]
    return await start_engines(specs, workdir)


async def start_engines(specs: list[EngineSpec], workdir: Path) -> VllmCluster:
    """The engines of ``specs``, started at once and waited for.

    Logs, the model and the adapters the specs name under ``workdir``. Raises
    :class:`~rig.venv.VllmUnavailable` (no environment, too little memory) or
    :class:`~rig.engine.EngineError`; nothing is left running then."""
    python = venv_python()
    if python is None:
        raise VllmUnavailable("vLLM for CPU is not installed: run `make vllm-env` (about 3.7 GB, 10-15 min)")
    check_memory(sum(s.data_parallel_size for s in specs))  # each rank an engine core of its own
    model = write_tiny_llama(workdir / "model")
    for name in sorted({name for spec in specs for name in spec.adapters}):
        write_lora_adapter(lora_folder(model, name), model)
    running: dict[str, Engine] = {}
    probe = asyncio.create_task(probe_attention(python))
    try:
        for spec in specs:
            running[spec.address] = start_engine(python, model, spec, workdir)
        await asyncio.gather(*(engine.wait_ready() for engine in running.values()))
        attention = await probe
    except BaseException:
        probe.cancel()
        for engine in running.values():
            engine.stop()
        raise
    infos = [
        EngineInfo(
            s.address,
            s.role,
            s.group,
            capacity(s),
            kv_events_port=s.kv_events_port,
            kv_events_replay_port=s.kv_replay_port,
            data_parallel_size=s.data_parallel_size,
        )
        for s in specs
    ]
    return VllmCluster(infos, running, workdir, python, model, attention)


async def start_vllm_stack(
    groups: list[str],
    kv_load_failure_policy: str = "fail",
    adapters: Mapping[str, tuple[str, ...]] | None = None,
    otlp_traces_endpoint: str | None = None,
) -> Stack:
    """A vLLM cluster as a :class:`~sim.stack.Stack`: EDS files written, every pair warmed up.

    The cluster is :func:`start_vllm_cluster`'s (with the same arguments); no gateway yet:
    :meth:`~sim.stack.Stack.route_with` starts one."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-vllm-"))
    cluster = await start_vllm_cluster(
        groups, workdir, kv_load_failure_policy, adapters, otlp_traces_endpoint
    )
    prefill_eds, decode_eds = workdir / "prefill.json", workdir / "decode.json"
    try:
        write_cluster_eds(cluster.engines, prefill_eds, decode_eds)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await cluster.warm_up(session)
    except BaseException:
        cluster.stop()
        raise
    return Stack(cluster, workdir, prefill_eds, decode_eds)


def kv_events_spec(
    group: str, int_block_hashes: bool = True, kv_blocks: int | None = None, data_parallel_size: int = 1
) -> EngineSpec:
    """An engine of role ``both`` in ``group`` publishing its KV-cache events.

    No connector; a replay socket; its blocks named by integers or (``int_block_hashes`` false) 32 raw
    bytes; its KV cache ``kv_blocks`` blocks (``None``: the default), of ``data_parallel_size`` ranks;
    every port free (for ranks past the first, the ports after them: most likely free too)."""
    return EngineSpec(
        "both",
        group,
        free_port(),
        free_port(),
        kv_events_port=free_port(),
        kv_replay_port=free_port(),
        int_block_hashes=int_block_hashes,
        kv_blocks=kv_blocks,
        data_parallel_size=data_parallel_size,
    )


async def start_kv_events_stack(specs: list[EngineSpec]) -> Stack:
    """The engines of ``specs`` (:func:`kv_events_spec`) as a :class:`~sim.stack.Stack`.

    Their EDS files written (each in both clusters, with its ``kv_events_port`` and
    ``kv_events_replay_port``); no gateway yet."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-vllm-events-"))
    cluster = await start_engines(specs, workdir)
    prefill_eds, decode_eds = workdir / "prefill.json", workdir / "decode.json"
    try:
        write_cluster_eds(cluster.engines, prefill_eds, decode_eds)
    except BaseException:
        cluster.stop()
        raise
    return Stack(cluster, workdir, prefill_eds, decode_eds)
