"""load_config: defaults < YAML < environment < overrides, validation messages, and the CLI exit code."""

from __future__ import annotations

import argparse
import dataclasses
import types
from pathlib import Path

import pytest
import yaml

from ext_proc.affinity import AutoModel, Mode, Policy
from ext_proc.affinity.config import AutoConfig
from ext_proc.affinity_config import AffinityConfig
from ext_proc.checks import ConfigError
from ext_proc.config import (
    ENV_AFFINITY_BONUS,
    ENV_AFFINITY_MODE,
    ENV_HANDOFF,
    ENV_NATS_URL,
    Config,
    ConfigSource,
    as_dict,
    load_config,
)
from ext_proc.discovery import SourceKind
from ext_proc.discovery.config import DiscoveryConfig, InferencePoolConfig, KubernetesConfig
from ext_proc.discovery.pods import Preset, RoleScheme
from ext_proc.handoff.routing import RoutingConfig
from ext_proc.load import LoadConfig
from ext_proc.prefix.config import PrefixConfig
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings
from ext_proc.xds.config import XdsConfig

NO_ENV: dict[str, str] = {}


def write_yaml(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(
    path: Path | None = None,
    overrides: dict[str, object] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    return load_config(None if path is None else str(path), overrides, NO_ENV if environ is None else environ)


def config_error(
    path: Path | None = None,
    overrides: dict[str, object] | None = None,
    environ: dict[str, str] | None = None,
) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, overrides, environ)
    return str(info.value)


# --- defaults and layering ---------------------------------------------------------------------


def test_defaults_without_file_env_or_overrides() -> None:
    config = load()
    assert config == Config()
    assert config.listen == "0.0.0.0:9002"
    assert config.metrics_listen == "127.0.0.1:9090"  # the admin endpoint: loopback unless set
    assert config.admin.debug_endpoints is True
    assert config.discovery == DiscoveryConfig((), "prefill", "decode", "pd", 0.25)
    assert config.affinity == AffinityConfig(Mode.PREFER, 0.3)
    assert config.load == LoadConfig(256, 100_000.0)
    assert config.routing == RoutingConfig(2, "x-gateway-destination-endpoint", "x-prefiller-host-port")


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load(write_yaml(tmp_path, "# nothing here\n")) == Config()


def test_yaml_values_are_applied(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
listen: 127.0.0.1:7000
metrics_listen: "[::1]:7001"
discovery:
  prefill_cluster: pf
  decode_cluster: dc
  metadata_namespace: acme
  poll_interval_seconds: 2
affinity:
  mode: strict
  bonus: 0.5
load:
  default_max_tokens: 64
  default_token_capacity: 5000
routing:
  fallback_count: 0
  destination_header: x-dest
  prefill_header: x-pre
""",
    )
    config = load(path)
    assert config.listen == "127.0.0.1:7000"
    assert config.metrics_listen == "[::1]:7001"
    assert config.discovery == DiscoveryConfig((), "pf", "dc", "acme", 2.0)
    assert config.affinity == AffinityConfig(Mode.STRICT, 0.5)
    assert config.load == LoadConfig(64, 5000.0)
    assert isinstance(config.load.default_token_capacity, float)
    assert config.routing == RoutingConfig(0, "x-dest", "x-pre")


def test_yaml_section_left_empty_keeps_its_defaults(tmp_path: Path) -> None:
    config = load(write_yaml(tmp_path, "affinity:\nlisten: 1.2.3.4:5\n"))
    assert config.affinity == AffinityConfig()
    assert config.listen == "1.2.3.4:5"


def test_environment_overrides_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "affinity:\n  mode: strict\n  bonus: 0.5\n")
    config = load(path, environ={ENV_AFFINITY_MODE: "off", ENV_AFFINITY_BONUS: "0.125"})
    assert config.affinity == AffinityConfig(Mode.OFF, 0.125)


def test_environment_alone_overrides_defaults() -> None:
    config = load(environ={ENV_AFFINITY_MODE: "strict"})
    assert config.affinity == AffinityConfig(Mode.STRICT, 0.3)


def test_unrelated_environment_variables_are_ignored() -> None:
    assert load(environ={"PD_EXTPROC_LISTEN": "1.1.1.1:1", "HOME": "/root"}) == Config()


def test_overrides_win_over_environment_and_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "affinity:\n  mode: strict\n  bonus: 0.5\nlisten: 1.1.1.1:1\n")
    config = load(
        path,
        overrides={"affinity.mode": "prefer", "affinity.bonus": 0.9, "listen": "2.2.2.2:2"},
        environ={ENV_AFFINITY_MODE: "off", ENV_AFFINITY_BONUS: "0.1"},
    )
    assert config.affinity == AffinityConfig(Mode.PREFER, 0.9)
    assert config.listen == "2.2.2.2:2"


def test_override_only_replaces_the_named_key_of_a_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "affinity:\n  mode: strict\n  bonus: 0.5\n")
    assert load(path, overrides={"affinity.bonus": 0.0}).affinity == AffinityConfig(Mode.STRICT, 0.0)


def test_environment_bonus_that_is_not_a_number_names_the_variable() -> None:
    message = config_error(environ={ENV_AFFINITY_BONUS: "lots"})
    assert ENV_AFFINITY_BONUS in message
    assert "affinity.bonus" in message
    assert "'lots'" in message


def test_environment_mode_is_validated_like_yaml() -> None:
    message = config_error(environ={ENV_AFFINITY_MODE: "sideways"})
    assert message.startswith(f"{ENV_AFFINITY_MODE} (affinity.mode): 'sideways' is not allowed")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (ENV_AFFINITY_MODE, "bogus", "(affinity.mode): 'bogus' is not allowed; use one of off, prefer"),
        (ENV_AFFINITY_BONUS, "2", "(affinity.bonus): 2.0 is not allowed; use a number in [0, 1]"),
        (ENV_HANDOFF, "carrier-pigeon", "(handoff.mode): 'carrier-pigeon' is not allowed; use one of"),
        (ENV_NATS_URL, "http://nats:4222", "(shared_state.nats.url): 'http://nats:4222' is not allowed"),
        (
            ENV_NATS_URL,
            "nats://nats:422200",
            "(shared_state.nats.url): 'nats://nats:422200' is not allowed: "
            "its port is not a number in 1..65535",
        ),
    ],
)
def test_an_error_in_a_variable_names_the_variable_then_the_key(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    """The file may hold a good value of the key: the error says where the bad one came from."""
    path = write_yaml(tmp_path, "affinity:\n  mode: prefer\n  bonus: 0.3\nhandoff:\n  mode: sidecar\n")
    assert config_error(path, environ={variable: value}).startswith(f"{variable} {message}")


def test_an_override_of_a_variable_is_named_by_its_own_origin_or_by_its_key() -> None:
    environ = {ENV_AFFINITY_MODE: "prefer"}
    assert config_error(overrides={"affinity.mode": "bogus"}, environ=environ).startswith(
        "affinity.mode: 'bogus' is not allowed"
    )
    with pytest.raises(ConfigError, match=r"^--affinity-mode \(affinity.mode\): 'bogus' is not allowed"):
        load_config(None, {"affinity.mode": "bogus"}, environ, {"affinity.mode": "--affinity-mode"})
    with pytest.raises(ConfigError, match=r"^listen: 'x' is not allowed"):  # another key: its own name
        load_config(None, {"listen": "x", "affinity.mode": "off"}, {}, {"affinity.mode": "--affinity-mode"})


# --- validation errors -------------------------------------------------------------------------


def test_unknown_top_level_key_is_named_with_the_allowed_keys(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "listn: 0.0.0.0:1\n"))
    assert message == (
        "listn: unknown key; allowed keys here: admin, affinity, discovery, engine_metrics, envoy_health, "
        "flow_control, handoff, health_listen, limits, listen, load, metrics_listen, routing, shared_state, "
        "tls, tracing, xds"
    )


def test_unknown_nested_key_is_named_with_its_section(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "affinity:\n  bouns: 0.2\n"))
    assert message == "affinity.bouns: unknown key; allowed keys here: auto, bonus, mode, prefix"


def test_unknown_override_key_is_rejected() -> None:
    message = config_error(overrides={"routing.fallbacks": 3})
    assert message.startswith("routing.fallbacks: unknown key; allowed keys here: ")
    assert "fallback_count" in message


@pytest.mark.parametrize("mode", ["sideways", "Strict", 1, None])
def test_bad_mode_lists_off_prefer_and_strict(mode: object) -> None:
    message = config_error(overrides={"affinity.mode": mode})
    assert message == f"affinity.mode: {mode!r} is not allowed; use one of off, prefer, strict, auto"


def test_an_unquoted_off_in_yaml_is_explained(tmp_path: Path) -> None:
    """YAML 1.1 reads ``mode: off`` as false: the message says to quote it."""
    assert config_error(write_yaml(tmp_path, "affinity:\n  mode: off\n")) == (
        "affinity.mode: False is not allowed; use one of off, prefer, strict, auto "
        "(YAML reads an unquoted off, on, yes or no as a boolean: quote it)"
    )
    assert load(write_yaml(tmp_path, "affinity:\n  mode: 'off'\n")).affinity.mode is Mode.OFF


@pytest.mark.parametrize("bonus", [-0.01, 1.01, 5])
def test_bonus_outside_unit_interval_is_rejected(bonus: float) -> None:
    message = config_error(overrides={"affinity.bonus": bonus})
    assert message.startswith("affinity.bonus: ")
    assert "use a number in [0, 1]" in message


@pytest.mark.parametrize("bonus", [0, 0.0, 1, 1.0])
def test_bonus_bounds_are_inclusive(bonus: float) -> None:
    assert load(overrides={"affinity.bonus": bonus}).affinity.bonus == float(bonus)


@pytest.mark.parametrize("bonus", ["0.5", True, [0.5]])
def test_bonus_of_wrong_type_says_a_number(bonus: object) -> None:
    assert config_error(overrides={"affinity.bonus": bonus}) == (
        f"affinity.bonus: {bonus!r} is not allowed; use a number"
    )


def test_auto_defaults_are_the_simulators_fabric_and_llama_3_8b() -> None:
    auto = load().affinity.auto
    assert auto == AutoConfig() and auto.bytes_per_token() == 131_072
    assert load().affinity.policy(2) == Policy(Mode.PREFER, 0.3, 2, AutoModel())


def test_auto_kv_bytes_come_from_the_model_shape_unless_given() -> None:
    shape = {"affinity.auto.num_layers": 80, "affinity.auto.num_kv_heads": 8, "affinity.auto.dtype_bytes": 1}
    assert load(overrides=shape).affinity.auto.bytes_per_token() == 2 * 80 * 8 * 128 * 1
    given = load(overrides={**shape, "affinity.auto.kv_bytes_per_token": 4096}).affinity
    assert given.auto.bytes_per_token() == 4096
    assert given.policy(0).auto.kv_bytes_per_token == 4096


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"kv_bytes_per_token": -1},
            "affinity.auto.kv_bytes_per_token: must be an integer in [0, 10737",
        ),
        ({"head_dim": 0}, "affinity.auto.head_dim: must be an integer in [1, 65536]"),
        ({"num_layers": 65536, "head_dim": 65536}, "affinity.auto: the model shape gives more than"),
        ({"same_group_gbps": 0}, "affinity.auto.same_group_gbps: must be a number in [0.001, 1000000]"),
        ({"cross_group_gbps": 200}, "affinity.auto.cross_group_gbps (200) must not exceed same_group_gbps"),
        ({"base_latency_ms": -1}, "affinity.auto.base_latency_ms: must be a number in [0, 1000000] (ms)"),
        ({"wait_scale_ms": float("nan")}, "affinity.auto.wait_scale_ms: must be a number in [0, 1000000]"),
        ({"wait_scale_ms": "fast"}, "affinity.auto.wait_scale_ms: 'fast' is not allowed; use a number"),
        ({"cpu_tier_gbps": 0}, "affinity.auto.cpu_tier_gbps: must be a number in [0.001, 1000000] (GB/s)"),
    ],
)
def test_bad_auto_values_are_named(override: dict[str, object], expected: str) -> None:
    message = config_error(overrides={f"affinity.auto.{k}": v for k, v in override.items()})
    assert message.startswith(expected)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"block_tokens": 0}, "affinity.prefix.block_tokens: must be an integer in [1, 4096]"),
        ({"max_blocks": 70000}, "affinity.prefix.max_blocks: must be an integer in [1, 65536]"),
        ({"weight": -0.1}, "affinity.prefix.weight: must be a number in [0, 100]"),
        ({"enabled": "yes"}, "affinity.prefix.enabled: 'yes' is not allowed; use true or false"),
        (
            {"source": "exact"},
            "affinity.prefix.source: 'exact' is not allowed; use one of approximate, kv-events",
        ),
        ({"kv_events.port": 0}, "affinity.prefix.kv_events.port: must be a port in [1, 65535]"),
        (
            {"kv_events.replay_port": 70000},
            "affinity.prefix.kv_events.replay_port: must be a port in [0, 65535]",
        ),
        (
            {"kv_events.stale_after_seconds": 0},
            "affinity.prefix.kv_events.stale_after_seconds: must be a number in (0, 86400]",
        ),
        (
            {"kv_events.recent_seconds": -1},
            "affinity.prefix.kv_events.recent_seconds: must be a number in [0, 600]",
        ),
        (
            {"kv_events.max_blocks_per_endpoint": 0},
            "affinity.prefix.kv_events.max_blocks_per_endpoint: must be an integer in [1, 16777216]",
        ),
        (
            {"kv_events.queue_batches": 0},
            "affinity.prefix.kv_events.queue_batches: must be an integer in [1, 1000000]",
        ),
        ({"kv_events.bogus": 1}, "affinity.prefix.kv_events.bogus: unknown key"),
        ({"cpu_tier_weight": 1.5}, "affinity.prefix.cpu_tier_weight: must be a number in [0, 1]"),
        ({"tokenizer": 3}, "affinity.prefix.tokenizer: 3 is not allowed; use a string"),
    ],
)
def test_bad_prefix_values_are_named(override: dict[str, object], expected: str) -> None:
    message = config_error(overrides={f"affinity.prefix.{k}": v for k, v in override.items()})
    assert message.startswith(expected)


def test_the_prefix_section_gives_the_policy_its_weight_only_when_enabled() -> None:
    off = load(overrides={"affinity.prefix.weight": 0.5}).affinity
    assert off.prefix.settings() is None and off.policy(2).prefix_weight == 0.0
    on = load(overrides={"affinity.prefix.weight": 0.5, "affinity.prefix.enabled": True}).affinity
    assert on.policy(2).prefix_weight == 0.5
    assert on.prefix.settings() == PrefixSettings(16, 2048, True)
    events = load(
        overrides={
            "affinity.prefix.enabled": True,
            "affinity.prefix.source": "kv-events",
            "affinity.prefix.kv_events.port": 6000,
            "affinity.prefix.kv_events.replay_port": 6001,
        }
    ).affinity.prefix.settings()
    assert events == PrefixSettings(
        source="kv-events", kv_events=KvEventsSettings(port=6000, replay_port=6001)
    )
    assert (
        load(overrides={"affinity.auto.prefill_ms_per_token": 0.2})
        .affinity.policy(0)
        .auto.prefill_ms_per_token
        == 0.2
    )


def test_equal_bandwidths_and_zero_wait_scale_are_allowed() -> None:
    keys = {"affinity.auto.cross_group_gbps": 100, "affinity.auto.wait_scale_ms": 0, "affinity.mode": "auto"}
    config = load(overrides=keys)
    assert config.affinity.mode is Mode.AUTO and config.affinity.auto.cross_group_gbps == 100.0


@pytest.mark.parametrize("key", ["listen", "metrics_listen"])
@pytest.mark.parametrize("value", ["9002", "localhost:", ":9002", "host:port", "host:-1"])
def test_bad_listen_address_is_rejected(key: str, value: str) -> None:
    assert config_error(overrides={key: value}) == (
        f"{key}: {value!r} is not allowed; use host:port, e.g. 0.0.0.0:9002"
    )


@pytest.mark.parametrize("key", ["listen", "metrics_listen", "health_listen"])
def test_a_listen_port_out_of_range_says_the_range(key: str) -> None:
    assert config_error(overrides={key: "0.0.0.0:70000"}) == (
        f"{key}: '0.0.0.0:70000' is not allowed: port 70000 is out of range; use a port in 0..65535"
    )


@pytest.mark.parametrize(
    ("key", "url"),
    [
        ("handoff.prefill_via", "http://127.0.0.1:70000"),
        ("handoff.prefill_via", "http://127.0.0.1:0"),
        ("envoy_health.admin_url", "http://127.0.0.1:99999"),
        ("shared_state.nats.url", "nats://a:4222,nats://b:65536"),
    ],
)
def test_a_url_port_out_of_range_says_the_range(key: str, url: str) -> None:
    bad = url.rpartition(",")[2]
    assert config_error(overrides={key: url}) == (
        f"{key}: {bad!r} is not allowed: its port is not a number in 1..65535"
    )


@pytest.mark.parametrize("value", ["[::]:0", "localhost:65535", "10.0.0.1:80"])
def test_good_listen_addresses_are_accepted(value: str) -> None:
    assert load(overrides={"listen": value}).listen == value


def test_health_listen_is_off_by_default_and_takes_a_host_port() -> None:
    assert load().health_listen == ""
    assert load(overrides={"health_listen": "0.0.0.0:9003"}).health_listen == "0.0.0.0:9003"


@pytest.mark.parametrize("value", ["9003", ":9003", "host:port"])
def test_a_bad_health_listen_says_empty_turns_it_off(value: str) -> None:
    assert config_error(overrides={"health_listen": value}) == (
        f"health_listen: {value!r} is not allowed; use host:port, e.g. 0.0.0.0:9002 (or an empty string: off)"
    )


def test_integer_where_string_expected_is_rejected(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "listen: 9002\n"))
    assert message == "listen: 9002 is not allowed; use a string"


def test_integer_header_name_is_rejected_naming_the_nested_key(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "routing:\n  prefill_header: 42\n"))
    assert message == "routing.prefill_header: 42 is not allowed; use a string"


@pytest.mark.parametrize("value", ["3", 2.0, True])
def test_non_integer_where_integer_expected_is_rejected(value: object) -> None:
    message = config_error(overrides={"routing.fallback_count": value})
    assert message == f"routing.fallback_count: {value!r} is not allowed; use an integer"


def test_eds_files_must_be_a_list_of_strings(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "discovery:\n  eds_files: [a.yaml, 3]\n"))
    assert message == "discovery.eds_files: ['a.yaml', 3] is not allowed; use a list of strings"


def test_section_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "affinity: strict\n"))
    assert message == "affinity: expected a mapping, got str"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"load.default_max_tokens": -1}, "load.default_max_tokens: must be an integer >= 0"),
        ({"load.default_max_tokens": 2**40 + 1}, "load.default_max_tokens: must be at most 1099511627776"),
        ({"load.default_token_capacity": 0}, "load.default_token_capacity: must be a number > 0"),
        ({"routing.fallback_count": 17}, "routing.fallback_count: must be an integer in [0, 16]"),
        ({"routing.fallback_count": -1}, "routing.fallback_count: must be an integer in [0, 16]"),
        ({"discovery.poll_interval_seconds": 0}, "discovery.poll_interval_seconds: must be a number > 0"),
        (
            {"discovery.decode_cluster": "prefill"},
            "discovery.prefill_cluster and discovery.decode_cluster must differ",
        ),
        ({"xds.no_envoy_delay_seconds": -0.1}, "xds.no_envoy_delay_seconds: must be a number in [0, 60]"),
        ({"xds.no_envoy_delay_seconds": 61}, "xds.no_envoy_delay_seconds: must be a number in [0, 60]"),
        (
            {"xds.no_envoy_delay_seconds": float("nan")},
            "xds.no_envoy_delay_seconds: must be a number in [0, 60]",
        ),
    ],
)
def test_range_checks_name_the_key(override: dict[str, object], expected: str) -> None:
    assert config_error(overrides=override) == expected


@pytest.mark.parametrize("name", ["X-Gateway-Destination", "x dest", "x:dest", ""])
@pytest.mark.parametrize("key", ["destination_header", "prefill_header"])
def test_header_names_must_be_lower_case_http_names(key: str, name: str) -> None:
    assert config_error(overrides={f"routing.{key}": name}) == (
        f"routing.{key}: {name!r} is not allowed; use a lower-case HTTP header name"
    )


# --- file handling -----------------------------------------------------------------------------


def test_relative_eds_files_resolve_against_the_config_folder(tmp_path: Path) -> None:
    folder = tmp_path / "conf"
    folder.mkdir()
    absolute = tmp_path / "elsewhere" / "decode.yaml"
    path = write_yaml(folder, f"discovery:\n  eds_files: [eds/prefill.yaml, '{absolute}']\n")
    config = load(path)
    assert config.discovery.eds_files == (str(folder.resolve() / "eds" / "prefill.yaml"), str(absolute))


def test_relative_eds_files_resolve_against_the_folder_of_a_symlinked_config_path(tmp_path: Path) -> None:
    """A Kubernetes ConfigMap mount: config.yaml -> ..data/config.yaml, ..data -> a timestamped
    folder that the next update deletes. EDS files next to config.yaml stay where they are."""
    mount = tmp_path / "mount"
    (mount / "..2025_01_01_00_00_00.1").mkdir(parents=True)
    write_yaml(mount / "..2025_01_01_00_00_00.1", "discovery:\n  eds_files: [eds/decode.yaml, ../d.yaml]\n")
    (mount / "..data").symlink_to("..2025_01_01_00_00_00.1")
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    config = load(mount / "config.yaml")
    assert config.discovery.eds_files == (str(mount / "eds" / "decode.yaml"), str(tmp_path / "d.yaml"))


def test_relative_eds_files_without_config_file_resolve_against_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load(overrides={"discovery.eds_files": ["a.yaml"]})
    assert config.discovery.eds_files == (str(Path.cwd() / "a.yaml"),)


def test_missing_config_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    message = config_error(path)
    assert message.startswith(f"config file {path}: cannot read: ")


def test_config_path_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    assert config_error(tmp_path).startswith(f"config file {tmp_path}: cannot read: ")


def test_invalid_yaml_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "affinity: [unclosed\n")
    assert config_error(path).startswith(f"config file {path}: not valid YAML: ")


@pytest.mark.parametrize("text", ["- listen\n- metrics_listen\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write_yaml(tmp_path, text)
    assert config_error(path) == f"config file {path}: expected a mapping at the top level"


# --- CLI ---------------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    """``ext_proc.cli.main`` (``cli.main``) with a clean affinity environment.

    ``serve_forever`` is replaced by a recorder
    (``cli.started``), so a config that validates returns 0 at once instead of serving.
    """
    monkeypatch.delenv(ENV_AFFINITY_MODE, raising=False)
    monkeypatch.delenv(ENV_AFFINITY_BONUS, raising=False)
    started: list[Config] = []

    async def fake_serve_forever(config: Config, source: ConfigSource) -> None:  # no server started here
        assert source.load() == config
        started.append(config)

    monkeypatch.setattr("ext_proc.app.serve_forever", fake_serve_forever)
    from ext_proc.cli import main

    return types.SimpleNamespace(main=main, started=started)


def test_cli_serve_with_bad_config_key_exits_2_naming_the_key(
    cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_yaml(tmp_path, "afinity:\n  mode: strict\n")
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pd-extproc: invalid configuration: afinity: unknown key" in err


def test_cli_serve_with_bad_affinity_mode_flag_exits_2(cli, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--affinity-mode", "sideways"]) == 2
    err = capsys.readouterr().err
    assert (
        "--affinity-mode (affinity.mode): 'sideways' is not allowed; use one of off, prefer, strict, auto"
        in err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "0.0.0.0:70000"], "--listen (listen): '0.0.0.0:70000' is not allowed: port 70000"),
        (["--metrics-listen", "9090"], "--metrics-listen (metrics_listen): '9090' is not allowed"),
        (["--eds-file", "e.yaml", "--discovery", "dns"], "--discovery (discovery.source): 'dns'"),
        (["--max-inflight-requests", "-1"], "--max-inflight-requests (limits.max_inflight_requests): "),
        (["--envoy-admin-url", "admin:9901"], "--envoy-admin-url (envoy_health.admin_url): 'admin:9901'"),
    ],
)
def test_cli_a_bad_flag_is_named(
    cli, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert f"pd-extproc: invalid configuration: {message}" in capsys.readouterr().err


def test_cli_each_config_flag_is_a_serve_flag() -> None:
    from ext_proc.cli import _FLAG_KEYS, _flag, build_parser

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {_flag(dest) for dest in _FLAG_KEYS} <= set(commands.choices["serve"]._option_string_actions)


def test_cli_flag_overrides_environment_and_is_validated(
    cli, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_AFFINITY_BONUS, "0.2")
    assert cli.main(["serve", "--affinity-bonus", "1.5"]) == 2
    assert "--affinity-bonus (affinity.bonus): 1.5 is not allowed" in capsys.readouterr().err


def test_cli_rejects_bad_environment_variable(
    cli, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_AFFINITY_MODE, "sideways")
    assert cli.main(["serve"]) == 2
    assert f"{ENV_AFFINITY_MODE} (affinity.mode): 'sideways' is not allowed" in capsys.readouterr().err


def test_cli_flags_reach_the_server_config_over_environment(
    cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(ENV_AFFINITY_MODE, "off")
    monkeypatch.setenv(ENV_AFFINITY_BONUS, "0.2")
    path = write_yaml(tmp_path, "affinity:\n  mode: prefer\nrouting:\n  fallback_count: 1\n")
    argv = ["serve", "--config", str(path), "--affinity-mode", "strict", "--listen", "127.0.0.1:0"]
    argv += ["--metrics-listen", "127.0.0.1:0", "--eds-file", "/eds/p.yaml", "--eds-file", "/eds/d.yaml"]
    assert cli.main(argv) == 0
    (config,) = cli.started
    assert config.affinity == AffinityConfig(Mode.STRICT, 0.2)
    assert (config.listen, config.metrics_listen) == ("127.0.0.1:0", "127.0.0.1:0")
    assert config.discovery.eds_files == ("/eds/p.yaml", "/eds/d.yaml")
    assert config.routing.fallback_count == 1


# --- regressions found in review ----------------------------------------------------------------


def test_empty_yaml_section_still_takes_environment_and_flags(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "affinity:\nrouting:\n")
    config = load(path, {"routing.fallback_count": 1}, {ENV_AFFINITY_MODE: "strict"})
    assert config.affinity.mode is Mode.STRICT and config.routing.fallback_count == 1


@pytest.mark.parametrize("value", ["0", "[]", "false", '""'])
def test_a_section_that_is_not_a_mapping_is_rejected(tmp_path: Path, value: str) -> None:
    assert config_error(write_yaml(tmp_path, f"affinity: {value}\n")).startswith(
        "affinity: expected a mapping"
    )


def test_routing_headers_must_differ() -> None:
    message = config_error(None, {"routing.prefill_header": "x-gateway-destination-endpoint"})
    assert message == "routing.destination_header and routing.prefill_header must differ"


def test_cli_relative_eds_file_resolves_against_the_working_directory(
    cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config_dir, work_dir = tmp_path / "etc", tmp_path / "work"
    config_dir.mkdir()
    work_dir.mkdir()
    path = write_yaml(config_dir, "discovery:\n  eds_files: [from-config.yaml]\n")
    monkeypatch.chdir(work_dir)
    assert cli.main(["serve", "--config", str(path), "--eds-file", "flag.yaml"]) == 0
    assert cli.started[0].discovery.eds_files == (str(work_dir / "flag.yaml"),)
    assert cli.main(["serve", "--config", str(path)]) == 0
    assert cli.started[1].discovery.eds_files == (str(config_dir / "from-config.yaml"),)


def test_xds_is_off_by_default_and_takes_booleans_only(tmp_path: Path) -> None:
    assert load().xds == XdsConfig(serve_eds=False, no_envoy_delay_seconds=2.0)
    config = load(write_yaml(tmp_path, "xds:\n  serve_eds: true\n  no_envoy_delay_seconds: 0\n"))
    assert config.xds == XdsConfig(serve_eds=True, no_envoy_delay_seconds=0.0)
    assert config_error(overrides={"xds.serve_eds": "yes"}) == (
        "xds.serve_eds: 'yes' is not allowed; use true or false"
    )
    assert (
        config_error(overrides={"xds.serve_eds": 1}) == "xds.serve_eds: 1 is not allowed; use true or false"
    )


def test_cli_serve_eds_flag(cli) -> None:
    assert cli.main(["serve", "--serve-eds"]) == 0
    assert cli.main(["serve"]) == 0
    assert [config.xds.serve_eds for config in cli.started] == [True, False]


def test_as_dict_is_plain_yaml_data_that_loads_back_the_same(tmp_path: Path) -> None:
    config = load(
        overrides={
            "affinity.mode": "strict",
            "handoff.mode": "kv-transfer-params",
            "discovery.eds_files": ["/e/p.yaml"],
            "load.default_token_capacity": 5,
        }
    )
    data = as_dict(config)
    assert list(data) == [f.name for f in dataclasses.fields(Config)]
    assert data["affinity"] == {
        "mode": "strict",
        "bonus": 0.3,
        "auto": dataclasses.asdict(AutoConfig()),
        "prefix": dataclasses.asdict(PrefixConfig()),
    }
    assert data["discovery"]["eds_files"] == ["/e/p.yaml"]  # type: ignore[index]
    text = yaml.safe_dump(data, sort_keys=False)  # plain data: safe_dump refuses enums
    assert load(write_yaml(tmp_path, text)) == config


def test_the_shipped_example_config_loads_and_names_every_key() -> None:
    path = Path(__file__).resolve().parents[3] / "config" / "pd-extproc.yaml"
    config = load(path)
    assert config == Config(discovery=config.discovery)  # every other value is the default
    assert [Path(p).name for p in config.discovery.eds_files] == ["prefill.yaml", "decode.yaml"]
    assert all(Path(p).is_file() for p in config.discovery.eds_files)
    text = path.read_text()

    def check(section: object, name: str, indent: str) -> None:
        for key in section.__dataclass_fields__:
            assert f"\n{indent}{key}:" in text, f"{name}.{key} is not documented in {path.name}"
            value = getattr(section, key)
            if dataclasses.is_dataclass(value):
                check(value, f"{name}.{key}", indent + "  ")

    for section in ("discovery", "affinity", "load", "routing", "handoff", "xds"):
        check(getattr(config, section), section, "  ")


# --- kubernetes discovery ------------------------------------------------------------------------


def test_kubernetes_defaults_follow_the_infernex_preset() -> None:
    discovery = load().discovery
    assert discovery.source is SourceKind.FILES
    kubernetes = discovery.kubernetes
    assert kubernetes == KubernetesConfig()
    assert (kubernetes.kubeconfig, kubernetes.namespaces, kubernetes.preset) == ("", (), Preset.INFERNEX)
    assert kubernetes.scheme() == RoleScheme(
        "openfuyao.com/pdRole", "prefill", "decode", "", "prefill-port", "decode-port"
    )
    assert kubernetes.group_label == "openfuyao.com/pdGroupID"
    assert kubernetes.capacity_annotation == "pd-extproc/token-capacity"
    assert kubernetes.bootstrap_port_annotation == "pd-extproc/bootstrap-port"
    assert kubernetes.metrics_port_annotation == "pd-extproc/metrics-port"


def test_the_llm_d_preset_and_keys_set_over_it(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
discovery:
  source: kubernetes
  kubernetes:
    namespaces: [llm, llm-2]
    preset: llm-d
    decode_port: 8200
    group_label: example.com/rack
""",
    )
    kubernetes = load(path).discovery.kubernetes
    assert kubernetes.namespaces == ("llm", "llm-2")
    assert kubernetes.scheme() == RoleScheme("llm-d.ai/role", "prefill", "decode", "both", 8000, 8200)
    assert kubernetes.group_label == "example.com/rack"


def test_every_role_and_port_key_replaces_the_presets() -> None:
    overrides = {
        "discovery.kubernetes.role_label": "example.com/role",
        "discovery.kubernetes.prefill_role": "p",
        "discovery.kubernetes.decode_role": "d",
        "discovery.kubernetes.both_role": "pd",
        "discovery.kubernetes.prefill_port": "http",
        "discovery.kubernetes.decode_port": 9000,
    }
    scheme = load(overrides=overrides).discovery.kubernetes.scheme()
    assert scheme == RoleScheme("example.com/role", "p", "d", "pd", "http", 9000)


def test_nested_dotted_overrides_reach_the_nested_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "discovery:\n  kubernetes:\n    preset: llm-d\n    namespaces: [a]\n")
    discovery = load(path, {"discovery.kubernetes.namespaces": ["b", "c"], "discovery.source": "kubernetes"})
    assert discovery.discovery.kubernetes.namespaces == ("b", "c")
    assert discovery.discovery.kubernetes.preset is Preset.LLM_D  # the file's other keys stay
    assert discovery.discovery.source is SourceKind.KUBERNETES


