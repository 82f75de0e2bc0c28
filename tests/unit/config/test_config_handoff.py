"""Configuration of the engine handoffs and of conditional disaggregation: defaults, flags, and
every value that is refused with a message naming the key."""

from __future__ import annotations

import pytest

from ext_proc.checks import ConfigError
from ext_proc.cli import main
from ext_proc.config import ENV_HANDOFF, load_config
from ext_proc.handoff.base import FailurePolicy, HandoffMode
from ext_proc.handoff.config import MAX_PREFILL_TIMEOUT


def error(overrides: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides, environ={})
    return str(info.value)


def test_defaults_keep_the_sidecar_and_disaggregate_prompts_from_512_tokens():
    config = load_config(None, {}, environ={})
    assert config.routing.pd_threshold_tokens == 512
    assert config.handoff.mode is HandoffMode.SIDECAR
    assert config.handoff.on_prefill_failure is FailurePolicy.DECODE_ONLY
    assert (config.handoff.prefill_via, config.handoff.prefill_timeout_seconds) == ("", 120.0)
    assert config.handoff.default_bootstrap_port == 8998
    assert config.handoff.eject_failed_prefill_seconds == 5.0


@pytest.mark.parametrize("mode", [m.value for m in HandoffMode])
def test_every_handoff_mode_is_accepted(mode):
    assert load_config(None, {"handoff.mode": mode}, environ={}).handoff.mode.value == mode


def test_environment_selects_the_handoff_over_the_file_and_under_the_flag(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("handoff:\n  mode: sglang-bootstrap\n", encoding="utf-8")
    env = {ENV_HANDOFF: "kv-transfer-params"}
    assert load_config(str(path), {}, environ=env).handoff.mode is HandoffMode.KV_TRANSFER_PARAMS
    assert load_config(None, {}, environ=env).handoff.mode is HandoffMode.KV_TRANSFER_PARAMS
    flag = {"handoff.mode": "sidecar"}
    assert load_config(str(path), flag, environ=env).handoff.mode is HandoffMode.SIDECAR


def test_environment_handoff_that_is_not_a_mode_is_refused_naming_the_variable_and_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, {}, environ={ENV_HANDOFF: "vllm"})
    assert f"{ENV_HANDOFF} (handoff.mode): 'vllm' is not allowed" in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "handoff.mode",
            "vllm",
            "handoff.mode: 'vllm' is not allowed; use one of sidecar, kv-transfer-params",
        ),
        ("handoff.on_prefill_failure", "retry", "use one of decode-only, error"),
        ("handoff.prefill_via", "127.0.0.1:10001", "handoff.prefill_via: '127.0.0.1:10001' is not allowed"),
        ("handoff.prefill_via", "http://127.0.0.1:10001/v1", "(no path)"),
        ("handoff.prefill_via", "ftp://127.0.0.1:10001", "use a base URL"),
        ("handoff.prefill_via", "http://", "use a base URL"),
        ("handoff.prefill_timeout_seconds", 0, "must be a number in (0, 1795]"),
        ("handoff.prefill_timeout_seconds", MAX_PREFILL_TIMEOUT + 1, "must be a number in (0, 1795]"),
        ("handoff.default_bootstrap_port", 0, "must be a port in 1..65535"),
        ("handoff.default_bootstrap_port", 70000, "must be a port in 1..65535"),
        ("handoff.eject_failed_prefill_seconds", -1, "must be a number in [0, 1795]"),
        ("handoff.eject_failed_prefill_seconds", MAX_PREFILL_TIMEOUT + 1, "must be a number in [0, 1795]"),
        ("routing.pd_threshold_tokens", -1, "routing.pd_threshold_tokens: must be an integer >= 0"),
        ("routing.pd_threshold_tokens", 1.5, "routing.pd_threshold_tokens: 1.5 is not allowed"),
    ],
)
def test_bad_values_are_refused_naming_the_key(key, value, message):
    assert message in error({key: value})


@pytest.mark.parametrize(
    "via", ["http://127.0.0.1:10001", "http://envoy.local:10001/", "https://[::1]:10001"]
)
def test_base_urls_are_accepted(via):
    assert load_config(None, {"handoff.prefill_via": via}, environ={}).handoff.prefill_via == via


def test_the_serve_flags_set_the_handoff(capsys):
    assert main(["serve", "--handoff", "sglang", "--listen", "127.0.0.1:0"]) == 2
    assert "--handoff (handoff.mode): 'sglang' is not allowed" in capsys.readouterr().err
    assert main(["serve", "--prefill-via", "nohost"]) == 2
    assert "--prefill-via (handoff.prefill_via): 'nohost' is not allowed" in capsys.readouterr().err
    assert main(["serve", "--pd-threshold-tokens", "-3"]) == 2
    assert (
        "--pd-threshold-tokens (routing.pd_threshold_tokens): must be an integer >= 0"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("source", ["file", "flag"])
def test_the_layerwise_mooncake_handoff_is_refused_with_why_and_what_instead(tmp_path, source) -> None:
    """vllm-ascend's MooncakeLayerwiseConnector would crash a prefill on a prefill-first leg: refused."""
    path = tmp_path / "c.yaml"
    path.write_text("handoff:\n  mode: mooncake-layerwise\n" if source == "file" else "{}\n")
    overrides = {} if source == "file" else {"handoff.mode": "mooncake-layerwise"}
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides, environ={})
    message = str(error.value)
    assert message.startswith("handoff.mode: 'mooncake-layerwise' is not supported")
    assert "remote_cached_tokens" in message and "kv-transfer-params" in message and "metaserver" in message
