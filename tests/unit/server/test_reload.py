"""Live configuration reload against a running server: the file is a Kubernetes ConfigMap mount
(``config.yaml`` -> ``..data/config.yaml``, ``..data`` swapped atomically to a new timestamped
folder), requests are real gRPC ext_proc streams, some of them open across the reload."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import threading
from pathlib import Path

import grpc
import pytest
from builders import endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, destination, headers, response_headers
from polling import until

from ext_proc.affinity import Mode
from ext_proc.app import RunningServer, start_server
from ext_proc.config import ConfigSource
from ext_proc.discovery.eds import write_eds_file
from ext_proc.reload import ConfigWatcher
from ext_proc.tokenize import gateway as gateway_module
from ext_proc.tokenize.folder import TokenizerLoadError, TokenizerSettings

PREFILL, SAME_GROUP, OTHER_GROUP = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
RELOAD_INTERVAL = 0.05


class ConfigMapMount:
    """A folder laid out as kubelet lays out a mounted ConfigMap, updated as kubelet does: the
    new content goes into a new timestamped folder, ``..data_tmp`` is pointed at it and renamed
    over ``..data`` (one atomic step), and the old folder is removed."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        self._versions = itertools.count()
        root.mkdir()
        self._folder = self._write(text)
        (root / "..data").symlink_to(self._folder)
        (root / "config.yaml").symlink_to("..data/config.yaml")

    @property
    def path(self) -> Path:
        """The path pd-extproc is given (``--config``)."""
        return self.root / "config.yaml"

    def _write(self, text: str) -> str:
        folder = f"..2025_01_01_00_00_00.{next(self._versions)}"
        (self.root / folder).mkdir()
        (self.root / folder / "config.yaml").write_text(text, encoding="utf-8")
        return folder

    def update(self, text: str) -> None:
        """Swap in ``text`` as the new content."""
        old, self._folder = self._folder, self._write(text)
        (self.root / "..data_tmp").symlink_to(self._folder)
        os.rename(self.root / "..data_tmp", self.root / "..data")
        shutil.rmtree(self.root / old)


def config_text(
    eds: list[Path],
    mode: str,
    bonus: float = 0.3,
    fallback_count: int = 2,
    auto: str = "{}",
    prefix: str = "{}",
) -> str:
    return (
        "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n"
        f"discovery:\n  eds_files: [{eds[0]}, {eds[1]}]\n  poll_interval_seconds: 0.05\n"
        f"affinity:\n  mode: '{mode}'\n  bonus: {bonus}\n  auto: {auto}\n  prefix: {prefix}\n"
        f"routing:\n  fallback_count: {fallback_count}\n  pd_threshold_tokens: 0\n"
    )


@pytest.fixture
def eds(tmp_path: Path) -> list[Path]:
    """One prefill in group a; a small decode in group a and a 100x larger one in group b: ``off``
    and ``prefer`` with bonus 0 pick group b (lower utilisation), ``strict`` and ``prefer`` with
    bonus 0.3 group a."""
    paths = [tmp_path / "prefill.yaml", tmp_path / "decode.yaml"]
    write_eds_file(paths[0], "prefill", [endpoint(PREFILL, "a", 1000.0)])
    decodes = [
        endpoint(SAME_GROUP, "a", 1000.0),
        endpoint(OTHER_GROUP, "b", 100_000.0),
    ]
    write_eds_file(paths[1], "decode", decodes)
    return paths


async def serve(mount: ConfigMapMount, overrides: dict[str, object] | None = None) -> RunningServer:
    source = ConfigSource(str(mount.path), overrides or {}, environ={})
    return await start_server(source.load(), source, RELOAD_INTERVAL)


def sample(server: RunningServer, name: str, **labels: str) -> float:
    return server.router.metrics.registry.get_sample_value(name, labels) or 0.0


def reloads(server: RunningServer, outcome: str) -> float:
    return sample(server, "pd_extproc_config_reloads_total", outcome=outcome)


async def route(stub: pb_grpc.ExternalProcessorStub) -> str:
    """One whole request; returns the decode it was sent to."""
    call = stub.Process()
    await call.write(headers())
    await call.read()
    await call.write(body())
    routed = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return destination(routed).split(",")[0]


