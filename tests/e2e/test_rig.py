"""The real-engine rig's own logic, without engines: the tiny model and its dtype, the engine
command, metrics parsing, the memory check, who served what from the engines' request logs, the
demo's refusals, the attention probe's failures, and a dead engine reported as such (by stand-ins for
vLLM engines, ``tests/support/vllm_standin.py``). (The engines themselves run in ``make test-vllm``.)"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from ext_proc.discovery.eds import load_eds_file
from rig import cluster as rig_cluster
from rig.attention import AttentionPath, probe_attention
from rig.cluster import KV_TOKENS, VllmCluster, capacity, check_memory, kv_events_spec
from rig.demo import RequestLogs
from rig.engine import (
    BLOCK_TOKENS,
    Engine,
    EngineError,
    EngineSpec,
    engine_command,
    engine_environment,
    parse_metrics,
    received_adapters,
    start_engine,
)
from rig.model import (
    DTYPE,
    HIDDEN_SIZE,
    LAYERS,
    LORA_RANK,
    WORDS,
    lora_folder,
    prompt,
    vocabulary,
    write_lora_adapter,
    write_tiny_llama,
)
from rig.venv import VllmUnavailable
from sim.cluster_process import EngineInfo, write_cluster_eds
from sim.gateway import free_port
from sim.workload import Record, RequestPlan

STANDIN = Path(__file__).resolve().parents[1] / "support" / "vllm_standin.py"
NOT_ASKED = AttentionPath(DTYPE, None, None, "not asked")


def test_a_prompt_of_n_words_is_n_tokens_of_the_vocabulary(tmp_path):
    folder = write_tiny_llama(tmp_path / "model")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert vocab == vocabulary() and config["vocab_size"] == len(vocab)
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 64
    words = prompt(300, seed=3).split()
    assert len(words) == 300 and set(words) <= set(WORDS) and prompt(300, 3) != prompt(300, 4)
    assert all(word in vocab for word in ("user", "assistant", ":"))  # the chat template's words


def test_the_engines_run_float32_and_the_kv_capacity_follows_its_four_bytes(tmp_path):
    """bfloat16 takes vLLM CPU's amx attention on an AMX CPU, where a decode dies after a KV load."""
    config = json.loads((write_tiny_llama(tmp_path / "model") / "config.json").read_text())
    command = engine_command(Path("p"), tmp_path, EngineSpec("decode", "a", 1, 2), nice=0)
    assert DTYPE == config["torch_dtype"] == command[command.index("--dtype") + 1] == "float32"
    # K and V of 2 layers of 128 float32 values a token: 2 KiB; 1 GiB of KV cache holds 2**19 tokens.
    assert KV_TOKENS == 524_288


def test_an_engine_starts_as_a_user_starts_vllm_with_its_own_nixl_role_and_port(tmp_path):
    spec = EngineSpec("decode", "rack-a", 8201, 5701, "recompute")
    command = engine_command(Path("/venv/bin/python"), tmp_path, spec, nice=19)
    assert command[:3] == ["nice", "-n", "19"]
    assert command[3:6] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--load-format", "dummy", "--enforce-eager"} <= set(command)
    kv = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }
    env = engine_environment(spec, base={})
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5701" and env["UCX_NET_DEVICES"] == "lo"
    assert env["UCX_TLS"] == "tcp,self,sm" and env["HF_HUB_OFFLINE"] == "1"
    assert engine_command(Path("p"), tmp_path, spec, nice=0)[0] == "p"


