"""What the gateway tokenizer costs a 12k-token chat prompt: cold, and with its first 10k tokens cached.

In-process micro-benchmark (not a test). The tokenizer is a byte-level BPE shaped like Llama 3's
(:mod:`sim.tokenizer_folder`: its pre-tokenizer pattern, special tokens and a Llama-3-style chat
template) with a 32k vocabulary, trained here on local text: this repository's docs and sources,
``/usr/share/doc`` and Python's standard library sources (nothing is downloaded; the folder is kept in
``.cache/tokenize_cost/`` and reused; ``--folder`` measures any tokenizer folder instead, e.g. a real
model's). The prompt is a conversation of prose paragraphs from those docs: a system prompt of about
2k tokens, then user and assistant turns until the rendered prompt holds 12k tokens.

- ``cold``: each repetition a different conversation, never seen (an empty prefix cache); what the
  router pays for a new long prompt. The tokenizer's own per-word cache is warm, as in a running gateway.
- ``cached``: the same conversations, each after its previous request (the turns up to about 10k
  tokens) was tokenized: only the new turns are tokenized, after the seam check.
- ``awaited``: ``cached`` through :class:`~ext_proc.tokenize.gateway.GatewayTokenizer` (the hop to its worker
  thread and back included), and ``cold`` likewise.
- ``render``, ``encode``: the cold path's two parts, the chat template alone and the encoder alone.
- ``chain``: :func:`~ext_proc.prefix.blocks.block_hashes` (16-token blocks, as the ``kv-events`` source
  chains a tokenized prompt) over the ``cached`` answer's ids as the tokenizer hands them on;
  ``chain_list``: over the same ids as a list of Python ints (a prompt given as ids in the body, a
  KV event's ``token_ids``).

Each path is timed for each encoder the gateway may run (:data:`ext_proc.tokenize.folder.ENCODERS`):
``fastokens`` and ``tiktoken`` (each when it loads for the folder: checked equal to ``tokenizers`` at
load) and ``tokenizers``, on the same conversations, and every answer is compared id for id with
``tokenizers``'.

Each is timed with ``time.perf_counter`` over ``--reps`` repetitions: p50 and p90 in ms (nearest rank).

Usage (from the repository root)::

    python -m bench.tokenize_cost [--quick] [--reps N] [--folder DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ext_proc.prefix.blocks import block_hashes
from ext_proc.tokenize.cache import PrefixTokenCache
from ext_proc.tokenize.folder import ENCODERS, FAST_ENCODERS, TokenizerSettings, load_prompt_tokenizer
from ext_proc.tokenize.gateway import GatewayTokenizer
from sim.report import percentile
from sim.tokenizer_folder import write_tokenizer_folder

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "tokenize_cost"
VOCAB = 32_000
QUICK_VOCAB = 4_000
CORPUS_CHARS = 24_000_000
"""The most characters of local text the 32k BPE is trained on."""
PROMPT_TOKENS = 12_000
SEEN_TOKENS = 10_000
SYSTEM_TOKENS = 2_000
BLOCK_TOKENS = 16
"""Tokens a block in the ``chain`` paths (vLLM's default block size)."""
IN_PROCESS = ("cold", "cached", "render", "encode", "chain", "chain_list")
"""The paths timed on the calling thread."""
PATHS = (*IN_PROCESS, "awaited_cold", "awaited_cached")
"""Every path timed (module docstring), in the report's order."""
CHAT = "/v1/chat/completions"


def _read(path: Path) -> str:
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, gzip.BadGzipFile, EOFError):
        return ""


def corpus(limit: int, quick: bool) -> Iterator[str]:
    """Local text, at most ``limit`` characters: the repository, ``/usr/share/doc``, the stdlib sources."""
    sources: list[Path] = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("*.md"))
    if not quick:
        sources += sorted(p for d in ("ext_proc", "sim", "bench", "tests") for p in (ROOT / d).rglob("*.py"))
        sources += sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and not p.is_symlink())
        sources += sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    total = 0
    for path in sources:
        text = _read(path)
        if text and total + len(text) <= limit:
            total += len(text)
            yield text


def tokenizer_folder(quick: bool) -> Path:
    """The trained folder in ``.cache/tokenize_cost/`` (trained now when absent)."""
    vocab = QUICK_VOCAB if quick else VOCAB
    folder = CACHE / f"bpe-{vocab}"
    if not (folder / "tokenizer.json").exists():
        started = time.perf_counter()
        write_tokenizer_folder(folder, corpus(CORPUS_CHARS, quick), vocab)
        print(
            f"trained a {vocab}-token BPE in {time.perf_counter() - started:.0f} s: {folder}", file=sys.stderr
        )
    return folder


