"""Engine profiles: the simulator's costs by name, from ``profiles.json`` beside this module.

A profile is a :class:`~sim.config.TimingConfig` and a :class:`~sim.config.KvConfig`: ``legacy`` is
the simulator's defaults (costs chosen, not measured); ``h200-llama-3-8b`` and ``h200-qwen-2.5-32b``
copy the fits of a GPU calibration (``profiles.json`` names its source per profile): prefill with the
attention n² term, decode steps with the per-sequence and KV-read terms, KV bytes per token. A
profile with ``hbm`` derives its KV capacity from the GPU's memory, as vLLM sizes its cache:
``(hbm_bytes * gpu_memory_utilization - weight_bytes) // kv_bytes_per_token`` tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sim.config import KvConfig, TimingConfig

PROFILES_FILE = Path(__file__).with_name("profiles.json")
DEFAULT_PROFILE = "legacy"


@dataclass(frozen=True)
class Profile:
    """One named engine profile; ``source`` says where its numbers come from."""

    name: str
    description: str
    source: str
    timing: TimingConfig
    kv: KvConfig


@cache
def _table() -> dict[str, dict]:
    return json.loads(PROFILES_FILE.read_text(encoding="utf-8"))


def profile_names() -> tuple[str, ...]:
    """The known profiles' names, in file order."""
    return tuple(_table())


def kv_capacity_tokens(hbm: dict[str, float], kv_bytes_per_token: int) -> int:
    """KV tokens that fit the HBM left after the weights at vLLM's ``gpu_memory_utilization``."""
    free = hbm["hbm_bytes"] * hbm["gpu_memory_utilization"] - hbm["weight_bytes"]
    return int(free // kv_bytes_per_token)


def load_profile(name: str) -> Profile:
    """The profile ``name``; raise ``ValueError`` naming the known ones if there is none."""
    table = _table()
    if name not in table:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(table)}")
    entry = table[name]
    kv = KvConfig(**entry["kv"])
    timing = dict(entry["timing"])
    if "hbm" in entry:
        timing["kv_capacity_tokens"] = kv_capacity_tokens(entry["hbm"], kv.kv_bytes_per_token)
    return Profile(name, entry["description"], entry["source"], TimingConfig(**timing), kv)