async def test_a_configmap_swap_changes_the_mode_live_and_requests_in_flight_finish(
    tmp_path: Path, eds: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ext_proc.reload")
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "off"))
    server = await serve(mount)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            routed_before = stub.Process()  # routed before the swap, finishes after it
            await routed_before.write(headers())
            await routed_before.read()
            await routed_before.write(body())
            assert destination(await routed_before.read()).startswith(OTHER_GROUP)
            spanning = stub.Process()  # headers before the swap, body after it
            await spanning.write(headers())
            await spanning.read()

            mount.update(config_text(eds, "strict"))
            await until(lambda: server.router.policy.mode is Mode.STRICT)

            await spanning.write(body())
            assert destination(await spanning.read()) == SAME_GROUP  # strict: no cross-group fallback
            assert await route(stub) == SAME_GROUP
            for call in (routed_before, spanning):
                await call.write(response_headers())
                assert (await call.read()).HasField("response_headers")
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
                assert call.cancelled() is False
                assert await call.code() == grpc.StatusCode.OK
    finally:
        await server.stop(grace=0)
    assert all(s.active_requests == 0 for s in server.router.registry.endpoints())
    decisions = "pd_extproc_route_decisions_total"
    assert sample(server, decisions, mode="off", locality="cross_group") == 1
    assert sample(server, decisions, mode="strict", locality="same_group") == 2
    assert reloads(server, "applied") == 1 and reloads(server, "rejected") == 0
    assert f"reloaded config file {mount.path}: affinity.mode off -> strict" in caplog.text
    assert server.reloads is not None and server.reloads.running.affinity.mode is Mode.STRICT


async def test_a_changed_bonus_applies_live(tmp_path: Path, eds: list[Path]) -> None:
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "prefer", bonus=0.3))
    server = await serve(mount)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            assert await route(stub) == SAME_GROUP
            mount.update(config_text(eds, "prefer", bonus=0.0))
            await until(lambda: server.router.policy.bonus == 0.0)
            assert await route(stub) == OTHER_GROUP
    finally:
        await server.stop(grace=0)


async def test_the_prefix_index_is_switched_on_tuned_and_off_live(tmp_path: Path, eds: list[Path]) -> None:
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "prefer"))
    server = await serve(mount)
    try:
        assert server.live.prefix is None and server.router.policy.prefix_weight == 0.0
        mount.update(config_text(eds, "prefer", prefix="{enabled: true, weight: 0.5}"))
        await until(lambda: server.live.prefix is not None)
        tracker = server.live.prefix
        assert server.router.policy.prefix_weight == 0.5
        mount.update(config_text(eds, "prefer", prefix="{enabled: true, weight: 0.2}"))
        await until(lambda: server.router.policy.prefix_weight == 0.2)
        assert server.live.prefix is tracker  # same hashing: the index is kept
        mount.update(config_text(eds, "prefer", prefix="{enabled: true, weight: 0.2, block_tokens: 32}"))
        await until(lambda: server.live.prefix is not tracker)
        assert server.live.prefix is not None and server.live.prefix.settings.block_tokens == 32
        mount.update(config_text(eds, "prefer", prefix="{enabled: false}"))
        await until(lambda: server.live.prefix is None)
    finally:
        await server.stop(grace=0)


async def test_a_changed_auto_fabric_applies_live_and_the_estimates_are_counted(
    tmp_path: Path, eds: list[Path]
) -> None:
    # A 1 GB KV cache a token: crossing groups at 1 GB/s costs seconds, at 100 GB/s (as fast as in
    # the group) nothing, so auto balances as off does and picks the 100x larger decode of group b.
    fabric = "{{kv_bytes_per_token: 1073741824, same_group_gbps: 100, cross_group_gbps: {}}}"
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "auto", auto=fabric.format(100)))
    server = await serve(mount)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            assert await route(stub) == OTHER_GROUP
            mount.update(config_text(eds, "auto", auto=fabric.format(1)))
            await until(lambda: server.router.policy.auto.cross_group_gbps == 1.0)
            assert await route(stub) == SAME_GROUP
    finally:
        await server.stop(grace=0)
    for locality in ("cross_group", "same_group"):
        for part in ("transfer", "wait", "margin"):
            assert sample(server, f"pd_extproc_auto_{part}_seconds_count", locality=locality) == 1
    # Staying home saved over a second of transfer: the margin landed in the top buckets.
    assert sample(server, "pd_extproc_auto_margin_seconds_bucket", locality="same_group", le="0.5") == 0