def test_nested_dotted_override_into_an_empty_or_absent_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "discovery:\n  kubernetes:\n")
    assert load(path, {"discovery.kubernetes.preset": "llm-d"}).discovery.kubernetes.preset is Preset.LLM_D
    assert load(None, {"discovery.kubernetes.preset": "llm-d"}).discovery.kubernetes.preset is Preset.LLM_D


def test_nested_dotted_override_through_a_value_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "discovery:\n  kubernetes: 3\n")
    assert config_error(path, {"discovery.kubernetes.preset": "llm-d"}) == (
        "discovery.kubernetes: expected a mapping"
    )


def test_unknown_nested_kubernetes_key_is_named_with_its_path() -> None:
    message = config_error(overrides={"discovery.kubernetes.namespace": ["a"]})
    assert message.startswith("discovery.kubernetes.namespace: unknown key; allowed keys here: ")
    assert "namespaces" in message


def test_a_relative_kubeconfig_resolves_against_the_config_folder(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "discovery:\n  kubernetes:\n    kubeconfig: kube/config\n")
    assert load(path).discovery.kubernetes.kubeconfig == str(tmp_path.resolve() / "kube" / "config")
    assert load(path, {"discovery.kubernetes.kubeconfig": ""}).discovery.kubernetes.kubeconfig == ""


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"discovery.source": "xds"},
            "discovery.source: 'xds' is not allowed; use one of files, kubernetes, inferencepool",
        ),
        (
            {"discovery.kubernetes.preset": "kserve"},
            "discovery.kubernetes.preset: 'kserve' is not allowed; use one of infernex, llm-d",
        ),
        (
            {"discovery.kubernetes.decode_port": 8.5},
            "discovery.kubernetes.decode_port: 8.5 is not allowed; use a string or an integer",
        ),
        (
            {"discovery.kubernetes.decode_port": 0},
            "discovery.kubernetes.decode_port: 0 is not allowed; use a port in 1..65535",
        ),
        (
            {"discovery.kubernetes.prefill_port": 65536},
            "discovery.kubernetes.prefill_port: 65536 is not allowed; use a port in 1..65535",
        ),
        (
            {"discovery.kubernetes.namespaces": ["ok", "Not_OK"]},
            "discovery.kubernetes.namespaces: 'Not_OK' is not allowed; use namespace names",
        ),
        (
            {"discovery.kubernetes.namespaces": ["a", "b", "a"]},
            "discovery.kubernetes.namespaces: 'a' is listed twice",
        ),
        (
            {"discovery.kubernetes.decode_role": "prefill"},
            "discovery.kubernetes.prefill_role, decode_role and both_role must differ "
            "(they are 'prefill', 'prefill', '')",
        ),
        (
            {"discovery.kubernetes.both_role": "decode"},
            "discovery.kubernetes.prefill_role, decode_role and both_role must differ "
            "(they are 'prefill', 'decode', 'decode')",
        ),
        (
            {"discovery.kubernetes.prefill_role": "pre fill"},
            "discovery.kubernetes.prefill_role: 'pre fill' is not allowed; use a Kubernetes label value",
        ),
    ],
)
def test_kubernetes_values_are_validated(override: dict[str, object], expected: str) -> None:
    assert config_error(overrides=override) == expected


