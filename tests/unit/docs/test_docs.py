"""The documentation cannot drift from the repository: every relative link and anchor of README.md and
docs/ resolves, every ``make`` target and ``pd-extproc`` command (subcommand and flags) quoted as code
exists and reads nothing above the clone, every benchmark command runs a module of ``bench/``, every flag
of ``pd-extproc serve`` and every global one is
quoted in docs/, and
docs/configuration.md lists exactly the keys and defaults of ``ext_proc/config.py``. Each check is also
fed a broken page, so that it is seen to fail."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml
from doc_pages import ROOT, broken_links, code_texts, commands, config_rows, make_targets, pages
from helm_chart import leaf_keys

from ext_proc.cli import build_parser
from ext_proc.config import Config, as_dict

CONFIGURATION = ROOT / "docs" / "configuration.md"
MAKEFILE = ROOT / "Makefile"


def _read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def test_the_manual_has_its_pages() -> None:
    names = {str(page.relative_to(ROOT)) for page in pages()}
    assert {
        "docs/getting-started.md",
        "docs/configuration.md",
        "docs/handoffs.md",
        "docs/operations.md",
        "docs/benchmarks.md",
        "docs/design.md",
        "docs/deploy/envoy.md",
        "docs/deploy/kubernetes.md",
        "docs/deploy/containers.md",
        "docs/deploy/gateways.md",
    } <= names


def test_readme_is_a_front_page() -> None:
    assert len(_read(ROOT / "README.md").split("\n")) <= 200


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    assert broken_links(page, _read(page)) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other\n\n## A `code` heading (with: punctuation)\n\n## Twice\n\n## Twice\n"
    )
    page = tmp_path / "page.md"
    text = (
        "[fine](other.md#a-code-heading-with-punctuation) [fine](other.md#twice-1) [fine](#here)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) ![image](nothing.png) [self](#nowhere)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n# Here\n"
    )
    problems = broken_links(page, text)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md: no such file",
        "other.md#nowhere: no heading with anchor #nowhere in other.md",
        "nothing.png: no such file",
        "#nowhere: no heading with anchor #nowhere in page.md",
    ]


def _unknown_make_targets(text: str, targets: set[str]) -> list[str]:
    return [f"{n}: make {args[0]}" for n, args in commands(text, "make") if args and args[0] not in targets]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_make_targets_exist(page: Path) -> None:
    assert _unknown_make_targets(_read(page), make_targets(MAKEFILE)) == []


def test_an_unknown_make_target_is_found() -> None:
    text = (
        "Run `make demo`, then `make tset`; `make` alone.\n"
        "```bash\nmake vllm-env   # once\ncd x && make bench-all\n```\n"
    )
    assert _unknown_make_targets(text, {"demo", "vllm-env"}) == ["1: make tset", "4: make bench-all"]


def _above_the_clone(text: str) -> list[str]:
    """Quoted code naming a path above the repository (``../shared/x``): a clone has nothing there, and
    the pages' commands run from its root."""
    return [f"{n}: {code.strip()}" for n, code in code_texts(text) if re.search(r"(?<![\w./])\.\./", code)]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_code_reads_nothing_above_the_clone(page: Path) -> None:
    assert _above_the_clone(_read(page)) == []


def test_a_path_above_the_clone_is_found() -> None:
    text = (
        "[a link](../README.md) is fine, `sim/x.jsonl` and `a/../b` too\n"
        "```bash\nT=../shared/traces/t.jsonl\npython bench/x.py ../t.jsonl --count 3\n```\n"
    )
    assert _above_the_clone(text) == [
        "3: T=../shared/traces/t.jsonl",
        "4: python bench/x.py ../t.jsonl --count 3",
    ]


_BENCH_RUN = re.compile(r"\bpython3?\s+(?:-m\s+bench\.(\w+)|bench/(\w+)\.py)")


def _bad_bench_commands(text: str) -> list[str]:
    """Quoted commands that run a benchmark by its path (the benchmarks are a package: ``python -m
    bench.<name>`` from the clone's root) or name a benchmark module that does not exist."""
    problems = []
    for number, code in code_texts(text):
        for match in _BENCH_RUN.finditer(code):
            if match.group(2):
                problems.append(f"{number}: {match.group(0)}: run as python -m bench.{match.group(2)}")
            elif not (ROOT / "bench" / f"{match.group(1)}.py").is_file():
                problems.append(f"{number}: {match.group(0)}: no such benchmark")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_benchmark_commands_run_a_module_that_exists(page: Path) -> None:
    assert _bad_bench_commands(_read(page)) == []


def test_a_benchmark_run_by_path_or_missing_is_found() -> None:
    text = "`python -m bench.overhead` is fine\n```bash\npython bench/overhead.py\npython -m bench.no\n```"
    assert _bad_bench_commands(text) == [
        "3: python bench/overhead.py: run as python -m bench.overhead",
        "4: python -m bench.no: no such benchmark",
    ]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _bad_pd_extproc_commands(text: str) -> list[str]:
    """Quoted ``pd-extproc`` commands naming a subcommand or a flag the CLI does not have."""
    top = build_parser()
    problems = []
    for number, args in commands(text, "pd-extproc"):
        if not args or args[0].startswith("-"):
            parser, flags = top, args
        elif args[0] in _subparsers(top):
            parser, flags = _subparsers(build_parser(args[0]))[args[0]], args[1:]
        else:
            problems.append(f"{number}: pd-extproc {args[0]}: no such subcommand")
            continue
        known = _options(parser) | _options(top)
        problems += [
            f"{number}: pd-extproc {' '.join(args[:1])} {flag}: no such flag"
            for flag in (a.partition("=")[0] for a in flags if a.startswith("--"))
            if flag not in known
        ]
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_pd_extproc_commands_exist(page: Path) -> None:
    assert _bad_pd_extproc_commands(_read(page)) == []


