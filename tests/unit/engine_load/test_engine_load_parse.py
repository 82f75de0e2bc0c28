"""Parsing engines' /metrics pages: real vLLM (v1 and v0 names), SGLang and simulator pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.engine_load.blend import EngineSample
from ext_proc.engine_load.names import EngineKind
from ext_proc.engine_load.parse import ScrapeError, parse_page
from sim.metrics import EngineMetrics

FIXTURES = Path(__file__).parent / "fixtures"
VLLM = (FIXTURES / "vllm_metrics.txt").read_bytes()  # vLLM v1, two data-parallel engines, ~75 KB
VLLM_V0 = (FIXTURES / "vllm_v0_metrics.txt").read_bytes()  # vLLM v0: gpu_cache_usage_perc
SGLANG = (FIXTURES / "sglang_metrics.txt").read_bytes()
VLLM_LORA = (FIXTURES / "vllm_lora_metrics.txt").read_bytes()  # vLLM v1 with --enable-lora --max-loras 4


def test_vllm_page_sums_requests_and_averages_kv_usage_over_engines() -> None:
    # engine 0: 14 running, 3 waiting, 0.6234 usage; engine 1: 11, 0, 0.4410; prefix-cache counters and
    # the time-to-first-token histograms' sums and counts summed
    sample = parse_page(VLLM, EngineKind.AUTO)
    assert sample == EngineSample(
        running=25.0,
        waiting=3.0,
        kv_usage=pytest.approx(0.5322),
        prefix_queries=pytest.approx(8.645014528139366e06 + 7.276590425264394e06),
        prefix_hits=pytest.approx(2.3106338676150874e06 + 2.391090274556218e06),
        ttft_sum=pytest.approx(54.590179140745036 + 62.68755896512823),
        ttft_count=400.0,
        lora_adapters=frozenset(),  # served without LoRA: max_lora 0, no adapters
        max_lora=0,
    )
    assert parse_page(VLLM, EngineKind.VLLM) == sample


@pytest.mark.parametrize("kind", [EngineKind.AUTO, EngineKind.VLLM])
def test_the_latest_lora_info_gives_the_adapters_running_and_waiting(kind: EngineKind) -> None:
    # four label sets on the page, set at different times: the latest holds sql-lora and chat-lora
    # running, tone-lora waiting
    sample = parse_page(VLLM_LORA, kind)
    assert sample.lora_adapters == frozenset({"sql-lora", "chat-lora", "tone-lora"})
    assert sample.max_lora == 4
    assert (sample.running, sample.waiting, sample.kv_usage) == (6.0, 2.0, 0.3125)


def test_sglang_pages_have_no_lora_info() -> None:
    assert parse_page(SGLANG, EngineKind.AUTO).lora_adapters is None


def test_lora_lists_ignore_blanks_and_spaces() -> None:
    page = (
        b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
        b'vllm:lora_requests_info{max_lora="2",running_lora_adapters=" a, ,b",waiting_lora_adapters=","} 5\n'
    )
    sample = parse_page(page, EngineKind.VLLM)
    assert (sample.lora_adapters, sample.max_lora) == (frozenset({"a", "b"}), 2)


@pytest.mark.parametrize("max_lora", [b"", b"-1", b"two", b"1.5"])
def test_a_bad_max_lora_is_a_parse_error(max_lora: bytes) -> None:
    page = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
    page += b'vllm:lora_requests_info{max_lora="' + max_lora + b'",running_lora_adapters="a"} 5\n'
    with pytest.raises(ScrapeError) as error:
        parse_page(page, EngineKind.VLLM)
    assert error.value.reason == "parse"


def test_older_vllm_names_are_read() -> None:
    expected = EngineSample(running=7.0, waiting=2.0, kv_usage=0.35, ttft_sum=1247.3, ttft_count=3070.0)
    assert parse_page(VLLM_V0, EngineKind.VLLM) == expected


def test_sglang_page() -> None:
    expected = EngineSample(
        running=22.0, waiting=5.0, kv_usage=0.28, ttft_sum=128.61379517527874, ttft_count=300.0
    )
    assert parse_page(SGLANG, EngineKind.SGLANG) == expected
    assert parse_page(SGLANG, EngineKind.AUTO) == expected


def test_the_simulators_own_page() -> None:
    metrics = EngineMetrics("sim-llama-3-8b", lambda: 4, lambda: 1, lambda: 0.25)
    assert parse_page(metrics.render(), EngineKind.AUTO) == EngineSample(
        4.0, 1.0, 0.25, ttft_sum=0.0, ttft_count=0.0
    )


@pytest.mark.parametrize(("page", "kind"), [(SGLANG, EngineKind.VLLM), (VLLM, EngineKind.SGLANG)])
def test_another_engines_page_lacks_the_names(page: bytes, kind: EngineKind) -> None:
    with pytest.raises(ScrapeError) as error:
        parse_page(page, kind)
    assert error.value.reason == "missing"


def test_newer_kv_name_wins_and_the_first_line_counts() -> None:
    page = b"vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.2\nvllm:num_requests_waiting 0\n"
    assert parse_page(page, EngineKind.VLLM) == EngineSample(running=None, waiting=0.0, kv_usage=0.2)


def test_names_that_only_start_like_a_wanted_one_are_not_read() -> None:
    page = (
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 50\n'
        b"vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n# vllm:num_requests_waiting 99\n"
    )
    assert parse_page(page, EngineKind.VLLM).waiting == 1.0


def test_a_ttft_sum_without_its_count_is_no_ttft() -> None:
    page = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"
    page += b"vllm:time_to_first_token_seconds_sum 3\n"
    sample = parse_page(page, EngineKind.VLLM)
    assert (sample.ttft_sum, sample.ttft_count) == (None, None)


def test_usage_above_one_is_clamped() -> None:
    page = b"sglang:token_usage 1.2\nsglang:num_queue_reqs 0\n"
    assert parse_page(page, EngineKind.SGLANG).kv_usage == 1.0


@pytest.mark.parametrize(
    "line",
    [
        b"vllm:num_requests_waiting NaN",
        b"vllm:num_requests_waiting -1",
        b"vllm:num_requests_waiting +Inf",
        b'vllm:num_requests_waiting{engine="0" 3',
        b"vllm:num_requests_waiting three",
    ],
)
def test_bad_values_and_lines_are_parse_errors(line: bytes) -> None:
    with pytest.raises(ScrapeError) as error:
        parse_page(b"vllm:kv_cache_usage_perc 0.5\n" + line + b"\n", EngineKind.VLLM)
    assert error.value.reason == "parse"


def test_an_empty_or_foreign_page_is_missing_metrics() -> None:
    for page in (b"", b"<html>not metrics</html>", b"\x00\xff" * 100):
        with pytest.raises(ScrapeError) as error:
            parse_page(page, EngineKind.AUTO)
        assert error.value.reason == "missing"


PD_DECODE = (
    b"sglang:num_running_reqs 8\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"
    b"sglang:num_decode_prealloc_queue_reqs 3\nsglang:num_decode_transfer_queue_reqs 2\n"
)
PD_PREFILL = (
    b"sglang:num_running_reqs 1\nsglang:num_queue_reqs 2\nsglang:token_usage 0.25\n"
    b"sglang:num_prefill_bootstrap_queue_reqs 4\nsglang:num_prefill_inflight_queue_reqs 1\n"
)


@pytest.mark.parametrize("kind", [EngineKind.SGLANG, EngineKind.AUTO])
@pytest.mark.parametrize(
    ("page", "waiting"),
    [
        (PD_DECODE, 6.0),  # 1 scheduled + 3 waiting for KV memory + 2 receiving their KV
        (PD_PREFILL, 7.0),  # 2 scheduled + 4 waiting for their decode + 1 sending its KV
        # older SGLang calls the bootstrap queue "prealloc"; a page with both names counts it once
        (PD_PREFILL.replace(b"bootstrap", b"prealloc"), 7.0),
        (PD_PREFILL + b"sglang:num_prefill_prealloc_queue_reqs 4\n", 7.0),
        # the PD queues alone are a waiting count too
        (b"sglang:token_usage 0.1\nsglang:num_decode_transfer_queue_reqs 5\n", 5.0),
    ],
    ids=["decode", "prefill", "prefill-older-name", "prefill-both-names", "pd-queues-only"],
)
def test_sglang_pd_queues_are_waiting_requests(page: bytes, waiting: float, kind: EngineKind) -> None:
    assert parse_page(page, kind).waiting == waiting


def test_a_page_with_pd_queues_but_no_usage_is_missing() -> None:
    with pytest.raises(ScrapeError) as error:
        parse_page(b"sglang:num_decode_transfer_queue_reqs 5\nsglang:num_queue_reqs 1\n", EngineKind.SGLANG)
    assert error.value.reason == "missing" and "sglang:num_decode_transfer_queue_reqs" in str(error.value)