@pytest.mark.parametrize("port", ["8000", "Decode", "a-very-long-port-name", "-port", "port-", "p_1"])
def test_a_port_name_must_be_a_container_port_name(port: str) -> None:
    assert config_error(overrides={"discovery.kubernetes.decode_port": port}).startswith(
        f"discovery.kubernetes.decode_port: {port!r} is not allowed; use a container port name"
    )


@pytest.mark.parametrize(
    "key",
    [
        "role_label",
        "group_label",
        "capacity_annotation",
        "bootstrap_port_annotation",
        "metrics_port_annotation",
    ],
)
@pytest.mark.parametrize("value", ["has space", "/name", "Example.com/name", "example.com/", "a/b/c", "-x"])
def test_label_and_annotation_keys_must_be_kubernetes_keys(key: str, value: str) -> None:
    assert config_error(overrides={f"discovery.kubernetes.{key}": value}) == (
        f"discovery.kubernetes.{key}: {value!r} is not allowed; use a Kubernetes label or annotation key "
        "such as example.com/name"
    )


def test_an_empty_group_label_is_rejected() -> None:
    assert config_error(overrides={"discovery.kubernetes.group_label": ""}).startswith(
        "discovery.kubernetes.group_label: '' is not allowed"
    )


@pytest.mark.parametrize("value", ["openfuyao.com/pdRole", "app", "a.b-c_d", "sub.example.com/x.y"])
def test_good_label_keys_are_accepted(value: str) -> None:
    assert load(overrides={"discovery.kubernetes.role_label": value}).discovery.kubernetes.role_label == value