def paragraphs() -> list[str]:
    """Prose paragraphs of the repository's docs (tables and code blocks left out)."""
    found: list[str] = []
    for page in sorted(ROOT.glob("docs/*.md")):
        for block in page.read_text().split("\n\n"):
            block = block.strip()
            if len(block) > 200 and not block.startswith(("|", "```", "#", "!", "<")):
                found.append(block)
    return found


def conversation(raw: Tokenizer, pool: list[str], rng: random.Random) -> tuple[list[dict[str, str]], int]:
    """Messages rendering to about :data:`PROMPT_TOKENS` tokens, and the length of the turn seen before.

    The turn seen before: how many messages make the one that holds about :data:`SEEN_TOKENS` (the previous
    request of this conversation)."""

    def count(text: str) -> int:
        return len(raw.encode(text, add_special_tokens=False).ids)

    def take(tokens: int) -> str:
        parts: list[str] = []
        while sum(map(count, parts)) < tokens:
            parts.append(rng.choice(pool))
        return "\n\n".join(parts)

    messages = [{"role": "system", "content": take(SYSTEM_TOKENS)}]
    total, seen = count(messages[0]["content"]), 1
    while total < PROMPT_TOKENS:
        role = ("user", "assistant")[len(messages) % 2 - 1]
        messages.append({"role": role, "content": take(rng.randint(100, 400))})
        total += count(f"<|start_header_id|>{role}<|end_header_id|>\n\n{messages[-1]['content']}<|eot_id|>")
        if total <= SEEN_TOKENS and role == "user":
            seen = len(messages)
    return messages, seen


def empty_cache(settings: TokenizerSettings) -> PrefixTokenCache:
    """An empty prefix token cache sized by ``settings``."""
    return PrefixTokenCache(settings.cache_entries, settings.cache_tokens, settings.cache_ttl_s)


def calibration() -> dict[str, float]:
    """How busy and how fast this machine was: the load average and ``sum(range(10**7))`` in ms."""
    started = time.perf_counter()
    sum(range(10**7))
    return {"load_average_1m": os.getloadavg()[0], "python_sum_1e7_ms": (time.perf_counter() - started) * 1e3}


def summary(seconds: list[float]) -> dict[str, float]:
    """The p50 and p90 of ``seconds``, in milliseconds."""
    return {"p50_ms": percentile(seconds, 0.5) * 1e3, "p90_ms": percentile(seconds, 0.9) * 1e3}


def measure(folder: Path, reps: int, seed: int = 1) -> dict[str, Any]:
    """Time the cold and cached paths over ``reps`` conversations with each encoder (module docstring)."""
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(seed)
    pool = paragraphs()
    chats = [conversation(raw, pool, rng) for _ in range(reps)]
    bodies = [({"messages": messages}, {"messages": messages[:seen]}) for messages, seen in chats]
    result: dict[str, Any] = {"folder": str(folder), "vocab": raw.get_vocab_size(), "reps": reps}
    answers: dict[str, list[list[int]]] = {}
    for encoder in ENCODERS:
        fast = tuple(e for e in FAST_ENCODERS if e == encoder)
        settings = TokenizerSettings(str(folder), fast_encoders=fast)
        loaded = load_prompt_tokenizer(settings)
        if loaded.encoder != encoder:
            print(f"{encoder} not used for {folder}: {loaded.why}", file=sys.stderr)
            continue
        result[encoder], answers[encoder] = measure_encoder(settings, bodies)
    result["ids_equal"] = {e: answers[e] == answers["tokenizers"] for e in answers if e != "tokenizers"}
    return result