async def test_an_in_place_rewrite_of_the_same_size_is_seen(tmp_path: Path, eds: list[Path]) -> None:
    """Outside Kubernetes an editor may rewrite the file in place; ``strict`` and ``prefer`` have
    the same length, so only the content tells the two files apart within one mtime tick."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text(eds, "strict"))
    source = ConfigSource(str(path), {}, environ={})
    server = await start_server(source.load(), source, RELOAD_INTERVAL)
    try:
        stat = path.stat()
        path.write_text(config_text(eds, "prefer"))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_size == stat.st_size
        await until(lambda: server.router.policy.mode is Mode.PREFER)
    finally:
        await server.stop(grace=0)


async def test_an_invalid_file_is_logged_once_and_the_running_config_stays(
    tmp_path: Path, eds: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "strict"))
    server = await serve(mount)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            mount.update(config_text(eds, "sometimes"))
            await until(lambda: reloads(server, "rejected") == 1)
            for _ in range(3):  # more polls of the same bad file
                await asyncio.sleep(RELOAD_INTERVAL * 2)
                assert await route(stub) == SAME_GROUP  # still strict
            mount.update(config_text(eds, "off"))
            await until(lambda: server.router.policy.mode is Mode.OFF)
            assert await route(stub) == OTHER_GROUP
    finally:
        await server.stop(grace=0)
    errors = [r for r in caplog.records if r.name == "ext_proc.reload" and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        f"rejected the changed config file {mount.path}: affinity.mode: 'sometimes' is not allowed; "
        "use one of off, prefer, strict, auto (the running configuration stays)"
    ]
    assert (reloads(server, "rejected"), reloads(server, "applied")) == (1, 1)


async def test_other_changed_keys_are_logged_as_needing_a_restart(
    tmp_path: Path, eds: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "prefer", bonus=0.3, fallback_count=2))
    server = await serve(mount)
    try:
        text = config_text(eds, "prefer", bonus=0.1, fallback_count=0)
        mount.update(text + "handoff:\n  mode: kv-transfer-params\n")
        await until(lambda: server.router.policy.bonus == 0.1)
    finally:
        await server.stop(grace=0)
    assert server.router.policy.fallback_count == 2
    assert server.reloads is not None
    running = server.reloads.running
    assert (running.affinity.bonus, running.routing.fallback_count, running.handoff.mode.value) == (
        0.1,
        2,
        "sidecar",
    )
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warning.startswith(f"config file {mount.path} changes routing.fallback_count, handoff.mode: ")
    assert "restart pd-extproc for the others" in warning


async def test_flags_and_environment_keep_their_precedence_over_a_reloaded_file(
    tmp_path: Path, eds: list[Path]
) -> None:
    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "off"))
    server = await serve(mount, {"affinity.mode": "strict"})
    try:
        assert server.router.policy.mode is Mode.STRICT
        mount.update(config_text(eds, "prefer", bonus=0.05))
        await until(lambda: server.router.policy.bonus == 0.05)
        assert server.router.policy.mode is Mode.STRICT
    finally:
        await server.stop(grace=0)


async def test_a_server_without_a_config_file_watches_nothing() -> None:
    source = ConfigSource(None, {"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"}, environ={})
    server = await start_server(source.load(), source)
    await server.stop(grace=0)
    assert server.reloads is None
    with pytest.raises(ValueError, match="nothing to watch"):
        ConfigWatcher(source, server.config, server.router, server.live, server.router.metrics)


async def test_a_changed_tokenizer_folder_loads_off_the_loop_while_the_old_one_serves(
    tmp_path: Path, eds: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new folder is loaded on a worker thread; requests meanwhile are routed with the old tokenizer."""
    loading, release, threads = threading.Event(), threading.Event(), []

    def slow_load(settings: TokenizerSettings) -> TokenizerLoadError:
        threads.append(threading.current_thread().name)
        loading.set()
        release.wait(10)
        return TokenizerLoadError(f"{settings.folder}: no such folder")

    def prefix(folder: str) -> str:
        return f"{{enabled: true, source: kv-events, tokenizer: '{tmp_path / folder}'}}"

    mount = ConfigMapMount(tmp_path / "mount", config_text(eds, "prefer", prefix=prefix("a")))
    server = await serve(mount)
    try:
        old = server.live.tokenizer
        assert old is not None and old.tokenizer is None  # the folder is missing: loaded, unusable
        monkeypatch.setattr(gateway_module, "load_folder", slow_load)
        mount.update(config_text(eds, "prefer", prefix=prefix("b")))
        await asyncio.to_thread(loading.wait, 10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            assert await route(stub) in (SAME_GROUP, OTHER_GROUP)  # the loop serves while it loads
        assert server.live.tokenizer is old
        assert sample(server, "pd_extproc_tokenize_fallbacks_total", reason="no_tokenizer") == 1
        release.set()
        await until(lambda: server.live.tokenizer is not old)
        assert threads and threads[0] != threading.main_thread().name
        assert server.live.tokenizer_opening is None
    finally:
        release.set()
        await server.stop(grace=0)
