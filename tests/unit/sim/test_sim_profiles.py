"""Engine profiles (sim.profiles): the measured costs as the calibration states them, the legacy
profile as the simulator's defaults, the n² and KV-read terms in the scheduler, ``sim --profile``."""

from __future__ import annotations

import argparse

import pytest

from sim.cli import add_parser, config_from_args
from sim.config import KvConfig, TimingConfig
from sim.engine import Scheduler, Sequence
from sim.profiles import load_profile, profile_names

LLAMA, QWEN = "h200-llama-3-8b", "h200-qwen-2.5-32b"


def test_legacy_is_the_defaults_and_measured_profiles_exist() -> None:
    assert {"legacy", LLAMA, QWEN} <= set(profile_names())
    legacy = load_profile("legacy")
    assert (legacy.timing, legacy.kv) == (TimingConfig(), KvConfig())
    with pytest.raises(ValueError, match=r"unknown profile 'h100'.*h200-llama-3-8b"):
        load_profile("h100")


@pytest.mark.parametrize(
    ("name", "prefill", "decode", "kv_bytes", "kv_tokens"),
    [
        # the calibration README's fits, as it rounds them
        (LLAMA, (3.82, 0.02518, 4.663e-7), (5.886, 0.0135, 2.963e-5), 131072, 845_638),
        (QWEN, (13.15, 0.1084, 1.123e-6), (19.95, 0.0264, 6.873e-5), 262144, 234_120),
    ],
)
def test_measured_profiles_follow_the_calibration_fits(
    name: str,
    prefill: tuple[float, float, float],
    decode: tuple[float, float, float],
    kv_bytes: int,
    kv_tokens: int,
) -> None:
    p = load_profile(name)
    a, b, c = prefill
    for n in (1024, 8192, 32768):
        assert p.timing.prefill_ms(n, 1, n * n) == pytest.approx(a + b * n + c * n * n, rel=2e-3)
    e, f, g = decode
    for batch, context in ((1, 1024), (64, 4096), (256, 1024)):
        expected = e + f * batch + g * batch * context
        assert p.timing.decode_ms(batch, batch * context) == pytest.approx(expected, rel=2e-3)
    assert p.kv.kv_bytes_per_token == kv_bytes
    # (141 GB * 0.9 - weights) / KV bytes per token: ~840k tokens for Llama-3-8B on an H200
    assert p.timing.kv_capacity_tokens == kv_tokens
    assert p.timing.max_model_len >= 126_195  # the conversation trace's longest prompt


def _run_prefill(timing: TimingConfig, prompt: int) -> float:
    """Model seconds of the steps that prefill one ``prompt``-token sequence alone."""
    s = Scheduler(timing)
    seq = Sequence("r", prompt, 1, 1, arrival=0.0)
    s.add(seq)
    s.admit(0.0)
    total = 0.0
    while seq.prefilled < prompt:
        plan = s.plan()
        assert plan is not None and plan.decode == []
        total += plan.duration_s
        s.apply(plan, total)
    return total


def test_chunked_prefill_pays_attention_once_per_pair() -> None:
    timing = load_profile(LLAMA).timing
    prompt = 20_000  # three chunks of at most 8192 tokens
    chunks = -(-prompt // timing.max_num_batched_tokens)
    expected = timing.prefill_ms(prompt, 1, prompt**2) + (chunks - 1) * timing.prefill_base_ms
    assert _run_prefill(timing, prompt) * 1e3 == pytest.approx(expected)


def test_legacy_step_costs_are_unchanged() -> None:
    t = TimingConfig()
    assert _run_prefill(t, 1000) * 1e3 == pytest.approx(3.0 + 0.05 * 1000)
    assert t.decode_ms(10, 10**6) == pytest.approx(12.0 + 0.1 * 10)


def test_decode_step_reads_every_sequence_context() -> None:
    timing = load_profile(LLAMA).timing
    s = Scheduler(timing)
    seqs = [Sequence(f"r{i}", 1000 * (i + 1), 5, 5, arrival=0.0) for i in range(2)]
    for seq in seqs:
        s.add(seq)
    s.admit(0.0)
    for seq in seqs:  # as if prefilled and one token generated
        seq.prefilled, seq.generated = seq.prompt_tokens, 1
    plan = s.plan()
    assert plan is not None and plan.decode == seqs
    assert plan.duration_s * 1e3 == pytest.approx(timing.decode_ms(2, 1001 + 2001))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", "--role", "both", "--group", "g", *argv])


def test_sim_cli_profile_gives_defaults_and_options_override() -> None:
    assert config_from_args(_parse([])).timing == TimingConfig()
    config = config_from_args(_parse(["--profile", LLAMA, "--max-batch", "8", "--cross-group-gbps", "5"]))
    measured = load_profile(LLAMA)
    assert config.timing.prefill_per_token2_ms == measured.timing.prefill_per_token2_ms
    assert config.timing.kv_capacity_tokens == measured.timing.kv_capacity_tokens
    assert config.timing.max_batch == 8 and config.kv.cross_group_gbps == 5.0
    with pytest.raises(SystemExit):
        _parse(["--profile", "h100"])