def test_cli_discovery_and_kubeconfig_flags(cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["serve", "--discovery", "kubernetes", "--kubeconfig", "kube.yaml"]) == 0
    (config,) = cli.started
    assert config.discovery.source is SourceKind.KUBERNETES
    assert config.discovery.kubernetes.kubeconfig == str(tmp_path / "kube.yaml")


def test_the_inferencepool_source_and_its_keys(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        "discovery:\n  source: inferencepool\n  inferencepool: {name: llama3.pool, namespace: serving}\n",
    )
    discovery = load(path).discovery
    assert discovery.source is SourceKind.INFERENCEPOOL
    assert (discovery.inferencepool.name, discovery.inferencepool.namespace) == (
        "llama3.pool",
        "serving",
    )
    assert load().discovery.inferencepool == InferencePoolConfig("", "")


def test_the_inferencepool_source_needs_a_pool_name() -> None:
    assert config_error(overrides={"discovery.source": "inferencepool"}) == (
        "discovery.inferencepool.name: required with discovery.source inferencepool: the name of the "
        "InferencePool whose pods are the endpoints (flag --pool-name)"
    )
    # a name alone is allowed with another source (check-config of a file prepared for later)
    assert load(overrides={"discovery.inferencepool.name": "pool"}).discovery.source is SourceKind.FILES


