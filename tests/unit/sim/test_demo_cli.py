"""``pd-extproc demo``'s command line refusals: a trace that cannot be replayed as asked, and options of
the other kind of engines, each one line on stderr and exit 2, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ext_proc.cli import main
from sim.traces import SAMPLE


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_a_malformed_trace_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(SAMPLE.read_text().splitlines()[0] + '\n{"timestamp": 3}\n', encoding="utf-8")
    err = _refused(capsys, ["--trace", str(trace)])
    assert f"pd-extproc demo: {trace}:2: not a Mooncake trace line: missing input_length" in err


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--format", "parquet"], "--format: unknown trace format 'parquet'; choose from mooncake, azure"),
        (["--start", "199", "--count", "5"], "--start 199 --count 5: the window runs past the end"),
        (["--start", "300"], "the window runs past the end"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read the trace"),
        (["--trace", str(SAMPLE), "--format", "azure"], ":1: not an Azure trace"),
    ],
)
def test_a_window_that_cannot_be_read_names_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], phrase: str
) -> None:
    assert phrase in _refused(capsys, argv)


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--requests", "10"], "--requests: the demo on --engines sim runs a trace"),
        (["--rate", "5", "--requests", "3"], "--requests, --rate: the demo on --engines sim"),
        (["--engines", "vllm", "--trace", str(SAMPLE)], "--trace: the demo on --engines vllm runs its own"),
        (["--engines", "vllm", "--profile", "legacy"], "--profile: the demo on --engines vllm"),
    ],
)
def test_options_of_the_other_engines_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], phrase: str
) -> None:
    assert phrase in _refused(capsys, argv)
