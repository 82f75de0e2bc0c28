"""Data-parallel ranks in the ``kv-events`` index: a publisher per rank, the rank credited (pure).

A vLLM engine run with data parallelism (``--data-parallel-size N``, the endpoint's
``data_parallel_size``) keeps one KV cache per rank and publishes each rank's events on sockets of its
own, the ports offset by the rank (vLLM 0.32 ``ZmqEventPublisher.offset_endpoint_port``; a batch says
its ``data_parallel_rank``). A rank's cache serves only the requests that reach that rank, so the index
keeps each rank apart as its own *publisher*: the endpoint's address when it has one rank,
``"<address>@dp<rank>"`` for each rank of an endpoint of several (also the ``endpoint`` label of the
kv-events metrics).

A request is credited at an endpoint of several ranks with what one rank holds of its prompt, the rank
holding the most leading blocks (the lowest on a tie), and only when that rank can be pinned: the engine
request whose cache counts then carries ``X-data-parallel-rank`` (vLLM's OpenAI server sends the request
to that rank). An endpoint none of whose ranks holds anything of the prompt is credited nothing and its
request is not pinned (vLLM's own balancer picks the rank).
"""

from __future__ import annotations

from collections.abc import Mapping

RANK_MARK = "@dp"
"""Between an endpoint's address and its rank in a publisher's name."""


def publisher(address: str, rank: int, size: int) -> str:
    """The publisher name of rank ``rank`` of the endpoint ``address`` of ``size`` ranks."""
    return address if size == 1 else f"{address}{RANK_MARK}{rank}"


def endpoint_of(name: str) -> str:
    """The endpoint address of the publisher ``name``."""
    return name.partition(RANK_MARK)[0]


def credited(matched: Mapping[str, int], pinned: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Per endpoint, the leading blocks it is credited with, and the rank credited at those of several.

    ``matched``: the leading blocks each publisher holds; ``pinned``: the request can be pinned to a
    rank (else the ranks of endpoints of several are credited nothing). Returns ``(blocks by address,
    rank by address)``; an address of one rank is credited its publisher's blocks and has no rank."""
    if not any(RANK_MARK in name for name in matched):
        return dict(matched), {}
    blocks: dict[str, int] = {}
    ranks: dict[str, int] = {}
    for name, held in matched.items():
        address, mark, rank_text = name.partition(RANK_MARK)
        if not mark:
            blocks[name] = held
        elif pinned:
            rank = int(rank_text)
            best = blocks.get(address, 0)
            if held > best or (address in ranks and held == best and rank < ranks[address]):
                blocks[address], ranks[address] = held, rank
    return blocks, ranks


def credited_publisher(address: str, ranks: Mapping[str, int]) -> str:
    """The publisher whose blocks :func:`credited` credited ``address`` with (``ranks``: its ranks)."""
    rank = ranks.get(address)
    return address if rank is None else f"{address}{RANK_MARK}{rank}"
