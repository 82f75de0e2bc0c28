"""What the Dockerfile's final stage asks of ``BASE_IMAGE``: nothing but the python3 its virtualenv runs
on. It runs no command (a minimal Debian with python3 and venv has no groupadd/useradd, no adduser),
starts from the build stage's base and runs as a numeric, unprivileged user. The image itself is built
and run by ``make test-compose`` (tests/compose/compose_e2e.py, real Docker)."""

from __future__ import annotations

import re
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comments dropped, continued lines joined."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (keyword.upper(), arguments.strip())
        for keyword, _, arguments in (line.strip().partition(" ") for line in joined.splitlines())
        if keyword
    ]


def final_stage(text: str) -> list[tuple[str, str]]:
    """The instructions of the last stage, its ``FROM`` first."""
    steps = instructions(text)
    start = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[start:]


def test_the_parser_sees_a_continued_run_of_the_last_stage() -> None:
    text = "FROM a AS build\nRUN x\nFROM a\n# groupadd here is a comment\nRUN groupadd g \\\n && useradd u\n"
    assert final_stage(text) == [("FROM", "a"), ("RUN", "groupadd g   && useradd u")]


def test_the_final_stage_runs_nothing_and_uses_a_numeric_user() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    steps = final_stage(text)
    build = next(arguments for keyword, arguments in instructions(text) if keyword == "FROM")
    assert steps[0] == ("FROM", build.removesuffix(" AS build")), "both stages on the same BASE_IMAGE"
    assert [arguments for keyword, arguments in steps if keyword == "RUN"] == []
    users = [arguments for keyword, arguments in steps if keyword == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users
