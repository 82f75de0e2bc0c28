"""load_config: defaults < YAML < environment < overrides, validation messages, and the CLI exit code."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import yaml

from ext_proc.affinity import Mode
from ext_proc.config import (
    ENV_AFFINITY_BONUS,
    ENV_AFFINITY_MODE,
    AffinityConfig,
    Config,
    ConfigError,
    ConfigSource,
    DiscoveryConfig,
    LoadConfig,
    RoutingConfig,
    as_dict,
    load_config,
)

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
    assert config.metrics_listen == "0.0.0.0:9090"
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
    assert message.startswith("affinity.mode: 'sideways' is not allowed")


# --- validation errors -------------------------------------------------------------------------


def test_unknown_top_level_key_is_named_with_the_allowed_keys(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "listn: 0.0.0.0:1\n"))
    assert message == (
        "listn: unknown key; allowed keys here: affinity, discovery, handoff, listen, load, metrics_listen, "
        "routing"
    )


def test_unknown_nested_key_is_named_with_its_section(tmp_path: Path) -> None:
    message = config_error(write_yaml(tmp_path, "affinity:\n  bouns: 0.2\n"))
    assert message == "affinity.bouns: unknown key; allowed keys here: bonus, mode"


def test_unknown_override_key_is_rejected() -> None:
    message = config_error(overrides={"routing.fallbacks": 3})
    assert message.startswith("routing.fallbacks: unknown key; allowed keys here: ")
    assert "fallback_count" in message


@pytest.mark.parametrize("mode", ["sideways", "Strict", 1, None])
def test_bad_mode_lists_off_prefer_and_strict(mode: object) -> None:
    message = config_error(overrides={"affinity.mode": mode})
    assert message == f"affinity.mode: {mode!r} is not allowed; use one of off, prefer, strict"


def test_an_unquoted_off_in_yaml_is_explained(tmp_path: Path) -> None:
    """YAML 1.1 reads ``mode: off`` as false: the message says to quote it."""
    assert config_error(write_yaml(tmp_path, "affinity:\n  mode: off\n")) == (
        "affinity.mode: False is not allowed; use one of off, prefer, strict "
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


@pytest.mark.parametrize("key", ["listen", "metrics_listen"])
@pytest.mark.parametrize("value", ["9002", "localhost:", ":9002", "host:port", "host:70000", "host:-1"])
def test_bad_listen_address_is_rejected(key: str, value: str) -> None:
    assert config_error(overrides={key: value}) == (
        f"{key}: {value!r} is not allowed; use host:port, e.g. 0.0.0.0:9002"
    )


@pytest.mark.parametrize("value", ["[::]:0", "localhost:65535", "10.0.0.1:80"])
def test_good_listen_addresses_are_accepted(value: str) -> None:
    assert load(overrides={"listen": value}).listen == value


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
    assert "affinity.mode: 'sideways' is not allowed; use one of off, prefer, strict" in err


def test_cli_flag_overrides_environment_and_is_validated(
    cli, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_AFFINITY_BONUS, "0.2")
    assert cli.main(["serve", "--affinity-bonus", "1.5"]) == 2
    assert "affinity.bonus: 1.5 is not allowed" in capsys.readouterr().err


def test_cli_rejects_bad_environment_variable(
    cli, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_AFFINITY_MODE, "sideways")
    assert cli.main(["serve"]) == 2
    assert "affinity.mode: 'sideways' is not allowed" in capsys.readouterr().err


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
    assert data["affinity"] == {"mode": "strict", "bonus": 0.3}
    assert data["discovery"]["eds_files"] == ["/e/p.yaml"]  # type: ignore[index]
    text = yaml.safe_dump(data, sort_keys=False)  # plain data: safe_dump refuses enums
    assert load(write_yaml(tmp_path, text)) == config


def test_the_shipped_example_config_loads_and_names_every_key() -> None:
    path = Path(__file__).resolve().parents[1] / "config" / "pd-extproc.yaml"
    config = load(path)
    assert config == Config(discovery=config.discovery)  # every other value is the default
    assert [Path(p).name for p in config.discovery.eds_files] == ["prefill.yaml", "decode.yaml"]
    assert all(Path(p).is_file() for p in config.discovery.eds_files)
    text = path.read_text()
    for section in ("discovery", "affinity", "load", "routing"):
        for key in getattr(config, section).__dataclass_fields__:
            assert f"  {key}:" in text, f"{section}.{key} is not documented in {path.name}"