@pytest.mark.parametrize("name", ["Pool", "pool_1", "-pool", "pool.", "a" * 254, "a b"])
def test_an_inferencepool_name_must_be_an_object_name(name: str) -> None:
    assert config_error(overrides={"discovery.inferencepool.name": name}).startswith(
        f"discovery.inferencepool.name: {name!r} is not allowed; use a Kubernetes object name"
    )


@pytest.mark.parametrize("namespace", ["Team", "team.a", "a" * 64, "-a"])
def test_an_inferencepool_namespace_must_be_a_namespace_name(namespace: str) -> None:
    assert config_error(overrides={"discovery.inferencepool.namespace": namespace}) == (
        f"discovery.inferencepool.namespace: {namespace!r} is not allowed; use a namespace name, or an "
        "empty string for the server's own"
    )


def test_cli_pool_and_health_flags(cli) -> None:
    argv = ["serve", "--discovery", "inferencepool", "--pool-name", "llama", "--pool-namespace", "serving"]
    assert cli.main([*argv, "--health-listen", "0.0.0.0:9003"]) == 0
    (config,) = cli.started
    assert config.discovery.source is SourceKind.INFERENCEPOOL
    assert config.discovery.inferencepool == InferencePoolConfig("llama", "serving")
    assert config.health_listen == "0.0.0.0:9003"