def measure_encoder(
    settings: TokenizerSettings, bodies: list[tuple[dict[str, Any], dict[str, Any]]]
) -> tuple[dict[str, Any], list[list[int]]]:
    """One encoder's timings over ``bodies`` (its setting ``fast_encoders``), and its cached answers."""
    cold_tokenizer = load_prompt_tokenizer(replace(settings, cache_entries=0)).tokenizer
    for body, _ in bodies[:3]:  # warm the BPE's word cache and jinja's compiled template
        cold_tokenizer.tokens(body, CHAT, 0.0)
    warm = load_prompt_tokenizer(settings).tokenizer  # long-lived as in a gateway: a cache per conversation
    template = cold_tokenizer._template  # the render alone
    encoder = cold_tokenizer._encoder  # the encoder alone
    assert template is not None
    variables = {"bos_token": "<|begin_of_text|>", "add_generation_prompt": True}
    results: dict[str, list[float]] = {k: [] for k in IN_PROCESS}
    sizes: dict[str, list[int]] = {"prompt_tokens": [], "cached_tokens": [], "seen_tokens": []}
    answers: list[list[int]] = []
    for body, earlier in bodies:
        started = time.perf_counter()
        cold_tokenizer.tokens(body, CHAT, 0.0)
        results["cold"].append(time.perf_counter() - started)
        started = time.perf_counter()
        text = template.render({**variables, "messages": body["messages"]})
        results["render"].append(time.perf_counter() - started)
        started = time.perf_counter()
        encoder.encode(text, False)
        results["encode"].append(time.perf_counter() - started)
        warm.cache = empty_cache(settings)
        sizes["seen_tokens"].append(len(warm.tokens(earlier, CHAT, 0.0).ids))
        started = time.perf_counter()
        answer = warm.tokens(body, CHAT, 1.0)
        results["cached"].append(time.perf_counter() - started)
        for name, ids in (("chain", answer.ids), ("chain_list", list(answer.ids))):
            started = time.perf_counter()
            block_hashes(ids, BLOCK_TOKENS, len(ids), 0)
            results[name].append(time.perf_counter() - started)
        answers.append(list(answer.ids))
        sizes["prompt_tokens"].append(len(answer.ids))
        sizes["cached_tokens"].append(answer.cached)
    awaited = asyncio.run(measure_awaited(settings, bodies))
    return {
        **{name: summary(values) for name, values in results.items()},
        **{f"awaited_{name}": summary(values) for name, values in awaited.items()},
        **{
            name: {"min": min(values), "p50": percentile(values, 0.5), "max": max(values)}
            for name, values in sizes.items()
        },
    }, answers


async def measure_awaited(
    settings: TokenizerSettings, bodies: list[tuple[dict[str, Any], dict[str, Any]]]
) -> dict[str, list[float]]:
    """Cold and cached through the gateway tokenizer's worker thread, one request at a time."""

    class Quiet:
        def tokenized(self, seconds: float, tokens: int, cached: int) -> None: ...
        def untokenized(self, reason: str) -> None: ...
        def tokenizer_encoder(self, encoder: str | None) -> None: ...

    times: dict[str, list[float]] = {"cold": [], "cached": []}
    gateway = GatewayTokenizer.open(settings, Quiet())
    assert gateway.tokenizer is not None
    try:
        for body, earlier in bodies:
            gateway.tokenizer.cache = empty_cache(settings)
            started = time.perf_counter()
            await gateway.prompt_tokens(earlier, CHAT)
            times["cold"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await gateway.prompt_tokens(body, CHAT)
            times["cached"].append(time.perf_counter() - started)
    finally:
        gateway.close()
    return times


def spread(values: dict[str, float]) -> str:
    """``values``' min / p50 / max, as whole numbers."""
    return f"{values['min']:.0f} / {values['p50']:.0f} / {values['max']:.0f}"


def report(result: dict[str, Any]) -> str:
    """The benchmark's ``result`` as printable text."""
    encoders = [e for e in ENCODERS if e in result]
    sizes = result[encoders[0]]
    lines = [
        f"tokenizer: {result['folder']} ({result['vocab']} tokens); {result['reps']} conversations of "
        f"{spread(sizes['prompt_tokens'])} tokens, {spread(sizes['seen_tokens'])} seen before, "
        f"{spread(sizes['cached_tokens'])} taken from the cache (min / p50 / max)",
        "".join([f"{'path':<16}", *(f"{e + ' p50':>18}{'p90 ms':>8}" for e in encoders)]),
    ]
    for name in PATHS:
        cells = [f"{result[e][name]['p50_ms']:>18.3f}{result[e][name]['p90_ms']:>8.3f}" for e in encoders]
        lines.append(f"{name:<16}" + "".join(cells))
    lines.append("(awaited_cold: the ~10k-token earlier turn, cold, through the worker thread)")
    for encoder, equal in result["ids_equal"].items():
        lines.append(f"{encoder}'s ids equal tokenizers' on every cached answer: {equal}")
    for when in ("before", "after"):
        machine = result["machine"][when]
        lines.append(
            f"machine {when}: load average {machine['load_average_1m']:.2f}, "
            f"sum(range(10**7)) {machine['python_sum_1e7_ms']:.0f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line ``argv``; print the report (and write JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4k BPE on the docs alone, few repetitions")
    parser.add_argument("--reps", type=int, help="conversations timed (default 200, 5 with --quick)")
    parser.add_argument(
        "--folder", type=Path, help="a tokenizer folder to measure instead of the trained BPE"
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    folder = args.folder or tokenizer_folder(args.quick)
    before = calibration()
    result = measure(folder, args.reps or (5 if args.quick else 200))
    result["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "before": before,
        "after": calibration(),
    }
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
