"""The ``pd-extproc`` command line: every subcommand is listed, only the one used is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ext_proc.cli import main


def test_serve_never_imports_the_simulator() -> None:
    """The product path (the parser, the configuration, the server app) loads no ``sim`` module."""
    code = (
        "import sys\n"
        "import ext_proc.app\n"
        "from ext_proc.cli import main\n"
        "assert main(['serve', '--affinity-mode', 'sideways']) == 2\n"
        "print(sorted(m for m in sys.modules if m == 'sim' or m.startswith('sim.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "invalid configuration: affinity.mode" in result.stderr


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{serve,sim,demo}" in out
    for line in (
        "run the ext_proc routing server",
        "run one simulated vLLM PD engine",
        "compare affinity modes on a simulated PD cluster",
    ):
        assert line in out


@pytest.mark.parametrize(
    ("command", "option"), [("sim", "--decode-step-ms"), ("demo", "--requests"), ("serve", "--eds-file")]
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