def test_every_serve_flag_sets_its_key(cli, tmp_path: Path) -> None:
    argv = [
        "serve",
        *("--listen", "127.0.0.1:9102", "--metrics-listen", "127.0.0.1:9190"),
        *("--health-listen", "127.0.0.1:9103", "--discovery", "inferencepool"),
        *("--pool-name", "pool", "--pool-namespace", "models", "--kubeconfig", str(tmp_path / "kube")),
        *("--affinity-mode", "strict", "--affinity-bonus", "0.5", "--handoff", "kv-transfer-params"),
        *("--prefill-via", "http://127.0.0.1:10001", "--pd-threshold-tokens", "7", "--serve-eds"),
        *("--max-inflight-requests", "9", "--engine-metrics", "--engine-metrics-interval", "0.5"),
        *("--envoy-admin-url", "http://127.0.0.1:9901", "--eds-file", str(tmp_path / "d.yaml")),
    ]
    assert cli.main(argv) == 0
    (config,) = cli.started
    assert (config.listen, config.metrics_listen, config.health_listen) == (
        "127.0.0.1:9102",
        "127.0.0.1:9190",
        "127.0.0.1:9103",
    )
    discovery = config.discovery
    assert (discovery.source, discovery.inferencepool) == (
        SourceKind.INFERENCEPOOL,
        InferencePoolConfig("pool", "models"),
    )
    assert (discovery.kubernetes.kubeconfig, discovery.eds_files) == (
        str(tmp_path / "kube"),
        (str(tmp_path / "d.yaml"),),
    )
    assert (config.affinity.mode, config.affinity.bonus) == (Mode.STRICT, 0.5)
    assert (config.handoff.mode.value, config.handoff.prefill_via) == (
        "kv-transfer-params",
        "http://127.0.0.1:10001",
    )
    assert (config.routing.pd_threshold_tokens, config.xds.serve_eds) == (7, True)
    assert (config.limits.max_inflight_requests, config.engine_metrics.enabled) == (9, True)
    assert config.engine_metrics.interval_seconds == 0.5
    assert config.envoy_health.admin_url == "http://127.0.0.1:9901"


