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
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from sim.config import KvConfig, TimingConfig

PROFILES_FILE = Path(__file__).with_name("profiles.json")
DEFAULT_PROFILE = "legacy"
MEASURED_PROFILE = "h200-llama-3-8b"
"""The profile the demo and the trace replay run on by default: costs measured on a GPU."""


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


def smaller(timing: TimingConfig) -> TimingConfig:
    """A smaller, slower decode engine than ``timing``.

    Half the KV cache and batch, a third longer fixed decode step (for the legacy profile, the old demo's
    small decodes)."""
    return replace(
        timing,
        kv_capacity_tokens=timing.kv_capacity_tokens // 2,
        max_batch=timing.max_batch // 2,
        decode_step_ms=timing.decode_step_ms * 4 / 3,
    )


def engines_of(
    profile: str, cpu_tier_tokens: int = 0, kv_tokens: int | None = None
) -> tuple[TimingConfig, TimingConfig, KvConfig]:
    """The large engines' timing, the small decodes' (:func:`smaller`) and the KV model of ``profile``.

    Every engine caches prefixes and has a CPU KV tier of ``cpu_tier_tokens`` (0: none), the large ones a
    KV cache of ``kv_tokens`` (``None``: the profile's)."""
    measured = load_profile(profile)
    large = replace(measured.timing, enable_prefix_caching=True, cpu_kv_capacity_tokens=cpu_tier_tokens)
    small = smaller(large)
    if kv_tokens is not None:
        large = replace(large, kv_capacity_tokens=kv_tokens)
    return large, small, measured.kv
