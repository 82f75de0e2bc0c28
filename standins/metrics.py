"""pd-extproc's own ``/metrics`` page read the way tests and benchmarks check it."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


async def by_outcome(
    session: aiohttp.ClientSession, admin_url: str, counter: str, label: str = "outcome"
) -> dict[str, float]:
    """The samples of pd-extproc's counter ``counter`` at ``admin_url``, by their ``label`` label.

    ``counter``: a counter's name (``..._total``)."""
    async with session.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == counter
    }