def test_switches_left_out_keep_the_files_values(cli, tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "xds:\n  serve_eds: true\nengine_metrics:\n  enabled: true\n")
    assert cli.main(["serve", "--config", str(path)]) == 0
    (config,) = cli.started
    assert (config.xds.serve_eds, config.engine_metrics.enabled) == (True, True)


def test_cli_inferencepool_without_pool_name_exits_2(cli, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--discovery", "inferencepool"]) == 2
    assert "discovery.inferencepool.name: required with discovery.source inferencepool" in (
        capsys.readouterr().err
    )


def test_cli_bad_discovery_flag_exits_2(cli, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--discovery", "dns"]) == 2
    assert (
        "--discovery (discovery.source): 'dns' is not allowed; use one of files, kubernetes, inferencepool"
        in capsys.readouterr().err
    )


def test_cli_unusable_kubeconfig_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ext_proc.cli import main

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("not: [a kubeconfig\n")
    argv = ["serve", "--discovery", "kubernetes", "--kubeconfig", str(kubeconfig)]
    assert main([*argv, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert (
        f"pd-extproc: invalid configuration: discovery.kubernetes: cannot use the kubeconfig {kubeconfig}"
        in err
    )


def test_the_tokenizer_and_the_tiers_reach_the_router_and_the_policy(tmp_path) -> None:
    config = load(
        overrides={
            "affinity.prefix.enabled": True,
            "affinity.prefix.tokenizer": str(tmp_path),
            "affinity.prefix.cpu_tier_weight": 0.25,
            "affinity.auto.cpu_tier_gbps": 25,
        }
    ).affinity
    assert config.prefix.settings() == PrefixSettings(tokenizer=str(tmp_path))
    policy = config.policy(2)
    assert policy.cpu_tier_weight == 0.25 and policy.auto.cpu_tier_gbps == 25.0
    defaults = load().affinity.policy(2)
    assert defaults.cpu_tier_weight == 0.5 and defaults.auto.cpu_tier_gbps == 55.0
