"""A prompt as a chain of block hashes: what a prefix cache can hold of it.

Engines cache a prompt's KV in fixed-size blocks keyed by a hash chained over the blocks before it
(vLLM: 16 tokens a block; block ``i``'s hash covers the tokens of blocks ``0..i``), so two prompts
share cache exactly as far as their leading blocks agree. The gateway has no tokenizer: it hashes
token ids when the body carries them (``prompt`` / ``input`` as ids) and otherwise the prompt text in
chunks of ``CHARS_PER_TOKEN * block_tokens`` characters — the same 4 characters a token the load
accounting estimates (:mod:`ext_proc.request`). Text chunks do not line up with an engine's token
blocks, but both chains stop agreeing where the prompts stop agreeing, so the length of the common
prefix they measure is the same within a block.

Pure: no I/O. Hashes are Python's ``hash`` of ``(previous, block)`` tuples: equal within one process
(string hashing is salted per process, so each gateway replica keeps its own index).
"""

from __future__ import annotations

from collections.abc import Sequence

CHARS_PER_TOKEN = 4
"""Characters of prompt text per estimated token (:func:`ext_proc.request.describe` counts so)."""


def prompt_content(body: dict[str, object]) -> str | list[int] | None:
    """The prompt of a parsed request body as the engines' caches see it; ``None`` without a prompt.

    Its text (chat message contents and text parts, or completions / responses prompt strings,
    concatenated in order) or its token ids (``prompt`` / ``input`` as ids, several rows concatenated).
    The body was already validated by :func:`ext_proc.request.describe`; parts of other types
    (images, say) are skipped, as the token estimate skips them.
    """
    if "messages" in body:
        return _chat_text(body["messages"])
    for field in ("prompt", "input"):
        if field in body:
            return _prompt(body[field])
    return None


def _chat_text(messages: object) -> str:
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "".join(texts)


def _prompt(prompt: object) -> str | list[int] | None:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        return None
    first = prompt[0]
    if isinstance(first, str):
        return "".join(p for p in prompt if isinstance(p, str))
    if isinstance(first, int):
        return [p for p in prompt if isinstance(p, int)]
    if isinstance(first, dict):  # Responses API input items shaped like chat messages
        return _chat_text(prompt)
    if isinstance(first, list):
        return [t for row in prompt if isinstance(row, list) for t in row if isinstance(t, int)]
    return None


def block_hashes(
    content: str | Sequence[int], block_tokens: int, max_blocks: int, seed: int = 0
) -> list[int]:
    """The chained hashes of the full blocks of ``content``, at most ``max_blocks`` of them.

    A block is ``block_tokens`` ids for token ids, else ``CHARS_PER_TOKEN * block_tokens`` characters;
    a partial last block is not cached (as in vLLM). ``seed`` starts the chain (e.g. the model name's
    hash: different models share no cache)."""
    size = block_tokens if not isinstance(content, str) else CHARS_PER_TOKEN * block_tokens
    count = min(len(content) // size, max_blocks)
    hashes: list[int] = []
    h = seed
    if isinstance(content, str):
        for start in range(0, count * size, size):
            h = hash((h, content[start : start + size]))
            hashes.append(h)
    else:
        for start in range(0, count * size, size):
            h = hash((h, *content[start : start + size]))
            hashes.append(h)
    return hashes