def test_an_engine_of_both_roles_publishing_kv_events_has_no_connector_and_its_ports_reach_eds(tmp_path):
    spec = kv_events_spec("rack-b", int_block_hashes=False, kv_blocks=48)
    command = engine_command(Path("p"), tmp_path, spec, nice=0)
    assert "--kv-transfer-config" not in command
    assert json.loads(command[command.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{spec.kv_events_port}",
        "replay_endpoint": f"tcp://*:{spec.kv_replay_port}",
        "topic": "",
    }
    assert command[command.index("--num-gpu-blocks-override") + 1] == "48"
    env = engine_environment(spec, base={})
    assert env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "0" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert engine_environment(kv_events_spec("rack-a"), base={})["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == "1"
    assert capacity(spec) == 48 * BLOCK_TOKENS
    ports = {"kv_events_port": spec.kv_events_port, "kv_events_replay_port": spec.kv_replay_port}
    info = EngineInfo(spec.address, spec.role, spec.group, capacity(spec), **ports)
    write_cluster_eds([info], tmp_path / "p.json", tmp_path / "d.json")
    for path in ("p.json", "d.json"):
        (listed,) = load_eds_file(tmp_path / path).endpoints
        assert (listed.address, listed.kv_events_port, listed.kv_events_replay_port) == (
            spec.address,
            spec.kv_events_port,
            spec.kv_replay_port,
        )


def test_an_engine_of_several_data_parallel_ranks_starts_them_behind_one_server_and_says_so_in_eds(tmp_path):
    spec = kv_events_spec("rack-dp", data_parallel_size=2)
    command = engine_command(Path("p"), tmp_path, spec, nice=0)
    assert command[command.index("--data-parallel-size") + 1] == "2"
    assert "--data-parallel-size" not in engine_command(Path("p"), tmp_path, kv_events_spec("rack-a"), nice=0)
    info = EngineInfo(spec.address, spec.role, spec.group, capacity(spec), data_parallel_size=2)
    write_cluster_eds([info], tmp_path / "p.json", tmp_path / "d.json")
    assert load_eds_file(tmp_path / "d.json").endpoints[0].data_parallel_size == 2


def test_a_lora_adapter_is_written_in_peft_layout_and_served_with_its_own_rank(tmp_path):
    """The adapter's safetensors file, read back by its format: header length, JSON header, float32 data."""
    model = write_tiny_llama(tmp_path / "model")
    folder = write_lora_adapter(lora_folder(model, "ad1"), model)
    assert folder == tmp_path / "lora-ad1"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == (
        "LORA",
        LORA_RANK,
        ["q_proj", "v_proj"],
    )
    blob = (folder / "adapter_model.safetensors").read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    assert len(header) == LAYERS * 2 * 2
    a = header["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b = header["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert (a["dtype"], a["shape"], b["shape"]) == ("F32", [LORA_RANK, HIDDEN_SIZE], [HIDDEN_SIZE, LORA_RANK])
    assert max(t["data_offsets"][1] for t in header.values()) == len(blob) - 8 - length

    spec = EngineSpec("prefill", "rack-a", 8201, 5701, adapters=("ad1", "ad2"))
    command = engine_command(Path("p"), model, spec, nice=0)
    assert {"--enable-lora"} <= set(command) and command[command.index("--max-lora-rank") + 1] == "8"
    modules = [command[i + 1] for i, arg in enumerate(command) if arg == "--lora-modules"]
    assert modules == [f"ad1={tmp_path / 'lora-ad1'}", f"ad2={tmp_path / 'lora-ad2'}"]
    assert "--enable-lora" not in engine_command(Path("p"), model, EngineSpec("prefill", "b", 1, 2), nice=0)


def test_a_tracing_engine_exports_only_sampled_callers_spans_under_its_own_name(tmp_path):
    spec = EngineSpec("decode", "rack-a", 8201, 5701, otlp_traces_endpoint="http://127.0.0.1:4317")
    command = engine_command(Path("p"), tmp_path, spec, nice=0)
    assert command[command.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317"
    env = engine_environment(spec, base={})
    assert env["OTEL_SERVICE_NAME"] == "vllm-decode-rack-a-8201"
    assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0")
    untraced = EngineSpec("decode", "rack-a", 8201, 5701)
    assert "--otlp-traces-endpoint" not in engine_command(Path("p"), tmp_path, untraced, nice=0)
    assert not any(k.startswith("OTEL_") for k in engine_environment(untraced, base={}))


def test_an_engines_request_log_says_which_adapter_each_request_ran():
    """vLLM's ``--enable-log-requests`` line for a request of the model, then of an adapter (abridged)."""
    log = (
        "(APIServer pid=1) INFO [request_logger.py:65] Received request cmpl-1-0: params: SamplingParams("
        "n=1, max_tokens=1, extra_args={'kv_transfer_params': {}}), lora_request: None.\n"
        "(APIServer pid=1) INFO [serving.py:226] Loaded new LoRA adapter: name 'ad1', path '/x/lora-ad1'\n"
        "(APIServer pid=1) INFO [request_logger.py:65] Received request cmpl-2-0: params: SamplingParams(), "
        "lora_request: LoRARequest(lora_name='ad1', lora_int_id=1, lora_path='/x/lora-ad1').\n"
    )
    assert received_adapters(log) == [None, "ad1"]


def test_metrics_are_keyed_by_name_and_labels_without_engine_and_model():
    page = (
        "# TYPE vllm:prompt_tokens_by_source counter\n"
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 21.0\n'
        "# TYPE vllm:nixl_xfer_time_seconds histogram\n"
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 3.0\n'
    )
    assert parse_metrics(page) == {
        "vllm:prompt_tokens_by_source_total{source=local_compute}": 21.0,
        "vllm:nixl_xfer_time_seconds_count": 3.0,
    }


def test_too_little_memory_is_refused_with_how_much_is_needed(monkeypatch):
    monkeypatch.setattr(rig_cluster, "available_memory", lambda: 4 * 2**30)
    with pytest.raises(
        VllmUnavailable, match=r"4 vLLM engines need about 10\.4 GiB .* 4\.0 GiB is available"
    ):
        check_memory(4)
    check_memory(1)


async def test_without_the_environment_the_cluster_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(rig_cluster, "venv_python", lambda: None)
    with pytest.raises(VllmUnavailable, match="make vllm-env"):
        await rig_cluster.start_vllm_cluster(["a"], tmp_path)


def test_the_engines_request_logs_say_which_prefill_and_decode_served(tmp_path):
    """Both legs carry the gateway's X-Request-Id; vLLM logs it on receipt and puts it in the answer's id."""
    done = subprocess.Popen([sys.executable, "-c", ""])
    done.wait()
    specs = [
        EngineSpec(r, g, port, port + 1)
        for r, g, port in [("prefill", "a", 1), ("decode", "a", 3), ("decode", "b", 5)]
    ]
    engines = {s.address: Engine(s, done, tmp_path / f"{s.name}.log") for s in specs}
    for engine in engines.values():
        engine.log.write_text("INFO start-up\n")
    cluster = VllmCluster(
        [EngineInfo(s.address, s.role, s.group, KV_TOKENS) for s in specs],
        engines,
        tmp_path,
        Path("p"),
        Path("m"),
        NOT_ASKED,
    )
    logs = RequestLogs(cluster)  # only what is logged from now on counts
    same, cross, local = (
        "11111111-2222-3333-4444-555555555555",
        "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        ("99999999-8888-7777-6666-555555555555"),
    )
    received = (
        "(APIServer pid=1) INFO [logger.py:1] Received request cmpl-{}-0: params: SamplingParams(...).\n"
    )
    with engines["127.0.0.1:1"].log.open("a") as log:
        log.write(received.format(same) + received.format(cross))
    with engines["127.0.0.1:3"].log.open("a") as log:
        log.write(received.format(same) + received.format(local))
    with engines["127.0.0.1:5"].log.open("a") as log:
        log.write(received.format(cross))
    plan = RequestPlan(0.0, 10, 4)
    records = [Record(plan, response_id=f"chatcmpl-{u}") for u in (same, cross, local)] + [Record(plan)]
    logs.fill(records)
    assert [(r.prefill_engine, r.decode_engine, r.kv_transfer) for r in records] == [
        ("127.0.0.1:1", "127.0.0.1:3", "same_group"),
        ("127.0.0.1:1", "127.0.0.1:5", "cross_group"),
        (None, "127.0.0.1:3", "none"),
        (None, None, "none"),
    ]


def test_the_demo_on_vllm_runs_the_kv_transfer_params_handoff_only():
    done = subprocess.run(
        [sys.executable, "-m", "ext_proc.cli", "demo", "--engines", "vllm", "--handoff", "sidecar"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "kv-transfer-params handoff only" in done.stderr


async def test_the_attention_probe_reports_why_vllm_could_not_be_asked_and_does_not_fail(tmp_path):
    without_vllm = await probe_attention(Path(sys.executable))  # pd-extproc's environment: no torch, vLLM
    assert (without_vllm.isa, without_vllm.amx_tiles) == (None, None)
    assert re.fullmatch(
        r"dtype float32, attention ISA unknown \(asking vLLM's _get_attn_isa failed \(exit 1\): "
        r"ModuleNotFoundError: No module named '(torch|vllm)'\)",
        without_vllm.describe(),
    )
    missing = await probe_attention(tmp_path / "no-python")
    assert missing.describe().startswith(f"dtype float32, attention ISA unknown (cannot run {tmp_path}")
    assert (
        AttentionPath("float32", "vec", False).describe()
        == "dtype float32, attention ISA vec (AMX tiles: no)"
    )


def standin_specs() -> list[EngineSpec]:
    """A prefill and a decode of one group, on free ports, for :func:`warm_up_standins`."""
    return [EngineSpec(role, "a", free_port(), free_port()) for role in ("prefill", "decode")]


async def warm_up_standins(tmp_path: Path, specs: list[EngineSpec]) -> dict[tuple[str, str], int]:
    """Start ``specs`` as stand-in engines (``tests/support/vllm_standin.py``, as ``STANDIN_DEATH`` says),
    run the rig's warm-up over them and stop them; its attempts per pair, or its error."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    python.chmod(0o755)
    engines = {s.address: start_engine(python, tmp_path, s, tmp_path, nice=0) for s in specs}
    try:
        await asyncio.gather(*(e.wait_ready(timeout=30) for e in engines.values()))
        infos = [EngineInfo(s.address, s.role, s.group, KV_TOKENS) for s in specs]
        cluster = VllmCluster(infos, engines, tmp_path, python, tmp_path, NOT_ASKED)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await cluster.warm_up(session)
    finally:
        for engine in engines.values():
            engine.stop()


async def test_a_live_decode_dropping_a_warm_up_connection_is_one_failed_attempt(tmp_path, monkeypatch):
    """A decode that closes a warm-up's connection without answering and stays alive (a restarted engine
    at load once did): the warm-up tries the pair again instead of failing the suite."""
    monkeypatch.setenv("STANDIN_DEATH", "drop-once")
    prefill, decode = specs = standin_specs()
    assert await warm_up_standins(tmp_path, specs) == {(prefill.address, decode.address): 2}


@pytest.mark.parametrize(
    ("death", "says"),
    [
        ("sigill", "died during the decode of a KV transfer from {prefill}: exited with code -4 (SIGILL)"),
        (
            "worker",
            "died during the decode of a KV transfer from {prefill}: "
            "its worker VllmWorker-0 died with exit code -4 (SIGILL)",
        ),
    ],
)
async def test_a_decode_that_dies_on_its_first_kv_load_is_reported_dead_with_its_signal_and_log(
    tmp_path, monkeypatch, death, says
):
    """As vLLM CPU's bfloat16 decode on an AMX CPU (issue 33): the prefill answers its leg, the decode
    dies of SIGILL on the KV load (its process, or its worker while its API server answers 500). The
    warm-up names the decode, the signal and its log's end, not a refused connection."""
    monkeypatch.setenv("STANDIN_DEATH", death)
    prefill, decode = specs = standin_specs()
    with pytest.raises(EngineError) as raised:
        await warm_up_standins(tmp_path, specs)
    message = str(raised.value)
    assert message.startswith(f"{decode.name} {says.format(prefill=prefill.name)}; its log ends:\n")
    assert f"stand-in kv_consumer engine serving on port {decode.port}" in message  # the log's end
    if death == "worker":
        assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -4)" in message