def test_an_unknown_subcommand_or_flag_is_found() -> None:
    text = (
        "`pd-extproc serve --config c.yaml --serve-eds`, `pd-extproc sim --role prefill`, `pd-extproc`\n"
        "```bash\nflock /tmp/bench.lock pd-extproc demo --engines vllm --rate=10\n"
        "pd-extproc serve --config c.yaml \\\n    --no-such-flag   # a comment --ignored\n"
        "helm install pd-extproc charts/pd-extproc\npd-extproc route --fast\n```\n"
        "`pd-extproc sim --role both --warp 2`\n"
    )
    assert _bad_pd_extproc_commands(text) == [
        "5: pd-extproc serve --no-such-flag: no such flag",
        "7: pd-extproc route: no such subcommand",
        "9: pd-extproc sim --warp: no such flag",
    ]


def _serve_and_global_flags() -> set[str]:
    """Every long flag of ``pd-extproc serve`` and of ``pd-extproc`` itself (``--log-level``), as the
    parser has them (a flag added there is demanded here), ``--help`` aside."""
    flags = _options(_subparsers(build_parser("serve"))["serve"]) | _options(build_parser())
    return {flag for flag in flags if flag.startswith("--") and flag != "--help"}


def _undocumented(flags: set[str], codes: Iterable[str]) -> list[str]:
    """The ``flags`` that no piece of ``codes`` quotes as a whole word (``--listen`` is not
    ``--listen-x``), sorted."""
    text = "\n".join(codes)
    return sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))


def test_every_serve_and_global_flag_is_quoted_in_the_manual() -> None:
    manual = [page for page in pages() if page.parent != ROOT]  # docs/, not the README
    codes = [code for page in manual for _, code in code_texts(_read(page))]
    assert _undocumented(_serve_and_global_flags(), codes) == []


def test_an_undocumented_flag_is_found() -> None:
    text = (
        "Use `--listen 0.0.0.0:1`, or --health-listen in prose.\n"
        "```bash\npd-extproc serve --metrics-listen-x 1 --eds-file a\n```\n"
    )
    codes = (code for _, code in code_texts(text))
    flags = {"--listen", "--metrics-listen", "--eds-file", "--health-listen"}
    assert _undocumented(flags, codes) == ["--health-listen", "--metrics-listen"]
    assert {"--listen", "--log-level", "--affinity-bonus"} <= _serve_and_global_flags()


def _flat(tree: dict[str, object], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for name, value in tree.items():
        flat |= _flat(value, f"{prefix}{name}.") if isinstance(value, dict) else {prefix + name: value}
    return flat


def _config_problems(text: str, defaults: dict[str, object]) -> list[str]:
    """Keys missing from the page, documented twice or unknown, and defaults that differ."""
    documented: dict[str, str] = {}
    problems = []
    for keys, values in config_rows(text):
        if len(values) not in (1, len(keys)):
            problems.append(f"{keys}: {len(values)} defaults for {len(keys)} keys")
            continue
        for key, value in zip(keys, values * len(keys) if len(values) == 1 else values, strict=True):
            if key in documented:
                problems.append(f"{key}: documented twice")
            documented[key] = value
    problems += [f"{key}: not documented" for key in defaults if key not in documented]
    for key, value in documented.items():
        if key not in defaults:
            problems.append(f"{key}: not a configuration key")
        elif yaml.safe_load(value) != defaults[key]:
            problems.append(f"{key}: documented default {value}, config.py has {defaults[key]!r}")
    return problems


def test_configuration_page_lists_every_key_and_its_default() -> None:
    defaults = _flat(as_dict(Config()))
    assert set(defaults) == leaf_keys(as_dict(Config()))
    assert _config_problems(_read(CONFIGURATION), defaults) == []


def test_a_missing_unknown_or_wrong_key_is_found() -> None:
    text = (
        "## Configuration reference\n\n| key | default | meaning |\n|---|---|---|\n"
        "| `listen` | `0.0.0.0:9002` | gRPC |\n| `a.x`, `y` | `1`, `2` | two |\n| `a.z` | `true` | off |\n"
        '| `a.x` | `1` | again |\n| `b.gone` | `""` | removed |\n\n'
        "## Next\n\n| `c.after` | `1` | not in the table |\n"
    )
    defaults = {"listen": "0.0.0.0:9002", "a.x": 1, "a.y": 2, "a.z": False, "a.w": 0.25, "c.after": 1}
    assert _config_problems(text, defaults) == [
        "a.x: documented twice",
        "a.w: not documented",
        "c.after: not documented",
        "a.z: documented default true, config.py has False",
        "b.gone: not a configuration key",
    ]
