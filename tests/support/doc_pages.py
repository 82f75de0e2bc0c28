"""Reading the documentation pages (README.md, docs/**/*.md) as tests/unit/docs/test_docs.py checks them:
their headings' anchors (GitHub's rule), relative links, quoted ``make`` and ``pd-extproc`` commands, and the
configuration reference table. Pure functions of a page's text, so the checks can be fed broken pages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Line:
    """One line of a page: its number (1-based), its text, and whether it is inside a fenced block."""

    number: int
    text: str
    fenced: bool


def lines(text: str) -> Iterator[Line]:
    """The page's lines; the fence lines themselves (```` ``` ````, ``~~~``) count as fenced."""
    fence: str | None = None
    for number, raw in enumerate(text.split("\n"), start=1):
        marker = re.match(r"^\s*(```|~~~)", raw)
        if marker and fence is None:
            fence = marker.group(1)
            yield Line(number, raw, True)
        elif marker and raw.strip().startswith(fence or "\0"):
            fence = None
            yield Line(number, raw, True)
        else:
            yield Line(number, raw, fence is not None)


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markup dropped, lower case, every character but letters,
    digits, ``_``, ``-`` and spaces removed, spaces turned into ``-``."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_]{2}(.+?)[*_]{2}", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, repeated ones numbered ``-1``, ``-2``, … as GitHub does."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in lines(text):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line.text)
        if heading and not line.fenced:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def _prose(text: str) -> str:
    """A prose line with its code spans blanked, so that nothing quoted as code reads as a link."""
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code."""
    for line in lines(text):
        if not line.fenced:
            for match in _LINK.finditer(_prose(line.text)):
                yield line.number, match.group(1)


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links of ``page`` whose file (or heading anchor in a Markdown file) does not exist."""
    problems = []
    for number, target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.name}:{number}: {target}"
        if path_part and not file.exists():
            problems.append(f"{where}: no such file")
        elif anchor and file.suffix == ".md":
            headings = anchors(file.read_text(encoding="utf-8") if path_part else text)
            if anchor not in headings:
                problems.append(f"{where}: no heading with anchor #{anchor} in {file.name}")
    return problems


def code_texts(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every piece of code: each code span, and each line of a fenced block (a line
    ending in ``\\`` joined with the next)."""
    pending = ""
    for line in lines(text):
        if line.fenced:
            if re.match(r"^\s*(```|~~~)", line.text):
                continue
            if line.text.rstrip().endswith("\\"):
                pending += line.text.rstrip()[:-1] + " "
                continue
            yield line.number, pending + line.text
            pending = ""
        else:
            for match in _CODE_SPAN.finditer(line.text):
                yield line.number, match.group(2)


_COMMAND_START = r"(?:^|[;&|(]\s*|\$\s+|\.venv/bin/|\bexec\s+|\bflock\s+\S+\s+)"


def commands(text: str, program: str) -> Iterator[tuple[int, list[str]]]:
    """(line, arguments) of every command ``program …`` quoted as code, in a command's position (the
    start of the code, after a shell separator, ``$``, ``.venv/bin/`` or ``flock LOCK``); the
    arguments end at a comment, a pipe or the next command. A name followed by anything but a
    word or a flag (``pd-extproc (gRPC, …)`` in a diagram) is no command."""
    pattern = re.compile(_COMMAND_START + re.escape(program) + r"(?=[ \t]|$)(.*)")
    for number, code in code_texts(text):
        for match in pattern.finditer(code.strip()):
            args = re.split(r"\s#|\s\|\s|\s&&\s|\s;\s|;\s", match.group(1))[0].split()
            if not args or re.match(r"^(--)?[a-z][\w-]*", args[0]):  # not a diagram's label
                yield number, args


def make_targets(makefile: Path) -> set[str]:
    """The targets the Makefile defines (rules ``name:`` at the start of a line)."""
    found = set()
    for line in makefile.read_text(encoding="utf-8").split("\n"):
        rule = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", line)
        if rule and not rule.group(1).startswith("."):
            found.add(rule.group(1))
    return found


def config_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(keys, defaults) of every row of the table under the "Configuration reference" heading: the
    keys are the first cell's code spans (a name without a dot continues the first key's section,
    ``affinity.auto.num_layers``, ``num_kv_heads``), the defaults the second cell's (one for every
    key, or one shared by all)."""
    rows = []
    section = text.partition("## Configuration reference")[2]
    for line in section.split("\n"):
        if line.startswith("#"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = [m.group(2) for m in _CODE_SPAN.finditer(cells[0])]
        keys = [names[0]] + [
            n if "." in n else f"{names[0].rpartition('.')[0]}.{n}".lstrip(".") for n in names[1:]
        ]
        defaults = [m.group(2) for m in _CODE_SPAN.finditer(cells[1])]
        rows.append((keys, defaults))
    return rows
