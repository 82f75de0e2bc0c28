"""The prefix-routing benchmark's workloads, as conversations of chat turns (seeded, planned up front).

* **A, shared system prompts**: ``tenants`` tenants, each a system prompt of 4-6k tokens; every request
  is one tenant's prompt plus a short question (20-200 tokens), the tenant drawn by a Zipf law over
  the tenants (a few popular, a long tail), Poisson arrivals.
* **B, multi-turn chat**: conversations arriving as a Poisson process, each with its own system prompt
  (1-2k tokens) and 3-6 turns; each turn sends the whole history (every earlier question and the
  engine's reply to it) plus a new question (50-300 tokens), a think time after the previous reply.
* **D, low reuse**: the control: every prompt unique (512-4,096 tokens, the demo's), Poisson arrivals.

Text is random hexadecimal, exactly 4 characters a token by the gateway's and the simulator's
estimate, so any two prompts share exactly the prefix the workload gives them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OUTPUT_TOKENS = (16, 96)
"""Output budget of every request, tokens (uniform), as in the routing benchmark."""


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its question, output budget and think time.

    ``user``: the new question; ``think_s``: seconds waited after the previous turn's reply (0 for a first
    turn)."""

    user: str
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another from ``start`` seconds on, each with the whole history."""

    start: float
    system: str
    turns: tuple[Turn, ...]


def messages(conversation: Conversation, turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The chat messages of turn ``turn``: the system prompt, the history and the new question.

    ``replies``: the engine's text of every earlier turn."""
    out = [{"role": "system", "content": conversation.system}] if conversation.system else []
    for earlier, reply in zip(conversation.turns[:turn], replies, strict=True):
        out += [{"role": "user", "content": earlier.user}, {"role": "assistant", "content": reply}]
    return [*out, {"role": "user", "content": conversation.turns[turn].user}]


def _text(rng: random.Random, tokens: int) -> str:
    return rng.randbytes(2 * tokens).hex()


def _budget(rng: random.Random) -> int:
    return rng.randint(*OUTPUT_TOKENS)


def shared_prompts(
    seed: int,
    requests: int,
    rate: float,
    tenants: int = 120,
    prefix: tuple[int, int] = (4000, 6000),
    zipf: float = 0.5,
) -> list[Conversation]:
    """Workload A (see the module docstring); tenant ``k`` (0-based) weighs ``(k + 1) ** -zipf``."""
    rng = random.Random(seed)
    prompts = [_text(rng, rng.randint(*prefix)) for _ in range(tenants)]
    weights = [(k + 1) ** -zipf for k in range(tenants)]
    out, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        system = rng.choices(prompts, weights)[0]
        out.append(Conversation(now, system, (Turn(_text(rng, rng.randint(20, 200)), _budget(rng)),)))
    return out


def multi_turn(seed: int, conversations: int, rate: float, think_s: float = 2.0) -> list[Conversation]:
    """Workload B (see the module docstring): ``conversations`` starting at ``rate`` per second."""
    rng = random.Random(seed)
    out, now = [], 0.0
    for _ in range(conversations):
        now += rng.expovariate(rate)
        turns = tuple(
            Turn(_text(rng, rng.randint(50, 300)), _budget(rng), rng.expovariate(1.0 / think_s) if i else 0.0)
            for i in range(rng.randint(3, 6))
        )
        out.append(Conversation(now, _text(rng, rng.randint(1000, 2000)), turns))
    return out


def low_reuse(
    seed: int, requests: int, rate: float, prompt: tuple[int, int] = (512, 4096)
) -> list[Conversation]:
    """Workload D (see the module docstring)."""
    rng = random.Random(seed)
    out, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        out.append(Conversation(now, "", (Turn(_text(rng, rng.randint(*prompt)), _budget(rng)),)))
    return out
