"""The ``pd-extproc`` command line: every subcommand is listed, only the one used is imported."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ext_proc.affinity.config import AutoConfig
from ext_proc.cli import main
from ext_proc.config import ENV_AFFINITY_BONUS, ENV_AFFINITY_MODE, load_config
from ext_proc.prefix.config import PrefixConfig
from sim.tokenizer_folder import write_tokenizer_folder

SHIPPED_CONFIG = Path(__file__).resolve().parents[3] / "config" / "pd-extproc.yaml"


def test_serve_never_imports_the_simulator() -> None:
    """The product path (the parser, the configuration, the server app) loads no module of the simulator,
    the rig or the demo command."""
    code = (
        "import sys\n"
        "import ext_proc.app\n"
        "from ext_proc.cli import main\n"
        "assert main(['serve', '--affinity-mode', 'sideways']) == 2\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('sim', 'rig', 'demo')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "invalid configuration: --affinity-mode (affinity.mode)" in result.stderr


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{serve,check-config,explain,envoy-bootstrap,sim,demo}" in out
    for line in (
        "run the ext_proc routing server",
        "validate and print the effective configuration",
        "the pair a running server would pick now, and why",
        "print an Envoy bootstrap listing many pd-extprocs",
        "run one simulated vLLM PD engine",
        "compare affinity modes on a simulated PD cluster",
    ):
        assert line in out


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("sim", "--decode-step-ms"),
        ("demo", "--requests"),
        ("serve", "--eds-file"),
        ("check-config", "--config"),
    ],
)
def test_each_subcommand_help_shows_its_own_options(
    capsys: pytest.CaptureFixture[str], command: str, option: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "warning", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pd-extproc {command} ") and option in out


def test_a_simulator_subcommand_still_validates_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--group", "g"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --role" in capsys.readouterr().err


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No affinity variables from the calling environment."""
    monkeypatch.delenv(ENV_AFFINITY_MODE, raising=False)
    monkeypatch.delenv(ENV_AFFINITY_BONUS, raising=False)
    return monkeypatch


