"""The engine load signal: each engine's ``/metrics``, scraped and blended into the decision's load.

See docs/routing.md "Engine load signal".

:mod:`~ext_proc.engine_load.names` maps metric names per engine type, :mod:`~ext_proc.engine_load.parse`
turns a ``/metrics`` page into an :class:`EngineSample`, :mod:`~ext_proc.engine_load.blend` is the pure
formula, and :class:`EngineScraper` runs the scrapes and writes the result into the registry's load
arrays. The affinity decision never knows where its numbers came from. :mod:`~ext_proc.engine_load.kinds`
is the seam: the load-signal protocol and the table of its kinds.
"""

from ext_proc.engine_load.blend import EngineSample, blended_offset, engine_tokens
from ext_proc.engine_load.names import EngineKind
from ext_proc.engine_load.parse import ScrapeError, parse_page
from ext_proc.engine_load.scraper import EngineScraper

__all__ = [
    "EngineKind",
    "EngineSample",
    "EngineScraper",
    "ScrapeError",
    "blended_offset",
    "engine_tokens",
    "parse_page",
]
