"""``pd-extproc demo --engines vllm``: the demo's workload and table on real vLLM engines.

Two pdGroups of one NixlConnector prefill and one decode each (:func:`rig.cluster.start_vllm_stack`),
the same seeded streaming chat workload as on the simulator (shorter prompts: the tiny model takes
2,048 tokens), once per affinity mode, through the shipped Envoy and ``pd-extproc serve --handoff
kv-transfer-params``. Real engines send none of the simulator's ground-truth headers, so the
engines' own request logs (``--enable-log-requests``) say which prefill and which decode served each
request: both legs carry the one ``X-Request-Id`` the gateway made, which vLLM also puts into the
answer's ``id``. vLLM reports no remote-prefill time, so the table shows the client's TTFT (prefill
leg included) where the simulator's shows dTTFT.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tqdm import tqdm

from rig.cluster import VllmCluster, start_vllm_stack
from rig.engine import MODEL_NAME
from sim.experiment import measure
from sim.report import COLUMNS
from sim.workload import Record, plan_workload

GROUPS = ["rack-a", "rack-b"]
PROMPT_TOKENS = (512, 2048)
"""Planned prompt sizes (the gateway's estimate, 4 characters a token): 300-1,250 words, each one
token of the tiny model, within its 2,048-token context."""
OUTPUT_TOKENS = (16, 64)
_DTTFT = [i for i, (key, _, _) in enumerate(COLUMNS) if key.startswith("decode_ttft")]
COLUMNS_VLLM = (
    *COLUMNS[: _DTTFT[0]],
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    *COLUMNS[_DTTFT[-1] + 1 :],
)
"""The demo's columns with the client's TTFT in place of dTTFT."""
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_RECEIVED = re.compile(r"Received request (\S+?):")


class RequestLogs:
    """The engines' request log lines from the moment it is made: who received which request id."""

    def __init__(self, cluster: VllmCluster) -> None:
        self._cluster = cluster
        self._offsets = {a: e.log_size() for a, e in cluster.running.items()}

    def received(self) -> dict[str, list[str]]:
        """Request id (the gateway's UUID) → the addresses of the engines that received it."""
        seen: dict[str, list[str]] = {}
        for address, offset in self._offsets.items():
            engine = self._cluster.running.get(address) or self._cluster.dead[address]
            for match in _RECEIVED.finditer(engine.log_since(offset)):
                uuid = _UUID.search(match.group(1))
                if uuid is not None:
                    seen.setdefault(uuid.group(0), []).append(address)
        return seen

    def fill(self, records: list[Record]) -> None:
        """Set each record's decode and prefill engine and where its KV came from."""
        received = self.received()
        for record in records:
            uuid = _UUID.search(record.response_id or "")
            engines = received.get(uuid.group(0), []) if uuid is not None else []
            roles = {self._cluster.info(a).role: a for a in engines}
            record.decode_engine = roles.get("decode")
            record.prefill_engine = roles.get("prefill")
            if record.decode_engine is None or record.prefill_engine is None:
                record.kv_transfer = "none"
            elif self._cluster.group_of(record.decode_engine) == self._cluster.group_of(
                record.prefill_engine
            ):
                record.kv_transfer = "same_group"
            else:
                record.kv_transfer = "cross_group"


async def run_vllm_demo(
    requests: int, modes: list[str], rate: float, bonus: float, progress: Callable[[], None]
) -> tuple[str, dict[str, dict]]:
    """Run the workload once per mode on real engines.

    The engines' dtype and attention kernels (one line, :meth:`~rig.attention.AttentionPath.describe`) and
    the summaries by mode. Raises :class:`~rig.venv.VllmUnavailable` when the machine cannot run them (the
    message says why)."""
    plans = plan_workload(requests, rate, prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS)
    stack = await start_vllm_stack(GROUPS)
    cluster = stack.cluster
    assert isinstance(cluster, VllmCluster)
    results: dict[str, dict] = {}
    try:
        for mode in modes:
            logs = RequestLogs(cluster)
            results[mode] = await measure(
                stack,
                mode,
                plans,
                bonus,
                progress=progress,
                handoff="kv-transfer-params",
                model=MODEL_NAME,
                ground_truth=logs.fill,
            )
    finally:
        stack.stop()
    return cluster.attention.describe(), results


async def run_vllm(requests: int, modes: list[str], rate: float, bonus: float) -> tuple[str, dict[str, dict]]:
    """Run :func:`run_vllm_demo` with a progress bar.

    Returns what it returns: the engines' dtype and attention kernels, and the results."""
    with tqdm(total=requests * len(modes), unit="req", desc="demo on vLLM", leave=False) as bar:
        return await run_vllm_demo(requests, modes, rate, bonus, progress=lambda: bar.update(1))