def test_check_config_prints_the_effective_configuration_that_loads_back_the_same(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["check-config", "--config", str(SHIPPED_CONFIG)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith(f"# {SHIPPED_CONFIG} is valid. Effective configuration")
    printed = yaml.safe_load(captured.out)
    assert printed["affinity"] == {
        "mode": "prefer",
        "bonus": 0.3,
        "auto": dataclasses.asdict(AutoConfig()),
        "prefix": dataclasses.asdict(PrefixConfig()),
    }
    assert printed["handoff"]["on_prefill_failure"] == "decode-only"
    assert [Path(p).name for p in printed["discovery"]["eds_files"]] == ["prefill.yaml", "decode.yaml"]
    effective = tmp_path / "effective.yaml"
    effective.write_text(captured.out)
    assert load_config(str(effective), environ={}) == load_config(str(SHIPPED_CONFIG), environ={})


def test_check_config_shows_the_environment_it_would_run_with(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("affinity:\n  mode: strict\n")
    clean_env.setenv(ENV_AFFINITY_BONUS, "0.05")
    assert main(["check-config", "--config", str(path)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["affinity"]
    assert (printed["mode"], printed["bonus"]) == ("strict", 0.05)


def test_check_config_says_the_kv_events_block_size_comes_from_the_engines(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("affinity:\n  prefix: {enabled: true, source: kv-events}\n")
    assert main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == (
        "# affinity.prefix.block_tokens (16) is the kv-events index's block size only until the engines' "
        "events give theirs: the first size heard is the pool's, and an engine whose events are of another "
        "is named in serve's log and in /healthz (kv_events.unusable)"
    )
    assert yaml.safe_load(out)["affinity"]["prefix"]["block_tokens"] == 16
    assert main(["check-config", "--config", str(SHIPPED_CONFIG)]) == 0
    assert "block_tokens" not in capsys.readouterr().out.splitlines()[1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "affinity:\n  mode: sometimes\n",
            "affinity.mode: 'sometimes' is not allowed; use one of off, prefer, strict, auto",
        ),
        ("affinity:\n  bonus: 2\n", "affinity.bonus: 2.0 is not allowed; use a number in [0, 1]"),
        (
            "handoff:\n  mdoe: sidecar\n",
            "handoff.mdoe: unknown key; allowed keys here: default_bootstrap_port, ",
        ),
    ],
    ids=["mode", "bonus", "typo"],
)
def test_check_config_exits_2_naming_the_key_and_the_allowed_values(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["check-config", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"pd-extproc: invalid configuration: {message}")


def test_check_config_needs_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["check-config"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --config" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda folder: None, "no such folder"),
        (lambda folder: folder.mkdir(), "no tokenizer.json in it"),
        (
            lambda folder: (folder.mkdir(), (folder / "tokenizer.json").mkdir())[-1],
            "tokenizer.json: cannot read",
        ),
        (
            lambda folder: (folder.mkdir(), (folder / "tokenizer.json").write_text("{}"))[-1],
            "not a tokenizer",
        ),
    ],
    ids=["missing", "empty", "unreadable", "not-a-tokenizer"],
)
def test_check_config_warns_of_a_tokenizer_folder_that_does_not_load_here(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, damage, message: str
) -> None:
    """The folder may be mounted only where pd-extproc runs (a chart's volume): a warning, not an error."""
    folder = tmp_path / "tokenizer"
    damage(folder)
    path = tmp_path / "c.yaml"
    path.write_text(
        f"affinity:\n  prefix:\n    enabled: true\n    source: kv-events\n    tokenizer: '{folder}'\n"
    )
    assert main(["check-config", "--config", str(path)]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["affinity"]["prefix"]["tokenizer"] == str(folder)
    assert captured.err.startswith(f"pd-extproc: warning: affinity.prefix.tokenizer: {folder}")
    assert message in captured.err and "on this machine" in captured.err and "no_tokenizer" in captured.err
    path.write_text(f"affinity:\n  prefix:\n    enabled: false\n    tokenizer: '{folder}'\n")
    assert main(["check-config", "--config", str(path)]) == 0  # not used: not loaded
    assert capsys.readouterr().err == ""


def test_check_config_accepts_a_tokenizer_folder_that_loads(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    docs = sorted((SHIPPED_CONFIG.parents[1] / "docs").glob("*.md"))[:2]
    folder = write_tokenizer_folder(tmp_path / "tokenizer", (p.read_text() for p in docs), vocab_size=500)
    path = tmp_path / "c.yaml"
    path.write_text(f"affinity:\n  prefix:\n    enabled: true\n    tokenizer: '{folder}'\n")
    assert main(["check-config", "--config", str(path)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["affinity"]["prefix"]["tokenizer"] == str(folder)


def test_check_config_exits_1_naming_an_eds_file_that_does_not_exist(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``serve`` would start on it, warn and poll (tests/unit/discovery/test_eds.py): ``check-config`` says
    so, still printing the effective configuration."""
    (tmp_path / "prefill.yaml").write_text((SHIPPED_CONFIG.parents[1] / "envoy/eds/prefill.yaml").read_text())
    path = tmp_path / "c.yaml"
    path.write_text("discovery:\n  eds_files: [prefill.yaml, decode.yaml, eds]\n")
    (tmp_path / "eds").mkdir()  # a folder is no file either
    assert main(["check-config", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"pd-extproc: error: discovery.eds_files: {tmp_path / name}: no such file (serve would start without "
        "its endpoints, warn and poll until it appears)"
        for name in ("decode.yaml", "eds")
    ]
    assert captured.out.startswith(
        f"# {path} names an EDS file that is missing here. Effective configuration"
    )
    assert yaml.safe_load(captured.out)["discovery"]["eds_files"][1] == str(tmp_path / "decode.yaml")
    path.write_text("discovery:\n  eds_files: [prefill.yaml, decode.yaml]\n  source: kubernetes\n")
    assert main(["check-config", "--config", str(path)]) == 0  # not read from kubernetes: not checked
    assert capsys.readouterr().err == ""
